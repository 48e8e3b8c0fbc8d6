"""Benchmark fp4kit's GPU kernels side by side with their baselines, in one process.

    PYTHONPATH=. python scripts/bench_kernels.py [--out benchmarks/results/kernels-<gpu>.json]

Measures (triton.testing.do_bench, median): the device-to-device copy ceiling; NVFP4 quantize
(plain and 4/6) bandwidth on the Nemotron-3-Nano expert stacks and an 8192^2 tensor, against
ModelOpt's 4/6 weight calibration where modelopt imports (scripts/bench_modelopt_4o6.py); the
W4A16 GEMM against bf16 torch.matmul; the grouped MoE against a bf16 grouped baseline. Writes
JSON and prints a table, then each target judged on this run (`targets` in the JSON). The
kernels run with the launch tables of fp4kit/kernels/tuning/<gpu>.json (recorded in the JSON);
scripts/tune_kernels.py sweeps and picks them.

    python scripts/bench_kernels.py --targets benchmarks/results/kernels-h200.json   # no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from triton.testing import do_bench

from fp4kit.kernels import launch

NANO_STACKS = ((128, 1856, 2688), (128, 2688, 1856))


def run_record(stem: str, out: str | None) -> tuple[str, dict]:
    """(the JSON path: `out` or benchmarks/results/<stem>-<gpu>.json, the run's record: date,
    command and versions, `benchlib.record`). Exits unless a CUDA GPU is there."""
    from benchlib import record

    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(sys.argv[0])} needs a CUDA GPU")
    slug = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "-")
    return out or f"benchmarks/results/{stem}-{slug}.json", record.run_record()


def copy_ceiling_tbps(n_bytes: int = 2 << 30) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * n_bytes / (ms * 1e-3) / 1e12


def write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<gpu>.json)")
    parser.add_argument("--skip-modelopt", action="store_true", help="do not time ModelOpt")
    parser.add_argument("--skip-quantize", action="store_true", help="do not time quantize (trial runs)")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host time of an eager W4A16 call at one row against torch.matmul's, and on "
                             "an sm_90 GPU of packed_linear's cluster launch at 32 rows (benchlib/w4a16.py's "
                             "cluster_host_us), five times each in this process (default out: "
                             "benchmarks/results/kernels-host-<gpu>.json)")
    parser.add_argument("--targets", metavar="JSON", default=None,
                        help="print the targets table of an earlier run's JSON and exit (no GPU needed)")
    args = parser.parse_args()
    if args.targets:
        with open(args.targets) as f:
            print_targets(targets(json.load(f)))
        return
    from benchlib import moe as moe_bench, quantize as quantize_bench, w4a16 as w4a16_bench

    if args.host_only:
        out_path, result = run_record("kernels-host", args.out)
        runs = [w4a16_bench.host_overhead_us(calls=2000) for _ in range(5)]
        result["host_overhead_runs"] = runs
        medians = lambda runs: {key: statistics.median(r[key] for r in runs) for key in runs[0]}  # noqa: E731
        result["host_overhead"] = medians(runs)
        if torch.cuda.get_device_capability() == (9, 0):
            cruns = [w4a16_bench.cluster_host_us() for _ in range(5)]
            result["cluster_host_overhead_runs"] = cruns
            result["cluster_host_overhead"] = medians(cruns)  # packed_linear_uses_cluster: the same in every run
            runs = runs + cruns
        write(out_path, result)
        for r in runs:
            print("  ".join(f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}"
                            for key, value in r.items()))
        print(f"median: {result['host_overhead']}")
        if "cluster_host_overhead" in result:
            print(f"median, 32 rows, pre-packed weight: {result['cluster_host_overhead']}")
        print(f"wrote {out_path}")
        return
    out_path, result = run_record("kernels", args.out)
    result["copy_ceiling_tbps"] = copy_ceiling_tbps()
    print(f"copy ceiling {result['copy_ceiling_tbps']:.2f} TB/s", flush=True)

    result["launch_shapes"] = launch.thaw(launch.tables())
    print(f"launch shapes: {result['launch_shapes']}", flush=True)

    if not args.skip_quantize:
        q_rows = quantize_bench.bench(shapes=(*NANO_STACKS, (8192, 8192)))
        stacks = [r for r in q_rows if len(r["shape"]) == 3]
        traffic = sum(r["bytes"] for r in stacks)
        quant = {
            "rows": q_rows,
            "timing": "expert_stack_* and ratio: the whole quantize() call, eager (checks included); "
                      "*_kernels: its launches replayed from a CUDA graph (one stack-kernel launch for "
                      "the expert stacks, max pass and quantize for 8192x8192); *_two_launches: the "
                      "stacks through the max pass and quantize launches instead; "
                      "*_given_amax: the one quantize launch when the global amax is given",
            "expert_stack_tbps": traffic / sum(r["ms_4o6"] for r in stacks) / 1e9,
            "expert_stack_tbps_plain": traffic / sum(r["ms_6"] for r in stacks) / 1e9,
            "expert_stack_tbps_kernels_4o6": traffic / sum(r["ms_kernels_4o6"] for r in stacks) / 1e9,
            "expert_stack_tbps_kernels_plain": traffic / sum(r["ms_kernels_6"] for r in stacks) / 1e9,
            "expert_stack_tbps_two_launches_4o6": traffic / sum(r["ms_two_launches_4o6"] for r in stacks) / 1e9,
            "expert_stack_tbps_two_launches_plain": traffic / sum(r["ms_two_launches_6"] for r in stacks) / 1e9,
            "ratio_4o6_to_plain_kernels": (sum(r["ms_kernels_4o6"] for r in stacks)
                                           / sum(r["ms_kernels_6"] for r in stacks)),
            "expert_stack_tbps_given_amax_4o6": traffic / sum(r["ms_given_amax_4o6"] for r in stacks) / 1e9,
            "expert_stack_tbps_given_amax_plain": traffic / sum(r["ms_given_amax_6"] for r in stacks) / 1e9,
            "ratio_4o6_to_plain": sum(r["ms_4o6"] for r in stacks) / sum(r["ms_6"] for r in stacks),
            "speedup_vs_modelopt": None,
            "modelopt_note": "not measured",
        }
        if not args.skip_modelopt:  # on the Nano layer's expert stacks and shared expert (bench_modelopt_4o6.py)
            try:
                import bench_modelopt_4o6

                mo = bench_modelopt_4o6.measure()
                quant.update(speedup_vs_modelopt=mo["speedup_vs_modelopt"], modelopt=mo,
                             modelopt_note="ModelOpt's Lightning 4/6 calibration vs fp4kit quantize, same tensors")
            except ImportError as exc:
                quant["modelopt_note"] = f"modelopt not importable: {exc}"
        result["quantize"] = quant
        print(f"quantize: {json.dumps(quant['rows'])}", flush=True)

    result["host_overhead"] = w4a16_bench.host_overhead_us()
    print(f"host overhead: {result['host_overhead']}", flush=True)
    result["gemm"] = w4a16_bench.bench()
    print_gemm(result["gemm"])
    result["gemv_limits"] = w4a16_bench.gemv_limits()
    print_gemv_limits(result["gemv_limits"])
    result["moe"] = moe_bench.bench()

    result["targets"] = targets(result)

    write(out_path, result)
    print_table(result)
    print_targets(result["targets"])
    print(f"wrote {out_path}")


# The kernels' targets (GEMM shapes and MoE token counts as benched), each judged on this run's
# figures alone. Where several figures measure one target, `measured` lists them all and `met`
# takes the most favourable: the target holds if any of fp4kit's ways of running the work meets it.
GEMM_M1_TARGET = ((8192, 8192), (28672, 8192))


def targets(r: dict) -> list[dict]:
    """[{target, threshold, measured: {what: figure}, met: bool or None (not measured), short:
    the figures that miss}] from one bench result (`main`'s JSON)."""
    out = []

    def add(target, threshold, measured, met, short=()):
        out.append({"target": target, "threshold": threshold, "measured": measured, "met": met,
                    "short": list(short)})

    q = r.get("quantize")
    if q:
        tbps = {"eager call 4/6 (expert_stack_tbps)": q["expert_stack_tbps"],
                "eager call plain": q["expert_stack_tbps_plain"],
                "stack kernel 4/6": q["expert_stack_tbps_kernels_4o6"],
                "stack kernel plain": q["expert_stack_tbps_kernels_plain"]}
        add("quantize, Nano expert stacks (TB/s)", ">= 2.5", tbps, max(tbps.values()) >= 2.5)
        ratio = {"eager call (ratio_4o6_to_plain)": q["ratio_4o6_to_plain"],
                 "stack kernel": q["ratio_4o6_to_plain_kernels"]}
        add("quantize, 4/6 time over plain", "<= 1.3", ratio, min(ratio.values()) <= 1.3)
        mo = q.get("speedup_vs_modelopt")
        add("quantize vs ModelOpt's 4/6 calibration", ">= 100", {"speedup_vs_modelopt": mo},
            None if mo is None else mo >= 100)
    gemm = r.get("gemm", [])
    best = {(g["N"], g["K"], g["M"]): g.get("speedup_vs_bf16_best", g["speedup_vs_bf16"]) for g in gemm}
    m1 = {f"{n}x{k}": best[(n, k, 1)] for n, k in GEMM_M1_TARGET if (n, k, 1) in best}
    if m1:
        add("W4A16 GEMM at M = 1 over bf16 (best layout)", ">= 2.5", m1, min(m1.values()) >= 2.5,
            [f"{key}: {v:.2f}" for key, v in m1.items() if v < 2.5])
    small = {f"{n}x{k} M={m}": v for (n, k, m), v in best.items() if m <= 64}
    if small:
        add("W4A16 GEMM for M <= 64 over bf16 (best layout)", ">= 1.0 everywhere",
            {"lowest": min(small.values())}, min(small.values()) >= 1.0,
            [f"{key}: {v:.2f}" for key, v in small.items() if v < 1.0])
    moe = {m["tokens"]: m["speedup_vs_bf16"] for m in r.get("moe", []) if m["tokens"] <= 64}
    if moe:
        add("grouped MoE at <= 64 tokens over bf16 grouped_mm", ">= 2.0",
            {f"{t} tokens": v for t, v in moe.items()}, min(moe.values()) >= 2.0,
            [f"{t} tokens: {v:.2f}" for t, v in moe.items() if v < 2.0])
    return out


def print_targets(rows) -> None:
    print("\ntarget                                             threshold            met   measured")
    for t in rows:
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        figures = ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in t["measured"].items())
        print(f"{t['target']:50s} {t['threshold']:20s} {met:5s} {figures}")
        if t["short"]:
            print(f"{'':77s}short: {'; '.join(t['short'])}")


def print_gemm(rows) -> None:
    print("\nW4A16 GEMM (CUDA graph; eager in brackets)   N      K      M   us(w4a16)  us(bf16)  speedup"
          "  us(packed)  speedup")
    for g in rows:
        print(f"{'':38s}{g['N']:7d}{g['K']:7d}{g['M']:7d} {1e3 * g['ms_w4a16']:10.1f} {1e3 * g['ms_bf16']:9.1f}"
              f" {g['speedup_vs_bf16']:8.2f} {1e3 * g['ms_packed']:11.1f} {g['speedup_vs_bf16_packed']:8.2f}"
              f"  [{1e3 * g['ms_w4a16_eager']:.1f} / {1e3 * g['ms_bf16_eager']:.1f}]"
              f" {g['path']}  (arith dequant {1e3 * g['ms_w4a16_arith_dequant']:.1f})", flush=True)


def print_gemv_limits(rows) -> None:
    print("\nGEMV at M = 1, its parts (CUDA graph)     N      K   us(GEMV)  us(loop)  us(loads only)"
          "  us(arithmetic only)  us(bf16)")
    for g in rows:
        parts = [g.get(key) for key in ("ms_loop", "ms_loads_only", "ms_arithmetic_only")]
        text = "".join(f" {1e3 * t:{w}.1f}" if t is not None else f" {'-':>{w}s}" for t, w in zip(parts, (9, 15, 20)))
        print(f"{'':38s}{g['N']:7d}{g['K']:7d} {1e3 * g['ms_gemv']:10.1f}{text} {1e3 * g['ms_bf16']:9.1f}", flush=True)


def print_table(r: dict) -> None:
    print(f"\n{r['gpu']}  copy ceiling {r['copy_ceiling_tbps']:.2f} TB/s")
    if "quantize" in r:
        print_quantize(r["quantize"])
    print_gemm(r["gemm"])
    if r.get("gemv_limits"):
        print_gemv_limits(r["gemv_limits"])
    print("\nMoE (128 experts, top-6, H=2688, I=1856)  tokens  us(w4a16)  us(bf16)  speedup  timing  [eager]  path")
    for m in r["moe"]:
        print(f"{'':42s}{m['tokens']:7d} {1e3 * m['ms_w4a16']:10.1f} {1e3 * m['ms_bf16']:9.1f} {m['speedup_vs_bf16']:8.2f}"
              f"  {m['timing']}  [{1e3 * m['ms_w4a16_eager']:.1f} / {1e3 * m['ms_bf16_eager']:.1f}]  {m['path']}"
              + (f" (sorted path {1e3 * m['ms_w4a16_sorted_graph']:.1f})" if m.get("ms_w4a16_sorted_graph") else "")
              + (f" (small on the matrix units {1e3 * m['ms_w4a16_small_matrix_unit_graph']:.1f})"
                 if m.get("ms_w4a16_small_matrix_unit_graph") else "")
              + (f" (sorted on the register-fed matrix units {1e3 * m['ms_w4a16_sorted_mma_graph']:.1f})"
                 if m.get("ms_w4a16_sorted_mma_graph") else ""))
    if r["moe"]:
        print(f"MoE baseline: {r['moe'][0]['baseline']}")
    print(f"host overhead: {r['host_overhead']}")


def print_quantize(q: dict) -> None:
    print("quantize (eager call | graph-replayed kernels)  ms(6)  TB/s(6)  ms(4o6)  TB/s(4o6)  4o6/6")
    for row in q["rows"]:
        print(f"{str(tuple(row['shape'])):20s} call    {row['ms_6']:7.3f} {row['tbps_6']:7.2f} {row['ms_4o6']:8.3f}"
              f" {row['tbps_4o6']:9.2f} {row['ratio_4o6_to_plain']:6.2f}")
        print(f"{'':20s} kernels {row['ms_kernels_6']:7.3f} {row['tbps_kernels_6']:7.2f} {row['ms_kernels_4o6']:8.3f}"
              f" {row['tbps_kernels_4o6']:9.2f} {row['ms_kernels_4o6'] / row['ms_kernels_6']:6.2f}"
              f"   (amax pass {row['ms_amax_pass']:.3f} ms)")
        if "ms_two_launches_6" in row:
            print(f"{'':20s} 2 launch{row['ms_two_launches_6']:7.3f} {row['tbps_two_launches_6']:7.2f}"
                  f" {row['ms_two_launches_4o6']:8.3f} {row['tbps_two_launches_4o6']:9.2f}"
                  f" {row['ms_two_launches_4o6'] / row['ms_two_launches_6']:6.2f}")
        print(f"{'':20s} g given {row['ms_given_amax_6']:7.3f} {row['tbps_given_amax_6']:7.2f} {row['ms_given_amax_4o6']:8.3f}"
              f" {row['tbps_given_amax_4o6']:9.2f} {row['ms_given_amax_4o6'] / row['ms_given_amax_6']:6.2f}")
    print(f"expert stacks: {q['expert_stack_tbps']:.2f} TB/s (4o6), {q['expert_stack_tbps_plain']:.2f} TB/s (6);"
          f" vs ModelOpt: {q['speedup_vs_modelopt']} ({q['modelopt_note']})")


if __name__ == "__main__":
    main()
