"""Data-parallel calibration against one GPU, as a user runs it: `fp4kit quantize` on one GPU, then
the same command with `--gpus N`, each a whole process. Compares the calibration stage's time
(the `time:` line the command prints), the whole process, and the checkpoint's bytes.

    python scripts/bench_parallel.py MODEL_DIR --calib 8x32k --gpus 2

Writes benchmarks/results/parallel-<gpu>.json and prints a table. The NVLink multicast variables a
multi-GPU machine sets (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST, NVSHMEM_DISABLE_NVLS)
are passed through untouched and recorded.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.record import run_record  # noqa: E402

NVLS_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def stage_times(stdout: str) -> dict[str, float]:
    """The `time: import 1.0s, load 2.3s, ...` line of `fp4kit quantize` as {stage: seconds}."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("time: ")), None)
    if line is None:
        raise RuntimeError(f"no `time:` line in the output:\n{stdout[-2000:]}")
    out = {}
    for part in line[len("time: "):].split(", "):
        m = re.fullmatch(r"(.+) ([\d.]+)s", part.strip())
        if m is None:
            raise RuntimeError(f"cannot read {part!r} in {line!r}")
        out[m[1]] = float(m[2])
    return out


def run_quantize(model: str, calib: str, out: Path, gpus: int | None, batch_size: str) -> dict:
    cmd = [sys.executable, "-m", "fp4kit.cli", "quantize", "--model", model, "--calib", calib, "--device", "cuda",
           "--batch-size", batch_size, "-o", str(out), "--overwrite", "--no-progress"]
    if gpus:
        cmd += ["--gpus", str(gpus)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return {"command": " ".join(cmd[1:]), "process_s": round(wall, 2), "stages_s": stage_times(done.stdout)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a BF16 model folder")
    p.add_argument("--calib", default="8x32k")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--batch-size", default="1")
    p.add_argument("--out", type=Path, help="results file (default: benchmarks/results/parallel-<gpu>.json)")
    args = p.parse_args()
    import torch

    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    record = run_record()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        one = run_quantize(args.model, args.calib, Path(tmp) / "one", None, args.batch_size)
        many = run_quantize(args.model, args.calib, Path(tmp) / "many", args.gpus, args.batch_size)
        files = sorted(p.name for p in (Path(tmp) / "one").glob("*.safetensors"))
        identical = all(filecmp.cmp(Path(tmp) / "one" / f, Path(tmp) / "many" / f, shallow=False) for f in files)
    speedup = one["stages_s"]["calibrate"] / many["stages_s"]["calibrate"]
    out = {**record, "model": Path(args.model).name, "calib": args.calib, "gpus": args.gpus,
           "env": {k: os.environ.get(k) for k in NVLS_VARS}, "one_gpu": one, "n_gpus": many,
           "calibrate_speedup": round(speedup, 3), "checkpoint_bytes_identical": identical}
    gpu = (record["versions"].get("gpu") or "gpu").split()[-1].lower()
    path = args.out or Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"parallel-{gpu}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"| | 1 GPU | {args.gpus} GPUs |\n|---|---:|---:|")
    print(f"| calibrate (s) | {one['stages_s']['calibrate']:.1f} | {many['stages_s']['calibrate']:.1f} |")
    print(f"| whole process (s) | {one['process_s']:.1f} | {many['process_s']:.1f} |")
    print(f"calibration speed-up {speedup:.2f}x; checkpoint bytes identical: {identical}; wrote {path}")


if __name__ == "__main__":
    main()
