"""fp4kit's 4/6 quantization against nvidia-modelopt 0.47's 4/6 weight calibration, same tensors.

One Nemotron-H MoE layer with Nemotron-3-Nano's widths (128 experts of 2688 -> 1856 -> 2688, a
shared expert; random N(0, 0.02) bf16 weights) on one GPU:
  ModelOpt: `mtq.quantize` with its Lightning recipe (`w4a16_nvfp4_4o6`: the `mse` algorithm,
            amax multipliers 1.0 and 1.5 per block), forward loop of one 64-token sample; wall
            time after a warm-up call on a second copy (extension builds and first-call setup
            not counted), minus the same forward run plainly.
  fp4kit:   `fp4kit.kernels.quantize.quantize(..., scale_rule="4o6")` on the same expert stacks
            (and the shared expert), each with its own global amax (median of CUDA-event timed
            calls, `triton.testing.do_bench`).
Both produce the 4/6 NVFP4 bytes of the same weights. Writes
benchmarks/results/modelopt-4o6-<gpu>.json (with its date, command and versions) and prints the
ratio. scripts/bench_kernels.py runs the same measurement (`measure`) into its own JSON.

    python scripts/bench_modelopt_4o6.py
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from fp4kit.kernels import quantize as kquant
from fp4kit.models.nemotron_h import NANO_WIDTHS

NANO = dict(NANO_WIDTHS, vocab_size=1024, max_position_embeddings=4096)
LIGHTNING_RECIPE = "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/ptq/w4a16_nvfp4_4o6.yaml"


def build(seed: int):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern="E", **NANO)
    with torch.device("cuda"):
        model = NemotronHForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=g)
    return model


def measure() -> dict:
    """The side-by-side measurement (see the module docstring) as a JSON-ready dict."""
    import modelopt.torch.quantization as mtq
    from modelopt.recipe import load_recipe as modelopt_load_recipe
    from triton.testing import do_bench

    cfg = modelopt_load_recipe(LIGHTNING_RECIPE).quantize.model_dump()
    assert cfg["algorithm"]["method"] == "mse", cfg["algorithm"]
    ids = torch.randint(0, NANO["vocab_size"], (1, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def modelopt_seconds(model) -> tuple[float, float]:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        forward = time.perf_counter() - t0
        t0 = time.perf_counter()
        mtq.quantize(model, copy.deepcopy(cfg), forward_loop=lambda m: m(input_ids=ids, use_cache=False))
        torch.cuda.synchronize()
        return time.perf_counter() - t0, forward

    modelopt_seconds(build(seed=2))  # warm-up: extension builds, kernel compiles
    model = build(seed=0)
    experts = model.model.layers[0].mixer.experts
    shared = model.model.layers[0].mixer.shared_experts
    weights = [experts.up_proj.detach().clone(), experts.down_proj.detach().clone(),
               shared.up_proj.weight.detach().clone(), shared.down_proj.weight.detach().clone()]
    n_weights = sum(w.numel() for w in weights)
    total, forward = modelopt_seconds(model)
    modelopt_s = total - forward
    del model

    for w in weights:  # warm-up
        kquant.quantize(w, scale_rule="4o6")
    fp4kit_ms = sum(do_bench(lambda w=w: kquant.quantize(w, scale_rule="4o6"), warmup=10, rep=100,
                             return_mode="median") for w in weights)
    return {
        "tensors": [list(w.shape) for w in weights], "weights": n_weights,
        "modelopt": {"recipe": LIGHTNING_RECIPE, "algorithm": cfg["algorithm"], "quantize_s": total,
                     "forward_s": forward, "calibration_s": modelopt_s},
        "fp4kit_quantize_4o6_ms": fp4kit_ms,
        "speedup_vs_modelopt": modelopt_s / (fp4kit_ms * 1e-3),
        "timing": "ModelOpt: mtq.quantize wall time (second model, after a warm-up model) minus one plain forward; "
                  "fp4kit: sum over the four tensors of the median quantize() call",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/modelopt-4o6-<gpu>.json)")
    args = ap.parse_args()
    from benchlib.record import run_record

    result = {**run_record(), **measure()}
    print(f"{result['weights'] / 1e6:.0f} M weights: ModelOpt 4/6 calibration {result['modelopt']['calibration_s']:.2f} s, "
          f"fp4kit 4/6 quantize {result['fp4kit_quantize_4o6_ms']:.2f} ms: {result['speedup_vs_modelopt']:.0f}x")
    gpu = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    out = Path(args.out or f"benchmarks/results/modelopt-4o6-{gpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
