"""`fp4kit.generate`: decoding from static buffers, one step captured as a CUDA graph.

`generate(model, tokenizer, prompts, max_new_tokens)` prefills the prompts with the model's own
forward into a transformers `StaticCache` (fixed-size key/value tensors for the attention layers,
fixed-size conv and SSM states for the Mamba layers), then decodes one token per step. A step
reads and writes only tensors whose addresses never change: the cache, the input ids, the
positions, the attention mask and, for greedy decoding, the picked tokens and the rows that have
finished (the argmax and the EOS check run inside the step). On CUDA that step is captured once
per batch bucket as a `torch.cuda.CUDAGraph` and replayed per token, with one read-back of the
new tokens per step; on the CPU, or with graph=False, the same step runs eagerly. The tokens equal transformers' `model.generate(do_sample=False)` (left padding, EOS
stopping and padding of finished rows as it does them), for BF16 models and for models loaded
with `load_quantized`. A Nemotron-H MoE router whose experts form one group (every Nemotron-3
model's) routes without the group step, which keeps every expert there
while `generate` runs (`models.nemotron_h.single_group_routing`): the same experts and weights,
two top-k launches fewer per MoE layer and step. A step's sdpa attention runs the query heads of
each key/value head as that head's query rows (`grouped_decode_sdpa`) instead of copying the cache
per query head, and the Mamba mixers' decode functions run written element-wise
(`models.mamba_step`); `step_ops="transformers"` keeps the model's own.

With compile=True the step's forward is first compiled by `torch.compile` (TorchInductor), which
fuses the hundreds of small element-wise, copy and reduction kernels of a decode step (norms,
routers, the Mamba state update) into a few; fp4kit's own kernels stay as they are
(`kernels.ops`). Inductor rounds to the activation dtype where the eager operators do
(`emulate_precision_casts`), but it may sum in another order, so its logits can differ from
eager ones in the last bit and a greedy token can flip where two logits tie that closely. On a
GPU Inductor's kernels are programmatic dependent launches (`inductor_pdl`; FP4KIT_INDUCTOR_PDL=0
turns that off).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .kernels import attention as attention_kernels, ops as kernel_ops
from .kernels.backend import interpreted
from .models import cache_argument
from .models import mamba_step
from .models.nemotron_h import one_launch_routing, single_group_routing
from .models.roles import input_device

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SSM_STATE_FORMATS = ("fp32", "fp16", "fp16-sr")
WARMUP_STEPS = 2  # eager runs on a side stream before capture: lazy kernel compiles and allocations
# Attention implementations whose decode step takes the 4-D mask built here.
MASKED_ATTENTION = ("sdpa", "eager")
# What a decode step's attention, routers and Mamba mixers run: "fp4kit", the attention over
# grouped query heads (`grouped_decode_sdpa`) and the mixers' element-wise decode functions
# (`models.mamba_step`); "triton", those with the attention (`kernel_decode_attention`), each
# single-group router (`models.nemotron_h.one_launch_routing`) and each Nemotron-H mixer's step
# between its projections (`models.mamba_step.one_launch`) as one Triton launch on a GPU;
# "transformers", the model's own.
STEP_OPS = ("fp4kit", "transformers", "triton")
DEFAULT_STEP_OPS = "triton"


@dataclass
class Generation:
    """What `generate` produced: per prompt, the new tokens (up to and including EOS)."""

    tokens: list[list[int]]
    text: list[str] | None
    steps: int  # decode steps run (the first token comes from the prefill; on a GPU one past the last EOS)
    seconds: float  # prefill + decode, host clock after the last token was read back
    graph: bool  # whether the decode step was replayed from a CUDA graph
    captures: int = 0
    replays: int = 0
    batch: int = 0  # rows run, the batch padded up to its bucket when a graph is used
    # host clock from the prefill's token read back to the last step's: the decode steps alone
    # (no prefill, compile or capture), each step's tokens read back as they are
    decode_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """All new tokens over `seconds` (the prefill's first token included)."""
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens the decode steps produced (each row's after its first) over `decode_seconds`."""
        made = sum(max(len(t) - 1, 0) for t in self.tokens)
        return made / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class _StaticStep:
    """One bucket's decode state: every tensor the step reads or writes, allocated once."""

    cache: object  # transformers.StaticCache
    input_ids: torch.Tensor  # [B, 1]: the token the next step reads
    position_ids: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # [B, 1, 1, max_len]: bool (sdpa) or additive (eager)
    column: torch.Tensor  # [1]: the cache slot the token in input_ids goes to
    done: torch.Tensor  # [B] bool: rows that have produced EOS
    token: torch.Tensor  # [B]: the token the last step picked (pad for finished rows)
    eos: torch.Tensor | None  # [E]: the model's EOS ids
    pad: torch.Tensor  # 0-d: the token finished rows are given
    greedy: bool  # the pick (argmax) runs inside the step, and so inside its graph
    compiled: bool = False  # the forward runs through torch.compile
    ops: str = DEFAULT_STEP_OPS  # STEP_OPS: the step's attention and Mamba functions
    mamba_modules: list = field(default_factory=list)  # with ops "fp4kit" and "triton": `mamba_step.mixer_modules(model)`
    mixers: list = field(default_factory=list)  # with ops "triton": `mamba_step.one_launch_mixers(model)`
    ssm: _StateFormat | None = None  # the SSM state held in fp16 (None: fp32, the model's own)
    after: Callable[[_StaticStep], None] | None = None  # runs after the forward in place of the greedy pick
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the last step's output, [B, 1, vocab] (the captured one under a graph)
    counts: dict = field(default_factory=lambda: {"captures": 0, "replays": 0})

    def buffers(self) -> list[torch.Tensor]:
        out = [self.input_ids, self.position_ids, self.mask, self.column, self.done, self.token]
        return out + ([self.ssm.seed] if self.ssm is not None else [])


def ssm_states(cache) -> list[torch.Tensor]:
    """The Mamba SSM states of a transformers cache (5.2x: each linear-attention layer's
    `recurrent_states`; older: `ssm_states`), [batch, heads, head_dim, state] fp32 each."""
    out = []
    for layer in getattr(cache, "layers", []):
        states = getattr(layer, "recurrent_states", None)
        if isinstance(states, dict):
            out.extend(t for t in states.values() if isinstance(t, torch.Tensor))
        elif isinstance(states, (list, tuple)):
            out.extend(t for t in states if isinstance(t, torch.Tensor))
    if not out:
        out = [t for t in getattr(cache, "ssm_states", []) if isinstance(t, torch.Tensor) and t.numel()]
    for t in out:
        if t.dtype != torch.float32:
            raise ValueError(f"the model keeps its SSM state in {t.dtype}; holding it in fp16 is measured against float32")
    return out


@dataclass
class _StateFormat:
    """The SSM state held as a serving engine with `--mamba-ssm-cache-dtype float16` holds it
    (fp16 values in the cache's fp32 tensors), each batch row in its own format (`formats`, with
    `rounds` for fp16-sr rows): the prefill's state stored with a plain cast, each step's with
    round-to-nearest (fp16) or stochastic rounding (fp16-sr, Philox `rounds`); fp32 rows keep the
    model's own state. Stochastic seeds: (ssm_seed << 32) + (t - 1) * L + l for decode step t >= 1
    and the l-th of the L Mamba layers, the random words indexed by the element's flat position in
    the layer's [batch, ...] state (row b starts at b * row size); the running seed lives on the
    device (`seed`), so a replayed graph draws each step's own words."""

    formats: list[str]  # per batch row
    rounds: list[int]  # per batch row (read for fp16-sr rows)
    states: list[torch.Tensor]
    seed: torch.Tensor  # [1] int64: the seed of the next step's first layer
    backend: str  # "triton" (the kernel) or "torch" (the emulator)

    @property
    def uniform(self) -> bool:
        return len(set(zip(self.formats, self.rounds))) == 1

    def after_prefill(self) -> None:
        for st in self.states:
            for b, fmt in enumerate(self.formats):
                if fmt != "fp32":
                    st[b].copy_(st[b].half().float())

    def after_step(self) -> None:
        from .kernels.ssm_state import round_state

        for layer, st in enumerate(self.states):
            if self.uniform:  # one launch for the whole state: the same words as row by row
                if self.formats[0] == "fp16":
                    st.copy_(st.half().float())
                elif self.formats[0] == "fp16-sr":
                    round_state(st, layer, self.rounds[0], out=st, backend=self.backend, base=self.seed)
                continue
            row = st[0].numel()
            for b, (fmt, rounds) in enumerate(zip(self.formats, self.rounds)):
                if fmt == "fp16":
                    st[b].copy_(st[b].half().float())
                elif fmt == "fp16-sr":
                    round_state(st[b], layer, rounds, b * row, out=st[b], backend=self.backend, base=self.seed)
        self.seed.add_(len(self.states))


def state_rows(ssm_state, philox_rounds, n: int) -> tuple[list[str], list[int]] | None:
    """`generate`'s ssm_state / philox_rounds (one value for every row, or one per prompt) as one
    format and one round count per row; None when every row keeps the model's fp32 state."""
    formats = [ssm_state] * n if isinstance(ssm_state, str) else list(ssm_state)
    rounds = [philox_rounds] * n if isinstance(philox_rounds, int) and not isinstance(philox_rounds, bool) \
        else list(philox_rounds)
    if len(formats) != n or len(rounds) != n:
        raise ValueError(f"ssm_state and philox_rounds take one value or one per prompt ({n}), "
                         f"got {len(formats)} and {len(rounds)}")
    for f in formats:
        if f not in SSM_STATE_FORMATS:
            raise ValueError(f"ssm_state must be one of {', '.join(SSM_STATE_FORMATS)}, got {f!r}")
    for r in rounds:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"philox_rounds must be a positive integer, got {r!r}")
    return None if all(f == "fp32" for f in formats) else (formats, rounds)


def hold_states(cache, formats: list[str], rounds: list[int], ssm_seed: int, device: torch.device) -> _StateFormat:
    """The prefill's SSM states in `cache`, stored in each row's format; returns what rounds them
    after every step."""
    states = ssm_states(cache)
    if not states:
        raise ValueError(f"ssm_state={sorted(set(formats) - {'fp32'})}: the model keeps no Mamba SSM state")
    held = _StateFormat(formats, rounds, states, torch.tensor([ssm_seed << 32], dtype=torch.int64, device=device),
                        "triton" if device.type == "cuda" else "torch")
    held.after_prefill()
    return held


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `batch` rows."""
    fits = [b for b in sorted(buckets) if b >= batch]
    if not fits:
        raise ValueError(f"a batch of {batch} prompts is larger than the largest batch bucket {max(buckets)}")
    return fits[0]


def _tokenize(tokenizer, prompts, device, model_pad: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), rows left-padded to one length as transformers' generate expects
    (with the tokenizer's pad token, else the model's)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts to generate from")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token id lists without one")
        rows = [tokenizer(p)["input_ids"] for p in prompts]
        pad = tokenizer.pad_token_id
    elif all(not isinstance(p, str) for p in prompts):
        rows = [[int(t) for t in p] for p in prompts]
        pad = tokenizer.pad_token_id if tokenizer is not None else model_pad
    else:
        raise ValueError("prompts must be all text or all token id lists")
    if any(len(r) == 0 for r in rows):
        raise ValueError("an empty prompt has no token to continue from")
    width = max(len(r) for r in rows)
    if pad is None and any(len(r) < width for r in rows):
        raise ValueError("prompts of different lengths need left padding, and neither the tokenizer nor the model names a pad token")
    pad = 0 if pad is None else pad
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _new_step(model, batch: int, max_len: int, device: torch.device, eos: list[int], pad: int,
              greedy: bool, compiled: bool = False, ops: str = DEFAULT_STEP_OPS) -> _StaticStep:
    from transformers import StaticCache

    impl = model.config._attn_implementation
    if impl not in MASKED_ATTENTION:
        raise ValueError(f"the static decode step builds its own attention mask, which {impl!r} attention does not take; "
                         f"load the model with attn_implementation one of {MASKED_ATTENTION}")
    # Closed columns hold False (sdpa) or the dtype's lowest value (eager: the mask is added to the scores).
    mask_dtype = torch.bool if impl == "sdpa" else model.dtype
    mask = torch.zeros(batch, 1, 1, max_len, dtype=mask_dtype, device=device)
    if mask_dtype != torch.bool:
        mask.fill_(torch.finfo(mask_dtype).min)
    return _StaticStep(
        cache=StaticCache(config=model.config, max_cache_len=max_len),
        input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device),
        position_ids=torch.zeros(batch, 1, dtype=torch.long, device=device),
        mask=mask,
        column=torch.zeros(1, dtype=torch.long, device=device),
        done=torch.zeros(batch, dtype=torch.bool, device=device),
        token=torch.zeros(batch, dtype=torch.long, device=device),
        eos=torch.tensor(eos, dtype=torch.long, device=device) if eos else None,
        pad=torch.tensor(pad, dtype=torch.long, device=device),
        greedy=greedy,
        compiled=compiled,
        ops=ops,
        mamba_modules=mamba_step.mixer_modules(model) if ops in ("fp4kit", "triton") else [],
        mixers=mamba_step.one_launch_mixers(model) if ops == "triton" else [],
    )


def _open(s: _StaticStep, allowed: torch.Tensor) -> None:
    """The prompt's columns of the mask, from `allowed` ([B, width] bool): open where true."""
    cols = slice(0, allowed.shape[1])
    if s.mask.dtype == torch.bool:
        s.mask[:, 0, 0, cols] = allowed
    else:
        s.mask[:, 0, 0, cols] = torch.where(allowed, 0.0, torch.finfo(s.mask.dtype).min).to(s.mask.dtype)


def _advance(s: _StaticStep, token: torch.Tensor) -> None:
    """Takes the picked tokens ([B]): finished rows get the pad token, the tokens become the next
    step's input, and rows that picked EOS are marked done. Device tensors only, no host sync."""
    token = torch.where(s.done, s.pad, token)
    s.token.copy_(token)
    s.input_ids.copy_(token[:, None])
    if s.eos is not None:
        s.done |= (token[:, None] == s.eos).any(-1)


def _step(model, s: _StaticStep) -> None:
    """One decode step: the token in input_ids enters the cache at `column` (its mask column
    opens), the model runs, and for greedy decoding the argmax is taken. Reads and writes only
    the step's own tensors, so it can be captured and replayed."""
    s.mask.index_fill_(3, s.column, True if s.mask.dtype == torch.bool else 0.0)
    s.column.add_(1)
    s.position_ids.add_(1)
    s.logits = _forward(model, s)
    if s.ssm is not None:
        s.ssm.after_step()
    if s.after is not None:
        s.after(s)
    elif s.greedy:
        _advance(s, s.logits[:, -1].argmax(-1))


def _masks(model, s: _StaticStep):
    """The step's attention mask as the model's forward takes it: Nemotron-H takes one per layer
    kind (a single-token step never pads the Mamba input); other models take the 4-D mask itself."""
    kinds = getattr(model.config, "layers_block_type", None)
    if kinds is None:
        return s.mask
    return {kind: (s.mask if kind == "full_attention" else None) for kind in set(kinds)}


def _call(model, input_ids, position_ids, mask, cache, cache_name: str) -> torch.Tensor:
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **{cache_name: cache},
                use_cache=True, logits_to_keep=1)
    return out.logits


# Compiled code is kept per model class and input shape (torch.compile's own cache): allow one
# entry per batch bucket and cache length for each of a few model kinds (BF16, several recipes).
COMPILE_ENTRIES = 64
# A compiled step's cache holds a whole number of these positions, so that prompts and
# generation lengths of about the same size share one compiled step.
CACHE_GRANULE = 1024


# "0" here: the compiled step's Inductor kernels are launched plainly (see `inductor_pdl`).
INDUCTOR_PDL_ENV = "FP4KIT_INDUCTOR_PDL"


def inductor_pdl(device_type: str = "cuda") -> bool:
    """Whether a compiled step's Inductor kernels on `device_type` are programmatic dependent
    launches (Inductor's triton.enable_pdl, which takes effect from Hopper on): each starts while
    the launch before it finishes and waits for it before reading its output, and lets the launch
    after it start once its loads are done, as fp4kit's FP8 GEMV does. On a GPU unless the
    environment variable FP4KIT_INDUCTOR_PDL is "0", where the installed torch's Inductor has the
    option; never elsewhere."""
    import torch._inductor.config as inductor_config

    return (device_type == "cuda" and os.environ.get(INDUCTOR_PDL_ENV, "1") != "0"
            and hasattr(inductor_config.triton, "enable_pdl"))


def compile_options(device_type: str) -> dict:
    """The Inductor options of the compiled step on `device_type`."""
    options = {"emulate_precision_casts": True}
    if device_type == "cpu":
        # Inductor's vectorized C++ (torch 2.13) fails to build the bit-level E4M3 emulation of
        # FP8 layers (an int vector operator it does not define); scalar loops build and agree.
        options["cpp.simdlen"] = 1
    if inductor_pdl(device_type):
        options["triton.enable_pdl"] = True
    return options


@functools.cache
def _compiled_call(device_type: str):
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), COMPILE_ENTRIES))
            break
    return torch.compile(_call, dynamic=False, options=compile_options(device_type))


def _forward(model, s: _StaticStep) -> torch.Tensor:
    call = _compiled_call(s.input_ids.device.type) if s.compiled else _call
    with _step_ops(model, s):
        return call(model, s.input_ids, s.position_ids, _masks(model, s), s.cache, cache_argument(model))


@contextlib.contextmanager
def _step_ops(model, s: _StaticStep):
    """The step's own attention and Mamba decode functions in place (ops "fp4kit"), with the
    one-launch attention, routers and Mamba steps (ops "triton"), or the model's."""
    if s.ops == "transformers":
        yield
        return
    kernels = s.ops == "triton"
    with grouped_attention(model, kernel=kernels), mamba_step.switched(s.mamba_modules), \
            mamba_step.one_launch(s.mixers), (one_launch_routing() if kernels else contextlib.nullcontext()):
        yield


# The attention implementations a decode step's sdpa attention runs under (`grouped_attention`).
GROUPED_SDPA = "fp4kit_grouped_sdpa"
KERNEL_ATTENTION = "fp4kit_decode_attention"
# Attention arguments under which `grouped_decode_sdpa` leaves the call to transformers' sdpa: a
# request for the weights, and anything that changes the scores or the softmax (a bias, a cap,
# attention sinks).
_OTHER_ATTENTION = ("output_attentions",)
_OTHER_SCORES = ("position_bias", "softcap", "s_aux", "sinks")


def grouped_decode_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention for one query position on grouped-query attention, without
    copying the keys and values once per query head.

    With a mask, transformers' sdpa repeats each key/value head for its query heads
    (`repeat_kv`: on Nemotron-3-Nano 16 copies of the whole static cache, per layer and step)
    before one `scaled_dot_product_attention`. Here the G query heads of a key/value head are
    laid out as G query rows of that head instead ([B, H, 1, D] -> [B, H / G, G, D]); every query
    row attends to the same keys under the same mask as before, so the scores, the softmax and the
    weighted sums are those of the repeated form. Other calls (prompts, masks that differ per
    query head) go to transformers' sdpa as they are."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, d = query.shape
    per_head_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1
    if groups == 1 or q_len != 1 or per_head_mask or any(kwargs.get(name) for name in _OTHER_ATTENTION) \
            or any(kwargs.get(name) is not None for name in _OTHER_SCORES):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows = query.reshape(b, heads // groups, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


# Whether the attention kernel runs compiled (not in Triton's interpreter): fixed at import, and a
# constant to code that torch.compile traces (see `mamba_step._STEP_KERNEL`).
_ATTENTION_KERNEL = not interpreted(attention_kernels._decode_attention_kernel)


def _kernel_device(query: torch.Tensor) -> bool:
    """Whether the attention kernel runs where the query is: on a GPU, compiled (not in Triton's
    interpreter)."""
    return query.is_cuda and _ATTENTION_KERNEL


def _kernel_takes(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether `kernels.attention.decode_attention` takes this call: one 16-bit query position
    (`_kernel_device`), a mask of one row per batch row and no other scores or outputs."""
    return (_kernel_device(query) and query.shape[2] == 1
            and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1)))
            and not any(kwargs.get(name) for name in _OTHER_ATTENTION)
            and not any(kwargs.get(name) is not None for name in _OTHER_SCORES))


def kernel_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """`grouped_decode_sdpa`'s attention as one Triton launch (`kernels.attention.decode_attention`,
    split over the cache, fp32 softmax) where it applies (`_kernel_takes`); other calls go to
    `grouped_decode_sdpa`."""
    if dropout or not _kernel_takes(query, key, attention_mask, kwargs):
        return grouped_decode_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    run = kernel_ops.decode_attention if torch.compiler.is_compiling() else attention_kernels.decode_attention
    return run(query, key, value, attention_mask, float(scale)), None


@contextlib.contextmanager
def grouped_attention(model: nn.Module, kernel: bool = False):
    """Within the block, a model on transformers' sdpa attention runs `grouped_decode_sdpa`, or
    with `kernel` `kernel_decode_attention` (registered with transformers' AttentionInterface);
    other implementations run as they are."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    name, fn = (KERNEL_ATTENTION, kernel_decode_attention) if kernel else (GROUPED_SDPA, grouped_decode_sdpa)
    AttentionInterface.register(name, fn)
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def _state_tensors(cache) -> list[torch.Tensor]:
    """The cache tensors a decode step changes in place besides the key/value slot it writes:
    the Mamba conv and SSM states and each attention layer's fill count."""
    out = []
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            out.extend(t for t in (states or {}).values() if t is not None)
        if getattr(layer, "is_initialized", False) and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            out.append(layer.cumulative_length)
    return out


def _capture(model, s: _StaticStep) -> None:
    """Warm up, then capture one decode step; every tensor is left as the prefill wrote it."""
    saved = [(t, t.clone()) for t in _state_tensors(s.cache) + s.buffers()]

    def restore():
        for t, copy in saved:
            t.copy_(copy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            _step(model, s)
            restore()
    torch.cuda.current_stream().wait_stream(side)
    s.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(s.graph):
        _step(model, s)
    restore()
    torch.cuda.current_stream().synchronize()
    s.counts["captures"] += 1


class _TokenReader:
    """Brings each step's tokens to the host. On a GPU: a copy into pinned memory and an event
    per step, two slots in turn, so that reading step t waits for step t alone and not for the
    step queued after it (lag 1: `generate` reads a step's tokens one step later). Elsewhere the
    tokens are read at once (lag 0)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.lag = 1 if self.cuda else 0
        if self.cuda:
            self.host = torch.empty((2, n), dtype=dtype, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]

    def send(self, t: int, token: torch.Tensor):
        """Step t's tokens on their way: a handle for `receive`."""
        if not self.cuda:
            return token.tolist()
        slot = t % 2
        self.host[slot].copy_(token, non_blocking=True)
        self.events[slot].record()
        return slot

    def receive(self, sent) -> list[int]:
        if not self.cuda:
            return sent
        self.events[sent].synchronize()
        return self.host[sent].tolist()


def _pick(logits: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    if greedy:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator).squeeze(-1)


def on_the_model_gpu(fn):
    """Runs `fn(model, ...)` with the GPU that holds the model's input as the current one: CUDA
    graphs capture and replay on the current GPU's streams, and Triton launches there."""

    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        device = input_device(model)
        if device.type != "cuda":
            return fn(model, *args, **kwargs)
        with torch.cuda.device(device):
            return fn(model, *args, **kwargs)

    return run


def with_single_group_routing(fn):
    """Runs `fn(model, ...)` with the model's single-group routers on their short forward."""

    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        with single_group_routing(model):
            return fn(model, *args, **kwargs)

    return run


@torch.inference_mode()
@on_the_model_gpu
@with_single_group_routing
def generate(model: nn.Module, tokenizer, prompts, max_new_tokens: int, *, greedy: bool = True,
             graph: bool | None = None, batch_buckets: Sequence[int] = DEFAULT_BUCKETS,
             stream: Callable[[list[int | None]], None] | None = None,
             generator: torch.Generator | None = None, ssm_state: str | Sequence[str] = "fp32",
             philox_rounds: int | Sequence[int] = 5, ssm_seed: int = 0, stop_at_eos: bool = True,
             compile: bool = False, step_ops: str = DEFAULT_STEP_OPS) -> Generation:
    """Continue each prompt by up to `max_new_tokens` tokens; a row stops at the model's EOS.

    prompts: text (with a tokenizer) or lists of token ids; rows of different lengths are
    left-padded with the tokenizer's pad token, as transformers' generate does.
    greedy: the most likely token (True), or a draw from the softmax of the logits.
    graph: replay the decode step from a CUDA graph; default: on CUDA, yes. The batch is padded up
    to the smallest of `batch_buckets` that holds it (the padding rows repeat the last prompt).
    stream: called after every step with one entry per prompt: the new token, or None for a row
    that has already stopped.
    ssm_state: the Mamba SSM state between steps as the model keeps it ("fp32"), or held in fp16
    as serving engines can: "fp16" (round to nearest) or "fp16-sr" (stochastic rounding with
    `philox_rounds` Philox rounds, seeds from `ssm_seed`; `_StateFormat`), by the Triton kernel
    on CUDA and the exact emulator elsewhere; either may also be a list with one value per prompt,
    to decode the same prompt in several state formats side by side.
    stop_at_eos: a row stops at the model's EOS (True), or every row runs `max_new_tokens`.
    compile: run the decode step's forward through `torch.compile` (see the module docstring); the
    first call for a model and batch bucket compiles it (minutes for a large model), later calls
    reuse it. The prefill runs eagerly.
    step_ops: "fp4kit": the step's sdpa attention runs over grouped query heads without copying
    the key/value cache per query head (`grouped_decode_sdpa`), and the Mamba mixers' decode
    functions run element-wise (`models.mamba_step`), for BF16 and quantized models alike;
    "triton" (default): those, with the attention (`kernel_decode_attention`), each single-group
    router (`models.nemotron_h.one_launch_routing`) and each Nemotron-H Mamba mixer's step between
    its projections (`models.mamba_step.one_launch`) as one Triton launch each on a GPU (elsewhere
    it is "fp4kit"); their sums run in other orders, so like compile=True its logits can differ
    from the "fp4kit" ones in the last bits; "transformers": the model's own functions, to
    compare with.
    """
    if step_ops not in STEP_OPS:
        raise ValueError(f"step_ops must be one of {', '.join(STEP_OPS)}, got {step_ops!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if isinstance(ssm_seed, bool) or not isinstance(ssm_seed, int) or not 0 <= ssm_seed < 2**30:
        raise ValueError(f"ssm_seed must be an integer in [0, 2^30), got {ssm_seed!r}")
    device = input_device(model)
    if graph is None:
        graph = device.type == "cuda"
    if graph and device.type != "cuda":
        raise ValueError(f"graph=True captures a CUDA graph, but the model is on {device}")
    ids, attn = _tokenize(tokenizer, prompts, device, model.generation_config.pad_token_id)
    n, width = ids.shape
    held = state_rows(ssm_state, philox_rounds, n)
    rows = bucket_for(n, batch_buckets) if graph else n
    if rows > n:  # the bucket's extra rows repeat the last prompt; their tokens are dropped
        ids = torch.cat([ids, ids[-1:].expand(rows - n, -1)])
        attn = torch.cat([attn, attn[-1:].expand(rows - n, -1)])
        if held is not None:
            held = (held[0] + held[0][-1:] * (rows - n), held[1] + held[1][-1:] * (rows - n))
    max_len = width + max_new_tokens
    if compile:
        max_len = -(-max_len // CACHE_GRANULE) * CACHE_GRANULE
    eos = _eos_ids(model) if stop_at_eos else []
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)

    start = time.perf_counter()
    s = _new_step(model, rows, max_len, device, eos, pad, greedy, compile, step_ops)
    # Prefill: the model's forward over the prompts, positions counted over the real tokens.
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions, **{cache_argument(model): s.cache},
                   use_cache=True, logits_to_keep=1).logits
    _open(s, attn.bool())
    s.position_ids.copy_(positions[:, -1:])
    s.column.fill_(width)
    if held is not None:
        s.ssm = hold_states(s.cache, *held, ssm_seed, device)
    _advance(s, _pick(logits[:, -1], greedy, generator))

    if graph:
        _capture(model, s)

    eos_set = set(eos)
    finished = [False] * n
    out: list[list[int]] = [[] for _ in range(n)]
    read_at: list[float] = []  # host clock as each step's tokens (the prefill's first) are read back

    def take(host: list[int]) -> bool:
        """One step's tokens to the rows still running; True once every row has stopped."""
        nonlocal finished
        read_at.append(time.perf_counter())
        for i in range(n):
            if not finished[i]:
                out[i].append(host[i])
        if stream is not None:
            stream([None if finished[i] else host[i] for i in range(n)])
        finished = [f or host[i] in eos_set for i, f in enumerate(finished)]
        return all(finished)

    # On a GPU the next step is queued before this step's tokens are read, so that the device
    # never waits for the host between steps; a run that stops at EOS runs one step past it.
    reader = _TokenReader(n, s.token.dtype, device)
    queued: list = []
    steps = 0
    for t in range(max_new_tokens):
        if t > 0:
            if graph:
                s.graph.replay()
                s.counts["replays"] += 1
            else:
                _step(model, s)
            if not greedy:
                _advance(s, _pick(s.logits[:, -1], greedy, generator))
            steps += 1
        queued.append(reader.send(t, s.token[:n]))
        if len(queued) > reader.lag and take(reader.receive(queued.pop(0))):
            break
    else:
        for sent in queued:
            if take(reader.receive(sent)):
                break
    seconds = time.perf_counter() - start

    text = [tokenizer.decode(t, skip_special_tokens=True) for t in out] if tokenizer is not None else None
    return Generation(tokens=out, text=text, steps=steps, seconds=seconds, graph=graph, captures=s.counts["captures"],
                      replays=s.counts["replays"], batch=rows, decode_seconds=read_at[-1] - read_at[0])
