"""Calibration-pass overhead: forward with fp4kit's observers vs a plain forward, same tokens.

Builds a Nemotron-H slice with the real widths of Nemotron-3-Nano (hidden 2688, 128 experts
top-6, Mamba 64x64 heads, 32/2 attention heads) and random weights on one GPU, then times
  plain:     model(input_ids, use_cache=False, logits_to_keep=1)
  observed:  the same inside fp4kit's Observers for a recipe (statistics it needs)
median of several repetitions, side by side in one process. Writes
benchmarks/results/calibration-overhead-<gpu>.json (with its date, command and versions) and
prints a table.

    python scripts/bench_calibration.py [--pattern MEM*EME] [--samples 4] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from benchlib.record import run_record

from fp4kit.calibrate import Observers
from fp4kit.models import Role, adapter_for
from fp4kit.models.nemotron_h import NANO_WIDTHS
from fp4kit.plan import plan_targets
from fp4kit.recipe import load_recipe



def observers_for(model, recipe_name: str) -> Observers:
    recipe = load_recipe(recipe_name)
    plan, _ = plan_targets(model, recipe)
    amax = [p.target for p in plan if p.rule is not None and p.rule.format in ("fp8", "nvfp4")]
    sq = [p.target for p in plan if p.rule is not None and p.rule.importance]
    kv = adapter_for(model).attention_kv(model) if recipe.kv_cache == "fp8" else []
    moe = {p.target.name: p.target.module for p in plan if p.target.role == Role.ROUTED_EXPERTS}
    return Observers(model, amax_targets=amax, importance_targets=sq, kv_layers=kv, moe_experts=moe)


def timed_pass(model, samples, observers=None) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        if observers is None:
            for row in samples:
                model(input_ids=row[None], use_cache=False, logits_to_keep=1)
        else:
            with observers:
                for row in samples:
                    model(input_ids=row[None], use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--pattern", default="MEM*EME")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--recipes", default="nemotron-h-w4a16-4o6,nemotron-h-nvfp4-w4a4")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    cfg = NemotronHConfig(hybrid_override_pattern=args.pattern, **NANO_WIDTHS)
    with torch.device("cuda"):
        model = NemotronHForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=g)
    samples = torch.randint(0, cfg.vocab_size, (args.samples, args.seq_len), device="cuda", generator=g)
    params = sum(p.numel() for p in model.parameters())

    timed_pass(model, samples[:1])  # warm-up
    results = {**run_record(), "pattern": args.pattern, "params": params, "tokens": samples.numel(),
               "experts_implementation": model.config._experts_implementation, "recipes": {}}
    plain_times, observed = [], {r: [] for r in args.recipes.split(",")}
    for _ in range(args.reps):  # interleaved, so drift hits both alike
        plain_times.append(timed_pass(model, samples))
        for r in observed:
            observed[r].append(timed_pass(model, samples, observers_for(model, r)))
    plain = statistics.median(plain_times)
    results["plain_s"] = plain
    print(f"{'pass':<28}{'median s':>10}{'ratio':>8}")
    print(f"{'plain forward':<28}{plain:>10.3f}{1.0:>8.3f}")
    for r, times in observed.items():
        med = statistics.median(times)
        results["recipes"][r] = {"observed_s": med, "ratio": med / plain, "all_s": times}
        print(f"{r:<28}{med:>10.3f}{med / plain:>8.3f}")
    results["plain_all_s"] = plain_times
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    (out / f"calibration-overhead-{gpu}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
