"""The fp16 SSM-state cache on a real-width Nemotron-H slice: `fp4kit eval --ssm-state` on a model
too large to ship, built on the GPU.

Builds the first `--layers` layers of Nemotron-3-Nano (configs/models/, default 7: `MEMEM*E`, three
Mamba layers at full width: 64 heads of 64 x 128 state each) with random weights as
scripts/dry_run.py builds them, then runs `fp4kit.ssm_eval.run` on it: the bundled evaluation
split concatenated (tokenized with the embedded model's tokenizer) read one token per step with
the SSM state in fp32, fp16 and fp16 with stochastic rounding (Philox R = 5 and 10, the Triton
kernel on CUDA), and greedy generation from its first 32 tokens. Random weights give nearly flat
logits, so the state's relative error against fp32 per position bucket is reported with the KL.

    python scripts/ssm_state_slice.py [--layers 7] [--tokens 8192] [--generate 2048]

Writes ssm-state.json, ssm-state.md and ssm-state.png to benchmarks/results/ssm-state-<gpu>/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from benchlib.record import run_record
from dry_run import build_model, gpu_tag, nano_config

from fp4kit import ssm_eval
from fp4kit.evaluate import token_rows
from fp4kit.models.tiny import load_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=7, help="the first N layers of Nemotron-3-Nano (default 7: MEMEM*E)")
    ap.add_argument("--tokens", type=int, default=8192, help="teacher-forced tokens (default 8192)")
    ap.add_argument("--generate", type=int, default=2048, help="greedy tokens after a 32-token prompt (default 2048)")
    ap.add_argument("--ssm-state", default="fp16,fp16-sr", help="state formats beside fp32 (default fp16,fp16-sr)")
    ap.add_argument("--philox-rounds", default="5,10")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="folder (default benchmarks/results/ssm-state-<gpu>)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device is available")
    variants = ssm_eval.parse_variants(args.ssm_state, args.philox_rounds)
    cfg = nano_config(args.layers)
    if "*" not in cfg.hybrid_override_pattern:  # transformers' cache builds no mask without an attention layer
        ap.error(f"--layers {args.layers} gives {cfg.hybrid_override_pattern!r}, which has no attention layer; take 6 or more")
    model = build_model(cfg, device=args.device, seed=args.seed)
    _, tokenizer = load_tiny_model(device="cpu")
    rows, _ = token_rows(tokenizer, None, tokens=args.tokens, seq_len=args.tokens)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"ssm-state-{gpu_tag()}"
    provenance = {**run_record(), "model": {
        "source": f"the first {args.layers} layers of Nemotron-3-Nano, random weights with log-normal row factors",
        "pattern": cfg.hybrid_override_pattern, "mamba_num_heads": cfg.mamba_num_heads,
        "mamba_head_dim": cfg.mamba_head_dim, "ssm_state_size": cfg.ssm_state_size,
        "params": sum(p.numel() for p in model.parameters())},
        "tokens": "the bundled evaluation split concatenated, the embedded model's tokenizer"}
    backend = "triton" if args.device.startswith("cuda") else "torch"
    result = ssm_eval.run(model, rows[0], variants, generate=args.generate, seed=args.seed, backend=backend,
                          state_error=True, out=out, provenance=provenance,
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    print(result["markdown"])
    print(f"wrote {', '.join(result['files'])} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
