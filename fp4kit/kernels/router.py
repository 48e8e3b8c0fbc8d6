"""The MoE router's expert pick in one launch: torch.topk(scores + bias, k, sorted=False) on a GPU
and the chosen experts' scores, bit for bit.

Reference (`topk_gather_reference`): the sigmoid scores [T, E] (fp32) plus the correction bias [E]
rounded once in fp32; the k largest by that sum per token; the plain scores gathered at them.
torch's CUDA top-k (`gatherTopK`, one block per token) writes the chosen experts in a fixed order,
which the experts' fp32 sums and the routing weights' normalisation then follow: first those above
the k-th largest value in increasing expert order, then those equal to it in increasing expert
order until k are taken. Values are compared as torch's radix select compares them: as their fp32
bit patterns made order-preserving, so -0.0 ranks below +0.0 and any NaN above everything.

`topk_gather` runs `_topk_gather_kernel`: one program per token holds the token's E sums, takes the
largest k times (the lowest expert among equals), and writes the picks in that order. transformers'
router runs three launches for this (the sum, top-k, the gather); under `torch.compile` the top-k
stays an opaque library call, which the compiled step pays for at every layer.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .backend import check_backend, current_device, interpreted, launch_cached, launch_options, next_power_of_2

_WHAT = "kernels.router_topk"
_LOWEST = -(2**31)  # below every value's key: the padding past E, and a pick once taken


@triton.jit
def _topk_gather_kernel(s_ptr, b_ptr, ids_ptr, w_ptr, E, stride_s,
                        TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    s = tl.load(s_ptr + t * stride_s + e, mask=ok, other=0.0)
    c = s + tl.load(b_ptr + e, mask=ok, other=0.0).to(tl.float32)
    # Order-preserving signed keys of the fp32 bit patterns (negative values: magnitude bits
    # flipped), NaN above everything, padding below everything.
    bits = c.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(c != c, 2147483647, key)
    key = tl.where(ok, key, -2147483648)
    work = key
    chosen = e < 0
    kth = tl.max(key, axis=0)
    for _ in tl.static_range(TOPK):
        kth = tl.max(work, axis=0)
        pick = tl.min(tl.where(work == kth, e, BLOCK_E), axis=0)
        chosen = chosen | (e == pick)
        work = tl.where(e == pick, -2147483648, work)
    above = chosen & (key > kth)
    at = chosen & (key == kth)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    pos = tl.where(above, tl.cumsum(above.to(tl.int32), axis=0) - 1, n_above + tl.cumsum(at.to(tl.int32), axis=0) - 1)
    for j in tl.static_range(TOPK):
        mine = chosen & (pos == j)
        tl.store(ids_ptr + t * TOPK + j, tl.max(tl.where(mine, e, -1), axis=0).to(tl.int64))
        tl.store(w_ptr + t * TOPK + j, tl.max(tl.where(mine, s, float("-inf")), axis=0))


def _keys(c: torch.Tensor) -> torch.Tensor:
    """The kernel's order-preserving int64 keys of fp32 values (NaN above everything)."""
    bits = c.contiguous().view(torch.int32).to(torch.int64)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return torch.where(torch.isnan(c), torch.full_like(key, 2**31 - 1), key)


def topk_gather_reference(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [T, k] int64, scores gathered there [T, k]) in the order torch's CUDA top-k writes
    them (module docstring), on any device."""
    key = _keys(scores.float() + bias.float())
    ranked = torch.sort(key, dim=-1, descending=True, stable=True)[1][:, :k]  # the lowest expert first among equals
    kth = key.gather(1, ranked[:, -1:])
    chosen_key = key.gather(1, ranked)
    # above the k-th value first, then equal to it; each part in increasing expert order
    order = torch.sort(torch.where(chosen_key > kth, 0, key.shape[1]) + ranked, dim=-1)[1]
    chosen = ranked.gather(1, order)
    return chosen, scores.gather(1, chosen)


def topk_gather(scores: torch.Tensor, bias: torch.Tensor, k: int, *, backend: str = "triton"):
    """torch.topk(scores + bias, k, dim=-1, sorted=False)[1] as torch computes it on a GPU, and
    scores.gather(1, those): (chosen [T, k] int64, gathered [T, k] fp32).

    scores: fp32 [T, E] (the router's sigmoid scores; rows may be strided); bias: [E], any float
    dtype (made fp32 exactly). backend: "triton" (`_topk_gather_kernel`) or "torch"
    (`topk_gather_reference`)."""
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"{_WHAT}: scores must be an fp32 [T, E] tensor, got "
                         f"{getattr(scores, 'dtype', type(scores))} {tuple(getattr(scores, 'shape', ()))}")
    t, n = scores.shape
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (n,):
        raise ValueError(f"{_WHAT}: bias must be a float [{n}] tensor, got {tuple(getattr(bias, 'shape', ()))}")
    if not 1 <= k <= n:
        raise ValueError(f"{_WHAT}: k must be in [1, {n}], got {k}")
    check_backend(backend, _topk_gather_kernel, scores, bias, what=_WHAT)
    if backend == "torch":
        return topk_gather_reference(scores, bias, k)
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    bias = bias.contiguous()
    chosen = torch.empty((t, k), dtype=torch.int64, device=scores.device)
    gathered = torch.empty((t, k), dtype=torch.float32, device=scores.device)
    if t:
        args = (scores, bias, chosen, gathered, n, scores.stride(0))
        consts = dict(TOPK=k, BLOCK_E=max(next_power_of_2(n), 16),
                      num_warps=1 if n <= 256 or interpreted(_topk_gather_kernel) else 4, **launch_options())
        gpu = scores.get_device()
        # a router on another GPU than the current one launches on its own
        with torch.cuda.device(gpu) if gpu >= 0 and gpu != current_device() else contextlib.nullcontext():
            launch_cached(_topk_gather_kernel, (t,), *args, **consts)
    return chosen, gathered
