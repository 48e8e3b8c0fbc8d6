"""What the fp16 SSM-state cache costs: a Nemotron-H run with its Mamba state held in fp32, fp16
(round to nearest) or fp16 with stochastic rounding, side by side.

Serving engines keep the state between decode steps in the cache dtype: each step loads it,
updates it in fp32, computes the layer's output from the fp32 value, and stores it back rounded
(`--mamba-ssm-cache-dtype float16`, with `--enable-mamba-cache-stochastic-rounding` by
`fp4kit.formats.fp16sr`, a fresh seed per layer and step). Here every variant is a row of one batch
that steps through the same tokens in `fp4kit.decode`'s static step (one CUDA graph replayed per
token on a GPU); after each step the state rows are rounded as their variant says (seeds as
`fp4kit.generate` draws them), so all variants see the same weights and inputs and differ only in
the state.

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

from . import decode
from .models import cache_argument
from .models.roles import input_device

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


def _bucket(pos: int) -> str:
    for lo, hi in BUCKETS:
        if pos >= lo and (hi is None or pos < hi):
            return f"{lo}-{hi}" if hi is not None else f"{lo}+"
    raise AssertionError(pos)


class _Record:
    """Runs after every step's forward (inside the captured step): the per-position measures
    against row 0 (the fp32 state) written at the position's index, and the next token of the
    text fed to every row. Each write goes to its own slot, so the step can be replayed."""

    FIELDS = ("nll", "kl", "top1", "err")

    def __init__(self, tokens: torch.Tensor, rows: int, states: list[torch.Tensor] | None) -> None:
        self.tokens = tokens
        self.states = states  # the SSM states, for the state's relative error (None: not measured)
        self.values = torch.zeros(tokens.numel() - 1, len(self.FIELDS), rows, dtype=torch.float64, device=tokens.device)

    def __call__(self, s) -> None:
        logits = s.logits[:, -1].float()
        logp = F.log_softmax(logits, dim=-1)
        nxt = self.tokens.index_select(0, s.column)  # the text's token at the next cache slot
        nll = -logp.index_select(1, nxt).squeeze(1).double()
        kl = (logp[0].exp() * (logp[0] - logp)).sum(-1).double()  # KL(fp32 row || row)
        top1 = (logits.argmax(-1) == logits[0].argmax()).double()
        err = torch.zeros_like(nll)
        if self.states is not None:
            num = torch.zeros_like(nll)
            den = torch.zeros((), dtype=torch.float64, device=nll.device)
            for st in self.states:
                num += (st.double() - st[0:1].double()).flatten(1).pow(2).sum(1)
                den += st[0].double().pow(2).sum()
            err = (num / den.clamp_min(1e-300)).sqrt()
        self.values.index_copy_(0, s.column - 1, torch.stack([nll, kl, top1, err])[None])
        s.input_ids.copy_(nxt.view(1, 1).expand_as(s.input_ids))


@torch.inference_mode()
@decode.on_the_model_gpu
@decode.with_single_group_routing
def teacher_forced(model: nn.Module, tokens: torch.Tensor, variants: list[Variant], *, seed: int = 0,
                   backend: str | None = None, state_error: bool = False, progress=None, graph: bool | None = None) -> dict:
    """tokens: [L] ids. Every row reads them one per step, each keeping its SSM state in its
    variant's format (`fp4kit.decode`'s static step: the first token is a one-token prefill, then
    one decode step per token, replayed from a CUDA graph on CUDA). Position t scores the
    prediction of token t + 1."""
    device = input_device(model)
    graph = device.type == "cuda" if graph is None else graph
    b, length = len(variants), tokens.numel()
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**30:
        raise ValueError(f"the seed must be an integer in [0, 2^30), got {seed!r}")
    if length < 2:
        raise ValueError(f"teacher forcing needs at least 2 tokens, got {length}")
    n = length - 1
    feed = tokens.to(device=device, dtype=torch.long).contiguous()
    s = decode._new_step(model, b, length, device, [], 0, greedy=False)
    first = torch.ones(b, 1, dtype=torch.long, device=device)
    s.logits = model(input_ids=feed[:1].view(1, 1).expand(b, 1), attention_mask=first, position_ids=first * 0,
                     **{cache_argument(model): s.cache}, use_cache=True, logits_to_keep=1).logits
    decode._open(s, first.bool())
    s.position_ids.zero_()
    s.column.fill_(1)
    s.ssm = decode.hold_states(s.cache, [v.fmt for v in variants], [v.rounds or 1 for v in variants], seed, device)
    if backend is not None:
        s.ssm.backend = backend
    record = _Record(feed, b, s.ssm.states if state_error else None)
    record(s)  # position 0, from the prefill
    s.after = record
    if graph:
        decode._capture(model, s)
    for t in range(1, n):
        if graph:
            s.graph.replay()
        else:
            decode._step(model, s)
        if progress is not None and (t + 1 == n or (t + 1) % 256 == 0):
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the rate is the device's, not the queue's
            progress(t + 1, n)
    values = record.values.cpu()
    nll, kl, top1, err = values.unbind(1)  # [n, b] each
    rows = []
    names = [_bucket(t) for t in range(n)]
    for i, v in enumerate(variants):
        row = {"state": v.label, "perplexity": math.exp(nll[:, i].mean().item()), "buckets": {}}
        for name in dict.fromkeys(names):
            at = torch.tensor([x == name for x in names])
            entry = {"positions": int(at.sum()), "kl_mean": kl[at, i].mean().item(), "top1_agreement": top1[at, i].mean().item()}
            if state_error:
                entry["state_rel_error"] = err[at, i].mean().item()
            row["buckets"][name] = entry
        rows.append(row)
    return {"positions": n, "rows": rows}


@torch.inference_mode()
def free_generation(model: nn.Module, prompt: torch.Tensor, variants: list[Variant], new_tokens: int, *,
                    seed: int = 0, progress=None, graph: bool | None = None) -> dict:
    """Greedy decoding of `new_tokens` per row from `prompt` ([P] ids) by `fp4kit.generate`, every
    row in its variant's state format and none stopping at EOS; the first step where each row's
    token differs from the fp32 row's (None: never). The state is rounded by the Triton kernel on
    CUDA and the emulator elsewhere: the two are bit-exact, so the choice changes no result."""
    steps = [0]

    def tick(_):
        steps[0] += 1
        if progress is not None:
            progress(steps[0], new_tokens)

    ids = [int(x) for x in prompt.tolist()]
    out = decode.generate(model, None, [ids] * len(variants), new_tokens, graph=graph, stream=tick,
                          ssm_state=[v.fmt for v in variants], philox_rounds=[v.rounds or 1 for v in variants],
                          ssm_seed=seed, stop_at_eos=False).tokens
    first_diff: list[int | None] = [None] * len(variants)
    for i in range(1, len(variants)):
        first_diff[i] = next((t for t, (a, b) in enumerate(zip(out[i], out[0])) if a != b), None)
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
                                                    progress=bar("generation"))
    result["markdown"] = markdown(result)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ssm-state.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / "ssm-state.md").write_text(result["markdown"] + "\n")
        plot(result, folder / "ssm-state.png")
        result["files"] = ["ssm-state.json", "ssm-state.md", "ssm-state.png"]
    return result
