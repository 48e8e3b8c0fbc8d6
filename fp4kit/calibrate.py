"""Statistics gathered during the calibration forward pass, as small named observers.

- InputAmax:      max|x| of a layer's input (FP8 static input_scale, NVFP4 W4A4 input_scale)
- SecondMoment:   per-input-channel sum of x^2 and token count (E[x^2] for importance-weighted 4/6)
- KVAmax:         max|k| and max|v| of an attention layer (FP8 KV-cache scales)
- ExpertTokens:   tokens routed to each expert of a MoE layer

Routed experts are fused [E, N, K] stacks in transformers: their observers split each statistic
per expert, from the router's top-k indices seen by the experts module and from the expert
activation's output (the down_proj input), whatever experts implementation runs (grouped_mm,
batched_mm or eager). No observer changes the forward computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .models.roles import AttentionKV, Target


# -- exact sums ----------------------------------------------------------------------------------
# A sum of fp32 values held exactly, as an integer count of 2^-149 (the smallest fp32 subnormal)
# split over LIMBS int64 words of 32 bits each plus carry room: integer addition is associative,
# so the sum does not depend on the order of the values or on how they were split between
# processes, and ranks reduce it with a plain integer all_reduce.
LIMB_BITS = 32
LIMBS = 9  # 2^-149 .. 2^128: 277 bits, one limb above for the carry of the top value
_LIMB_MASK = (1 << LIMB_BITS) - 1
# The top limb of a sum that met an Inf or NaN; real values add less than 2^23 to it per call.
_POISON = 1 << 56


def exact_zeros(shape, device=None) -> torch.Tensor:
    return torch.zeros(*shape, LIMBS, dtype=torch.int64, device=device)


def exact_add(limbs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """limbs [..., LIMBS] += the fp32 `value` [...] exactly (in place; returns limbs). Each call
    adds less than 2^32 to a limb, so 2^31 calls never overflow one. An Inf or NaN makes its sum
    NaN."""
    bits = value.detach().float().contiguous().view(torch.int32).to(torch.int64)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    m = torch.where(exp > 0, mant | 0x800000, mant)
    pos = (exp - 1).clamp(min=0)  # value = m * 2^(pos - 149)
    m = torch.where(bits < 0, -m, m)
    idx = (pos // LIMB_BITS).unsqueeze(-1)
    wide = m << (pos % LIMB_BITS)  # |wide| < 2^55
    limbs.scatter_add_(-1, idx, (wide & _LIMB_MASK).unsqueeze(-1))
    limbs.scatter_add_(-1, idx + 1, (wide >> LIMB_BITS).unsqueeze(-1))
    # Inf or NaN: the sum becomes NaN (checked where it is read, not here: no host sync)
    limbs[..., LIMBS - 1].masked_fill_(exp == 0xFF, _POISON)
    return limbs


def exact_value(limbs: torch.Tensor) -> torch.Tensor:
    """The exact sum held in limbs [..., LIMBS] as float32: summed in float64 from the top limb
    down, then rounded to float32 (within one float32 rounding of the exact sum). The limbs are
    first brought to their one normal form, so the result is a function of the sum alone, whatever
    the order and the processes it was added in."""
    carry = torch.zeros_like(limbs[..., 0])
    words = []
    for j in range(LIMBS):  # normalise: every limb but the top one in [0, 2^32)
        w = limbs[..., j] + carry
        carry = w >> LIMB_BITS
        words.append(w & _LIMB_MASK if j < LIMBS - 1 else w)
    total = torch.zeros(limbs.shape[:-1], dtype=torch.float64, device=limbs.device)
    for j in reversed(range(LIMBS)):
        total = total + torch.ldexp(words[j].double(), torch.tensor(LIMB_BITS * j - 149, dtype=torch.float64, device=limbs.device))
    return torch.where(words[LIMBS - 1].abs() >= _POISON // 2, torch.nan, total).float()


@dataclass
class Statistics:
    input_amax: dict[str, torch.Tensor] = field(default_factory=dict)
    sq_sum: dict[str, torch.Tensor] = field(default_factory=dict)  # exact sums: [..., LIMBS] int64 (exact_add)
    sq_count: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    expert_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens_seen: int = 0

    def importance(self, key: str) -> torch.Tensor | None:
        """E[x^2] per input channel ([K], or [E, K] for expert stacks); None if never observed."""
        if key not in self.sq_sum:
            return None
        count = self.sq_count[key].clamp(min=1).unsqueeze(-1)
        return self.square_sum(key) / count

    def square_sum(self, key: str) -> torch.Tensor:
        """The per-channel sum of x^2 of `key` as float32."""
        return exact_value(self.sq_sum[key])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensor dict (safetensors-friendly) for checkpointing a calibration run."""
        out: dict[str, torch.Tensor] = {"tokens_seen": torch.tensor(self.tokens_seen)}
        for k, v in self.input_amax.items():
            out[f"input_amax|{k}"] = v
        for k, v in self.sq_sum.items():
            out[f"sq_sum|{k}"] = v
            out[f"sq_count|{k}"] = self.sq_count[k]
        for k, (a, b) in self.kv_amax.items():
            out[f"kv_k|{k}"] = a
            out[f"kv_v|{k}"] = b
        for k, v in self.expert_tokens.items():
            out[f"expert_tokens|{k}"] = v
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    @classmethod
    def from_state_dict(cls, d: dict[str, torch.Tensor]) -> "Statistics":
        s = cls(tokens_seen=int(d["tokens_seen"]))
        kv: dict[str, dict[str, torch.Tensor]] = {}
        for name, v in d.items():
            if "|" not in name:
                continue
            kind, key = name.split("|", 1)
            if kind == "input_amax":
                s.input_amax[key] = v
            elif kind == "sq_sum":
                # a snapshot of an earlier release holds the float32 sum itself
                s.sq_sum[key] = v if v.dtype == torch.int64 else exact_add(exact_zeros(v.shape, v.device), v)
            elif kind == "sq_count":
                s.sq_count[key] = v
            elif kind in ("kv_k", "kv_v"):
                kv.setdefault(key, {})[kind] = v
            elif kind == "expert_tokens":
                s.expert_tokens[key] = v
        s.kv_amax = {k: (p["kv_k"], p["kv_v"]) for k, p in kv.items()}
        return s


def _experts_impl(experts: nn.Module) -> str | None:
    return getattr(getattr(experts, "config", None), "_experts_implementation", None)


def _amax_update(store: dict, key: str, value: torch.Tensor) -> None:
    value = value.detach().float()
    store[key] = value if key not in store else torch.maximum(store[key], value)


def _add(store: dict, key: str, value: torch.Tensor) -> None:
    store[key] = value if key not in store else store[key] + value


def _add_exact(store: dict, key: str, value: torch.Tensor) -> None:
    if key not in store:
        store[key] = exact_zeros(value.shape, value.device)
    exact_add(store[key], value)


@dataclass
class _StackWatch:
    """Per-expert statistics for one MoE experts module."""

    key_up: str
    key_down: str
    up_amax: bool
    up_sq: bool
    down_amax: bool
    down_sq: bool
    ids: torch.Tensor | None = None
    pending: list[int] = field(default_factory=list)


class Observers:
    """Hooks that fill a Statistics while the model runs; use as a context manager."""

    def __init__(
        self,
        model: nn.Module,
        *,
        amax_targets: list[Target] = (),
        importance_targets: list[Target] = (),
        kv_layers: list[AttentionKV] = (),
        moe_experts: dict[str, nn.Module] | None = None,
        stats: Statistics | None = None,
    ) -> None:
        self.model = model
        self.stats = stats or Statistics()
        self._handles: list = []
        self._amax = {t.key: t for t in amax_targets}
        self._sq = {t.key: t for t in importance_targets}
        self._kv = list(kv_layers)
        self._moe = dict(moe_experts or {})

    # -- plain Linear layers -------------------------------------------------------------------
    def _linear_pre_hook(self, key: str, want_amax: bool, want_sq: bool):
        stats = self.stats

        def hook(module, args):
            x = args[0].detach()
            if want_amax:
                _amax_update(stats.input_amax, key, x.abs().amax())
            if want_sq:
                flat = x.reshape(-1, x.shape[-1]).float()
                _add_exact(stats.sq_sum, key, (flat * flat).sum(0))
                _add(stats.sq_count, key, torch.tensor(flat.shape[0], dtype=torch.float64, device=flat.device))

        return hook

    # -- fused expert stacks -------------------------------------------------------------------
    def _experts_pre_hook(self, name: str, watch: _StackWatch, num_experts: int):
        stats = self.stats

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            ids = top_k_index.reshape(-1)
            # Everything stays on the device: no host sync inside the forward pass.
            _add(stats.expert_tokens, name, torch.bincount(ids, minlength=num_experts))
            watch.ids = ids
            if (watch.down_amax or watch.down_sq) and _experts_impl(module) not in ("grouped_mm", "batched_mm"):
                watch.pending = torch.unique(ids).tolist()  # eager: one act call per hit expert, ascending
            if not (watch.up_amax or watch.up_sq):
                return
            x = hidden.detach().reshape(-1, hidden.shape[-1])
            token = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k_index.shape[-1])
            if watch.up_amax:
                row_amax = x.abs().amax(-1).float()[token]
                amax = torch.zeros(num_experts, device=x.device).scatter_reduce(0, ids, row_amax, "amax", include_self=True)
                _amax_update(stats.input_amax, watch.key_up, amax)
            if watch.up_sq:
                routing = torch.zeros(num_experts, x.shape[0], device=x.device)
                routing.index_put_((ids, token), torch.ones_like(ids, dtype=routing.dtype), accumulate=True)
                xf = x.float()
                _add_exact(stats.sq_sum, watch.key_up, routing @ (xf * xf))
                _add(stats.sq_count, watch.key_up, routing.sum(-1).double())

        return hook

    def _act_hook(self, watch: _StackWatch, num_experts: int, module_of_experts: nn.Module):
        stats = self.stats

        def hook(module, args, out):
            if watch.ids is None:
                return
            y = out.detach().reshape(-1, out.shape[-1])
            ids = watch.ids
            impl = _experts_impl(module_of_experts)
            if impl == "grouped_mm":
                eid = torch.sort(ids).values  # rows are grouped by expert, ascending
            elif impl == "batched_mm":
                eid = ids  # rows in (token, k) order
            else:  # eager: one call per expert that received tokens, in ascending order
                if not watch.pending:
                    return
                e = watch.pending.pop(0)
                eid = torch.full((y.shape[0],), e, dtype=ids.dtype, device=y.device)
            if watch.down_amax:
                amax = torch.zeros(num_experts, device=y.device).scatter_reduce(0, eid, y.abs().amax(-1).float(), "amax", include_self=True)
                _amax_update(stats.input_amax, watch.key_down, amax)
            if watch.down_sq:
                yf = y.float()
                sq = torch.zeros(num_experts, y.shape[1], device=y.device).index_add_(0, eid, yf * yf)
                _add_exact(stats.sq_sum, watch.key_down, sq)
                _add(stats.sq_count, watch.key_down, torch.bincount(eid, minlength=num_experts).double())

        return hook

    # -- attention KV -------------------------------------------------------------------------
    # The cache holds keys AFTER the rotary embedding (where a model has one), so k amax is taken
    # there: the attention module's pre-hook keeps its position embeddings, and the k_proj hook
    # rotates its output with the model's own `apply_rotary_pos_emb` before taking the max.
    def _kv_hook(self, kv: AttentionKV, which: int, rotary: dict):
        stats = self.stats

        def hook(module, args, out):
            x = out.detach()
            pe = rotary.get("pe")
            if which == 0 and pe is not None and rotary.get("fn") is not None:
                head_dim = getattr(kv.module, "head_dim")
                k = x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)
                x = rotary["fn"](k, k, pe[0], pe[1])[1]
            amax = x.abs().amax().float()
            k_amax, v_amax = stats.kv_amax.get(kv.name, (torch.zeros((), device=amax.device), torch.zeros((), device=amax.device)))
            stats.kv_amax[kv.name] = (torch.maximum(k_amax, amax), v_amax) if which == 0 else (k_amax, torch.maximum(v_amax, amax))

        return hook

    @staticmethod
    def _rotary_pre_hook(rotary: dict):
        def hook(module, args, kwargs):
            rotary["pe"] = kwargs.get("position_embeddings")

        return hook

    def _model_pre_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.stats.tokens_seen += int(ids.numel())

    def __enter__(self) -> "Observers":
        h = self._handles
        h.append(self.model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
        stacks: dict[int, tuple[nn.Module, str]] = {}
        linear_keys = set(self._amax) | set(self._sq)
        for key in linear_keys:
            t = self._amax.get(key) or self._sq[key]
            if t.is_stack:
                stacks[id(t.module)] = (t.module, t.name)
                continue
            h.append(t.module.register_forward_pre_hook(self._linear_pre_hook(key, key in self._amax, key in self._sq)))
        for name, experts in self._moe.items():
            stacks.setdefault(id(experts), (experts, name))
        for experts, name in stacks.values():
            n = experts.up_proj.shape[0]
            watch = _StackWatch(
                key_up=f"{name}.up_proj", key_down=f"{name}.down_proj",
                up_amax=f"{name}.up_proj" in self._amax, up_sq=f"{name}.up_proj" in self._sq,
                down_amax=f"{name}.down_proj" in self._amax, down_sq=f"{name}.down_proj" in self._sq,
            )
            h.append(experts.register_forward_pre_hook(self._experts_pre_hook(name, watch, n), with_kwargs=True))
            if watch.down_amax or watch.down_sq:
                h.append(experts.act_fn.register_forward_hook(self._act_hook(watch, n, experts)))
        for kv in self._kv:
            rotary: dict = {}
            if kv.module is not None:
                import sys

                rotary["fn"] = getattr(sys.modules[type(kv.module).__module__], "apply_rotary_pos_emb", None)
                h.append(kv.module.register_forward_pre_hook(self._rotary_pre_hook(rotary), with_kwargs=True))
            h.append(kv.k_proj.register_forward_hook(self._kv_hook(kv, 0, rotary)))
            h.append(kv.v_proj.register_forward_hook(self._kv_hook(kv, 1, rotary)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


AUTO_BATCH_MOST = 64  # `--batch-size auto` never goes above this many samples per forward
AUTO_BATCH_HEADROOM = 0.85  # the share of the free device memory a batch may take


def fitting_batch(per_sample_bytes: int, free_bytes: int, remaining: int, *, most: int = AUTO_BATCH_MOST,
                  headroom: float = AUTO_BATCH_HEADROOM) -> int:
    """The largest batch whose peak fits: `per_sample_bytes` is what one sample's forward added to
    the device's peak memory, `free_bytes` what the device has for the next forward. At least 1,
    at most `most` and the samples left."""
    if per_sample_bytes <= 0:
        return max(1, min(most, remaining))
    return max(1, min(most, remaining, int(headroom * free_bytes) // per_sample_bytes))


def measured_forward(model: nn.Module, batch: torch.Tensor) -> tuple[int, int]:
    """Runs one calibration forward of `batch` and returns (bytes it added to the device's peak
    memory, bytes free for the next forward: the device's free memory plus what torch's caching
    allocator holds unused). CUDA only."""
    device = batch.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(input_ids=batch, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(device)
    added = torch.cuda.max_memory_allocated(device) - base
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return added, free
