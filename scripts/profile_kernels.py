"""Where fp4kit's GPU kernels spend their time: Nsight Compute counters for one launch each.

    PYTHONPATH=. python scripts/profile_kernels.py [--out benchmarks/results/kernels-pipes-<gpu>.json]

Runs each case below in a child process under `ncu` (Nsight Compute, which must be on PATH),
profiles the case's second launch of its kernel (the first compiles it), and records per kernel:
the time, instructions executed (and per weight or element, counting every thread), how busy
instruction issue, the integer ALU pipe and the FMA pipe were, achieved occupancy, registers,
and the stall reasons per issued instruction. ncu flushes the caches before the launch, so the
weights come from DRAM (a CUDA-graph replay in the bench may find some of them in L2).
Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

# name -> (what it runs, the kernel to profile, elements it processes)
CASES = {
    "gemv 8192x8192 M=1": ("gemm:8192:8192:1", "_gemv_kernel", 8192 * 8192),
    "mma 8192x8192 M=4": ("gemm:8192:8192:4", "_mma_kernel", 8192 * 8192),
    "mma 8192x8192 M=16": ("gemm:8192:8192:16", "_mma_kernel", 8192 * 8192),
    "wgmma 3712x2688 M=16": ("gemm:3712:2688:16", "_w4a16_kernel", 3712 * 2688),
    "wgmma 3712x2688 M=64": ("gemm:3712:2688:64", "_w4a16_kernel", 3712 * 2688),
    # The pre-packed weight (kernels.packed_gemm) with PACKED's launch shapes.
    "packed 8192x8192 M=1": ("packed:8192:8192:1", "_packed_kernel", 8192 * 8192),
    "packed 8192x8192 M=16": ("packed:8192:8192:16", "_packed_kernel", 8192 * 8192),
    "packed 3712x2688 M=16": ("packed:3712:2688:16", "_packed_kernel", 3712 * 2688),
    "packed 3712x2688 M=64": ("packed:3712:2688:64", "_packed_kernel", 3712 * 2688),
    "quantize plain [128,1856,2688]": ("quantize:6:two", "_quantize_kernel", 128 * 1856 * 2688),
    "quantize 4/6 [128,1856,2688]": ("quantize:4o6:two", "_quantize_kernel", 128 * 1856 * 2688),
    "stack kernel plain [128,1856,2688]": ("quantize:6:stack", "_stack_kernel", 128 * 1856 * 2688),
    "stack kernel 4/6 [128,1856,2688]": ("quantize:4o6:stack", "_stack_kernel", 128 * 1856 * 2688),
    # One token through Nemotron-3-Nano's routed experts on the CUDA cores (the second launch:
    # the down projection, as many weights as the up one).
    "moe small 1 token": ("moe:1", "_moe_small_kernel", 6 * 1856 * 2688),
    # The FP8 Mamba projections at one row: fp4kit's GEMV (kernels.fp8_gemm) and torch._scaled_mm.
    "fp8 gemv 10304x2688 M=1": ("fp8:10304:2688:1", "_fp8_gemv_kernel", 10304 * 2688),
    "fp8 gemv 2688x4096 M=1": ("fp8:2688:4096:1", "_fp8_gemv_kernel", 2688 * 4096),
    "fp8 _scaled_mm 10304x2688 M=1": ("fp8lib:10304:2688:1", "regex:nvjet|gemm|gemv", 10304 * 2688),
    "fp8 _scaled_mm 2688x4096 M=1": ("fp8lib:2688:4096:1", "regex:nvjet|gemm|gemv", 2688 * 4096),
    # Quantize items close behind the max items (lag 1 and 2, 8-tile items): how much of the
    # second read L2 serves, against the waits.
    "stack kernel plain lag 1 [128,1856,2688]": ("quantize:6:stack:1:8:8", "_stack_kernel", 128 * 1856 * 2688),
    "stack kernel plain lag 2 [128,1856,2688]": ("quantize:6:stack:2:8:8", "_stack_kernel", 128 * 1856 * 2688),
}

STALLS = ("long_scoreboard", "math_pipe_throttle", "not_selected", "wait", "short_scoreboard", "barrier",
          "dispatch_stall", "mio_throttle", "lg_throttle", "no_instruction")
METRICS = {
    "us": "gpu__time_duration.sum",
    "inst_executed": "smsp__inst_executed.sum",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "alu_pipe_pct": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "fma_pipe_pct": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_read_bytes": "dram__bytes_read.sum",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "l2_bytes": "lts__t_bytes.sum",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    **{f"stall_{s}": f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS},
}


def run_case(case: str) -> None:
    """The workload of one case (in the child process ncu watches): three calls."""
    import torch

    from fp4kit.kernels import launch, packed_gemm, quantize as kquant, w4a16_gemm

    torch.manual_seed(0)
    kind, *args = case.split(":")
    if kind in ("gemm", "packed"):
        n, k, m = map(int, args)
        wq = kquant.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if kind == "packed":
            wp = packed_gemm.pack(wq)
            call = lambda: packed_gemm.packed_matmul(x, wp)  # noqa: E731
        else:
            call = lambda: w4a16_gemm.w4a16_matmul(x, wq)  # noqa: E731
        for _ in range(3):
            call()
    elif kind == "moe":
        from fp4kit.kernels import moe_gemm

        t = int(args[0])
        up = kquant.quantize(torch.randn(128, 1856, 2688, device="cuda", dtype=torch.bfloat16) * 0.02)
        down = kquant.quantize(torch.randn(128, 2688, 1856, device="cuda", dtype=torch.bfloat16) * 0.02)
        x = torch.randn(t, 2688, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(128, device="cuda")[:6] for _ in range(t)])
        wts = torch.rand(t, 6, device="cuda")
        for _ in range(3):
            moe_gemm.moe_experts(x, ids, wts, up, down)
    elif kind in ("fp8", "fp8lib"):
        from fp4kit.kernels import fp8_gemm

        n, k, m = map(int, args)
        w = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        xq = (torch.randn(m, k, device="cuda") * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
        xs, ws = torch.tensor(0.03, device="cuda"), torch.tensor(0.01, device="cuda")
        for _ in range(3):
            if kind == "fp8":
                fp8_gemm.fp8_matmul(xq, w, xs, ws)
            else:
                torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
    elif kind == "quantize":  # rule, then "two" (max pass and quantize launches) or "stack" (one launch)
        stack = {}
        if args[1] == "two":
            stack["max_member_bytes"] = None
        if len(args) >= 5:  # stack: lag, tiles per max item, tiles per quantize item[, prefetch, programs/SM]
            stack.update(lag=int(args[2]), max_tiles=int(args[3]), quant_tiles=int(args[4]))
        if len(args) == 7:
            stack.update(prefetch=args[5] == "1", programs_per_sm=int(args[6]))
        tables = launch.override(launch.table("quantize"), STACK=stack)
        w = torch.randn(128, 1856, 2688, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            kquant.quantize(w, scale_rule=args[0], tables=tables)
    else:
        raise SystemExit(f"profile_kernels: unknown case {case!r}")
    torch.cuda.synchronize()


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def profile(case: str, kernel: str, ncu: str) -> dict:
    cmd = [ncu, "--csv", "--clock-control", "none", "-k", kernel, "--launch-skip", "1", "--launch-count", "1",
           "--metrics", ",".join(METRICS.values()), sys.executable, os.path.abspath(__file__), "--case", case]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [r for r in csv.DictReader(io.StringIO(done.stdout[done.stdout.find('"ID"'):]))
            if r.get("Metric Name")]
    if done.returncode or not rows:
        raise SystemExit(f"profile_kernels: ncu failed on {case} (exit {done.returncode}):\n"
                         f"{done.stderr[-2000:] or done.stdout[-2000:]}")
    got = {r["Metric Name"]: (r["Metric Unit"], r["Metric Value"]) for r in rows}
    out = {}
    for key, metric in METRICS.items():
        unit, value = got.get(metric, ("", "nan"))
        v = _number(value) if value not in ("", "n/a") else float("nan")
        if key == "us":
            v *= _TO_US.get(unit, 1.0)
        elif key.endswith("bytes"):
            v *= _TO_BYTES.get(unit, 1.0)
        out[key] = v
    return out


_TO_BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def _wanted(case: str, only: str | None) -> bool:
    """Whether --only (comma-separated texts, or None: all) selects this case."""
    return only is None or any(part in case for part in only.split(","))


def merge_rows(earlier: dict, rows: list, only: str) -> list:
    """--only: the earlier file's rows of the cases not profiled now, each marked with the run it
    came from (its date and command, where the row does not carry them), then this run's rows."""
    kept = [dict(r) for r in earlier["kernels"] if not _wanted(r["case"], only)]
    for r in kept:
        r.setdefault("date_utc", earlier["date"] if "date" in earlier else earlier["date_utc"])  # earlier files: date_utc
        r.setdefault("command", earlier["command"])
    return kept + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-pipes-<gpu>.json)")
    parser.add_argument("--only", default=None,
                        help="profile only the cases whose name contains one of these comma-separated texts")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        run_case(args.case)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels: needs a CUDA GPU")
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("profile_kernels: Nsight Compute's `ncu` is not on PATH")
    gpu = torch.cuda.get_device_name()
    rows = []
    for name, (case, kernel, elements) in CASES.items():
        if not _wanted(name, args.only):
            continue
        r = profile(case, kernel, ncu)
        r.update(case=name, kernel=kernel, elements=elements,
                 instructions_per_element=r["inst_executed"] * 32 / elements)
        rows.append(r)
        print(f"{name:32s} {r['us']:9.1f} us  {r['instructions_per_element']:5.2f} instr/elem  "
              f"issue {r['issue_active_pct']:5.1f}%  ALU {r['alu_pipe_pct']:5.1f}%  FMA {r['fma_pipe_pct']:5.1f}%  "
              f"warps {r['warps_active_pct']:5.1f}%  regs {r['registers']:.0f}  "
              f"DRAM {r['dram_pct']:5.1f}%  L2 {r['l2_throughput_pct']:5.1f}%  "
              f"stalls: long sb {r['stall_long_scoreboard']:.2f}, pipe {r['stall_math_pipe_throttle']:.2f}, "
              f"barrier {r['stall_barrier']:.2f}", flush=True)
    slug = gpu.lower().replace("nvidia", "").strip().replace(" ", "-")
    out = args.out or f"benchmarks/results/kernels-pipes-{slug}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from benchlib.record import run_record

    record = run_record()
    date, command = record["date"], record["command"]
    for r in rows:
        r.update(date_utc=date, command=command)
    if args.only and os.path.exists(out):
        with open(out) as f:
            rows = merge_rows(json.load(f), rows, args.only)
    result = {**record,
              "note": "one launch per kernel under ncu (caches flushed, clocks not locked); ALU/FMA: "
                      "instructions issued to that pipe as a share of its peak; stalls: cycles per issued "
                      "instruction", "kernels": rows}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
