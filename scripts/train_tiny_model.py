"""Train the bundled tiny Nemotron-H (fp4kit/data/tiny-nemotron-h/) end to end.

The shipped checkpoint came from this run on one H200 (then `cp` of the output folder into
fp4kit/data/tiny-nemotron-h/ and `python scripts/bench_tiny_model_cpu.py` on a CPU):

    PYTHONPATH=. python scripts/train_tiny_model.py --out /tmp/tiny-nemotron-h \
        --results benchmarks/results/tiny-model.json --fit-schedule --time-budget-s 450

--fit-schedule set --max-steps to 1427 there; `--max-steps 1427` without it gives the same
schedule on any machine.

Steps: byte-level BPE tokenizer (trained on the train split if --tokenizer holds none), the
model config, seeded training on one GPU with validation-loss early stopping (validation = the
calibration split; the eval split stays held out), then the saved bf16 checkpoint is reloaded
and scored on the held-out eval split against a unigram baseline.

Precision: fp32 master weights and AdamW state, forward and backward under bf16 autocast. The
model is rounded to bf16 for saving; the router's weight and correction bias are stored as fp32
tensors (holding those bf16 values), the dtype transformers keeps them in.

Expert load is balanced without an auxiliary loss: after each step every router's
`e_score_correction_bias` moves by --bias-update-rate towards equal load.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys
import time

import torch
from benchlib.record import run_record

from fp4kit.models.tiny import corpus_documents, heldout_slice, token_stream

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO / "fp4kit" / "data" / "tiny-nemotron-h"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 0, 1, 2: the Nemotron-H config defaults

# Every dimension a quantized weight has is a multiple of 16 (the NVFP4 block):
#   hidden 256; Mamba in_proj [1168, 256] (z 512 + xBC 640 + dt 16), out_proj [256, 512];
#   attention q/o 4 x 64, k/v 2 x 64; experts up [32, 128, 256], down [32, 256, 128];
#   shared expert up [256, 256], down [256, 256]; lm_head [4096, 256].
MODEL_CONFIG = dict(
    hybrid_override_pattern="MEM*EMEM*E",
    hidden_size=256,
    mamba_num_heads=16,
    mamba_head_dim=32,
    n_groups=2,
    ssm_state_size=32,
    conv_kernel=4,
    chunk_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    n_routed_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    n_shared_experts=1,
    moe_shared_expert_intermediate_size=256,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    mlp_hidden_act="relu2",
    intermediate_size=256,  # dense MLP ('-' layers): none in the pattern
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    layer_norm_epsilon=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def log(msg: str) -> None:
    print(msg, flush=True)


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus_documents("train"), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_or_train_tokenizer(path: pathlib.Path, vocab_size: int):
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").exists():
        log(f"training a {vocab_size}-token byte-level BPE tokenizer on the train split -> {path}")
        train_tokenizer(vocab_size).save_pretrained(path)
        # The class name every transformers release (4.x and 5.x) resolves to the fast tokenizer.
        config_path = path / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text())
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) != vocab_size or tokenizer.eos_token_id != MODEL_CONFIG["eos_token_id"]:
        raise SystemExit(f"{path}: tokenizer has {len(tokenizer)} tokens, eos {tokenizer.eos_token_id}")
    return tokenizer


def build_config(vocab_size: int):
    from transformers import NemotronHConfig

    config = NemotronHConfig(vocab_size=vocab_size, **MODEL_CONFIG)
    config.architectures = ["NemotronHForCausalLM"]
    return config


def param_decay_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embeddings" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine from --lr down to --lr * --min-lr-ratio at --max-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def rows_of(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor, batch_size: int, device, autocast: bool) -> float:
    """Token-weighted mean next-token cross entropy over all rows (nats)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i : i + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        total += nll.sum().item()
        count += nll.numel()
    model.train()
    return total / count


def unigram_loss(train_stream: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> float:
    """Add-one smoothed unigram model from train counts, scored on the same targets as the model."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return -logp[rows[:, 1:].reshape(-1)].mean().item()


class RouterLoad:
    """Counts the experts each router picks during a step (forward hooks on every `gate`)."""

    def __init__(self, model):
        self.gates = [m for name, m in model.named_modules() if name.endswith("mixer.gate")]
        self.counts = [torch.zeros(g.e_score_correction_bias.numel(), device=g.weight.device) for g in self.gates]
        for gate, counts in zip(self.gates, self.counts):
            gate.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts):
        def hook(module, inputs, output):
            if module.training:
                counts.add_(torch.bincount(output[2].reshape(-1), minlength=counts.numel()).to(counts.dtype))
        return hook

    @torch.no_grad()
    def update_bias(self, rate: float) -> float:
        """Move each bias towards equal load; returns the worst max/mean load ratio of the step."""
        worst = 0.0
        for gate, counts in zip(self.gates, self.counts):
            mean = counts.mean()
            gate.e_score_correction_bias += rate * torch.sign(mean - counts)
            worst = max(worst, (counts.max() / mean).item())
            counts.zero_()
        return worst


def save_checkpoint(model, tokenizer, tokenizer_dir: pathlib.Path, out: pathlib.Path) -> None:
    """bf16 safetensors + config.json carrying hybrid_override_pattern, + tokenizer files."""
    from transformers import GenerationConfig

    model = model.to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith("mixer.gate"):
            module.float()  # router weight + e_score_correction_bias: fp32 tensors, bf16-rounded values
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).resolve() != (out / name).resolve():
            shutil.copyfile(tokenizer_dir / name, out / name)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["hybrid_override_pattern"] = model.config.hybrid_override_pattern
    # The default (0, inf) is written as a non-standard JSON object; absent, it reads back the same.
    if config.get("time_step_limit") is not None and not math.isfinite(model.config.time_step_limit[1]):
        del config["time_step_limit"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="directory for the trained model")
    p.add_argument("--results", type=pathlib.Path, required=True, help="JSON with the curve and scores")
    p.add_argument("--tokenizer", type=pathlib.Path, default=DEFAULT_TOKENIZER,
                   help="tokenizer directory; a tokenizer is trained there if it holds none")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bias-update-rate", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--patience", type=int, default=5, help="evaluations without a new best before stopping")
    p.add_argument("--val-rows", type=int, default=0, help="use only the first N validation rows (0: all)")
    p.add_argument("--eval-rows", type=int, default=0, help="score only the first N held-out rows (0: all)")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="stop training after this many seconds")
    p.add_argument("--fit-schedule", action="store_true",
                   help="after --fit-after steps, shorten --max-steps (and so the cosine) to what the time "
                        "budget allows; the steps used are recorded and reproduce the run as --max-steps")
    p.add_argument("--fit-after", type=int, default=30)
    p.add_argument("--experts-implementation", default="eager", choices=["eager", "grouped_mm", "batched_mm"])
    p.add_argument("--no-autocast", action="store_true", help="train in fp32 (CPU smoke runs)")
    args = p.parse_args()
    if args.fit_schedule and args.fit_after >= args.warmup_steps:
        p.error("--fit-after must fall inside the warmup, so that the fitted run equals a plain --max-steps run")

    from transformers import NemotronHForCausalLM

    t_start = time.time()
    requested_max_steps = args.max_steps
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    autocast = not args.no_autocast
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = load_or_train_tokenizer(args.tokenizer, args.vocab_size)
    streams = {split: token_stream(tokenizer, corpus_documents(split)) for split in ("train", "calibration", "eval")}
    for split, s in streams.items():
        log(f"{split}: {s.numel()} tokens")
    train_stream = streams["train"]
    val_rows = rows_of(streams["calibration"], args.seq_len)
    if args.val_rows:
        val_rows = val_rows[: args.val_rows]
    eval_rows = rows_of(streams["eval"], args.seq_len)
    if args.eval_rows:
        eval_rows = eval_rows[: args.eval_rows]

    config = build_config(args.vocab_size)
    config._experts_implementation = args.experts_implementation
    model = NemotronHForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"pattern {config.hybrid_override_pattern}, {n_params} parameters")

    optimizer = torch.optim.AdamW(param_decay_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                                  eps=1e-8, fused=device.type == "cuda")
    router = RouterLoad(model)
    gen = torch.Generator().manual_seed(args.seed)
    n_windows = train_stream.numel() - args.seq_len - 1

    curve, best_val, best_step, best_state, bad_evals = [], float("inf"), -1, None, 0
    stop_reason = "max_steps"
    t_first_eval = eval_seconds = 0.0
    t_train = time.time()
    model.train()
    step = 0
    while step < args.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=gen)
        ids = torch.stack([train_stream[s : s + args.seq_len] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        load_ratio = router.update_bias(args.bias_update_rate)

        if args.fit_schedule and step == args.fit_after:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_now = time.time() - t_train
            # Steps that fit: the steps since the first evaluation set the pace, and each later
            # evaluation costs what the first one did.
            per_step = (t_now - t_first_eval) / args.fit_after
            per_step += eval_seconds / args.eval_every
            fitted = step + int(0.95 * (args.time_budget_s - t_now) / per_step)
            if fitted < args.max_steps:
                log(f"{per_step * 1000:.0f} ms a step with evaluations: --max-steps {args.max_steps} -> {fitted}")
                args.max_steps = fitted
        last = step == args.max_steps - 1 or time.time() - t_train > args.time_budget_s
        if step % args.eval_every == 0 or last:
            train_loss = loss.item()
            t_eval = time.time()
            val = mean_loss(model, val_rows, 2 * args.batch_size, device, autocast)
            elapsed = time.time() - t_train
            if step == 0:
                t_first_eval, eval_seconds = elapsed, time.time() - t_eval
            curve.append({"step": step, "train_loss": round(train_loss, 4), "val_loss": round(val, 4),
                          "lr": lr_at(step, args), "max_expert_load_ratio": round(load_ratio, 2),
                          "elapsed_s": round(elapsed, 1)})
            log(f"step {step:5d}  train {train_loss:.4f}  val {val:.4f}  lr {lr_at(step, args):.2e}  "
                f"load max/mean {load_ratio:.2f}  {elapsed:6.1f}s")
            if val < best_val:
                best_val, best_step, bad_evals = val, step, 0
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            else:
                bad_evals += 1
                if bad_evals >= args.patience:
                    stop_reason = f"early stop: no new best validation loss in {args.patience} evaluations"
                    break
        if time.time() - t_train > args.time_budget_s:
            stop_reason = f"time budget of {args.time_budget_s:.0f}s"
            break
        step += 1
    train_seconds = time.time() - t_train
    steps_run = min(step + 1, args.max_steps)
    log(f"stopped after {steps_run} steps, {train_seconds:.0f}s ({stop_reason}); best val {best_val:.4f} at {best_step}")

    model.load_state_dict(best_state)
    save_checkpoint(model, tokenizer, args.tokenizer, args.out)
    del model

    # Score what ships: the saved bf16 checkpoint, reloaded as a user would.
    model = NemotronHForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16, use_safetensors=True).to(device)
    model.eval()
    saved = json.loads((args.out / "config.json").read_text())
    assert saved["hybrid_override_pattern"] == model.config.hybrid_override_pattern == config.hybrid_override_pattern
    heldout = mean_loss(model, eval_rows, 2 * args.batch_size, device, autocast=False)
    best_val_bf16 = mean_loss(model, val_rows, 2 * args.batch_size, device, autocast=False)
    unigram = unigram_loss(train_stream, eval_rows, args.vocab_size)
    slice_ids = heldout_slice(tokenizer)
    with torch.no_grad():
        slice_loss = model(input_ids=slice_ids.to(device), labels=slice_ids.to(device)).loss.item()
    slice_unigram = unigram_loss(train_stream, slice_ids, args.vocab_size)
    prompt = "ROMEO.\n"
    with torch.no_grad():
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)
    log(f"held-out loss {heldout:.4f} (ppl {math.exp(heldout):.1f}); unigram {unigram:.4f} (ppl {math.exp(unigram):.1f})")
    log(f"slice loss {slice_loss:.4f}; sample: {sample!r}")

    size = sum(f.stat().st_size for f in args.out.iterdir())
    results = {
        **run_record(),
        "model": {
            "architecture": "NemotronHForCausalLM",
            "hybrid_override_pattern": config.hybrid_override_pattern,
            "parameters": n_params,
            "config": {**MODEL_CONFIG, "vocab_size": args.vocab_size},
            "checkpoint_bytes": size,
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": args.vocab_size, "trained_on": "train split"},
        "data": {split: {"plays": len(corpus_documents(split)), "tokens": s.numel()} for split, s in streams.items()},
        "training": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
            "precision": "fp32 master weights and AdamW state, bf16 autocast; checkpoint bf16 (router fp32)"
                         if autocast else "fp32",
            "experts_implementation": args.experts_implementation,
            "hyperparameters": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                                if k not in ("out", "results", "tokenizer")},
            "validation": f"calibration split, {val_rows.shape[0]} rows x {args.seq_len} tokens",
            "requested_max_steps": requested_max_steps,
            "steps": steps_run,
            "tokens_seen": steps_run * args.batch_size * args.seq_len,
            "train_seconds": round(train_seconds, 1),
            "total_seconds": round(time.time() - t_start, 1),
            "stop_reason": stop_reason,
            "best_step": best_step,
            "best_val_loss": round(best_val, 4),
            "best_val_loss_bf16_checkpoint": round(best_val_bf16, 4),
            "curve": curve,
        },
        "heldout": {
            "split": "eval",
            "rows": eval_rows.shape[0],
            "seq_len": args.seq_len,
            "tokens_scored": eval_rows.shape[0] * (args.seq_len - 1),
            "loss": round(heldout, 4),
            "perplexity": round(math.exp(heldout), 2),
            "unigram_loss": round(unigram, 4),
            "unigram_perplexity": round(math.exp(unigram), 2),
            "unigram": "add-one smoothed token counts of the train split, same tokenizer, same targets",
        },
        "heldout_slice": {
            "definition": "fp4kit.models.tiny.heldout_slice: first 4 x 512 tokens of the eval stream, "
                          "loss = model(ids, labels=ids).loss, bf16 weights",
            "rows": int(slice_ids.shape[0]),
            "seq_len": int(slice_ids.shape[1]),
            "loss": round(slice_loss, 4),
            "unigram_loss": round(slice_unigram, 4),
        },
        "sample": {"prompt": prompt, "max_new_tokens": 48, "greedy": True, "text": sample},
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {args.out} ({size / 2**20:.1f} MiB) and {args.results}")


if __name__ == "__main__":
    sys.exit(main())
