"""Decode speed: BF16 against its fp4kit checkpoints loaded back, both decoded by `fp4kit.generate`
with one CUDA graph per batch bucket, and BF16 through transformers' eager `model.generate`.

Builds the first `--layers` layers of Nemotron-3-Nano (configs/models/, default 26: the half model)
on one GPU with random weights (N(0, 0.02), each row scaled by a log-normal factor, as
scripts/dry_run.py), quantizes it under each recipe (default: nemotron-h-w4a16-4o6 and
modelopt-lightning, whose lm_head is W4A16 too) on random calibration tokens, exports the
checkpoint to a temporary folder and loads it back with `fp4kit.load_quantized` (Triton kernels on
CUDA). Then, per batch size, side by side in one process, interleaved:

  decode time = median time of generate(N new tokens) - median time of generate(1 new token)
  tokens/s    = batch * (N - 1) / decode time  (the N - 1 tokens that come from decode steps;
                prefill, cache allocation and graph capture are in both timings and cancel)
  steps tokens/s = batch * (N - 1) / median Generation.decode_seconds of generate(N) (fp4kit's
                generate: its decode steps timed alone, from the prefill's token read back to the
                last step's; no second generate to subtract, whose prefill and capture vary by
                tens of milliseconds from run to run)

for `graph` (fp4kit.generate, captured step; with --compile, the step's forward compiled by
torch.compile first, for every model alike) and, for BF16 at `--eager-batches`, `eager`
(transformers' model.generate). Every row runs the full N tokens (EOS is switched off). GPU memory
is measured, not computed: the weights (allocated bytes added by building or loading a model) and
the peak a generate adds over them (static caches, activations, the graph's pool). Also checks
that the checkpoint generates: row 0's tokens against BF16's, the agreeing prefix, and the
teacher-forced agreement; and records the host time of one eager W4A16 call (M = 1).

`--step-ops fp4kit,transformers` times every model under each of `fp4kit.generate`'s step ops
(the step's attention, routers and Mamba decode functions: fp4kit's, those with one-launch
attention and routers (triton), or the model's own), side by side.
`--sequential-shared` times each checkpoint also with its MoE blocks' shared expert run after the
routed experts on one stream (`models.nemotron_h.shared_experts_after_routed`), as labels ending
in _sequential-shared: load_quantized runs it on a second stream beside them on a GPU.

`--layouts checkpoint,packed` loads each checkpoint once per layout of its NVFP4 linears
(`load_quantized(layout=...)`), the layouts after the first as labels <recipe>_<layout>-layout.

Writes benchmarks/results/decode-graph[-compiled][-mamba-kernels]-<gpu>.json (with its date,
command and versions) and prints a table.

    python scripts/bench_decode.py [--layers 26] [--batches 1,16,64] [--prompt-len 512] [--new-tokens 256] [--compile]
                                   [--step-ops fp4kit,transformers] [--sequential-shared] [--layouts checkpoint,packed]

Smoke run of the same flow on the embedded tiny model (trained, 4096-token vocabulary), on the CPU
with fp4kit's exact emulation and no graph; writes to a temporary file unless --out is given:

    python scripts/bench_decode.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchlib.record import run_record, write_results

from fp4kit.decode import DEFAULT_STEP_OPS, INDUCTOR_PDL_ENV, STEP_OPS, generate as fp4kit_generate, inductor_pdl
from fp4kit.export.load import load_quantized
from fp4kit.modules import LAYOUTS
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.models.nemotron_h import NANO_WIDTHS, mamba_kernels, shared_experts_after_routed
from fp4kit.quantize import DEFAULT_RECIPE, quantize
from fp4kit.recipe import load_recipe

# Run sizes: the half model on a GPU, and the embedded tiny model for a CPU smoke run.
DEFAULTS = {
    "slice": dict(batches="1,16,64", prompt_len=512, new_tokens=256, reps=3, calib_samples=8, calib_len=512,
                  recipes=f"{DEFAULT_RECIPE},modelopt-lightning", eager_batches="1"),
    "tiny": dict(batches="1,4", prompt_len=16, new_tokens=12, reps=2, calib_samples=4, calib_len=128,
                 recipes=DEFAULT_RECIPE, eager_batches="1"),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def build_slice(pattern: str, device: torch.device, generator: torch.Generator):
    """A Nemotron-H of Nano's widths with any pattern, random bf16 weights N(0, 0.02)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern=pattern, **NANO_WIDTHS)
    torch.manual_seed(generator.initial_seed())  # the init draws the 1-d parameters (dt_bias) from it
    with device:
        model = NemotronHForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=generator)
    return model


def build_nano_layers(layers: int, device: torch.device, seed: int):
    """The first `layers` layers of Nemotron-3-Nano, built as scripts/dry_run.py builds them."""
    from dry_run import build_model, nano_config

    return build_model(nano_config(layers), device=str(device), seed=seed)


def timed_generate(model, prompts: torch.Tensor, new_tokens: int, how: str, compile: bool = False,
                   ops: str = "fp4kit", sequential: bool = False) -> tuple[float, list[list[int]], float | None]:
    """Seconds for one greedy generate of exactly `new_tokens` tokens per row, the tokens, and for
    fp4kit's generate its decode steps' own seconds (`Generation.decode_seconds`; None for
    transformers' generate); sequential: the MoE blocks' shared expert after the routed experts,
    on one stream."""
    if sequential:
        with shared_experts_after_routed(model):
            return timed_generate(model, prompts, new_tokens, how, compile, ops)
    sync(prompts.device)
    t0 = time.perf_counter()
    decode_s = None
    if how == "eager":
        out = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=model.generation_config.pad_token_id or 0,
        )[:, prompts.shape[1]:].tolist()
    else:
        result = fp4kit_generate(model, None, prompts.tolist(), new_tokens, graph=how == "graph",
                                 compile=compile, step_ops=ops)
        out, decode_s = result.tokens, result.decode_seconds
    sync(prompts.device)
    seconds = time.perf_counter() - t0
    if [len(r) for r in out] != [new_tokens] * prompts.shape[0]:
        raise RuntimeError(f"{how} generate returned rows of {sorted({len(r) for r in out})} tokens, expected {new_tokens}")
    return seconds, out, decode_s


def teacher_forced_argmax(model, sequence: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """argmax of the next-token logits at the positions that predict the last `new_tokens` tokens."""
    with torch.inference_mode():
        logits = model(input_ids=sequence, use_cache=False, logits_to_keep=new_tokens + 1).logits
    return logits[:, :-1].argmax(-1)


def agreement(ref: list[list[int]], test: list[list[int]]) -> dict:
    same = torch.tensor(ref) == torch.tensor(test)
    return {
        "row0_agree": same[0].float().mean().item(),
        "row0_agree_prefix": int(same[0].long().cumprod(0).sum()),
        "all_rows_agree": same.float().mean().item(),
    }


def bench_batch(runs: dict, prompts: torch.Tensor, new_tokens: int, reps: int, compile: bool = False) -> dict:
    """runs: {label: (model, "graph" | "eager" | "step", step_ops, sequential shared expert)}.
    Timings, memory and tokens per label; compile: fp4kit.generate compiles its step (the first
    generate per label includes the compile)."""
    device = prompts.device
    out: dict = {}
    tokens = {}
    for label, (model, how, ops, seq) in runs.items():  # warm-up: compiles kernels, and measures the memory a generate adds
        base = allocated(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        first_s, tokens[label], _ = timed_generate(model, prompts, new_tokens, how, compile, ops, seq)
        out[f"first_generate_s_{label}"] = first_s
        if device.type == "cuda":
            out[f"generate_peak_extra_bytes_{label}"] = torch.cuda.max_memory_allocated(device) - base
    times = {label: {"one": [], "all": [], "steps": []} for label in runs}
    for _ in range(reps):  # interleaved, so drift hits all alike
        for label, (model, how, ops, seq) in runs.items():
            times[label]["one"].append(timed_generate(model, prompts, 1, how, compile, ops, seq)[0])
            seconds, _, decode_s = timed_generate(model, prompts, new_tokens, how, compile, ops, seq)
            times[label]["all"].append(seconds)
            times[label]["steps"].append(decode_s)
    decoded = prompts.shape[0] * (new_tokens - 1)
    for label, t in times.items():
        one, full = statistics.median(t["one"]), statistics.median(t["all"])
        out[f"tokens_per_s_{label}"] = decoded / (full - one)
        out[f"ms_per_decode_step_{label}"] = 1e3 * (full - one) / (new_tokens - 1)
        out[f"generate_1_s_{label}"] = t["one"]
        out[f"generate_{new_tokens}_s_{label}"] = t["all"]
        if None not in t["steps"]:  # fp4kit's generate: its decode steps timed alone, no prefill to subtract
            out[f"decode_steps_s_{label}"] = t["steps"]
            out[f"steps_tokens_per_s_{label}"] = decoded / statistics.median(t["steps"])
    out["row0_tokens"] = {label: rows[0] for label, rows in tokens.items()}
    ref = tokens["bf16_graph" if "bf16_graph" in tokens else "bf16_step"]
    sequence = torch.cat([prompts, torch.tensor(ref, device=device)], dim=1)
    forced_ref = teacher_forced_argmax(runs["bf16_graph" if "bf16_graph" in runs else "bf16_step"][0], sequence, new_tokens)
    for label, (model, how, _, _) in runs.items():
        if label.startswith("bf16"):
            out[f"agree_{label}"] = agreement(ref, tokens[label])
            continue
        out[f"agree_{label}"] = {**agreement(ref, tokens[label]),
                                 "teacher_forced_agree": (forced_ref == teacher_forced_argmax(model, sequence, new_tokens)).float().mean().item()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model instead of the real-width model")
    ap.add_argument("--layers", type=int, default=26, help="the first N layers of Nemotron-3-Nano (default 26: the half model)")
    ap.add_argument("--pattern", help="instead of --layers: a hybrid_override_pattern at Nano's widths, N(0, 0.02) weights")
    ap.add_argument("--recipes", help=f"comma-separated recipes (default {DEFAULTS['slice']['recipes']}; --tiny {DEFAULT_RECIPE})")
    ap.add_argument("--backend", choices=("triton", "torch"),
                    help="how the loaded checkpoints compute (default: triton on CUDA, torch on the CPU)")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,16,64; --tiny 1,4)")
    ap.add_argument("--eager-batches", help="batch sizes at which BF16's eager model.generate is timed too (default 1)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default 512; --tiny 16)")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per row, >= 2 (default 256; --tiny 12)")
    ap.add_argument("--reps", type=int, help="timed repetitions per model and batch (default 3; --tiny 2)")
    ap.add_argument("--calib-samples", type=int, help="random calibration rows (default 8; --tiny 4)")
    ap.add_argument("--calib-len", type=int, help="tokens per calibration row (default 512; --tiny 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="folder for the temporary checkpoints (default: the system temp folder)")
    ap.add_argument("--out", help="JSON file (default: benchmarks/results/decode-graph-<gpu>.json; --tiny: a temporary file)")
    ap.add_argument("--compile", action="store_true",
                    help="fp4kit.generate compiles its decode step (torch.compile) for every model alike")
    ap.add_argument("--step-ops", default=DEFAULT_STEP_OPS,
                    help=f"comma-separated, of {', '.join(STEP_OPS)}: what the decode step's attention, routers "
                         "and Mamba mixers run (fp4kit.generate's step_ops), every model under each; labels of the others "
                         f"than the first end in _<ops>-ops (default {DEFAULT_STEP_OPS})")
    ap.add_argument("--sequential-shared", action="store_true",
                    help="time each checkpoint also with its MoE blocks' shared expert after the routed experts "
                         "on one stream (labels ending in _sequential-shared)")
    ap.add_argument("--inductor-pdl", action=argparse.BooleanOptionalAction,
                    help="with --compile: TorchInductor's kernels as programmatic dependent launches or not (its "
                         "triton.enable_pdl, Hopper onwards), every model alike (default: fp4kit.generate's, on; "
                         "fp4kit.decode.inductor_pdl)")
    ap.add_argument("--layouts", default=LAYOUTS[0],
                    help=f"comma-separated NVFP4 linear layouts each checkpoint is loaded with (of {', '.join(LAYOUTS)}; "
                         f"default {LAYOUTS[0]}): a layout after the first gives labels <recipe>_<layout>-layout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args()
    if args.inductor_pdl is not None:
        import torch._inductor.config as inductor_config

        if not args.compile:
            ap.error("--[no-]inductor-pdl applies to the compiled step: add --compile")
        if args.inductor_pdl and not hasattr(inductor_config.triton, "enable_pdl"):
            ap.error(f"--inductor-pdl: torch {torch.__version__}'s Inductor has no triton.enable_pdl")
        os.environ[INDUCTOR_PDL_ENV] = "1" if args.inductor_pdl else "0"
    for key, value in DEFAULTS["tiny" if args.tiny else "slice"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    batches = [int(b) for b in args.batches.split(",")]
    eager_batches = {int(b) for b in args.eager_batches.split(",") if b}
    recipes = [r for r in args.recipes.split(",") if r]
    step_ops = [o for o in args.step_ops.split(",") if o]
    if not step_ops or any(o not in STEP_OPS for o in step_ops) or len(set(step_ops)) != len(step_ops):
        ap.error(f"--step-ops takes distinct values of {', '.join(STEP_OPS)}, got {args.step_ops!r}")
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or any(x not in LAYOUTS for x in layouts) or len(set(layouts)) != len(layouts):
        ap.error(f"--layouts takes distinct values of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (one from the prefill, the rest timed)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is available")
    if device.type != "cuda" and not args.tiny:
        ap.error("the real-width model needs --device cuda; use --tiny on the CPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    quantizer = "triton" if device.type == "cuda" else "torch"
    backend = args.backend or quantizer
    how = "graph" if device.type == "cuda" else "step"  # the same static step, run eagerly off CUDA
    progress = not args.no_progress

    g = torch.Generator(device=device).manual_seed(args.seed)
    base = allocated(device)
    t0 = time.perf_counter()
    tokenizer = None
    if args.tiny:
        from fp4kit.models.tiny import load_tiny_model

        model, tokenizer = load_tiny_model(dtype=torch.bfloat16, device=device)
        source = "the embedded tiny Nemotron-H (trained)"
    elif args.pattern:
        model = build_slice(args.pattern, device, g)
        source = "Nemotron-H at Nano's widths, random N(0, 0.02) weights"
    else:
        model = build_nano_layers(args.layers, device, args.seed)
        source = f"the first {args.layers} layers of Nemotron-3-Nano, random weights with log-normal row factors"
    sync(device)
    build_s = time.perf_counter() - t0
    weight_bytes = {"bf16": allocated(device) - base}
    model.generation_config.eos_token_id = None  # every row decodes all its tokens
    cfg = model.config
    vocab = cfg.vocab_size
    params = sum(p.numel() for p in model.parameters())
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{source}: pattern {cfg.hybrid_override_pattern}, {params / 1e9:.3f} B parameters, built in {build_s:.1f}s")

    calib = torch.randint(0, vocab, (args.calib_samples, args.calib_len), device=device, generator=g)
    prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), device=device, generator=g)

    loaded, checkpoints = {}, {}
    for recipe in recipes:
        with tempfile.TemporaryDirectory(dir=args.workdir, prefix="fp4kit-bench-decode-") as tmp:
            t0 = time.perf_counter()
            qm = quantize(model, load_recipe(recipe), calib, backend=quantizer, progress=progress)
            qm.calibration = {"spec": f"{args.calib_samples}x{args.calib_len}", "tokens": int(calib.numel()),
                              "source": "uniformly random token ids", "seed": args.seed}
            path = export_checkpoint(qm, Path(tmp) / "checkpoint", tokenizer=tokenizer, progress=progress,
                                     card_extra={"source": source, "title": f"bench_decode {recipe}"})
            quantize_s = time.perf_counter() - t0
            warnings = list(qm.warnings)
            del qm
            for layout in layouts:
                name = recipe if layout == layouts[0] else f"{recipe}_{layout}-layout"
                before = allocated(device)
                t0 = time.perf_counter()
                qmodel = load_quantized(path, device=device, backend=backend, layout=layout)
                sync(device)
                load_s = time.perf_counter() - t0
                weight_bytes[name] = allocated(device) - before
                qmodel.generation_config.eos_token_id = None
                checkpoints[name] = {"checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
                                     "quantize_export_s": quantize_s, "load_s": load_s, "layout": layout,
                                     "warnings": warnings}
                loaded[name] = qmodel
                memory = (f", weights on the GPU {weight_bytes[name] / 1e9:.3f} GB (BF16 "
                          f"{weight_bytes['bf16'] / 1e9:.3f} GB)" if device.type == "cuda" else "")
                print(f"{name}: quantize + export {quantize_s:.1f}s, load {load_s:.1f}s ({layout} layout), "
                      f"checkpoint {checkpoints[name]['checkpoint_bytes'] / 1e9:.3f} GB{memory}")

    launch = None
    if device.type == "cuda":
        from benchlib.w4a16 import host_overhead_us

        launch = host_overhead_us()
        print(f"eager launch, host time per call (M = 1, 3712 x 2688): {launch}")

    per_batch = {}
    for b in batches:
        runs, refs = {}, {}
        for i, ops in enumerate(step_ops):
            tail = "" if i == 0 else f"_{ops}-ops"
            runs[f"bf16_{how}{tail}"] = (model, how, ops, False)
            if i == 0 and b in eager_batches:
                runs["bf16_eager"] = (model, "eager", "transformers", False)  # model.generate: the model's own
            runs.update({f"{recipe}_{how}{tail}": (m, how, ops, False) for recipe, m in loaded.items()})
            if i == 0 and args.sequential_shared:
                runs.update({f"{recipe}_{how}_sequential-shared": (m, how, ops, True) for recipe, m in loaded.items()})
            refs.update({label: f"bf16_{how}{tail}" for label in runs if label not in refs})
        print(f"batch {b}: timing {', '.join(runs)} ...", flush=True)
        r = bench_batch(runs, prompts[:b], args.new_tokens, args.reps, args.compile)
        # Each label over BF16 under the same step ops (BF16's eager generate: over the first's).
        r["speedup_over_bf16_" + how] = {label: r[f"tokens_per_s_{label}"] / r[f"tokens_per_s_{refs[label]}"]
                                         for label in runs}
        if "bf16_eager" in runs:
            r["speedup_over_bf16_eager"] = {label: r[f"tokens_per_s_{label}"] / r["tokens_per_s_bf16_eager"] for label in runs}
        per_batch[str(b)] = r

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # transformers runs the Mamba mixers with these packages where they import, else in plain torch.
    kernels = mamba_kernels()
    results = {
        **run_record(), "device": str(device), "quantize_backend": quantizer, "load_backend": backend, "decode": how,
        "compile": args.compile, "inductor_pdl": args.compile and inductor_pdl(device.type),
        "mamba_kernels": kernels, "step_ops": step_ops,
        "sequential_shared": args.sequential_shared,
        "model": {
            "source": source, "pattern": cfg.hybrid_override_pattern, "params": params, "hidden_size": cfg.hidden_size,
            "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "vocab_size": vocab,
            "experts_implementation_bf16": getattr(cfg, "_experts_implementation", None),
            "attn_implementation": cfg._attn_implementation,
        },
        "recipes": recipes, "layouts": layouts, "checkpoints": checkpoints,
        "calibration": {"samples": args.calib_samples, "seq_len": args.calib_len, "tokens": "uniformly random"},
        "bf16_weight_bytes": bf16_bytes, "build_s": build_s,
        "weight_memory_bytes": weight_bytes if device.type == "cuda" else None,  # allocator bytes: CUDA only
        "weight_memory_over_bf16": {k: v / weight_bytes["bf16"] for k, v in weight_bytes.items()} if device.type == "cuda" else None,
        "eager_launch_host_us": launch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
        "tokens_per_s": "batch * (new_tokens - 1) / (median generate(new_tokens) - median generate(1))",
        "steps_tokens_per_s": "batch * (new_tokens - 1) / median decode_seconds of generate(new_tokens): the decode "
                              "steps' own host-clock time, from the prefill's token read back to the last step's",
        "batches": per_batch,
    }

    labels = [f"bf16_{how}", "bf16_eager", *(f"{r}_{how}" for r in loaded)]
    labels += [f"{name}_{how}_{ops}-ops" for ops in step_ops[1:] for name in ["bf16", *loaded]]
    labels += [f"{r}_{how}_sequential-shared" for r in loaded if args.sequential_shared]
    print(f"\n{'batch':>5}" + "".join(f"{lab + ' tok/s':>34}" for lab in labels))
    for b, r in per_batch.items():
        cells = []
        for lab in labels:
            if f"tokens_per_s_{lab}" not in r:
                cells.append(f"{'-':>34}")
                continue
            rel = r[f"speedup_over_bf16_{how}"][lab]
            cells.append(f"{r[f'tokens_per_s_{lab}']:>24.1f} ({rel:5.2f}x)")
        print(f"{b:>5}" + "".join(cells))
        base = r.get(f"steps_tokens_per_s_bf16_{how}")
        cells = [f"{r[f'steps_tokens_per_s_{lab}']:>24.1f} ({r[f'steps_tokens_per_s_{lab}'] / base:5.2f}x)"
                 if base and f"steps_tokens_per_s_{lab}" in r else f"{'-':>34}" for lab in labels]
        print(f"{'steps':>5}" + "".join(cells))
    if device.type == "cuda":
        print("weight memory: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in weight_bytes.items()))

    # With mamba-ssm and causal-conv1d both models run other Mamba code: a results file of its own.
    name = "decode-graph" + ("-compiled" if args.compile else "") + ("-mamba-kernels" if all(kernels.values()) else "")
    out = write_results(results, name, gpu, out=args.out, smoke=args.tiny)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
