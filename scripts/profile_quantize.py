"""Where the quantize stage's time goes: host time to queue, device time by kernel, and the wall.

Builds the first `--layers` layers of Nemotron-3-Nano on the GPU (scripts/dry_run.py's random
weights), calibrates it on `--calib` random tokens through `fp4kit.quantize.quantize` (which also
compiles every kernel the stage launches), then runs the stage itself (`quantize_weights`, the
call `fp4kit quantize` times as "quantize") `--repeats` times and once under torch.profiler.
Reports, against the BF16 bytes the stage reads:

- the wall time of the stage (queue every weight, then the one read-back), its best and median;
- the host time to queue every weight (the Python and launch cost), before the read-back waits;
- the device time, summed by kernel name (CUDA activity of the profiled run), and the number of
  kernels launched;
- the host time by Python function (one more stage under cProfile: own time and calls).

    python scripts/profile_quantize.py [--layers 52] [--recipe nemotron-h-w4a16-4o6] [--repeats 5]

Writes benchmarks/results/quantize-profile-<gpu>.json (with its date, command and versions) and
prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict

import torch
from benchlib.record import run_record, write_results
from dry_run import build_model, nano_config, parse_calib

from fp4kit.quantize import _read_back_results, queue_weights, quantize
from fp4kit.recipe import load_recipe

TOP = 20


def stage(qm) -> tuple[float, float]:
    """(wall s, host s to queue) of one quantize stage over qm's plan and statistics."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending = queue_weights(qm.plan, qm.stats, backend="triton", progress=False, warnings=[], arith=qm.arith)
    queued = time.perf_counter() - t0
    _read_back_results(*pending, [], qm.arith)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, queued


def host_functions(qm, top: int = TOP) -> list[dict]:
    """The Python functions of one more stage by own host time (cProfile, which slows every call
    alike): where the host time to queue goes."""
    prof = cProfile.Profile()
    prof.enable()
    stage(qm)
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{'/'.join(path.split('/')[-2:])}:{line} {name}", "own_us": round(tt * 1e6, 1),
             "cum_us": round(ct * 1e6, 1), "calls": nc} for (path, line, name), (_, nc, tt, ct, _) in rows]


def kernel_table(events) -> dict[str, dict[str, float]]:
    """{kernel name: {"us": device time, "count": launches}} over a profile's CUDA events."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "count": 0})
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = out[e.name]
            row["us"] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            row["count"] += 1
    return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="the first N layers of the Nano pattern (default: all 52)")
    ap.add_argument("--recipe", default="nemotron-h-w4a16-4o6")
    ap.add_argument("--calib", default="1x2k", help="calibration NxL for the statistics (default 1x2k)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/quantize-profile-<gpu>.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: profile_quantize needs a CUDA device")
    record = run_record()
    cfg = nano_config(args.layers)
    model = build_model(cfg, "cuda", args.seed)
    n, seq = parse_calib(args.calib)
    samples = torch.randint(0, cfg.vocab_size, (n, seq), generator=torch.Generator().manual_seed(args.seed))
    recipe = load_recipe(args.recipe)
    qm = quantize(model, recipe, samples, backend="triton", progress=False)
    first = qm.timings["quantize"]
    bf16_bytes = sum(q.bytes_before for q in qm.quantized.values())
    qm.quantized = {}  # the first stage's tensors, freed
    runs = [stage(qm) for _ in range(args.repeats)]
    walls = [w for w, _ in runs]
    hosts = [h for _, h in runs]

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stage(qm)
    kernels = kernel_table(prof.events())
    functions = host_functions(qm)
    device_us = sum(r["us"] for r in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: kv[1]["us"], reverse=True)[:TOP]
    ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda r: r[1], reverse=True)[:TOP]
    best = min(walls)
    doc = {
        **record,
        "layers": cfg.num_hidden_layers, "recipe": recipe.name, "calib": args.calib,
        "weights": sum(1 for p in qm.plan if p.rule is not None), "quantized_bf16_bytes": bf16_bytes,
        "first_stage_s": first,
        "stage_wall_s": walls, "stage_best_s": best, "stage_median_s": statistics.median(walls),
        "stage_tb_per_s": bf16_bytes / best / 1e12,
        "queue_host_s": hosts, "queue_host_median_s": statistics.median(hosts),
        "device_kernel_s": device_us / 1e6,
        "device_kernel_launches": sum(v["count"] for v in kernels.values()),
        "top_kernels": [{"name": k[:160], "us": round(v["us"], 1), "count": v["count"]} for k, v in top],
        "top_cpu_ops": [{"op": k, "self_us": round(us, 1), "count": c} for k, us, c in ops],
        "top_host_functions": functions,
    }
    path = write_results(doc, "quantize-profile", torch.cuda.get_device_name(), out=args.out)
    print(f"{doc['weights']} weights, {bf16_bytes / 1e9:.1f} GB of BF16; first stage {first:.3f} s")
    print(f"stage wall: best {best:.4f} s, median {doc['stage_median_s']:.4f} s ({doc['stage_tb_per_s']:.2f} TB/s)")
    print(f"host time to queue: median {doc['queue_host_median_s']:.4f} s; device kernel time {doc['device_kernel_s']:.4f} s "
          f"in {doc['device_kernel_launches']} kernels ({doc['device_kernel_launches'] / doc['weights']:.1f} per weight)")
    print(f"{'kernel':<90} {'ms':>9} {'count':>6}")
    for row in doc["top_kernels"]:
        print(f"{row['name'][:90]:<90} {row['us'] / 1e3:9.3f} {row['count']:6d}")
    print(f"{'cpu op':<60} {'self ms':>9} {'count':>6}")
    for row in doc["top_cpu_ops"]:
        print(f"{row['op'][:60]:<60} {row['self_us'] / 1e3:9.3f} {row['count']:6d}")
    print(f"{'python function (cProfile)':<70} {'own ms':>9} {'cum ms':>9} {'calls':>6}")
    for row in functions:
        print(f"{row['function'][:70]:<70} {row['own_us'] / 1e3:9.3f} {row['cum_us'] / 1e3:9.3f} {row['calls']:6d}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
