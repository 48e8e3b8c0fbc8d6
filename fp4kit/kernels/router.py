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
largest k times (the lowest expert among equals: one maximum of value and expert packed in 64
bits, carrying the score), works out the order on the k picks alone and writes each pick at its
place. transformers' router runs three launches for this (the sum, top-k, the gather); under
`torch.compile` the top-k stays an opaque library call, which the compiled step pays for at every
layer.

`route` runs a whole single-group sigmoid router in one launch (`_route_kernel`): the fp32 logits,
the scores, this pick, and the picked scores normalised and scaled, for the decode step's few rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import backend, launch
from .backend import (Constants, check_backend, current_device, dependent_launch, interpreted, launch_cached,
                      launch_options, next_power_of_2)
from .tiles import split_counters

_WHAT = "kernels.router_topk"


@triton.jit
def _larger(key_a, s_a, key_b, s_b):
    """The (packed key, score) pair with the larger key (`_picks`' reduction)."""
    a = key_a >= key_b
    return tl.where(a, key_a, key_b), tl.where(a, s_a, s_b)


@triton.jit
def _picks(c, s, e, ok, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_E: tl.constexpr):
    """The k largest of the fp32 sums `c` [BLOCK_E] (entries past E: ok False), as vectors over
    j < TOPK_P2 (entries j >= TOPK unused): (expert, its value of `s`, its place in torch's order
    (module docstring)).

    Values are compared by order-preserving signed keys of their fp32 bit patterns (negative
    values: magnitude bits flipped; NaN above everything, padding below everything), packed with
    the expert above it as key * 2^32 + (BLOCK_E - 1 - expert), so that one maximum takes the
    largest value and, among equals, the lowest expert; k such maxima (each carrying its `s`) give
    the picks in descending order. Their places are then worked out on the k picks alone: those
    above the k-th value first, then those equal to it, each part in increasing expert order."""
    bits = c.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(c != c, 2147483647, key)
    key = tl.where(ok, key, -2147483648)
    work = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    j = tl.arange(0, TOPK_P2)
    packed = tl.zeros([TOPK_P2], tl.int64)
    picked = tl.zeros([TOPK_P2], tl.float32)
    for i in tl.static_range(TOPK):
        best, best_s = tl.reduce((work, s), 0, _larger)
        packed = tl.where(j == i, best, packed)
        picked = tl.where(j == i, best_s, picked)
        work = tl.where(work == best, -9223372036854775807 - 1, work)
    expert = (BLOCK_E - 1) - (packed & 0xFFFFFFFF)
    kth = best >> 32
    below = (packed >> 32) <= kth  # 0: above the k-th value, 1: equal to it
    used = j < TOPK
    # place of pick j: the used picks i in an earlier part, or in the same part with a lower expert
    first = ((below[None, :].to(tl.int32) < below[:, None].to(tl.int32))
             | ((below[None, :] == below[:, None]) & (expert[None, :] < expert[:, None]))) & used[None, :]
    pos = tl.sum(first.to(tl.int32), axis=1)
    return expert, picked, pos


@triton.jit
def _topk_gather_kernel(s_ptr, b_ptr, ids_ptr, w_ptr, E, stride_s,
                        TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    s = tl.load(s_ptr + t * stride_s + e, mask=ok, other=0.0)
    c = s + tl.load(b_ptr + e, mask=ok, other=0.0).to(tl.float32)
    expert, picked, pos = _picks(c, s, e, ok, TOPK, TOPK_P2, BLOCK_E)
    used = tl.arange(0, TOPK_P2) < TOPK
    tl.store(ids_ptr + t * TOPK + pos, expert, mask=used)
    tl.store(w_ptr + t * TOPK + pos, picked, mask=used)


@triton.jit
def _route_weight(w_ptr, r, r_ok, k, K, stride_w):
    """The router weight's rows r at columns k, as fp32; zeros past E and K."""
    return tl.load(w_ptr + r[:, None].to(tl.int64) * stride_w + k[None, :], mask=r_ok[:, None] & (k[None, :] < K),
                   other=0.0).to(tl.float32)


@triton.jit
def _route_kernel(x_ptr, w_ptr, b_ptr, logits_ptr, ids_ptr, wout_ptr, cnt_ptr, E, K, stride_x, stride_w, scale,
                  TOPK: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, TOPK_P2: tl.constexpr, PDL: tl.constexpr = False,
                  NATIVE: tl.constexpr = True, TRIGGER: tl.constexpr = False):
    """One token's router (program axis 1) in one launch. Each program computes the fp32 logits of
    BLOCK_R experts (fp32 products of the token's row and the weight rows, summed in fp32), stores
    them and counts itself in at the token's counter; the last of the token's programs to arrive
    reads the E logits back (through L2, where the others' stores are), takes the sigmoid scores,
    picks as `_topk_gather_kernel` does, normalises the picked scores by their sum (+ 1e-20, in
    pick order) where NORM, scales them, and puts the counter back to 0 for the next launch.

    PDL: the launch is a programmatic dependent of the one before it (`backend.pdl`), which may
    still be writing x (in a decode step, the norm before the router): the program requests its
    first K tile of the router's weight, which no launch writes, then waits for that launch to
    complete (`gdc_wait`) before it reads x or touches the logits and counters. The same products
    summed in the same order: the plain launch's values bit for bit. In Triton's interpreter
    (NATIVE false) only the early weight load is taken.

    TRIGGER: the launch after it may start at once (`gdc_launch_dependents`); a launch that is a
    programmatic dependent of the router (the MoE up launch with WAIT_FIRST) waits for it to complete
    before reading anything."""
    if TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < E
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    k_first = 0
    if PDL:
        w = _route_weight(w_ptr, r, r_ok, kk, K, stride_w)
        if NATIVE:
            gdc_wait()
        acc += w * tl.load(x_ptr + t * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        acc += _route_weight(w_ptr, r, r_ok, k, K, stride_w) * x[None, :]
    tl.store(logits_ptr + t * E + r, tl.sum(acc, axis=1), mask=r_ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        logit = tl.load(logits_ptr + t * E + e, mask=ok, other=0.0, cache_modifier=".cg")
        s = tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), 1.0 + tl.exp(-logit))
        c = s + tl.load(b_ptr + e, mask=ok, other=0.0).to(tl.float32)
        expert, picked, pos = _picks(c, s, e, ok, TOPK, TOPK_P2, BLOCK_E)
        j = tl.arange(0, TOPK_P2)
        used = j < TOPK
        if NORM:
            # the picked scores summed one by one in torch's order (`in_order`: by place)
            in_order = tl.sum(tl.where((pos[None, :] == j[:, None]) & used[None, :], picked[None, :], 0.0), axis=1)
            total = 0.0
            for i in tl.static_range(TOPK):
                total += tl.sum(tl.where(j == i, in_order, 0.0), axis=0)
            total += 1e-20
            picked = tl.math.div_rn(picked, total)
        tl.store(ids_ptr + t * TOPK + pos, expert, mask=used)
        tl.store(wout_ptr + t * TOPK + pos, picked * scale, mask=used)
        tl.store(cnt_ptr + t, 0)


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
        consts = dict(TOPK=k, TOPK_P2=max(next_power_of_2(k), 2), BLOCK_E=max(next_power_of_2(n), 16),
                      num_warps=1 if n <= 256 or interpreted(_topk_gather_kernel) else 4, **launch_options())
        gpu = scores.get_device()
        # a router on another GPU than the current one launches on its own
        with torch.cuda.device(gpu) if gpu >= 0 and gpu != current_device() else contextlib.nullcontext():
            launch_cached(_topk_gather_kernel, (t,), *args, **consts)
    return chosen, gathered


# The one-launch router (`route`): weight columns per loop step and the most tokens it takes (more:
# the logits by torch's matmul, then `topk_gather`). A loop step takes a whole row up to 4096
# columns (Nemotron-H's 2688 in one): the steps' loads issue in order, each waiting for the one
# before, so fewer steps are fewer round trips to memory. The experts per program and the warps
# come from the launch table ("router" in tuning/<gpu>.json, ROUTE: `experts`, `num_warps`).
ROUTE_BLOCK_K = 4096
ROUTE_MAX_TOKENS = 64


def route_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, *, norm: bool = True,
                    scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A single-group sigmoid router's forward (logits [T, E] fp32, weights [T, k] fp32, chosen
    [T, k] int64) in torch: fp32 logits of x's rows, sigmoid scores, the pick of
    `topk_gather_reference`, the picked scores normalised by their sum + 1e-20 where `norm`, then
    scaled."""
    return _route_by(topk_gather_reference, x, weight, bias, k, norm, scale)


def _route_by(pick, x, weight, bias, k, norm, scale):
    """`route_reference`'s steps with `pick` (`topk_gather_reference`, or the kernel `topk_gather`,
    which gives its picks bit for bit) for the top-k and the gather."""
    logits = torch.nn.functional.linear(x.float(), weight.float())
    chosen, weights = pick(logits.sigmoid(), bias, k)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * scale, chosen


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, *, norm: bool = True,
          scale: float = 1.0, backend: str = "triton", tables: Mapping | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route_reference`'s router in one launch (`_route_kernel`) for up to ROUTE_MAX_TOKENS rows:
    (logits, weights, chosen). The logits are summed in another order than torch's matmul (and
    the sigmoid's exp may differ from torch's in the last bit), so a pick can differ from
    `route_reference`'s where two experts' sums tie to about 1e-7; given its own logits, the pick,
    its order and the weights follow `route_reference`'s rules.

    x: [T, K] (any float dtype, made fp32 exactly); weight: [E, K] fp32; bias: [E] any float.
    More rows than ROUTE_MAX_TOKENS: torch's fp32 matmul and sigmoid, then `topk_gather`.
    backend: "triton" or "torch" (`route_reference`). tables: the launch table (default: the
    device's "router" table), whose ROUTE entry gives the experts per program and the warps."""
    what = "kernels.route"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{what}: x must be a float [T, K] tensor, got {tuple(getattr(x, 'shape', ()))}")
    t, kdim = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != kdim:
        raise ValueError(f"{what}: weight must be an fp32 [E, {kdim}] tensor, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    n = weight.shape[0]
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (n,):
        raise ValueError(f"{what}: bias must be a float [{n}] tensor, got {tuple(getattr(bias, 'shape', ()))}")
    if not 1 <= k <= n:
        raise ValueError(f"{what}: k must be in [1, {n}], got {k}")
    check_backend(backend, _route_kernel, x, weight, bias, what=what)
    if backend == "torch":
        return route_reference(x, weight, bias, k, norm=norm, scale=scale)
    if t > ROUTE_MAX_TOKENS:
        return _route_by(topk_gather, x, weight, bias, k, norm, scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, bias = weight.contiguous(), bias.contiguous()
    logits = torch.empty((t, n), dtype=torch.float32, device=x.device)
    weights = torch.empty((t, k), dtype=torch.float32, device=x.device)
    chosen = torch.empty((t, k), dtype=torch.int64, device=x.device)
    if t:
        gpu = x.get_device()
        with torch.cuda.device(gpu) if gpu >= 0 and gpu != current_device() else contextlib.nullcontext():
            counters = split_counters(x.device, t)
            args = (x, weight, bias, logits, chosen, weights, counters, n, kdim, x.stride(0), weight.stride(0),
                    float(scale))
            if tables is None:
                programs, consts = _default_route_plan(n, kdim, k, bool(norm), x.device)
            else:
                programs, consts = _route_plan(n, kdim, k, bool(norm), tables, x.device)
            launch_cached(_route_kernel, (programs, t), *args, constants=consts)
    return logits, weights, chosen


def _route_plan(n: int, kdim: int, k: int, norm: bool, tables: Mapping,
                device: torch.device) -> tuple[int, Constants]:
    """(programs per token, the kernel's constants) for E = n experts over kdim columns, from the
    ROUTE table's experts per program and warps, and its "pdl" (absent: off): the launch as a
    programmatic dependent of the one before it where `backend.pdl` allows that on `device` (in
    Triton's interpreter the kernel takes the early weight load alone); its "trigger" (absent:
    off): the launch after it may start at once, natively on Hopper only."""
    c = tables["ROUTE"]
    per, warps = int(c["experts"]), int(c["num_warps"])
    if per < 1 or per & (per - 1) or warps < 1 or warps & (warps - 1) or warps > 16:
        raise ValueError(f"kernels.route: the ROUTE table's experts and num_warps (<= 16) must be powers of two, "
                         f"got experts={per}, num_warps={warps}")
    native = not interpreted(_route_kernel)
    pdl = dependent_launch(c.get("pdl", False), device, _route_kernel, native)
    trigger = bool(c.get("trigger", False)) and native and backend.pdl(device, _route_kernel)
    consts = Constants(TOPK=k, NORM=norm, BLOCK_R=per, BLOCK_K=min(ROUTE_BLOCK_K, max(next_power_of_2(kdim), 16)),
                       BLOCK_E=max(next_power_of_2(n), 16), TOPK_P2=max(next_power_of_2(k), 2), PDL=pdl,
                       NATIVE=native, TRIGGER=trigger, num_warps=warps, **({"launch_pdl": True} if pdl and native else {}),
                       **launch_options())
    return -(-n // per), consts


@functools.lru_cache(maxsize=256)
def _default_route_plan(n: int, kdim: int, k: int, norm: bool, device: torch.device) -> tuple[int, Constants]:
    """`_route_plan` under the device's own launch table (frozen for the process), kept per shape."""
    return _route_plan(n, kdim, k, norm, launch.table("router", device), device)
