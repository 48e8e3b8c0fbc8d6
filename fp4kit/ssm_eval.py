"""What the fp16 SSM-state cache costs: a Nemotron-H run with its Mamba state held in fp32, fp16
(round to nearest) or fp16 with stochastic rounding, side by side.

Serving engines keep the state between decode steps in the cache dtype: each step loads it,
updates it in fp32, computes the layer's output from the fp32 value, and stores it back rounded
(`--mamba-ssm-cache-dtype float16`, with `--enable-mamba-cache-stochastic-rounding` by
`fp4kit.formats.fp16sr`, a fresh seed per layer and step). Here every variant is a row of one batch
that steps through the same tokens; after each step the state rows are rounded as their variant
says, so all variants see the same weights and inputs and differ only in the state.

- teacher-forced: the evaluation text is fed one token per step (as a decode would read it);
  against the fp32-state row: KL(fp32 || variant) per position bucket, top-1 agreement, and each
  row's perplexity of the text; with `--state-error`, the state's relative error against fp32
  per bucket (for random-weight models, whose logits are nearly flat);
- free generation: greedy decoding from a prompt; the step at which each row's output first
  differs from the fp32 row's.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .decode import ssm_states as state_tensors
from .formats import fp16sr
from .models import cache_argument

STATE_FORMATS = ("fp32", "fp16", "fp16-sr")
BUCKETS = ((0, 512), (512, 2048), (2048, 8192), (8192, None))


@dataclass(frozen=True)
class Variant:
    fmt: str
    rounds: int | None = None  # Philox rounds of fp16-sr

    @property
    def label(self) -> str:
        return f"fp16-sr R={self.rounds}" if self.fmt == "fp16-sr" else self.fmt


def parse_variants(formats: str, rounds: str = "5,10") -> list[Variant]:
    """`fp16,fp16-sr` and `5,10` -> fp32 (the baseline, always first) and each asked variant;
    fp16-sr once per number of rounds."""
    out = [Variant("fp32")]
    want = [f.strip() for f in formats.split(",") if f.strip()]
    bad = [f for f in want if f not in STATE_FORMATS]
    if bad or not want:
        raise ValueError(f"--ssm-state takes a comma-separated list of {', '.join(STATE_FORMATS)}, got {formats!r}")
    try:
        rs = [int(r) for r in rounds.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--philox-rounds takes comma-separated positive integers, got {rounds!r}") from None
    if not rs or any(r < 1 for r in rs):
        raise ValueError(f"--philox-rounds takes comma-separated positive integers, got {rounds!r}")
    for f in want:
        if f == "fp16":
            out.append(Variant("fp16"))
        elif f == "fp16-sr":
            out.extend(Variant("fp16-sr", r) for r in rs)
    return list(dict.fromkeys(out))


class StateRounder:
    """Rounds each row of every SSM state as its variant says; stochastic rows draw one 32-bit
    seed per layer and step from `generator`, as the engines draw theirs from torch's."""

    def __init__(self, variants: list[Variant], seed: int, backend: str) -> None:
        self.variants = variants
        self.generator = torch.Generator().manual_seed(seed)
        self.backend = backend

    def __call__(self, cache, *, prefill: bool = False) -> None:
        for state in state_tensors(cache):
            seed = int(torch.randint(0, 2**32, (1,), generator=self.generator))
            row = state[0].numel()
            for b, v in enumerate(self.variants):
                if v.fmt == "fp32":
                    continue
                if v.fmt == "fp16" or prefill:  # the engines store a prefill's state with a plain cast
                    state[b].copy_(state[b].half().float())
                elif self.backend == "triton":
                    from .kernels.ssm_state import round_state

                    round_state(state[b], seed, v.rounds, b * row, out=state[b])
                else:
                    state[b].copy_(fp16sr.round_state(state[b].contiguous(), seed, v.rounds, b * row).float())


def _bucket(pos: int) -> str:
    for lo, hi in BUCKETS:
        if pos >= lo and (hi is None or pos < hi):
            return f"{lo}-{hi}" if hi is not None else f"{lo}+"
    raise AssertionError(pos)


def _step(model, ids: torch.Tensor, cache):
    out = model(input_ids=ids, **{cache_argument(model): cache}, use_cache=True)
    return out.logits[:, -1].float(), out.cache if getattr(out, "cache", None) is not None else out.past_key_values


@torch.inference_mode()
def teacher_forced(model: nn.Module, tokens: torch.Tensor, variants: list[Variant], *, seed: int = 0,
                   backend: str = "torch", state_error: bool = False, progress=None) -> dict:
    """tokens: [L] ids. Every row reads them one per step."""
    device = next(model.parameters()).device
    b = len(variants)
    rounder = StateRounder(variants, seed, backend)
    # Every sum stays on the device (float64 where it accumulates over positions), so a step never
    # waits for the device; the sums are read once at the end.
    sums: dict[str, dict] = {}
    nll = torch.zeros(b, dtype=torch.float64, device=device)
    ids_all = tokens.to(device)
    cache = None
    n = tokens.numel() - 1
    for t in range(n):
        ids = ids_all[t].view(1, 1).expand(b, 1)
        logits, cache = _step(model, ids, cache)
        rounder(cache)
        logp = F.log_softmax(logits, dim=-1)
        nll -= logp[:, ids_all[t + 1]].double()
        kl = (logp[0].exp() * (logp[0] - logp)).sum(-1).double()  # KL(fp32 row || row)
        top1 = logits.argmax(-1) == logits[0].argmax()
        s = sums.setdefault(_bucket(t), {"n": 0, **{k: torch.zeros(b, dtype=torch.float64, device=device)
                                                      for k in ("kl", "top1", "err")}})
        s["n"] += 1
        s["kl"] += kl
        s["top1"] += top1.double()
        if state_error:
            num = torch.zeros(b, dtype=torch.float64, device=device)
            den = torch.zeros((), dtype=torch.float64, device=device)
            for st in state_tensors(cache):
                d = (st.double() - st[0:1].double()).flatten(1)
                num += d.pow(2).sum(1)
                den += st[0].double().pow(2).sum()
            s["err"] += (num / den.clamp_min(1e-300)).sqrt()
        if progress is not None:
            progress(t + 1, n)
    nll = nll.cpu()
    for s in sums.values():
        for k in ("kl", "top1", "err"):
            s[k] = s[k].cpu()
    rows = []
    for i, v in enumerate(variants):
        row = {"state": v.label, "perplexity": math.exp(nll[i].item() / n), "buckets": {}}
        for name, s in sums.items():
            entry = {"positions": s["n"], "kl_mean": s["kl"][i].item() / s["n"], "top1_agreement": s["top1"][i].item() / s["n"]}
            if state_error:
                entry["state_rel_error"] = s["err"][i].item() / s["n"]
            row["buckets"][name] = entry
        rows.append(row)
    return {"positions": n, "rows": rows}


@torch.inference_mode()
def free_generation(model: nn.Module, prompt: torch.Tensor, variants: list[Variant], new_tokens: int, *,
                    seed: int = 0, backend: str = "torch", progress=None) -> dict:
    """Greedy decoding of `new_tokens` per row from `prompt` ([P] ids); the first step where each
    row's token differs from the fp32 row's (None: never)."""
    device = next(model.parameters()).device
    b = len(variants)
    rounder = StateRounder(variants, seed, backend)
    logits, cache = _step(model, prompt.view(1, -1).expand(b, -1).to(device), None)
    rounder(cache, prefill=True)
    first_diff: list[int | None] = [None] * b
    out = []
    for t in range(new_tokens):
        nxt = logits.argmax(-1)
        out.append(nxt.cpu())
        for i in range(1, b):
            if first_diff[i] is None and int(nxt[i]) != int(nxt[0]):
                first_diff[i] = t
        if t + 1 < new_tokens:
            logits, cache = _step(model, nxt.view(b, 1), cache)
            rounder(cache)
        if progress is not None:
            progress(t + 1, new_tokens)
    return {"new_tokens": new_tokens, "prompt_tokens": prompt.numel(),
            "rows": [{"state": v.label, "first_difference_step": first_diff[i]} for i, v in enumerate(variants)]}


def markdown(result: dict) -> str:
    tf = result["teacher_forced"]
    names = [n for n in (f"{lo}-{hi}" if hi is not None else f"{lo}+" for lo, hi in BUCKETS) if n in tf["rows"][0]["buckets"]]
    err = any("state_rel_error" in e for r in tf["rows"] for e in r["buckets"].values())
    head = ["SSM state", "perplexity"] + [f"KL {n}" for n in names] + [f"top-1 {n}" for n in names]
    if err:
        head += [f"state rel. err {n}" for n in names]
    lines = [f"Teacher-forced over {tf['positions']} tokens, one per step; KL and top-1 against the fp32-state run.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in tf["rows"]:
        cells = [r["state"], f"{r['perplexity']:.4f}"]
        cells += [f"{r['buckets'][n]['kl_mean']:.2e}" for n in names]
        cells += [f"{100 * r['buckets'][n]['top1_agreement']:.2f}%" for n in names]
        if err:
            cells += [f"{r['buckets'][n]['state_rel_error']:.2e}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    fg = result.get("free_generation")
    if fg:
        lines += ["", f"Greedy generation of {fg['new_tokens']} tokens after a {fg['prompt_tokens']}-token prompt: "
                      "the first step whose token differs from the fp32-state run's.", "",
                  "| SSM state | first difference |", "|---|---|"]
        for r in fg["rows"][1:]:
            d = r["first_difference_step"]
            lines.append(f"| {r['state']} | {'none' if d is None else d} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tf = result["teacher_forced"]
    names = list(tf["rows"][0]["buckets"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in tf["rows"][1:]:
        ax.plot(names, [max(r["buckets"][n]["kl_mean"], 1e-12) for n in names], marker="o", label=r["state"])
    ax.set_yscale("log")
    ax.set_xlabel("position bucket (tokens)")
    ax.set_ylabel("mean KL vs fp32 state")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(model: nn.Module, tokens: torch.Tensor, variants: list[Variant], *, generate: int, prompt_tokens: int = 32,
        seed: int = 0, backend: str = "torch", state_error: bool = False, out: str | Path | None = None,
        provenance: dict | None = None, progress: bool = True, log=print) -> dict:
    """Both measurements, written as ssm-state.json, ssm-state.md and ssm-state.png under `out`."""
    def bar(what):
        t0 = time.perf_counter()

        def tick(i, n):
            if progress and (i == n or i % 256 == 0):
                rate = i / max(time.perf_counter() - t0, 1e-9)
                log(f"{what}: {i}/{n} tokens, {rate:.1f} tokens/s, ETA {(n - i) / max(rate, 1e-9):.0f} s")
        return tick

    result = {**(provenance or {}), "variants": [v.label for v in variants], "seed": seed, "backend": backend}
    result["teacher_forced"] = teacher_forced(model, tokens, variants, seed=seed, backend=backend, state_error=state_error,
                                              progress=bar("teacher-forced"))
    if generate:
        result["free_generation"] = free_generation(model, tokens[:prompt_tokens], variants, generate, seed=seed,
                                                    backend=backend, progress=bar("generation"))
    result["markdown"] = markdown(result)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ssm-state.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / "ssm-state.md").write_text(result["markdown"] + "\n")
        plot(result, folder / "ssm-state.png")
        result["files"] = ["ssm-state.json", "ssm-state.md", "ssm-state.png"]
    return result
