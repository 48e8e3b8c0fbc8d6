"""Time the parts of the pre-packed W4A16 GEMM's split-K epilogue on a GPU (a study).

The packed kernel's K loop with its epilogue in parts (scripts/benchlib/split_epilogue.py: the
library's, partials and counter without the last program's sums, the counter alone, no split
epilogue at all, partials only, and the partials summed by a second launch), on Nano's shared-expert
shapes at 16 and 64 rows, with the launch table's shape split 2 ways and the table's way, warm (one
weight, replayed) and cold (copies, four L2s in all), beside the unsplit launch and torch.matmul.
Checks that the library's epilogue and the two-launch one give `packed_matmul`'s bytes. Writes JSON
(default benchmarks/results/split-epilogue-<gpu>.json) and prints a table.

    PYTHONPATH=.:scripts python scripts/bench_split_epilogue.py [--out PATH]
"""

from __future__ import annotations

import argparse

import torch
from bench_kernels import run_record, write
from benchlib.split_epilogue import EPILOGUES, RIGHT, epilogue_matmul
from sweeps.common import nvfp4_bytes, tensor_copies, time_calls, weight_copies
from sweeps.packed import NANO

from fp4kit.kernels.packed_gemm import config, pack, packed_matmul
from fp4kit.kernels.quantize import quantize


def measure(shapes=NANO, ms=(16, 64)) -> list:
    rows = []
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        copies = [pack(q) for q in weight_copies(wq, nvfp4_bytes(wq))]
        wb = wq.dequantize(torch.bfloat16)
        bf16_copies = tensor_copies(wb, 2 * n * k)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            base = config(m, n, k, x.device)
            cases = [(f"split {s}, EPI {e}", e, {"BLOCK_M": base["BLOCK_M"], "num_warps": base["num_warps"], "SPLIT": s})
                     for s in sorted({2, base["SPLIT"]}) for e in EPILOGUES]
            cases.append(("unsplit", 3, {"BLOCK_M": base["BLOCK_M"], "num_warps": base["num_warps"], "SPLIT": 1}))
            for name, epi, cfg in cases:
                row = {"N": n, "K": k, "M": m, "case": name, "EPI": epi, "launch": config(m, n, k, x.device, dict(cfg, UNROLL=1))}
                if epi in RIGHT or cfg["SPLIT"] == 1:
                    row["equal"] = bool(torch.equal(epilogue_matmul(x, copies[0], epi, cfg),
                                                    packed_matmul(x, copies[0], cfg=dict(cfg, UNROLL=1, PREFETCH=0))))
                row["us_warm"] = 1e3 * time_calls([lambda: epilogue_matmul(x, copies[0], epi, cfg)])
                row["us_cold"] = 1e3 * time_calls([lambda w=w: epilogue_matmul(x, w, epi, cfg) for w in copies])
                rows.append(row)
            rows.append({"N": n, "K": k, "M": m, "case": "bf16",
                         "us_warm": 1e3 * time_calls([lambda: torch.matmul(x, wb.T)]),
                         "us_cold": 1e3 * time_calls([lambda w=w: torch.matmul(x, w.T) for w in bf16_copies])})
        del wq, copies, wb, bf16_copies
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/split-epilogue-<gpu>.json)")
    args = ap.parse_args()
    path, result = run_record("split-epilogue", args.out)
    result["rows"] = rows = measure()
    write(path, result)
    print(f"{'N':>5} {'K':>5} {'M':>3}  {'case':<16} {'warm us':>8} {'cold us':>8}  equal")
    for r in rows:
        print(f"{r['N']:>5} {r['K']:>5} {r['M']:>3}  {r['case']:<16} {r['us_warm']:>8.2f} {r['us_cold']:>8.2f}  "
              f"{r.get('equal', '')}")
    bad = [r["case"] for r in rows if r.get("equal") is False]
    if bad:
        raise SystemExit(f"not packed_matmul's bytes: {bad}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
