"""One query position's grouped-query attention over a static key/value cache, in one launch.

A decode step's attention reads one query row per head against the whole cache (a fixed number of
slots, the ones not yet written closed by the mask). `decode_attention` runs it as split-KV
"flash decoding": program (b, h, s) takes key/value head h of row b and the s-th of SPLITS slices
of the cache, holds the G query heads of that key/value head as G rows, and keeps a running
maximum, a running sum of exponentials and an fp32 weighted sum of values over its slice. Each
program stores its three partials and counts itself in at its head's counter; the last of the
head's programs to arrive rescales the SPLITS partials to their common maximum, sums them in the
order s = 0, 1, ... (the result does not depend on which program was last), divides, writes the
output in the query's dtype and puts the counter back to 0 for the next launch.

Arithmetic: the scores are fp32 sums of the exact products of the 16-bit query and key (the
matrix units), times the scale; the softmax is fp32; the probabilities meet the values as tf32
(10 mantissa bits, against the 8 of the bf16 probabilities that flash attention kernels use) with
fp32 sums. The reference (`decode_attention_reference`) is torch's scaled_dot_product_attention
on the same grouped rows in fp32.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .backend import check_backend, current_device, interpreted, launch_cached, launch_options, next_power_of_2
from .tiles import split_counters

_WHAT = "kernels.decode_attention"
# Cache slots per program step and the slices the cache is cut into (at most: a slice holds at
# least one step's slots).
BLOCK_N = 64
SPLITS = 16
COMBINE = 4  # the last program's partial sums per loop step (loads in flight together)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, part_ptr, cnt_ptr, S, heads_kv, per_split, scale,
                             sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_s,
                             G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
                             COMBINE: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    n_split = tl.num_programs(1)
    b = (bh // heads_kv).to(tl.int64)
    h = (bh % heads_kv).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + (h * G + g[:, None]) * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = sp * per_split
    end = tl.minimum(start + per_split, S)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None].to(tl.int64) * sk_s + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None].to(tl.int64) * sv_s + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if MASK == 1:  # bool: True attends
            keep = tl.load(m_ptr + b * sm_b + n * sm_s, mask=n_ok, other=0) != 0
            s = tl.where(keep[None, :] & n_ok[None, :], s, float("-inf"))
        elif MASK == 2:  # additive
            s = s + tl.load(m_ptr + b * sm_b + n * sm_s, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            s = tl.where(n_ok[None, :], s, float("-inf"))
        else:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing open yet stays at 0
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m_i - base)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # partials: [heads, SPLITS, BLOCK_G, BLOCK_D + 2] fp32 (the sums, then m and l)
    width = BLOCK_D + 2
    row = (bh.to(tl.int64) * n_split + sp) * BLOCK_G + g
    tl.store(part_ptr + row[:, None] * width + d[None, :], acc)
    tl.store(part_ptr + row * width + BLOCK_D, m_i)
    tl.store(part_ptr + row * width + BLOCK_D + 1, l_i)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel", scope="gpu")
    if arrived == n_split - 1:
        # The partials' loads do not depend on each other: unrolled, several are in flight at once
        # (all SPLITS maxima; the sums COMBINE splits per loop step, which bounds the registers
        # they take). A split past n_split is masked off: weight exp(-inf) = 0 on zeros, adding +0.0.
        first = bh.to(tl.int64) * n_split * BLOCK_G + g
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for s_i in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(part_ptr + (first + s_i * BLOCK_G) * width + BLOCK_D,
                                          mask=g * 0 + s_i < n_split, other=float("-inf"), cache_modifier=".cg"))
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_G], tl.float32)
        out = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for s0 in range(0, n_split, COMBINE):
            for j in tl.static_range(COMBINE):
                r = first + (s0 + j) * BLOCK_G
                live = g * 0 + s0 + j < n_split
                w = tl.exp(tl.load(part_ptr + r * width + BLOCK_D, mask=live, other=float("-inf"),
                                   cache_modifier=".cg") - top)
                total += w * tl.load(part_ptr + r * width + BLOCK_D + 1, mask=live, other=0.0, cache_modifier=".cg")
                out += w[:, None] * tl.load(part_ptr + r[:, None] * width + d[None, :], mask=live[:, None], other=0.0,
                                            cache_modifier=".cg")
        out = out / total[:, None]
        # output [B, 1, H, D] contiguous
        o_off = (b * heads_kv * G + h * G + g[:, None]) * D + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        tl.store(cnt_ptr + bh, 0)


def decode_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """torch's scaled_dot_product_attention in fp32 on the grouped rows ([B, H, 1, D] query over
    [B, H_kv, S, D] keys and values, H = G * H_kv): [B, 1, H, D] in the query's dtype."""
    b, heads, _, d = query.shape
    rows = query.float().reshape(b, key.shape[1], heads // key.shape[1], d)
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    out = torch.nn.functional.scaled_dot_product_attention(rows, key.float(), value.float(), attn_mask=mask,
                                                           scale=scale)
    return out.reshape(b, heads, 1, d).transpose(1, 2).to(query.dtype).contiguous()


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, *, backend: str = "triton") -> torch.Tensor:
    """One query position of grouped-query attention over a static cache: [B, 1, H, D] in the
    query's dtype (transformers' attention output layout).

    query: [B, H, 1, D] (any strides with unit stride in D); key, value: [B, H_kv, S, D] (unit
    stride in D), H a multiple of H_kv; mask: None, or [B, 1, 1, S] (dims of size 1 may
    broadcast), bool (True attends) or float (added to the scores); scale: the scores' factor.
    backend: "triton" (`_decode_attention_kernel`) or "torch" (`decode_attention_reference`)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        raise ValueError(f"{_WHAT}: query, key and value must be 4-D tensors")
    b, heads, q_len, d = query.shape
    if q_len != 1:
        raise ValueError(f"{_WHAT}: takes one query position, got {q_len}")
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"{_WHAT}: query, key and value must share a 16-bit dtype, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    if key.shape != value.shape or key.shape[0] != b or key.shape[3] != d or heads % key.shape[1]:
        raise ValueError(f"{_WHAT}: key and value must be [{b}, H_kv, S, {d}] with {heads} a multiple of H_kv, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    heads_kv, slots = key.shape[1], key.shape[2]
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != slots \
                or mask.shape[0] not in (1, b) or not (mask.dtype == torch.bool or mask.is_floating_point()):
            raise ValueError(f"{_WHAT}: mask must be a bool or float [{b}, 1, 1, {slots}] tensor, got "
                             f"{mask.dtype} {tuple(mask.shape)}")
    check_backend(backend, _decode_attention_kernel, query, key, value, what=_WHAT)
    if backend == "torch":
        return decode_attention_reference(query, key, value, mask, scale)
    if query.stride(3) != 1:
        query = query.contiguous()
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    out = torch.empty((b, 1, heads, d), dtype=query.dtype, device=query.device)
    if b == 0 or slots == 0:
        return out.zero_()
    group = heads // heads_kv
    block_g, block_d = max(next_power_of_2(group), 16), max(next_power_of_2(d), 16)
    per_split = -(-max(-(-slots // SPLITS), BLOCK_N) // BLOCK_N) * BLOCK_N  # whole steps of BLOCK_N slots
    splits = -(-slots // per_split)
    if mask is None:
        kind, m, sm_b, sm_s = 0, query, 0, 0
    else:
        kind, m = (1 if mask.dtype == torch.bool else 2), mask
        sm_b, sm_s = (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(3)
    part = torch.empty((b * heads_kv * splits * block_g * (block_d + 2),), dtype=torch.float32, device=query.device)
    gpu = query.get_device()
    with torch.cuda.device(gpu) if gpu >= 0 and gpu != current_device() else contextlib.nullcontext():
        counters = split_counters(query.device, b * heads_kv)
        args = (query, key, value, m, out, part, counters, slots, heads_kv, per_split, float(scale),
                query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
                value.stride(0), value.stride(1), value.stride(2), sm_b, sm_s)
        consts = dict(G=group, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=BLOCK_N, MASK=kind, SPLITS=SPLITS,
                      COMBINE=COMBINE,
                      IEEE=interpreted(_decode_attention_kernel), num_warps=4, **launch_options())
        launch_cached(_decode_attention_kernel, (b * heads_kv, splits), *args, **consts)
    return out
