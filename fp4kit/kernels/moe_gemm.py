"""Grouped W4A16 MoE for Nemotron-H's non-gated experts: out = sum_k w_k * down_e(relu(up_e x)^2).

Reference: transformers' `NemotronHExperts.forward` on the dequantized weights (backend="torch",
`experts_reference`): up_proj [E, I, H] and down_proj [E, H, I] as 3-D NVFP4 stacks (one global
scale per expert), the router's top-k expert ids [T, k] and fp32 weights [T, k]. Intermediates
are rounded to the activation dtype where the reference rounds them (the linears' outputs,
relu^2); the k slots of a token are summed in fp32 in a fixed order.

`moe_config` picks the path by rule from the launch table ("moe" in tuning/<gpu>.json):
- up to SMALL["max_assignments"] (token, slot) assignments, `_moe_small`: two launches and no
  host-side routing. `_moe_small_kernel` finds each program's expert from the routed ids and
  compacts its assignments in order, for up_proj then down_proj (split-K partials in fp32, the
  down kernel finishing relu^2 as it reads them); in the down launch the last program to finish
  a token's slice of output features applies the routing weights to it (`_combine_tile`; with
  cfg "combine": False a third launch does, `_moe_combine_kernel`). Up to MOE_GEMV["max_assignments"] the projections run on the CUDA cores
  (`tiles.gemv_accumulate`; split-K by MOE_GEMV's own target, its AHEAD K tiles in flight per
  thread, 1 if absent; with its "pdl" on Hopper the down launch starts while the up launch runs,
  its programs' first weight tiles requested before they wait for it), else on the matrix units
  (`tiles.accumulate`; split-K by SMALL's).
- beyond, `_moe_sorted`: the assignments sorted by expert (`torch.sort`, stable; `offsets[e]`
  marks expert e's run), one launch per projection whose programs each walk one expert's run.
  With up to MOE_MMA["max_per_expert"] assignments per expert and 16-bit activations on a GPU
  the walk runs on the register-fed matrix units (`_moe_up_mma_kernel`, `_moe_down_mma_kernel`,
  `mma.mma_accumulate`), else on wgmma tiles (`_moe_up_kernel`, `_moe_down_kernel`).
Measured times: benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

from . import backend, launch
from .backend import (ACT_DTYPES, cdiv, check_backend, check_weight, exact_dot, interpreted, launch_cached,
                      launch_options, next_power_of_2)
from .mma import MMA_UNSCALE, mma_accumulate, mma_fragments, mma_lanes, mma_rows, mma_scales, mma_vec
from .tiles import accumulate, gemv_accumulate, gemv_k_tile, int64_activations, lut_tile, relu2, split_counters, use_lut

_WHAT = "kernels.moe_experts"


@triton.jit
def _expert_slice(wq_ptr, ws_ptr, gs_ptr, e, N, K, BLOCK_N: tl.constexpr):
    """Expert e's [N, K] weight in a 3-D NVFP4 stack, at this program's N slice: the slice's
    int64 rows and which exist, the expert's packed words and scale bytes, its global scale."""
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e64 = e.to(tl.int64)
    wq = wq_ptr + e64 * N * (K // 8)
    ws = ws_ptr + e64 * N * (K // 16)
    return n.to(tl.int64), n < N, wq, ws, tl.load(gs_ptr + e)


@triton.jit
def _moe_up_kernel(
    x_ptr, order_ptr, offsets_ptr, wq_ptr, ws_ptr, gs_ptr, inter_ptr,
    H, I, TOPK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        n64, n_ok, wq, ws, gs = _expert_slice(wq_ptr, ws_ptr, gs_ptr, e, I, H, BLOCK_N)
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            m_ok = pos < end
            assignment = tl.load(order_ptr + pos, mask=m_ok, other=0)
            token = (assignment // TOPK).to(tl.int64)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = accumulate(acc, x_ptr, token * H, m_ok, wq, ws, gs, n64, n_ok, H, 0, H,
                              BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
            tl.store(inter_ptr + pos[None, :].to(tl.int64) * I + n64[:, None],
                     relu2(acc, inter_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, order_ptr, offsets_ptr, weight_ptr, wq_ptr, ws_ptr, gs_ptr, out_ptr,
    H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
):
    # The walk over expert e's run mirrors `_moe_up_kernel`'s; the rows read and the epilogue differ.
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        n64, n_ok, wq, ws, gs = _expert_slice(wq_ptr, ws_ptr, gs_ptr, e, H, I, BLOCK_N)
        for m0 in range(start, end, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            m_ok = pos < end
            assignment = tl.load(order_ptr + pos, mask=m_ok, other=0)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = accumulate(acc, inter_ptr, pos.to(tl.int64) * I, m_ok, wq, ws, gs, n64, n_ok,
                              I, 0, I, BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
            route_w = tl.load(weight_ptr + assignment, mask=m_ok, other=0.0)
            y = acc.to(ACT_DTYPE).to(tl.float32) * route_w[None, :]
            tl.store(out_ptr + assignment[None, :].to(tl.int64) * H + n64[:, None], y,
                     mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _mma_columns(v0, v1, ROWS: tl.constexpr):
    """Per-lane values of the lane's D columns 2c and 2c + 1 (`mma.mma_fragments` with one
    activation tile) broadcast to the fragments' shape."""
    v = tl.join(v0, v1)[:, :, None]
    if ROWS == 2:
        v = v[:, :, :, None]
    return v


@triton.jit
def _mma_expert(gs_ptr, e, N, K, ROWS: tl.constexpr, WARPS: tl.constexpr, EMULATE: tl.constexpr):
    """What `_moe_up_mma_kernel` / `_moe_down_mma_kernel` need of expert e's weight [N, K] (row
    e * N of the stack) in this program: lanes g and c, zero accumulators, the lane's first weight
    row, its rows' first blocks (`mma.mma_rows`), and the factor of the fp32 sums: the
    global scale times `mma.MMA_UNSCALE`."""
    g, c, warp, zero = mma_lanes(WARPS, EMULATE)
    row = tl.program_id(1) * (16 * ROWS * WARPS) + warp * (16 * ROWS) + g
    return g, c, zero, row, mma_rows(row, e * N, N, K), tl.load(gs_ptr + e) * MMA_UNSCALE


@triton.jit
def _moe_up_mma_kernel(
    x4_ptr, order_ptr, offsets_ptr, wb_ptr, ws_ptr, gs_ptr, inter_ptr,
    H, I, TOPK, stride_x4,
    ROWS: tl.constexpr, WARPS: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr, VEC: tl.constexpr = False,
):
    """`_moe_up_kernel` on the register-fed matrix units (`mma.mma_accumulate`): a program
    takes one expert and 16 * ROWS * WARPS of its output features, and walks the expert's run of
    assignments 8 at a time (a lane's B column: the token row of one assignment; past the run,
    the run's last, not stored). VEC: 16-byte loads (`mma.mma_vec`)."""
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        g, c, zero, row, wrows, gs = _mma_expert(gs_ptr, e, I, H, ROWS, WARPS, EMULATE)
        for m0 in range(start, end, 8):
            token = tl.load(order_ptr + tl.minimum(m0 + g, end - 1)) // TOPK
            xrow = token.to(tl.int64) * stride_x4
            acc = mma_accumulate(zero, x4_ptr, xrow, xrow, wb_ptr, ws_ptr, wrows, c, 0, H, 1, ROWS, F16,
                                 EVEN_K, SCALE_PAIRS, PREFETCH, EMULATE, 1, 0, VEC)
            y, rows, pos = mma_fragments(acc, row, m0 + 2 * c, 1, ROWS)
            tl.store(inter_ptr + pos.to(tl.int64) * I + rows, relu2(y * gs, inter_ptr.dtype.element_ty),
                     mask=(pos < end) & (rows < I))


@triton.jit
def _moe_down_mma_kernel(
    x4_ptr, order_ptr, offsets_ptr, weight_ptr, wb_ptr, ws_ptr, gs_ptr, out_ptr,
    H, I, stride_x4,
    ROWS: tl.constexpr, WARPS: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, ACT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    VEC: tl.constexpr = False,
):
    """`_moe_down_kernel` on the register-fed matrix units: the up output's rows (x4_ptr, its
    int64 view) in sorted order are the B columns; epilogue as `_moe_down_kernel`. VEC: 16-byte
    loads (`mma.mma_vec`)."""
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        g, c, zero, row, wrows, gs = _mma_expert(gs_ptr, e, H, I, ROWS, WARPS, EMULATE)
        for m0 in range(start, end, 8):
            xrow = tl.minimum(m0 + g, end - 1).to(tl.int64) * stride_x4
            acc = mma_accumulate(zero, x4_ptr, xrow, xrow, wb_ptr, ws_ptr, wrows, c, 0, I, 1, ROWS, F16,
                                 EVEN_K, SCALE_PAIRS, PREFETCH, EMULATE, 1, 0, VEC)
            # The lane's two columns' assignments and routing weights, read in the lane's own
            # layout and joined into the fragments' shape (`_mma_columns`). Gathered in the
            # fragments' layout instead (tl.load(order_ptr + pos)), the assignment ids came out
            # wrong on an H200 (Triton 3.6; right in the interpreter): tests/gpu's MoE tests
            # caught it.
            p0 = m0 + 2 * c
            a0 = tl.load(order_ptr + p0, mask=p0 < end, other=0)
            a1 = tl.load(order_ptr + p0 + 1, mask=p0 + 1 < end, other=0)
            r0 = tl.load(weight_ptr + a0, mask=p0 < end, other=0.0)
            r1 = tl.load(weight_ptr + a1, mask=p0 + 1 < end, other=0.0)
            y, rows, pos = mma_fragments(acc, row, p0, 1, ROWS)
            ok = (pos < end) & (rows < H)
            dst = _mma_columns(a0.to(tl.int64) * H, a1.to(tl.int64) * H, ROWS)
            route_w = _mma_columns(r0, r1, ROWS)
            tl.store(out_ptr + dst + rows, (y * gs).to(ACT_DTYPE).to(tl.float32) * route_w, mask=ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# --------------------------------------------------------------------------------------------
# Decode sizes (up to SMALL["max_assignments"]): routing inside the kernels, split-K, three launches
# --------------------------------------------------------------------------------------------
@triton.jit
def _slot_expert(ids_ptr, A, E, slot, A_PAD: tl.constexpr, BY_ASSIGNMENT: tl.constexpr):
    """(expert this program serves, its assignment ids [A_PAD], whether it serves one).

    BY_ASSIGNMENT (fewer assignments than experts): program `slot` takes the expert of
    assignment `slot` if no earlier assignment has it, so each routed expert is taken once and
    the grid is as small as the assignment count. Otherwise program `slot` is expert `slot`.
    An id outside [0, E) is served by no program."""
    a_idx = tl.arange(0, A_PAD)
    ids = tl.load(ids_ptr + a_idx, mask=a_idx < A, other=-1).to(tl.int32)
    if BY_ASSIGNMENT:
        e = tl.load(ids_ptr + slot).to(tl.int32)
        earlier = tl.sum(((ids == e) & (a_idx < slot)).to(tl.int32), axis=0)
        serves = (earlier == 0) & (e >= 0) & (e < E)
    else:
        e = slot
        serves = e < E
    return e, ids, serves


@triton.jit
def _expert_rows(ids, e, r0, BLOCK_M: tl.constexpr, A_PAD: tl.constexpr):
    """Rows r0 .. r0+BLOCK_M-1 of expert e's assignments in increasing order: their assignment
    indices and which exist (a compaction of ids == e by its running count)."""
    mine = ids == e
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    want = r0 + tl.arange(0, BLOCK_M)
    hit = mine[None, :] & (rank[None, :] == want[:, None])  # [BLOCK_M, A_PAD]
    assignment = tl.sum(tl.where(hit, tl.arange(0, A_PAD)[None, :], 0), axis=1)
    return assignment, tl.sum(hit.to(tl.int32), axis=1) > 0


@triton.jit
def _combine_tile(part_ptr, ids_ptr, w_ptr, out_ptr, t, h, ok, A, E, H, parts, TOPK: tl.constexpr,
                  ACT: tl.constexpr):
    """out[t, h] = sum over slots j = 0 .. TOPK-1 (this order, fp32) of w[t, j] times the down
    projection of assignment t*TOPK + j (its `parts` partials summed in order s = 0, 1, ...,
    rounded to ACT as the linear's output); cast to out's dtype. An assignment whose expert id is
    outside [0, E) adds nothing. The partials are read through L2 (.cg), where other programs of
    the same launch store them."""
    total = tl.zeros(h.shape, dtype=tl.float32)
    for j in tl.static_range(TOPK):
        a = t.to(tl.int64) * TOPK + j
        e = tl.load(ids_ptr + a)
        routed = (e >= 0) & (e < E)  # else no program wrote its partials
        live = tl.where(routed, ok, False)
        y = tl.load(part_ptr + a * H + h, mask=live, other=0.0, cache_modifier=".cg")
        for s in range(1, parts):
            y += tl.load(part_ptr + s * A.to(tl.int64) * H + a * H + h, mask=live, other=0.0, cache_modifier=".cg")
        total += tl.where(routed, y.to(ACT).to(tl.float32) * tl.load(w_ptr + a), 0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + h, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_small_kernel(
    x_ptr, x4_ptr, ids_ptr, wq_ptr, ws_ptr, gs_ptr, part_ptr, w_ptr, out_ptr, cnt_ptr,
    A, E, N, K, TOPK, k_per_split, part_stride,
    A_PAD: tl.constexpr, BY_ASSIGNMENT: tl.constexpr, UP: tl.constexpr, X_PARTS: tl.constexpr,
    RELU2_OUT: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, LUT: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, GEMV: tl.constexpr, KB: tl.constexpr, AHEAD: tl.constexpr = 1,
    COMBINE: tl.constexpr = False, TOPK_C: tl.constexpr = 1, TRIGGER: tl.constexpr = False,
    WAIT: tl.constexpr = False, WAIT_FIRST: tl.constexpr = False,
):
    """One projection for one expert, one N slice and one K split (grid: slots, N / BLOCK_N,
    splits); rows are stored by assignment index (no sort): fp32 partial sums
    part[split, assignment, n], or with RELU2_OUT (one split) the finished activation
    relu^2(round(acc)) in ACT. UP: rows are the tokens' hidden states x[assignment // TOPK].
    Not UP: rows are the up projection's output at the same assignment: its ACT activation
    (X_PARTS = 0) or relu^2 of its X_PARTS partials (as `tiles.accumulate` reads them).
    GEMV: the expert's rows BLOCK_M at a time on the CUDA cores (`tiles.gemv_accumulate`;
    wq_ptr is then the packed bytes' int64 view, x4_ptr the 16-bit activations' one; KB = K / 16
    at compile time, the slice's blocks addressed from its first row; AHEAD K tiles in flight);
    else on the matrix units (`tiles.accumulate`; wq_ptr the int32 view; KB and AHEAD unused).
    COMBINE (down, TOPK_C = TOPK): after its stores the program counts itself in at the counter of
    each (token, N slice) it wrote; the last of the programs a token's slice waits for (its routed
    assignments times the splits) applies the routing weights to that slice (`_combine_tile`,
    w_ptr the weights, out_ptr [T, N]) and puts the counter back to 0 for the next launch.
    TRIGGER (up): the launch after it may start at once (`gdc_launch_dependents`). WAIT (down,
    GEMV, launched as a programmatic dependent of the up launch): a program reads the routed ids
    (written before the up launch began) and requests its first weight tiles, then waits for the
    up launch to finish before it reads the activations or stores anything (`gemv_accumulate`).
    WAIT_FIRST (up, launched as a programmatic dependent of the launch before it, the router): a
    program waits for that launch to complete before anything else, its trigger included, so that a
    down launch (which reads the routed ids before its own wait) starts only once the ids are
    written."""
    tl.static_assert(GEMV or not WAIT, "WAIT: the CUDA-core tiles only")
    tl.static_assert(UP or not WAIT_FIRST, "WAIT_FIRST: the up launch only")
    if WAIT_FIRST:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    slot = tl.program_id(0)
    pid_s = tl.program_id(2)
    e, ids, serves = _slot_expert(ids_ptr, A, E, slot, A_PAD, BY_ASSIGNMENT)
    count = tl.sum((ids == e).to(tl.int32), axis=0)
    if serves & (count > 0):
        n64, n_ok, wq, ws, gs = _expert_slice(wq_ptr, ws_ptr, gs_ptr, e, N, K, BLOCK_N)
        k_start = pid_s * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for r0 in range(0, count, BLOCK_M):
            assignment, m_ok = _expert_rows(ids, e, r0, BLOCK_M, A_PAD)
            a64 = assignment.to(tl.int64)
            if UP:
                x_row = (a64 // TOPK) * K
            else:
                x_row = a64 * K
            if GEMV:
                first = e.to(tl.int64) * N * KB + (tl.program_id(1) * BLOCK_N).to(tl.int64) * KB
                acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
                acc3 = gemv_accumulate(acc3, x_ptr, x4_ptr, x_row[:, None], m_ok, wq_ptr + first, ws_ptr + first, gs,
                                        tl.arange(0, BLOCK_N).to(tl.int64), n_ok, K, k_start, k_end, BLOCK_N, BLOCK_K,
                                        LUT, EVEN_N, EVEN_K, X_PARTS, part_stride, ACT, KB=KB, AHEAD=AHEAD,
                                        WAIT=WAIT)
                acc = tl.trans(tl.sum(acc3, axis=2) * 64.0)  # [BLOCK_N, BLOCK_M]; 64: E2M1 * 2^-6 values
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc = accumulate(acc, x_ptr, x_row, m_ok, wq, ws, gs, n64, n_ok, K, k_start, k_end,
                                  BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K, X_PARTS, part_stride, ACT)
            ok = n_ok[:, None] & m_ok[None, :]
            if RELU2_OUT:
                tl.store(part_ptr + a64[None, :] * N + n64[:, None], relu2(acc, ACT), mask=ok)
            else:
                tl.store(part_ptr + pid_s.to(tl.int64) * A * N + a64[None, :] * N + n64[:, None], acc, mask=ok)
        if COMBINE:
            tl.debug_barrier()  # this program's partial stores come before its arrivals
            a_idx = tl.arange(0, A_PAD)
            mine = ids == e
            rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
            routed = (ids >= 0) & (ids < E)
            for r in range(0, count):
                t = tl.sum(tl.where(mine & (rank == r), a_idx, 0), axis=0) // TOPK_C
                waits = tl.sum((routed & (a_idx // TOPK_C == t)).to(tl.int32), axis=0) * tl.num_programs(2)
                tile = t * tl.num_programs(1) + tl.program_id(1)
                arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == waits - 1:
                    _combine_tile(part_ptr, ids_ptr, w_ptr, out_ptr, t, n64, n_ok, A, E, N, tl.num_programs(2), TOPK_C,
                                  ACT)
                    tl.store(cnt_ptr + tile, 0)
    if COMBINE:
        if (slot == 0) & (pid_s == 0):  # tokens no expert is routed for: zeros, as the separate launch writes
            if WAIT:
                gdc_wait()  # a program that served no expert has not waited yet
            a_idx = tl.arange(0, A_PAD)
            routed = (ids >= 0) & (ids < E)
            h = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            for t in range(0, A // TOPK_C):
                if tl.sum((routed & (a_idx // TOPK_C == t)).to(tl.int32), axis=0) == 0:
                    tl.store(out_ptr + t * N + h, tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=h < N)


@triton.jit
def _moe_combine_kernel(part_ptr, ids_ptr, w_ptr, out_ptr, A, E, H, PARTS: tl.constexpr,
                        TOPK: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """`_combine_tile` over program (t, h-block)'s slice: the routing weights applied in a launch of
    their own (`_moe_small` with cfg "combine": False)."""
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _combine_tile(part_ptr, ids_ptr, w_ptr, out_ptr, tl.program_id(0), h, h < H, A, E, H, PARTS, TOPK, ACT)


def _check_inputs(hidden, top_k_index, top_k_weights, up, down):
    check_weight(up, _WHAT + " up_proj", batch_dims=1)
    check_weight(down, _WHAT + " down_proj", batch_dims=1)
    e, i, h = up.shape
    if tuple(down.shape) != (e, h, i):
        raise FormatError(f"{_WHAT}: down_proj shape {down.shape} should be {(e, h, i)} for up_proj {up.shape}")
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in ACT_DTYPES or hidden.dim() != 2 or hidden.shape[1] != h:
        raise FormatError(f"{_WHAT}: hidden_states must be a bf16/fp16/fp32 [T, {h}] tensor")
    t = hidden.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_index.dtype not in (torch.int32, torch.int64):
        raise FormatError(f"{_WHAT}: top_k_index must be an integer [T={t}, k] tensor, got {tuple(top_k_index.shape)}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape) or not top_k_weights.is_floating_point():
        raise FormatError(f"{_WHAT}: top_k_weights must be a float tensor shaped like top_k_index")
    return e, i, h


def experts_reference(hidden, top_k_index, top_k_weights, up_w, down_w):
    """transformers' NemotronHExperts.forward on dense weights [E, I, H] / [E, H, I], restated:
    per expert, its tokens through up, relu^2, down, times the routing weight, added in the
    routing weights' dtype (fp32) in expert order; cast back to the activation dtype."""
    out = torch.zeros_like(hidden, dtype=top_k_weights.dtype)
    for expert in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == expert)
        h = torch.nn.functional.linear(hidden[token], up_w[expert])
        h = torch.square(torch.relu(h))
        y = torch.nn.functional.linear(h, down_w[expert]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
# The launch table ("moe"), by entry:
#   DEQUANT     {"lut"}: the dequantization's inline PTX on a GPU (as in the "w4a16" table);
#   MOE_GEMV    the CUDA-core tiles up to max_assignments assignments: BLOCK_M of an expert's rows
#               per program, BLOCK_N output features, BLOCK_K of K per step, warps, an
#               optional register cap (maxnreg), their split-K (as SMALL's), and "pdl": the
#               down launch as a programmatic dependent of the up launch where `backend.pdl`
#               allows (absent: False), and "pdl_up": the up launch as a programmatic dependent of
#               the launch before it (the router), waiting for it first (absent: False);
#   SMALL       the in-kernel-routing path up to max_assignments; K split until about
#               programs_per_sm programs per multiprocessor, at most max_parts ways (on the
#               matrix units; the CUDA-core tiles split by MOE_GEMV's own entries);
#   MOE_MMA     the register-fed matrix units up to max_per_expert assignments per expert on
#               average: weight-row tiles of 16 per warp (rows), warps, L2 prefetch distance;
#   MOE_DECODE  the wgmma tiles' launch shape up to 24 rows per expert (maxnreg: a register cap).
# Each entry's "chosen_by" in the tuning file names the sweep that picked it.


def _table(tables: Mapping | None, device: torch.device | None) -> Mapping:
    return launch.table("moe", device) if tables is None else tables


def moe_mma_config(rows: int | None = None, num_warps: int | None = None, prefetch: int | None = None, *,
                   tables: Mapping | None = None) -> dict:
    """The register-fed matrix units' launch shape; arguments left None take MOE_MMA's entries."""
    mma = _table(tables, None)["MOE_MMA"]
    r = rows or mma["rows"]
    nw = num_warps or mma["num_warps"]
    return dict(mma=True, ROWS=r, num_warps=nw, BLOCK_M=8, BLOCK_N=16 * r * nw, BLOCK_K=128,
                PREFETCH=mma["prefetch"] if prefetch is None else prefetch)


def moe_config(assignments: int, n_experts: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
               tables: Mapping | None = None) -> dict:
    """Decode sizes: the CUDA-core tiles (MOE_GEMV) up to their assignment count; then, for 16-bit
    activations on a GPU, the register-fed matrix units on the sorted path (MOE_MMA) up to their
    rows per expert; else BLOCK_M = 16 on the matrix units, BLOCK_M following the mean number of
    rows per expert."""
    t = _table(tables, device)
    gemv = t["MOE_GEMV"]
    if assignments <= gemv["max_assignments"]:
        cfg = dict(gemv=True, **{k: v for k, v in gemv.items() if k != "max_assignments"})
        if device.type != "cuda":  # the interpreter: fewer, larger programs; two rows each
            cfg.update(BLOCK_M=2, BLOCK_N=16, BLOCK_K=64)
        return cfg
    return beyond_gemv_config(assignments, n_experts, device, dtype, t)


def beyond_gemv_config(assignments: int, n_experts: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16, tables: Mapping | None = None) -> dict:
    """moe_config without the CUDA-core tiles: the register-fed matrix units (MOE_MMA) for 16-bit
    activations on a GPU up to their assignments per expert, else the wgmma tiles."""
    t = _table(tables, device)
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and assignments <= t["MOE_MMA"]["max_per_expert"] * n_experts):
        return moe_mma_config(tables=t)
    return matrix_unit_config(assignments, n_experts, device, t)


def matrix_unit_config(assignments: int, n_experts: int, device: torch.device,
                       tables: Mapping | None = None) -> dict:
    """The wgmma tiles' launch shape at any size (moe_config without the CUDA-core tiles)."""
    per_expert = assignments / max(n_experts, 1)
    if per_expert <= 24:
        cfg = dict(BLOCK_M=16, **_table(tables, device)["MOE_DECODE"])
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if device.type != "cuda":
        cfg.update(BLOCK_N=32, BLOCK_K=64)
    return cfg


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                up_proj: nvfp4.NVFP4Tensor, down_proj: nvfp4.NVFP4Tensor, *, backend: str = "triton",
                cfg: dict | None = None, tables: Mapping | None = None) -> torch.Tensor:
    """Nemotron-H routed experts with NVFP4 weights: [T, H] -> [T, H] in hidden_states' dtype.

    top_k_index: expert ids in [0, E) (as transformers requires; other ids are never used to
    address memory, and the output of their tokens is then unspecified).
    backend: "triton" (two launches up to SMALL["max_assignments"] assignments, else the sort
    and two grouped launches) or "torch" (`experts_reference` on `up_proj.dequantize()` /
    `down_proj.dequantize()` in the activation dtype).
    cfg: a `moe_config(...)` dict to force a launch shape; its optional "small" key forces the
    path, "combine": False gives the small path's routing weights a launch of their own.
    tables: the launch table (default: the device's, `launch.table("moe", device)`).
    """
    n_exp, inter, hid = _check_inputs(hidden_states, top_k_index, top_k_weights, up_proj, down_proj)
    check_backend(backend, _moe_up_kernel, hidden_states, top_k_index, top_k_weights, up_proj.packed.view(torch.int32),
                  down_proj.packed.view(torch.int32), what=_WHAT)
    dtype = hidden_states.dtype
    if backend == "torch":
        return experts_reference(hidden_states, top_k_index, top_k_weights,
                                 up_proj.dequantize(dtype), down_proj.dequantize(dtype))
    t, top_k = top_k_index.shape
    a = t * top_k
    x = hidden_states.contiguous()
    table = _table(tables, x.device)
    cfg = dict(cfg or moe_config(a, n_exp, x.device, dtype, table))
    # The in-kernel-routing path by default up to its size (the register-fed units run sorted only).
    small = cfg.pop("small", cfg.get("gemv", False) or (a <= table["SMALL"]["max_assignments"] and not cfg.get("mma")))
    lut = cfg.pop("lut", lut_tile(cfg)) and use_lut(dtype, _moe_up_kernel, table["DEQUANT"]["lut"])
    if a == 0:
        return torch.zeros_like(x)
    if not small and cfg.pop("gemv", False):
        raise ValueError(f"{_WHAT}: the CUDA-core tiles (gemv) run on the in-kernel-routing path only (small)")
    if cfg.get("mma") and (small or dtype == torch.float32):
        raise ValueError(f"{_WHAT}: the register-fed matrix units run on the sorted path only, for bf16/fp16 "
                         f"activations on a GPU (got {dtype} on {x.device}, small={small})")
    combine = cfg.pop("combine", True)
    weights = top_k_weights.reshape(-1).to(torch.float32).contiguous()
    if small:
        return _moe_small(x, top_k_index, weights, up_proj, down_proj, cfg, lut, table, combine)
    return _moe_sorted(x, top_k_index, weights, up_proj, down_proj, cfg, lut, table)


def moe_experts_and_shared(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           up_proj: nvfp4.NVFP4Tensor, down_proj: nvfp4.NVFP4Tensor, shared_up,
                           shared_down) -> tuple[torch.Tensor, torch.Tensor]:
    """(`moe_experts(...)` on the Triton backend, the shared expert down(relu^2(up(x))) by
    `shared_linear`: its weights in the checkpoint layout (`nvfp4.NVFP4Tensor`) or packed
    (`packed_gemm.PackedNVFP4`)) for Nemotron-H's MoE block: the launches of the two computed one
    after the other, so each output is theirs bit for bit. On a GPU the shared expert's launches
    go to a second stream, which waits for the caller's work so far and which the caller's stream
    waits for before it goes on: its small GEMVs run beside the routed experts' instead of after
    them (in a CUDA graph, as a branch of the graph)."""
    return _beside_shared(hidden_states, shared_up, shared_down,
                          lambda: moe_experts(hidden_states, top_k_index, top_k_weights, up_proj, down_proj))


def routed_experts_and_shared(hidden_states: torch.Tensor, route_x: torch.Tensor, router_weight: torch.Tensor,
                              router_bias: torch.Tensor, top_k: int, up_proj: nvfp4.NVFP4Tensor,
                              down_proj: nvfp4.NVFP4Tensor, shared_up, shared_down, *, norm: bool = True,
                              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_experts_and_shared` with the router in the same call: `router.route(route_x,
    router_weight, router_bias, top_k, norm=norm, scale=scale)` picks the experts and their
    weights (route_x: the router's fp32 rows of hidden_states). The shared expert needs no
    routing, so on a GPU its launches go to the second stream before the router's launch and run
    beside it too, not only beside the routed experts. The same launches on the same values as
    the router followed by `moe_experts_and_shared`, so the same outputs bit for bit."""
    from .router import route

    def routed() -> torch.Tensor:
        _, weights, chosen = route(route_x, router_weight, router_bias, top_k, norm=norm, scale=scale)
        return moe_experts(hidden_states, chosen, weights, up_proj, down_proj)

    return _beside_shared(hidden_states, shared_up, shared_down, routed)


_SIDE_STREAMS: dict = {}  # device index -> the stream the shared expert runs on


def shared_linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T for one of a shared expert's W4A16 weights on the Triton backend: `w4a16_matmul` for
    an `nvfp4.NVFP4Tensor` (the checkpoint layout), `packed_linear.packed_linear` for a
    `packed_gemm.PackedNVFP4`."""
    from .packed_gemm import PackedNVFP4
    from .packed_linear import packed_linear
    from .w4a16_gemm import w4a16_matmul

    if isinstance(w, PackedNVFP4):
        return packed_linear(x, w, backend="triton")
    return w4a16_matmul(x, w, backend="triton")


def _beside_shared(hidden_states: torch.Tensor, shared_up, shared_down, main_work) -> tuple[torch.Tensor, torch.Tensor]:
    """(main_work(), the shared expert down(relu^2(up(hidden_states)))): on a GPU the shared
    expert's launches on the device's second stream, queued before main_work's on the caller's
    stream (module docstring of `moe_experts_and_shared`); elsewhere one after the other."""
    def shared() -> torch.Tensor:
        h = shared_linear(hidden_states, shared_up)
        return shared_linear(torch.square(torch.relu(h)), shared_down)

    device = hidden_states.device
    if device.type != "cuda":
        return main_work(), shared()
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    main = torch.cuda.current_stream(index)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out_shared = shared()
    out_main = main_work()
    main.wait_stream(side)
    # out_shared's memory returns to the side stream's pool when the caller drops it; the side
    # stream is this function's alone and waits for the caller's stream before its next use, so
    # no later write there can overtake the caller's reads (no record_stream, which a CUDA graph
    # capture would have to track).
    return out_main, out_shared


def _moe_small(x, top_k_index, weights, up, down, cfg, lut, tables, combine=True):
    """Two launches, no host-side routing: up (fp32 split-K partials per assignment), down
    (reading relu^2 of the up partials; fp32 partials; the routing weights and the top-k sum
    applied by the last program of each token's slice). combine=False: those in a third launch.
    cfg["gemv"]: the projections on the CUDA cores (`gemv_accumulate`; split-K by cfg's
    programs_per_sm and max_parts, as MOE_GEMV gives them), else the matrix units (split-K by
    SMALL's)."""
    t, top_k = top_k_index.shape
    n_exp, inter, hid = up.shape
    a = t * top_k
    dtype, device = x.dtype, x.device
    ids = top_k_index.reshape(-1).contiguous()
    by_assignment = a < n_exp
    slots = a if by_assignment else n_exp
    gemv = cfg.pop("gemv", False)
    # The down launch as a programmatic dependent of the up launch (CUDA-core tiles on Hopper on)
    pdl = cfg.pop("pdl", False) and gemv and backend.pdl(device, _moe_small_kernel)
    # The up launch as a programmatic dependent of the launch before it (the router), waiting first
    pdl_up = cfg.pop("pdl_up", False) and gemv and backend.pdl(device, _moe_small_kernel)
    if gemv:
        lut = tables["DEQUANT"]["lut"] and not interpreted(_moe_small_kernel)  # the block-dot PTX takes any dtype
        # the tiles' own split-K (MOE_GEMV), SMALL's for a cfg given without one
        split = {k: cfg.pop(k, tables["SMALL"][k]) for k in ("programs_per_sm", "max_parts")}
        if device.type == "cuda":
            cfg_up, cfg_dn = gemv_k_tile(hid, cfg), gemv_k_tile(inter, cfg)
        else:
            cfg_up = cfg_dn = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], 64))
        view = torch.int64
    else:
        split = tables["SMALL"]
        cfg_up = cfg_dn = cfg
        view = torch.int32
    common = dict(A_PAD=max(next_power_of_2(a), 2), BY_ASSIGNMENT=by_assignment, ACT=_TL_DTYPES[dtype],
                  IEEE=exact_dot(dtype, _moe_small_kernel), LUT=lut, GEMV=gemv, **launch_options())
    bn = cfg["BLOCK_N"]
    s_up, kps_up = backend.split_k(slots * cdiv(inter, bn), hid, cfg_up["BLOCK_K"], device, split)
    # One split: the up kernel finishes the activation itself; more: fp32 partials, finished by
    # the down kernel as it reads them.
    if s_up == 1:
        part_up = torch.empty((a, inter), dtype=dtype, device=device)
    else:
        part_up = torch.empty((s_up, a, inter), dtype=torch.float32, device=device)
    x, x4 = int64_activations(x) if gemv else (x, x)
    launch_cached(_moe_small_kernel, (slots, cdiv(inter, bn), s_up),
        x, x4, ids, up.packed.view(view), up.block_scale.view(torch.uint8),
        up.global_scale, part_up, weights, part_up, ids, a, n_exp, inter, hid, top_k, kps_up, 0, UP=True, X_PARTS=0,
        RELU2_OUT=s_up == 1, TRIGGER=pdl, WAIT_FIRST=pdl_up, **({"launch_pdl": True} if pdl_up else {}),
        EVEN_N=inter % bn == 0, EVEN_K=hid % cfg_up["BLOCK_K"] == 0, KB=hid // 16 if gemv else 0, **cfg_up, **common)
    s_dn, kps_dn = backend.split_k(slots * cdiv(hid, bn), inter, cfg_dn["BLOCK_K"], device, split)
    part_dn = torch.empty((s_dn, a, hid), dtype=torch.float32, device=device)
    part_up, part_up4 = int64_activations(part_up) if gemv else (part_up, part_up)
    out = torch.empty((t, hid), dtype=dtype, device=device)
    counters = split_counters(device, t * cdiv(hid, bn)) if combine else ids
    launch_cached(_moe_small_kernel, (slots, cdiv(hid, bn), s_dn),
        part_up, part_up4, ids, down.packed.view(view),
        down.block_scale.view(torch.uint8), down.global_scale, part_dn, weights, out, counters, a, n_exp, hid, inter,
        top_k, kps_dn, a * inter, UP=False, X_PARTS=0 if s_up == 1 else s_up, RELU2_OUT=False, EVEN_N=hid % bn == 0,
        EVEN_K=inter % cfg_dn["BLOCK_K"] == 0, KB=inter // 16 if gemv else 0, COMBINE=combine, TOPK_C=top_k,
        WAIT=pdl, **({"launch_pdl": True} if pdl else {}), **cfg_dn, **common)
    if combine:
        return out
    block = min(1024, next_power_of_2(hid))
    launch_cached(_moe_combine_kernel, (t, cdiv(hid, block)),
        part_dn, ids, weights, out, a, n_exp, hid, PARTS=s_dn, TOPK=top_k, ACT=_TL_DTYPES[dtype], BLOCK=block,
        **launch_options())
    return out


def _moe_sorted(x, top_k_index, weights, up, down, cfg, lut, tables):
    """Two grouped launches over the assignments sorted by expert (any number of tokens)."""
    t, top_k = top_k_index.shape
    n_exp, inter, hid = up.shape
    a = t * top_k
    dtype, device = x.dtype, x.device
    # Sort the assignments (token * k + slot) by expert; offsets[e]..offsets[e+1] is expert e's run.
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(n_exp + 1, device=device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # int64, read as is by the kernels
    ieee = exact_dot(dtype, _moe_up_kernel)
    inter_act = torch.empty((a, inter), dtype=dtype, device=device)
    if cfg.get("mma"):
        return _moe_sorted_mma(x, top_k, weights, up, down, cfg, order, offsets, inter_act)
    launch_cached(_moe_up_kernel, (n_exp, cdiv(inter, cfg["BLOCK_N"])),
        x, order, offsets, up.packed.view(torch.int32), up.block_scale.view(torch.uint8), up.global_scale,
        inter_act, hid, inter, top_k, IEEE=ieee, LUT=lut,
        EVEN_N=inter % cfg["BLOCK_N"] == 0, EVEN_K=hid % cfg["BLOCK_K"] == 0, **cfg, **launch_options())
    per_slot = torch.empty((a, hid), dtype=torch.float32, device=device)
    launch_cached(_moe_down_kernel, (n_exp, cdiv(hid, cfg["BLOCK_N"])),
        inter_act, order, offsets, weights, down.packed.view(torch.int32), down.block_scale.view(torch.uint8),
        down.global_scale, per_slot, hid, inter, IEEE=ieee, LUT=lut,
        EVEN_N=hid % cfg["BLOCK_N"] == 0, EVEN_K=inter % cfg["BLOCK_K"] == 0, ACT_DTYPE=_TL_DTYPES[dtype],
        **cfg, **launch_options())
    return per_slot.view(t, top_k, hid).sum(dim=1).to(dtype)


def _moe_sorted_mma(x, top_k, weights, up, down, cfg, order, offsets, inter_act):
    """`_moe_sorted`'s two launches on the register-fed matrix units (16-bit activations)."""
    n_exp, inter, hid = up.shape
    a = order.numel()
    t = a // top_k
    x, x4 = int64_activations(x)
    opts = dict(ROWS=cfg["ROWS"], WARPS=cfg["num_warps"], F16=x.dtype == torch.float16, PREFETCH=cfg["PREFETCH"],
                EMULATE=interpreted(_moe_up_mma_kernel), num_warps=cfg["num_warps"], num_stages=1,
                **launch_options())
    up_scales, up_pairs = mma_scales(up)
    launch_cached(_moe_up_mma_kernel, (n_exp, cdiv(inter, cfg["BLOCK_N"])),
        x4, order, offsets, up.packed.view(torch.int64), up_scales, up.global_scale, inter_act, hid, inter, top_k,
        x.stride(0) // 4, EVEN_K=hid % 128 == 0, SCALE_PAIRS=up_pairs,
        VEC=mma_vec(up.packed, x4, x.stride(0) // 4, hid, _moe_up_mma_kernel), **opts)
    per_slot = torch.empty((a, hid), dtype=torch.float32, device=x.device)
    down_scales, down_pairs = mma_scales(down)
    launch_cached(_moe_down_mma_kernel, (n_exp, cdiv(hid, cfg["BLOCK_N"])),
        inter_act.view(torch.int64), order, offsets, weights, down.packed.view(torch.int64), down_scales,
        down.global_scale, per_slot, hid, inter, inter // 4, EVEN_K=inter % 128 == 0, SCALE_PAIRS=down_pairs,
        VEC=mma_vec(down.packed, inter_act, inter // 4, inter, _moe_down_mma_kernel), ACT_DTYPE=_TL_DTYPES[x.dtype],
        **opts)
    return per_slot.view(t, top_k, hid).sum(dim=1).to(x.dtype)
