"""Decode speed: the BF16 model vs its fp4kit checkpoint loaded back, greedy generate, same prompts.

Builds a Nemotron-H slice with the real widths of Nemotron-3-Nano (as scripts/bench_calibration.py:
hidden 2688, 128 experts top-6, Mamba 64x64 heads, 32/2 attention heads) and random weights on one
GPU, quantizes it under a recipe (default nemotron-h-w4a16-4o6: experts NVFP4 W4A16 4/6, Mamba
in/out_proj FP8, KV cache FP8) on random calibration tokens, exports the checkpoint to a temporary
folder and loads it back with `fp4kit.load_quantized` (Triton kernels on CUDA). Then, per batch size,
side by side in one process:

  decode time = median time of generate(N new tokens) - median time of generate(1 new token),
                greedy, min_new_tokens = N, transformers' default (hybrid Mamba + attention) cache
  tokens/s    = batch * (N - 1) / decode time  (the N - 1 tokens that come from decode steps;
                the first new token comes from the prefill, which both timings contain)

and checks that the checkpoint generates: row 0's new tokens from both models, the fraction of
positions where they agree (free-running greedy diverges for good at the first disagreement, so
the agreeing prefix is reported too), and the teacher-forced agreement (both models read the BF16
model's output and predict each next token; the fraction of equal argmaxes). With random weights
the logits are nearly flat, so disagreements there say little about quantization quality.

Writes benchmarks/results/decode-<gpu>.json (with its date, command and versions) and prints a
table.

    python scripts/bench_decode.py [--pattern MEM*EME] [--batches 1,16] [--new-tokens 128]

Smoke run of the same flow on the embedded tiny model (trained, 4096-token vocabulary), on the CPU
with fp4kit's exact emulation; writes to a temporary file unless --out is given:

    python scripts/bench_decode.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchlib.record import run_record

from fp4kit.export.load import load_quantized
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.models.nemotron_h import NANO_WIDTHS
from fp4kit.quantize import DEFAULT_RECIPE, quantize
from fp4kit.recipe import load_recipe

# Run sizes: the real-width slice on a GPU, and the embedded tiny model for a CPU smoke run.
DEFAULTS = {
    "slice": dict(batches="1,16", prompt_len=64, new_tokens=128, reps=3, calib_samples=8, calib_len=512),
    "tiny": dict(batches="1,4", prompt_len=16, new_tokens=12, reps=2, calib_samples=4, calib_len=128),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_slice(pattern: str, device: torch.device, generator: torch.Generator):
    """The real-width Nemotron-H slice, random bf16 weights N(0, 0.02) (as bench_calibration.py)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern=pattern, **NANO_WIDTHS)
    torch.manual_seed(generator.initial_seed())  # the init draws the 1-d parameters (dt_bias) from it
    with device:
        model = NemotronHForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=generator)
    return model, None


def generate(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Seconds for one greedy generate of exactly `new_tokens` tokens, and the new tokens [B, N]."""
    sync(prompts.device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=model.generation_config.pad_token_id or 0,
    )
    sync(prompts.device)
    seconds = time.perf_counter() - t0
    new = out[:, prompts.shape[1]:]
    if tuple(new.shape) != (prompts.shape[0], new_tokens):
        raise RuntimeError(f"generate returned {tuple(new.shape)} new tokens, expected {(prompts.shape[0], new_tokens)}")
    return seconds, new


def teacher_forced_argmax(model, sequence: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """argmax of the next-token logits at the positions that predict the last `new_tokens` tokens."""
    with torch.inference_mode():
        logits = model(input_ids=sequence, use_cache=False, logits_to_keep=new_tokens + 1).logits
    return logits[:, :-1].argmax(-1)


def agreement(ref: torch.Tensor, test: torch.Tensor, forced_ref: torch.Tensor, forced_test: torch.Tensor) -> dict:
    same = ref == test
    return {
        "row0_tokens_bf16": ref[0].tolist(),
        "row0_tokens_fp4kit": test[0].tolist(),
        "row0_agree": same[0].float().mean().item(),
        "row0_agree_prefix": int(same[0].long().cumprod(0).sum()),
        "all_rows_agree": same.float().mean().item(),
        "teacher_forced_agree": (forced_ref == forced_test).float().mean().item(),
    }


def bench_batch(models: dict, prompts: torch.Tensor, new_tokens: int, reps: int) -> dict:
    new = {name: generate(m, prompts, new_tokens)[1] for name, m in models.items()}  # warm-up: compiles kernels
    times = {name: {"one": [], "all": []} for name in models}
    for _ in range(reps):  # interleaved, so drift hits both alike
        for name, m in models.items():
            times[name]["one"].append(generate(m, prompts, 1)[0])
            times[name]["all"].append(generate(m, prompts, new_tokens)[0])
    out: dict = {}
    decoded = prompts.shape[0] * (new_tokens - 1)
    for name, t in times.items():
        one, full = statistics.median(t["one"]), statistics.median(t["all"])
        out[f"decode_s_{name}"] = full - one
        out[f"tokens_per_s_{name}"] = decoded / (full - one)
        out[f"ms_per_decode_step_{name}"] = 1e3 * (full - one) / (new_tokens - 1)
        out[f"generate_1_s_{name}"] = t["one"]
        out[f"generate_{new_tokens}_s_{name}"] = t["all"]
    out["speedup"] = out["tokens_per_s_fp4kit"] / out["tokens_per_s_bf16"]
    sequence = torch.cat([prompts, new["bf16"]], dim=1)
    forced = {name: teacher_forced_argmax(m, sequence, new_tokens) for name, m in models.items()}
    out.update(agreement(new["bf16"], new["fp4kit"], forced["bf16"], forced["fp4kit"]))
    return out


def gpu_slug(name: str) -> str:
    name = name.lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model instead of the real-width slice")
    ap.add_argument("--pattern", default="MEM*EME", help="hybrid_override_pattern of the slice")
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--backend", choices=("triton", "torch"),
                    help="how the loaded checkpoint computes (default: triton on CUDA, torch on the CPU)")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,16; --tiny 1,4)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (default 64; --tiny 16)")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per row, >= 2 (default 128; --tiny 12)")
    ap.add_argument("--reps", type=int, help="timed repetitions per model and batch (default 3; --tiny 2)")
    ap.add_argument("--calib-samples", type=int, help="random calibration rows (default 8; --tiny 4)")
    ap.add_argument("--calib-len", type=int, help="tokens per calibration row (default 512; --tiny 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="folder for the temporary checkpoint (default: the system temp folder)")
    ap.add_argument("--out", help="JSON file (default: benchmarks/results/decode-<gpu>.json; --tiny: a temporary file)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--launch-shapes", help="a tuning file (the format of fp4kit/kernels/tuning/<gpu>.json, as "
                                            "scripts/tune_kernels.py writes it) whose launch tables the kernels "
                                            "use here instead of the package's")
    args = ap.parse_args()
    launch_shapes = None
    if args.launch_shapes:
        from fp4kit.kernels import launch

        launch_shapes = json.loads(Path(args.launch_shapes).read_text())["kernels"]
        os.environ[launch.TUNING_ENV] = str(Path(args.launch_shapes).resolve())  # read at the first launch
        launch.tables.cache_clear()
    for key, value in DEFAULTS["tiny" if args.tiny else "slice"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    batches = [int(b) for b in args.batches.split(",")]
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (one from the prefill, the rest timed)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is available")
    if device.type != "cuda" and not args.tiny:
        ap.error("the real-width slice needs --device cuda; use --tiny on the CPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    quantizer = "triton" if device.type == "cuda" else "torch"
    backend = args.backend or quantizer
    progress = not args.no_progress

    g = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.tiny:
        from fp4kit.models.tiny import load_tiny_model

        model, tokenizer = load_tiny_model(dtype=torch.bfloat16, device=device)
        source = "the embedded tiny Nemotron-H (trained)"
    else:
        model, tokenizer = build_slice(args.pattern, device, g)
        source = "real-width Nemotron-H slice, random N(0, 0.02) weights"
    sync(device)
    build_s = time.perf_counter() - t0
    cfg = model.config
    vocab = cfg.vocab_size
    params = sum(p.numel() for p in model.parameters())
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{source}: pattern {cfg.hybrid_override_pattern}, {params / 1e9:.3f} B parameters, built in {build_s:.1f}s")

    calib = torch.randint(0, vocab, (args.calib_samples, args.calib_len), device=device, generator=g)
    prompts = torch.randint(0, vocab, (max(batches), args.prompt_len), device=device, generator=g)

    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="fp4kit-bench-decode-") as tmp:
        t0 = time.perf_counter()
        qm = quantize(model, load_recipe(args.recipe), calib, backend=quantizer, progress=progress)
        qm.calibration = {"spec": f"{args.calib_samples}x{args.calib_len}", "tokens": int(calib.numel()),
                          "source": "uniformly random token ids", "seed": args.seed}
        path = export_checkpoint(qm, Path(tmp) / "checkpoint", tokenizer=tokenizer, progress=progress,
                                 card_extra={"source": source, "title": f"bench_decode {args.recipe}"})
        quantize_s = {**qm.timings, "total": time.perf_counter() - t0}
        warnings = list(qm.warnings)
        del qm
        if device.type == "cuda":
            torch.cuda.empty_cache()
        checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))

        t0 = time.perf_counter()
        qmodel = load_quantized(path, device=device, backend=backend)
        sync(device)
        load_s = time.perf_counter() - t0
    print(f"quantize + export {quantize_s['total']:.1f}s, load {load_s:.1f}s, checkpoint {checkpoint_bytes / 1e9:.3f} GB "
          f"(BF16 weights {bf16_bytes / 1e9:.3f} GB), {len(warnings)} warning(s)")

    models = {"bf16": model, "fp4kit": qmodel}
    per_batch = {}
    for b in batches:
        print(f"batch {b}: timing ...", flush=True)
        per_batch[str(b)] = bench_batch(models, prompts[:b], args.new_tokens, args.reps)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # transformers runs the Mamba mixers with these packages when installed, else in plain torch.
    mamba_kernels = {name: importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d")}
    results = {
        **run_record(), "device": str(device), "quantize_backend": quantizer, "load_backend": backend,
        "mamba_kernels_installed": mamba_kernels,
        "model": {
            "source": source, "pattern": cfg.hybrid_override_pattern, "params": params, "hidden_size": cfg.hidden_size,
            "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "vocab_size": vocab,
            "experts_implementation_bf16": getattr(cfg, "_experts_implementation", None),
        },
        "recipe": args.recipe,
        "calibration": {"samples": args.calib_samples, "seq_len": args.calib_len, "tokens": "uniformly random"},
        "bf16_weight_bytes": bf16_bytes, "checkpoint_bytes": checkpoint_bytes,
        "build_s": build_s, "quantize_export_s": quantize_s, "load_s": load_s, "quantize_warnings": warnings,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
        "tokens_per_s": "batch * (new_tokens - 1) / (median generate(new_tokens) - median generate(1))",
        "batches": per_batch,
        "kernel_launch_shapes": launch_shapes,
    }

    print(f"\n{'batch':>5}{'bf16 tok/s':>13}{'fp4kit tok/s':>14}{'speedup':>9}{'row0 agree':>12}{'prefix':>8}{'forced':>8}")
    for b, r in per_batch.items():
        print(f"{b:>5}{r['tokens_per_s_bf16']:>13.1f}{r['tokens_per_s_fp4kit']:>14.1f}{r['speedup']:>9.3f}"
              f"{r['row0_agree']:>12.3f}{r['row0_agree_prefix']:>8}{r['teacher_forced_agree']:>8.3f}")
    for b, r in per_batch.items():
        print(f"batch {b} row 0 bf16:   {r['row0_tokens_bf16']}")
        print(f"batch {b} row 0 fp4kit: {r['row0_tokens_fp4kit']}")

    if args.out is not None:
        out = Path(args.out)
    elif args.tiny:
        out = Path(tempfile.mkdtemp(prefix="fp4kit-bench-decode-")) / "decode-tiny.json"
    else:
        out = Path("benchmarks/results") / f"decode-{gpu_slug(gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
