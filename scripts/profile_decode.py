"""Where a decode step's device time goes: BF16 against its fp4kit checkpoint, both decoded by
`fp4kit.generate` (one CUDA graph per step), kernels grouped by kind.

Builds the first `--layers` layers of Nemotron-3-Nano on the GPU (scripts/dry_run.py's random
weights), quantizes it under `--recipe` on random tokens, loads the checkpoint back with the
Triton kernels, and profiles `generate` of `--steps` + 1 new tokens and of 1 token for each model
(torch.profiler, CUDA activity); the difference, divided by the steps, is one decode step. Its
kernels are grouped by name: fp4kit's own Triton kernels, BF16 matrix products, copies,
elementwise, reductions, top-k and sorting, and the rest; the kernels that take the most time
per step are listed by name as well (`top_kernels_per_step`). Each model's step is also timed by
the host clock without the profiler (`per_step_wall_us`: over `--reps` generates of `--steps` + 1
tokens, the median of `Generation.decode_seconds` per step, the decode steps timed alone; a
difference of two generates would carry their prefills' and captures' run-to-run spread, tens of
milliseconds, into a few dozen steps); less the step's kernel time, that leaves the time per step
the device ran no kernel of the step (`per_step_idle_us`: launch gaps within the graph, the host's
turn between steps; negative where kernels of two streams overlap). For a checkpoint whose MoE
blocks run fp4kit's router and expert kernels, `moe_blocks_us` takes one decode step's timeline
apart block by block (`moe_blocks`): from the end of the compiled kernel before the router to the
start of the compiled kernel after the experts, when the router ran and when the routed experts'
and the shared expert's last kernels ended (the shared expert runs on a stream of its own).

    python scripts/profile_decode.py [--layers 26] [--batch 1] [--steps 32] [--compile] [--step-ops fp4kit,transformers]

Writes benchmarks/results/decode-profile-<gpu>.json (with its date, command and versions) and
prints a table. `--device cpu --tiny` profiles the embedded model's aten operators on the CPU
instead (a smoke run; writes to a temporary file unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch
from benchlib.record import run_record, write_results

from fp4kit.decode import DEFAULT_STEP_OPS, STEP_OPS, generate, inductor_pdl
from fp4kit.export.load import load_quantized
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.quantize import DEFAULT_RECIPE, quantize
from fp4kit.recipe import load_recipe

# Kernel (or, on the CPU, operator) names by kind; the first pattern that matches names the kind.
KINDS = (
    ("fp4kit kernels", r"^_(moe|gemv|mma|w4a16|packed|dequantize|fp8|round|route|decode_attention|mamba_step)"),
    ("bf16 matmul", r"nvjet|cutlass|gemm|cublas|grouped_mm|splitKreduce|aten::(mm|bmm|addmm|linear|_grouped_mm)$"),
    ("copy", r"copy|Memcpy|Memset|aten::(copy_|clone|contiguous|to|_to_copy)$"),
    ("top-k and sort", r"topk|[Ss]ort|aten::(topk|sort|argsort)$"),
    ("reduction", r"reduce_kernel|aten::(sum|mean|amax|max|argmax|softmax|_softmax|cumsum)$"),
    ("elementwise", r"elementwise|aten::(add|mul|sub|div|exp|silu|sigmoid|where|neg|pow|rsqrt|clamp)_?$"),
)


TOP = 25  # kernels listed by name per model


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def profiled(model, prompt: list[list[int]], new: int, device: torch.device,
             compile: bool = False, step_ops: str = DEFAULT_STEP_OPS, timeline: list | None = None
             ) -> dict[str, dict[str, float]]:
    """{kernel name: {"us": time, "count": launches}} over one generate of `new` tokens. timeline:
    a list that receives each CUDA kernel of that generate as {name, stream, start, end} (us), in
    order of start."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    generate(model, None, prompt, new, compile=compile, step_ops=step_ops)  # warm-up: compiles kernels
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        generate(model, None, prompt, new, compile=compile, step_ops=step_ops)
        if cuda:
            torch.cuda.synchronize(device)
    if timeline is not None and cuda:
        timeline.extend(kernel_timeline(prof))
    out: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        if cuda:
            if e.device_type.name != "CUDA" or not e.self_device_time_total:
                continue
            us = e.self_device_time_total
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        row = out.setdefault(e.key, {"us": 0.0, "count": 0})
        row["us"] += us
        row["count"] += e.count
    return out


def kernel_timeline(prof) -> list[dict]:
    """A finished profile's CUDA kernels as {name, stream, start, end} (us), in order of start (read
    from its Chrome trace, which keeps each kernel's stream)."""
    with tempfile.TemporaryDirectory(prefix="fp4kit-profile-trace-") as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    rows = [{"name": e["name"], "stream": e.get("args", {}).get("stream"), "start": float(e["ts"]),
             "end": float(e["ts"]) + float(e.get("dur", 0.0))}
            for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    return sorted(rows, key=lambda r: r["start"])


def last_step(kernels: list[dict]) -> list[dict]:
    """The kernels of the last decode step that has one before it: those after the next-to-last
    greedy pick's argmax up to the last one's, inclusive ([] with fewer than three picks)."""
    picks = [i for i, k in enumerate(kernels) if "ArgMax" in k["name"]]
    return kernels[picks[-2] + 1:picks[-1] + 1] if len(picks) >= 3 else []


COMPILED = "triton_"  # Inductor's kernels: the step's code around the fp4kit operators


def moe_blocks(step: list[dict]) -> list[dict]:
    """Each MoE block of a decode step whose router (`_route_kernel`) and routed experts
    (`_moe_*` kernels) are fp4kit's, in microseconds from the end of the compiled kernel before
    the router (the block's input ready): `block` to the start of the first compiled kernel after
    the routed experts (the join of the block's streams), `router_end`, `routed_end` and
    `shared_end` (the last kernel in the block that is neither; None where there is none)."""
    out = []
    routers = [i for i, k in enumerate(step) if k["name"] == "_route_kernel"]
    for n, i in enumerate(routers):
        router = step[i]
        stop = routers[n + 1] if n + 1 < len(routers) else len(step)
        routed = [k for k in step[i + 1:stop] if k["name"].startswith("_moe_")]
        before = [k for k in step[:i] if k["name"].startswith(COMPILED) and k["end"] <= router["start"]]
        if not routed or not before:
            continue
        ready = max(k["end"] for k in before)
        routed_end = max(k["end"] for k in routed)
        join = next((k for k in step[i + 1:] if k["name"].startswith(COMPILED) and k["start"] >= router["end"]), None)
        if join is None:
            continue
        shared = [k for k in step if ready <= k["start"] < join["start"] and k is not router and k not in routed]
        out.append({"block": join["start"] - ready, "router_end": router["end"] - ready,
                    "routed_end": routed_end - ready,
                    "shared_end": max(k["end"] for k in shared) - ready if shared else None})
    return out


def summarize_blocks(blocks: list[dict]) -> dict:
    """`moe_blocks`' figures as per-block lists (rounded to 0.1 us) and the blocks' total."""
    keys = ("block", "router_end", "routed_end", "shared_end")
    return {"blocks": len(blocks), "block_total": round(sum(b["block"] for b in blocks), 1),
            **{k: [None if b[k] is None else round(b[k], 1) for b in blocks] for k in keys}}


def wall_per_step(model, prompt: list[list[int]], steps: int, device: torch.device, compile: bool = False,
                  step_ops: str = DEFAULT_STEP_OPS, reps: int = 3) -> float:
    """Microseconds of host clock per decode step: `Generation.decode_seconds` of a generate of
    `steps` + 1 tokens over its `steps` steps, the median of `reps` generates (after the profiled
    runs: kernels compiled, graphs warm)."""
    import statistics

    return statistics.median(generate(model, None, prompt, steps + 1, compile=compile, step_ops=step_ops).decode_seconds
                             / steps * 1e6 for _ in range(reps))


def by_kind(per_name: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Kernel figures summed by kind (`kind_of`)."""
    out: dict[str, dict[str, float]] = {}
    for name, v in per_name.items():
        row = out.setdefault(kind_of(name), {"us": 0.0, "count": 0})
        row["us"] += v["us"]
        row["count"] += v["count"]
    return out


def top_kernels(per_name: dict[str, dict[str, float]], n: int = TOP) -> list[dict]:
    """The `n` kernels that take the most time, each with its kind."""
    rows = sorted(per_name.items(), key=lambda kv: -kv[1]["us"])[:n]
    return [{"kernel": name[:200], "kind": kind_of(name), "us": v["us"], "count": v["count"]} for name, v in rows]


def per_step(full: dict, one: dict, steps: int) -> dict[str, dict[str, float]]:
    kinds = sorted(set(full) | set(one))
    zero = {"us": 0.0, "count": 0}
    return {k: {"us": (full.get(k, zero)["us"] - one.get(k, zero)["us"]) / steps,
                "count": (full.get(k, zero)["count"] - one.get(k, zero)["count"]) / steps} for k in kinds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=26, help="the first N layers of Nemotron-3-Nano (default 26)")
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled (default 32)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model (for a CPU smoke run)")
    ap.add_argument("--compile", action="store_true", help="generate compiles its decode step (torch.compile)")
    ap.add_argument("--step-ops", default=DEFAULT_STEP_OPS,
                    help=f"comma-separated, of {', '.join(STEP_OPS)}: what the step's attention, routers and Mamba mixers run "
                         "(generate's step_ops), each model profiled under each; the names of the others than the "
                         f"first end in ' (<ops> ops)' (default {DEFAULT_STEP_OPS})")
    ap.add_argument("--reps", type=int, default=3, help="timed generates per model for the wall time per step")
    ap.add_argument("--out", help="JSON file (default benchmarks/results/decode-profile-<gpu>.json)")
    args = ap.parse_args()
    step_ops = [o for o in args.step_ops.split(",") if o]
    if not step_ops or any(o not in STEP_OPS for o in step_ops) or len(set(step_ops)) != len(step_ops):
        ap.error(f"--step-ops takes distinct values of {', '.join(STEP_OPS)}, got {args.step_ops!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device is available; use --device cpu --tiny")
    if device.type != "cuda" and not args.tiny:
        ap.error("the real-width model needs --device cuda; use --tiny on the CPU")
    if args.tiny:
        from fp4kit.models.tiny import load_tiny_model

        model, _ = load_tiny_model(device=device)
        source = "the embedded tiny Nemotron-H"
    else:
        from dry_run import build_model, nano_config

        model = build_model(nano_config(args.layers), device=str(device), seed=0)
        source = f"the first {args.layers} layers of Nemotron-3-Nano, random weights with log-normal row factors"
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (4, 256), generator=g).to(device)
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="fp4kit-profile-decode-") as tmp:
        qm = quantize(model, load_recipe(args.recipe), calib, progress=False)
        path = export_checkpoint(qm, Path(tmp) / "checkpoint", progress=False)
        del qm
        qmodel = load_quantized(path, device=device, backend="triton" if device.type == "cuda" else "torch")
    qmodel.generation_config.eos_token_id = None

    runs = {(name if i == 0 else f"{name} ({ops} ops)"): (m, ops)
            for i, ops in enumerate(step_ops) for name, m in (("bf16", model), (args.recipe, qmodel))}
    timelines = {name: [] for name in runs}
    named = {name: per_step(profiled(m, prompt, args.steps + 1, device, args.compile, ops, timelines[name]),
                            profiled(m, prompt, 1, device, args.compile, ops), args.steps)
             for name, (m, ops) in runs.items()}
    blocks = {name: summarize_blocks(moe_blocks(last_step(t))) for name, t in timelines.items()}
    steps = {name: by_kind(v) for name, v in named.items()}
    wall = {name: wall_per_step(m, prompt, args.steps, device, args.compile, ops, args.reps)
            for name, (m, ops) in runs.items()}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {**run_record(), "source": source, "pattern": model.config.hybrid_override_pattern, "recipe": args.recipe,
              "compile": args.compile, "inductor_pdl": args.compile and inductor_pdl(device.type),
              "step_ops": step_ops, "batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps,
              "measure": "CUDA kernel time" if device.type == "cuda" else "CPU time of aten operators",
              "per_step": steps,
              "per_step_total_us": {name: sum(v["us"] for v in s.values()) for name, s in steps.items()},
              "per_step_kernels": {name: sum(v["count"] for v in s.values()) for name, s in steps.items()},
              "reps": args.reps, "per_step_wall_us": wall,
              "per_step_idle_us": {name: wall[name] - sum(v["us"] for v in s.values()) for name, s in steps.items()},
              "top_kernels_per_step": {name: top_kernels(v) for name, v in named.items()},
              "moe_blocks_us": {name: b for name, b in blocks.items() if b["blocks"]}}
    kinds = sorted({k for s in steps.values() for k in s}, key=lambda k: -max(s.get(k, {"us": 0})["us"] for s in steps.values()))
    print(f"{'per decode step':<18}" + "".join(f"{name + ' us':>26}{'kernels':>9}" for name in steps))
    for k in kinds:
        print(f"{k:<18}" + "".join(f"{s.get(k, {'us': 0})['us']:>26.1f}{s.get(k, {'count': 0})['count']:>9.0f}" for s in steps.values()))
    print(f"{'total':<18}" + "".join(f"{result['per_step_total_us'][name]:>26.1f}"
                                     f"{result['per_step_kernels'][name]:>9.0f}" for name in steps))
    print(f"{'wall (host clock)':<18}" + "".join(f"{wall[name]:>26.1f}{'':>9}" for name in steps))
    print(f"{'no kernel running':<18}" + "".join(f"{result['per_step_idle_us'][name]:>26.1f}{'':>9}" for name in steps))
    for name, rows in result["top_kernels_per_step"].items():
        print(f"\n{name}: the {len(rows)} kernels that take the most time per step")
        for r in rows:
            print(f"{r['us']:>10.1f} us {r['count']:>6.1f}x  {r['kind']:<15} {r['kernel'][:90]}")
    for name, b in result["moe_blocks_us"].items():
        print(f"\n{name}: {b['blocks']} MoE blocks of one step, {b['block_total']} us in all; per block, us from its "
              f"input: router end / routed experts' end / shared expert's end / the join")
        for r, e, sh, j in zip(b["router_end"], b["routed_end"], b["shared_end"], b["block"]):
            print(f"{r:>8.1f} {e:>8.1f} {'-' if sh is None else f'{sh:.1f}':>8} {j:>8.1f}")
    out = write_results(result, "decode-profile", gpu, out=args.out, smoke=device.type != "cuda")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
