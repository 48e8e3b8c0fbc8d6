"""The pre-packed W4A16 GEMM at 64 rows under Nsight Compute: what bounds it on Nano's shared-expert
shapes, split-K by split-K, beside torch's bf16 matmul.

Run under ncu on a GPU, it launches `packed_matmul` at M = 64 on 3712 x 2688 and 2688 x 3712 with
the launch table's shape and SPLIT 1, 2 and 4 (three launches each), and the bf16 matmul of the same
problem; `--parse` turns ncu's text report into a results file (the metrics per launch: grid,
duration, DRAM throughput, registers, waves, occupancy, the cycles a warp waits per instruction):

    ncu --kernel-name regex:'_packed|nvjet' --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python scripts/ncu_packed.py > ncu.txt
    python scripts/ncu_packed.py --parse ncu.txt --versions VERSIONS.json --out benchmarks/results/packed-gemm-ncu-<gpu>.json

`--versions`: the GPU machine's `benchlib.record.versions()` as JSON (the parse may run elsewhere).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

SHAPES = ((3712, 2688), (2688, 3712))
SPLITS = (1, 2, 4)
ROWS = 64
# ncu's metric lines: "    Duration     us     22.91"
_METRICS = {"Duration": "duration_us", "DRAM Throughput": "dram_pct", "Registers Per Thread": "registers",
            "Waves Per SM": "waves_per_sm", "Theoretical Occupancy": "theoretical_occupancy_pct",
            "Achieved Occupancy": "achieved_occupancy_pct", "Warp Cycles Per Issued Instruction": "cycles_per_issue",
            "L2 Hit Rate": "l2_hit_pct"}
_LAUNCH = re.compile(r"^\s{2}(\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
_VALUE = re.compile(r"^\s{4}(" + "|".join(map(re.escape, _METRICS)) + r")\s+\S.*?([-\d.,]+)\s*$")


def launch_all() -> None:
    """The launches ncu profiles, in order: per shape, each split three times, then the table's own
    shape and the bf16 matmul, alternately, three times."""
    import torch

    from fp4kit.kernels import packed_gemm as pg
    from fp4kit.kernels.quantize import quantize

    torch.manual_seed(0)
    for n, k in SHAPES:
        p = pg.pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02), torch.bfloat16)
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        print(n, k, "table's launch", pg.config(ROWS, n, k, x.device), flush=True)
        for split in SPLITS:
            for _ in range(3):
                pg.packed_matmul(x, p, cfg={"SPLIT": split})
        for _ in range(3):
            pg.packed_matmul(x, p)
            x @ wb.T
        torch.cuda.synchronize()


def parse(text: str) -> list[dict]:
    """One row per profiled launch: kernel, grid, block and the metrics of `_METRICS`."""
    rows = []
    for line in text.splitlines():
        m = _LAUNCH.match(line)
        if m:
            rows.append({"kernel": m.group(1), "grid": [int(v) for v in m.group(2, 3, 4)],
                         "block": [int(v) for v in m.group(5, 6, 7)]})
            continue
        m = _VALUE.match(line)
        if m and rows:
            rows[-1][_METRICS[m.group(1)]] = float(m.group(2).replace(",", ""))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parse", help="ncu's text report of a run of this script: write it as a results file")
    ap.add_argument("--versions", help="JSON of the GPU machine's versions (benchlib.record.versions())")
    ap.add_argument("--out", help="results file to write (with --parse)")
    args = ap.parse_args(argv)
    if not args.parse:
        launch_all()
        return 0
    if not args.out:
        ap.error("--parse needs --out")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib.record import run_record

    record = run_record(None if argv is None else [__file__, *argv])
    if args.versions:
        record["versions"] = json.loads(Path(args.versions).read_text())
    rows = parse(Path(args.parse).read_text())
    if not rows:
        print(f"error: no ncu launches in {args.parse}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps({**record, "rows": ROWS, "shapes": SHAPES, "splits": SPLITS,
                                          "launches": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['kernel'][:40]:40s} {str(r['grid']):14s} {r.get('duration_us', float('nan')):7.2f} us "
              f"DRAM {r.get('dram_pct', float('nan')):5.1f} %  regs {r.get('registers', 0):4.0f}  "
              f"waves {r.get('waves_per_sm', float('nan')):4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
