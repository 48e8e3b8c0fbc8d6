"""Grouped W4A16 MoE for Nemotron-H's non-gated experts: out = sum_k w_k * down_e(relu(up_e x)^2).

Reference: transformers' `NemotronHExperts.forward` run on dequantized weights (backend="torch"
is that computation, `experts_reference`): up_proj [E, I, H] and down_proj [E, H, I] as 3-D NVFP4
stacks (one global scale per expert), router output as the model produces it (top-k expert ids
[T, k] and fp32 weights [T, k]).

Up to MOE_GEMV["max_assignments"] (token, slot) assignments (4 tokens at top-6, on the CUDA
cores), and up to SMALL["max_assignments"] (8 tokens) where the register-fed matrix units below
do not run (fp32 activations, Triton's interpreter), `_moe_small`, three launches and no
host-side routing:
- `_moe_small_kernel` for up_proj, grid (slots, I / BLOCK_N, K splits): each program reads the
  routed expert ids, finds its expert (with fewer assignments than experts, a program per
  assignment that serves its expert if no earlier assignment has it; else a program per
  expert) and compacts that expert's assignments in order; rows are stored by assignment
  index. One split: relu^2 of the output rounded to the activation dtype (as the reference's
  linear and relu2); more: fp32 partial sums. The projection runs on the CUDA cores
  (`w4a16_gemm._gemv_accumulate`: fp32 weights, the block scale applied once per block, no
  shared memory; BLOCK_M of the expert's rows at a time) or on the matrix units (the GEMM's
  `_accumulate`, 16 rows at a time).
- the same kernel for down_proj, reading the up output (summing its partials in a fixed order
  and finishing relu^2 on the fly); fp32 partials.
- `_moe_combine_kernel`: per token, each slot's down output rounded to the activation dtype
  times its fp32 routing weight, summed over the k slots in fp32 (fixed order), cast.
Beyond, `_moe_sorted`, one launch per projection:
- routing: the T*k (token, slot) assignments are sorted by expert (`torch.sort`, stable) and
  `offsets[e]` marks where expert e's run starts; no padding, no per-expert loop on the host.
- `_moe_up_kernel`, grid (E, I / BLOCK_N): a program takes one expert and one slice of its
  output features and walks that expert's run of assignments BLOCK_M rows at a time, gathering
  the token rows of `hidden`; experts with no tokens return at once. The dequantized weight tile
  is the GEMM's (`w4a16_gemm._accumulate`). Epilogue: round to the activation dtype (as the
  reference's linear output), relu, square, round again (as the reference's relu2), store the
  intermediate in sorted order.
- `_moe_down_kernel`, grid (E, H / BLOCK_N): the same walk over the intermediate; epilogue: round
  to the activation dtype, times the fp32 routing weight, stored per assignment in fp32.
- with up to MOE_MMA["max_per_expert"] assignments per expert on average and 16-bit activations
  on a GPU, `_moe_up_mma_kernel` / `_moe_down_mma_kernel` instead: the same walk 8 assignments
  at a time on the register-fed matrix units (`w4a16_gemm._mma_accumulate`: the weight decoded
  in registers into mma.sync's operand, no shared memory), the same epilogues.
- the k slots of each token are summed in fp32 (fixed order) and cast to the activation dtype.

Measured on an H200 against transformers' grouped_mm experts in bf16 (CUDA graphs, 128 experts,
top-6, H=2688, I=1856; benchmarks/results/kernels-h200.json, `bench_kernels.py`, launch shapes
swept in benchmarks/results/kernels-sweeps-mma-wide-h200.json): 5.44x at 1 token (23.2 us on the
CUDA cores; the sorted path on the register-fed matrix units took 63.2), 2.81x at 8 (134.1 us, the
register-fed units; 197.6 on wgmma), 2.97x at 64 (333.3 us, the register-fed units; 539.5 on
wgmma), 1.53x at 256 (wgmma), 0.66x at 2048. The CUDA-core tiles win up to 4 tokens and the
register-fed units from 8 to 128 tokens (about 6 assignments per expert); they lose to wgmma at
256 (sweep_moe_gemv, sweep_moe_mma). On the CUDA cores the experts' weights stream at about 1.5
TB/s at 8 tokens (about 41 experts of 5.6 MB); the wgmma tiles are instruction bound (about 6.5
instructions per weight, `w4a16_gemm`).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

from .backend import cdiv, check_backend, interpreted, launch_options, next_power_of_2
from .w4a16_gemm import (_ACT_DTYPES, DEQUANT, _accumulate, _gemv_accumulate, _gemv_k_tile, _relu2, _sm_count,
                         check_weight, int64_activations, lut_tile, _mma_accumulate, _mma_fragments, _mma_lanes,
                         _mma_rows, MMA_UNSCALE, mma_scales, mma_vec, time_if_right, use_lut, with_maxnreg)

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
            acc = _accumulate(acc, x_ptr, token * H, m_ok, wq, ws, gs, n64, n_ok, H, 0, H,
                              BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
            tl.store(inter_ptr + pos[None, :].to(tl.int64) * I + n64[:, None],
                     _relu2(acc, inter_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, order_ptr, offsets_ptr, weight_ptr, wq_ptr, ws_ptr, gs_ptr, out_ptr,
    H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
):
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
            acc = _accumulate(acc, inter_ptr, pos.to(tl.int64) * I, m_ok, wq, ws, gs, n64, n_ok,
                              I, 0, I, BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
            route_w = tl.load(weight_ptr + assignment, mask=m_ok, other=0.0)
            y = acc.to(ACT_DTYPE).to(tl.float32) * route_w[None, :]
            tl.store(out_ptr + assignment[None, :].to(tl.int64) * H + n64[:, None], y,
                     mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _mma_columns(v0, v1, ROWS: tl.constexpr):
    """Per-lane values of the lane's D columns 2c and 2c + 1 (`w4a16_gemm._mma_fragments` with one
    activation tile) broadcast to the fragments' shape."""
    v = tl.join(v0, v1)[:, :, None]
    if ROWS == 2:
        v = v[:, :, :, None]
    return v


@triton.jit
def _mma_expert(gs_ptr, e, N, K, ROWS: tl.constexpr, WARPS: tl.constexpr, EMULATE: tl.constexpr):
    """What `_moe_up_mma_kernel` / `_moe_down_mma_kernel` need of expert e's weight [N, K] (row
    e * N of the stack) in this program: lanes g and c, zero accumulators, the lane's first weight
    row, its rows' first blocks (`w4a16_gemm._mma_rows`), and the factor of the fp32 sums: the
    global scale times `w4a16_gemm.MMA_UNSCALE`."""
    g, c, warp, zero = _mma_lanes(WARPS, EMULATE)
    row = tl.program_id(1) * (16 * ROWS * WARPS) + warp * (16 * ROWS) + g
    return g, c, zero, row, _mma_rows(row, e * N, N, K), tl.load(gs_ptr + e) * MMA_UNSCALE


@triton.jit
def _moe_up_mma_kernel(
    x4_ptr, order_ptr, offsets_ptr, wb_ptr, ws_ptr, gs_ptr, inter_ptr,
    H, I, TOPK, stride_x4,
    ROWS: tl.constexpr, WARPS: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr,
    SCALE_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr, VEC: tl.constexpr = False,
):
    """`_moe_up_kernel` on the register-fed matrix units (`w4a16_gemm._mma_accumulate`): a program
    takes one expert and 16 * ROWS * WARPS of its output features, and walks the expert's run of
    assignments 8 at a time (a lane's B column: the token row of one assignment; past the run,
    the run's last, not stored). VEC: 16-byte loads (`w4a16_gemm.mma_vec`)."""
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        g, c, zero, row, wrows, gs = _mma_expert(gs_ptr, e, I, H, ROWS, WARPS, EMULATE)
        for m0 in range(start, end, 8):
            token = tl.load(order_ptr + tl.minimum(m0 + g, end - 1)) // TOPK
            xrow = token.to(tl.int64) * stride_x4
            acc = _mma_accumulate(zero, x4_ptr, xrow, xrow, wb_ptr, ws_ptr, wrows, c, 0, H, 1, ROWS, F16,
                                 EVEN_K, SCALE_PAIRS, PREFETCH, EMULATE, 1, 0, VEC)
            y, rows, pos = _mma_fragments(acc, row, m0 + 2 * c, 1, ROWS)
            tl.store(inter_ptr + pos.to(tl.int64) * I + rows, _relu2(y * gs, inter_ptr.dtype.element_ty),
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
    loads (`w4a16_gemm.mma_vec`)."""
    e = tl.program_id(0)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if end > start:
        g, c, zero, row, wrows, gs = _mma_expert(gs_ptr, e, H, I, ROWS, WARPS, EMULATE)
        for m0 in range(start, end, 8):
            xrow = tl.minimum(m0 + g, end - 1).to(tl.int64) * stride_x4
            acc = _mma_accumulate(zero, x4_ptr, xrow, xrow, wb_ptr, ws_ptr, wrows, c, 0, I, 1, ROWS, F16,
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
            y, rows, pos = _mma_fragments(acc, row, p0, 1, ROWS)
            ok = (pos < end) & (rows < H)
            dst = _mma_columns(a0.to(tl.int64) * H, a1.to(tl.int64) * H, ROWS)
            route_w = _mma_columns(r0, r1, ROWS)
            tl.store(out_ptr + dst + rows, (y * gs).to(ACT_DTYPE).to(tl.float32) * route_w, mask=ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# --------------------------------------------------------------------------------------------
# Decode sizes (up to SMALL_MAX assignments): routing inside the kernels, split-K, three launches
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
def _moe_small_kernel(
    x_ptr, x4_ptr, ids_ptr, wq_ptr, ws_ptr, gs_ptr, part_ptr,
    A, E, N, K, TOPK, k_per_split, part_stride,
    A_PAD: tl.constexpr, BY_ASSIGNMENT: tl.constexpr, UP: tl.constexpr, X_PARTS: tl.constexpr,
    RELU2_OUT: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, LUT: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, GEMV: tl.constexpr,
):
    """One projection for one expert, one N slice and one K split (grid: slots, N / BLOCK_N,
    splits); rows are stored by assignment index (no sort): fp32 partial sums
    part[split, assignment, n], or with RELU2_OUT (one split) the finished activation
    relu^2(round(acc)) in ACT. UP: rows are the tokens' hidden states x[assignment // TOPK].
    Not UP: rows are the up projection's output at the same assignment: its ACT activation
    (X_PARTS = 0) or relu^2 of its X_PARTS partials (`_load_x`).
    GEMV: the expert's rows BLOCK_M at a time on the CUDA cores (`w4a16_gemm._gemv_accumulate`;
    wq_ptr is then the packed bytes' int64 view, x4_ptr the 16-bit activations' one); else on the
    matrix units (`w4a16_gemm._accumulate`; wq_ptr the int32 view)."""
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
                wb = wq_ptr + e.to(tl.int64) * N * (K // 16)
                acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
                acc3 = _gemv_accumulate(acc3, x_ptr, x4_ptr, x_row[:, None], m_ok, wb, ws, gs, n64, n_ok, K, k_start,
                                        k_end, BLOCK_N, BLOCK_K, LUT, EVEN_N, EVEN_K, X_PARTS, part_stride, ACT)
                acc = tl.trans(tl.sum(acc3, axis=2) * 64.0)  # [BLOCK_N, BLOCK_M]; 64: E2M1 * 2^-6 values
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc = _accumulate(acc, x_ptr, x_row, m_ok, wq, ws, gs, n64, n_ok, K, k_start, k_end,
                                  BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K, X_PARTS, part_stride, ACT)
            ok = n_ok[:, None] & m_ok[None, :]
            if RELU2_OUT:
                tl.store(part_ptr + a64[None, :] * N + n64[:, None], _relu2(acc, ACT), mask=ok)
            else:
                tl.store(part_ptr + pid_s.to(tl.int64) * A * N + a64[None, :] * N + n64[:, None], acc, mask=ok)


@triton.jit
def _moe_combine_kernel(part_ptr, ids_ptr, w_ptr, out_ptr, A, E, H, PARTS: tl.constexpr,
                        TOPK: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum over slots j = 0 .. TOPK-1 (this order, fp32) of w[t, j] times the down
    projection of assignment t*TOPK + j (its PARTS partials summed in order, rounded to ACT as
    the linear's output); cast to out's dtype. An assignment whose expert id is outside [0, E)
    adds nothing."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        a = t.to(tl.int64) * TOPK + j
        y = tl.load(part_ptr + a * H + h, mask=ok, other=0.0)
        for s in tl.static_range(1, PARTS):
            y += tl.load(part_ptr + s * A.to(tl.int64) * H + a * H + h, mask=ok, other=0.0)
        e = tl.load(ids_ptr + a)
        routed = (e >= 0) & (e < E)
        total += tl.where(routed, y.to(ACT).to(tl.float32) * tl.load(w_ptr + a), 0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + h, total.to(out_ptr.dtype.element_ty), mask=ok)




def _check_inputs(hidden, top_k_index, top_k_weights, up, down):
    check_weight(up, _WHAT + " up_proj", batch_dims=1)
    check_weight(down, _WHAT + " down_proj", batch_dims=1)
    e, i, h = up.shape
    if tuple(down.shape) != (e, h, i):
        raise FormatError(f"{_WHAT}: down_proj shape {down.shape} should be {(e, h, i)} for up_proj {up.shape}")
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in _ACT_DTYPES or hidden.dim() != 2 or hidden.shape[1] != h:
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


# Launch shape for decode-sized runs (up to 24 rows per expert), picked on an H200 by `sweep`
# (scripts/bench_kernels.py --sweep-moe; benchmarks/results/kernels-sweeps-matrix-unit-h200.json). maxnreg 128: 4
# programs per multiprocessor instead of 3 (138-144 registers uncapped), a few spills.
MOE_DECODE = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "maxnreg": 128}

# Up to SMALL["max_assignments"] (tokens * top-k) the routing is done inside the kernels and K is
# split until there are about SMALL["programs_per_sm"] programs per multiprocessor (at most
# SMALL["max_parts"] splits): `_moe_small`. Beyond, the sort-based path (`_moe_sorted`). Picked on
# an H200 by `sweep_small` (scripts/bench_kernels.py --sweep-moe-small; Nano's experts, top-6;
# benchmarks/results/kernels-sweeps-matrix-unit-h200.json), on the matrix-unit tiles: faster
# than the sorted path at 1, 2, 4 and 8 tokens (42.1 / 65.1 / 115.6 / 194.8 us against
# 82.9 / 94.7 / 135.6 / 206.7), slower at 64 (570.7 against 541.4).
SMALL = {"max_assignments": 48, "programs_per_sm": 2, "max_parts": 4}


# Up to MOE_GEMV["max_assignments"] assignments the in-kernel-routing path runs its projections
# on the CUDA cores (`w4a16_gemm._gemv_accumulate`), BLOCK_M of an expert's rows at a time.
# Picked on an H200 by `sweep_gemv` (scripts/bench_kernels.py --sweep-moe-gemv; sweep_moe_gemv in
# benchmarks/results/kernels-sweeps-mma-wide-h200.json): one row, 4 output features and 512 of K
# per one-warp program; faster than the default beyond them (the register-fed matrix units,
# MOE_MMA) up to 4 tokens (78.7 against 98.4 us), slower from 8 (147.4 against 133.9; 291.5 against
# 196.9 at 16).
MOE_GEMV = {"max_assignments": 24, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 1, "num_stages": 1}


# Beyond the CUDA-core tiles, with up to MOE_MMA["max_per_expert"] assignments per expert on
# average and 16-bit activations on a GPU, the sorted path runs on the register-fed matrix units
# (`_moe_up_mma_kernel`, `_moe_down_mma_kernel`): weight-row tiles of 16 per warp (rows), warps
# per program and the L2 prefetch distance, as in the GEMM's MMA. Picked by pick_mma from
# sweep_moe_mma (benchmarks/results/kernels-sweeps-mma-wide-h200.json): faster than the wgmma tiles
# up to 128 tokens (421.1 against 558.6 us), slower at 256 (718.6 against 635.1).
MOE_MMA = {"max_per_expert": 6, "rows": 2, "num_warps": 4, "prefetch": 2}


def moe_mma_config(rows: int | None = None, num_warps: int | None = None, prefetch: int | None = None) -> dict:
    r = rows or MOE_MMA["rows"]
    nw = num_warps or MOE_MMA["num_warps"]
    return dict(mma=True, ROWS=r, num_warps=nw, BLOCK_M=8, BLOCK_N=16 * r * nw, BLOCK_K=128,
                PREFETCH=MOE_MMA["prefetch"] if prefetch is None else prefetch)


def moe_config(assignments: int, n_experts: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Decode sizes: the CUDA-core tiles (MOE_GEMV) up to their assignment count; then, for 16-bit
    activations on a GPU, the register-fed matrix units (MOE_MMA) up to their rows per expert;
    else BLOCK_M = 16 on the matrix units, BLOCK_M following the mean number of rows per expert."""
    if assignments <= MOE_GEMV["max_assignments"]:
        cfg = dict(gemv=True, **{k: v for k, v in MOE_GEMV.items() if k != "max_assignments"})
        if device.type != "cuda":  # the interpreter: fewer, larger programs; two rows each
            cfg.update(BLOCK_M=2, BLOCK_N=16, BLOCK_K=64)
        return cfg
    return beyond_gemv_config(assignments, n_experts, device, dtype)


def beyond_gemv_config(assignments: int, n_experts: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16) -> dict:
    """moe_config without the CUDA-core tiles: the register-fed matrix units (MOE_MMA) for 16-bit
    activations on a GPU up to their assignments per expert, else the wgmma tiles."""
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and assignments <= MOE_MMA["max_per_expert"] * n_experts):
        return moe_mma_config()
    return matrix_unit_config(assignments, n_experts, device)


def matrix_unit_config(assignments: int, n_experts: int, device: torch.device) -> dict:
    """The matrix-unit launch shape at any size (moe_config without the CUDA-core tiles)."""
    per_expert = assignments / max(n_experts, 1)
    if per_expert <= 24:
        cfg = dict(BLOCK_M=16, **MOE_DECODE)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if device.type != "cuda":
        cfg.update(BLOCK_N=32, BLOCK_K=64)
    return cfg


def _nano_experts(n_exp, hid, inter):
    """Random bf16 expert stacks of the given widths quantized on the GPU: (up, down)."""
    from .quantize import quantize

    up = quantize(torch.randn((n_exp, inter, hid), dtype=torch.bfloat16, device="cuda") * 0.02)
    down = quantize(torch.randn((n_exp, hid, inter), dtype=torch.bfloat16, device="cuda") * 0.02)
    return up, down


def _routed_tokens(t, n_exp, top_k, hid, up, down):
    """t random tokens routed top_k of n_exp, and the torch backend's output as the fp32
    reference a swept launch shape must match: (hidden, ids, weights, reference)."""
    h = torch.randn((t, hid), dtype=torch.bfloat16, device="cuda")
    ids = torch.rand((t, n_exp), device="cuda").topk(top_k, dim=-1).indices
    w = torch.rand((t, top_k), device="cuda")
    return h, ids, w, moe_experts(h, ids, w, up, down, backend="torch").float()


def sweep(tokens=(1, 8, 64), n_exp=128, top_k=6, hid=2688, inter=1856,
          shapes=((64, 128, 4), (32, 128, 4), (32, 256, 4), (64, 256, 4)), maxnreg=(None,)):
    """CUDA-graph times of decode launch shapes (BLOCK_N, BLOCK_K, warps) x register cap on
    Nano's experts, each checked first."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    for t in tokens:
        h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
        for (bn, bk, nw), mr in itertools.product(shapes, maxnreg):
            cfg = with_maxnreg(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3), mr)
            row = {"tokens": t, "maxnreg": mr, **cfg}
            row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=cfg), ref))
            out.append(row)
    return out


def sweep_small(tokens=(1, 2, 4, 8, 64), n_exp=128, top_k=6, hid=2688, inter=1856, programs_per_sm=(2, 4),
                max_parts=(4,)):
    """CUDA-graph times of the in-kernel-routing path (`_moe_small`) per split-K target and
    split cap, and of the sort-based path, on Nano's experts, each checked first."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    saved = dict(SMALL)
    try:
        for t in tokens:
            h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
            cfg = matrix_unit_config(t * top_k, n_exp, h.device)
            row = {"tokens": t, "path": "sorted"}
            row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=dict(cfg, small=False)), ref))
            out.append(row)
            for pps, parts in itertools.product(programs_per_sm, max_parts):
                SMALL.update(programs_per_sm=pps, max_parts=parts)
                row = {"tokens": t, "path": "small", "programs_per_sm": pps, "max_parts": parts}
                row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=dict(cfg, small=True)), ref))
                out.append(row)
    finally:
        SMALL.update(saved)
    return out


def sweep_gemv(tokens=(1, 2, 4, 8, 16, 32, 64), n_exp=128, top_k=6, hid=2688, inter=1856,
               tiles=((1, 4, 512, 1), (1, 8, 512, 1), (1, 4, 2048, 4), (1, 8, 2048, 4), (2, 8, 512, 1))):
    """CUDA-graph times of the CUDA-core tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps) on the
    in-kernel-routing path, and of the default beyond them (`beyond_gemv_config`: the register-fed
    or the wgmma matrix units) at the same token count, side by side, on Nano's experts; each
    checked first."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    for t in tokens:
        h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
        base = beyond_gemv_config(t * top_k, n_exp, h.device, h.dtype)
        row = {"tokens": t, "path": "matrix-unit"}
        row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=dict(base)), ref))
        out.append(row)
        for bm, bn, bk, nw in tiles:
            cfg = dict(gemv=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=1)
            row = {"tokens": t, "path": "gemv", "tile": [bm, bn, bk, nw]}
            row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=dict(cfg)), ref))
            out.append(row)
    return out


def sweep_mma(tokens=(32, 64, 128, 256), n_exp=128, top_k=6, hid=2688, inter=1856,
              launches=((1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 4, 2), (2, 2, 0), (2, 2, 4))):
    """CUDA-graph times of the sorted path on the register-fed matrix units for launch shapes
    (weight tiles per warp, warps, L2 prefetch distance), and of the sorted path on wgmma at the
    same token count, side by side, on Nano's experts; each checked first."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    for t in tokens:
        h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
        base = matrix_unit_config(t * top_k, n_exp, h.device)
        row = {"tokens": t, "path": "sorted"}
        row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=dict(base, small=False)), ref))
        out.append(row)
        for launch in launches:
            cfg = dict(moe_mma_config(*launch), small=False)
            row = {"tokens": t, "path": "sorted-mma", "launch": list(launch)}
            row.update(time_if_right(lambda: moe_experts(h, ids, w, up, down, cfg=dict(cfg)), ref))
            out.append(row)
    return out


def pick_mma(rows, n_exp=128, top_k=6) -> dict:
    """MOE_MMA: the launch shape with the smallest time summed over the token counts where the
    register-fed path is used, and max_per_expert: the mean assignments per expert at the
    largest token count up to which that shape beats the sorted wgmma path at every swept
    count (0 if not at the first)."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else float("inf")

    base = {r["tokens"]: ms(r) for r in rows if r["path"] == "sorted"}
    mma = [r for r in rows if r["path"] == "sorted-mma"]

    def reach(launch):
        times = {r["tokens"]: ms(r) for r in mma if tuple(r["launch"]) == launch}
        up_to = 0
        for t in sorted(base):
            if not times.get(t, float("inf")) < base[t]:
                break
            up_to = t
        return up_to

    launches = {tuple(r["launch"]) for r in mma}
    # The shape that wins furthest, then the fastest summed over the counts it is used for.
    up_to = max(reach(launch) for launch in launches)
    totals = {launch: sum(ms(r) for r in mma if tuple(r["launch"]) == launch and r["tokens"] <= up_to)
              for launch in launches if reach(launch) == up_to}
    rows_per_warp, warps, prefetch = min(totals, key=lambda launch: (totals[launch], launch))
    return {"max_per_expert": top_k * up_to / n_exp, "rows": rows_per_warp, "num_warps": warps,
            "prefetch": prefetch}


def pick_gemv(rows, top_k=6, decode_tokens=8) -> dict:
    """MOE_GEMV: the tile with the smallest summed time up to `decode_tokens` tokens, and
    max_assignments: top_k times the largest token count up to which it beats the matrix-unit
    default beyond the tiles at every swept count (0 if not at the first)."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else float("inf")

    totals = {}
    for r in rows:
        if r["path"] == "gemv" and r["tokens"] <= decode_tokens:
            totals[tuple(r["tile"])] = totals.get(tuple(r["tile"]), 0.0) + ms(r)
    tile = min(totals, key=totals.get)
    gemv = {r["tokens"]: ms(r) for r in rows if r["path"] == "gemv" and tuple(r["tile"]) == tile}
    base = {r["tokens"]: ms(r) for r in rows if r["path"] == "matrix-unit"}
    up_to = 0
    for t in sorted(base):
        if not gemv.get(t, float("inf")) < base[t]:
            break
        up_to = t
    bm, bn, bk, nw = tile
    return {"max_assignments": top_k * up_to, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw,
            "num_stages": 1}


def pick_small(rows, top_k=6) -> dict:
    """SMALL's split-K target and cap with the smallest summed time, and max_assignments: 512 if
    the path beats the sorted one at every swept token count, else top_k times the largest
    count up to which it beats it (0 if not at the first)."""
    totals = {}
    for r in rows:
        if r["path"] == "small":
            key = (r["programs_per_sm"], r["max_parts"])
            totals[key] = totals.get(key, 0.0) + (r["ms"] if r["ms"] is not None else float("inf"))
    pps, parts = min(totals, key=totals.get)
    best = {r["tokens"]: r["ms"] for r in rows if r["path"] == "small" and
            (r["programs_per_sm"], r["max_parts"]) == (pps, parts) and r["ms"] is not None}
    sorted_ms = {r["tokens"]: r["ms"] for r in rows if r["path"] == "sorted" and r["ms"] is not None}
    up_to = 0
    for t in sorted(sorted_ms):
        if not best.get(t, float("inf")) < sorted_ms[t]:
            break
        up_to = t
    max_a = 512 if up_to == max(sorted_ms) else top_k * up_to
    return {"max_assignments": max_a, "programs_per_sm": pps, "max_parts": parts}


def pick(rows) -> dict:
    """The MOE_DECODE entry with the smallest summed sweep time."""
    totals = {}
    for r in rows:
        key = (r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r.get("maxnreg"))
        totals[key] = totals.get(key, 0.0) + (r["ms"] if r["ms"] is not None else float("inf"))
    bn, bk, nw, mr = min(totals, key=totals.get)
    return with_maxnreg({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 3}, mr)


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                up_proj: nvfp4.NVFP4Tensor, down_proj: nvfp4.NVFP4Tensor, *, backend: str = "triton",
                cfg: dict | None = None) -> torch.Tensor:
    """Nemotron-H routed experts with NVFP4 weights: [T, H] -> [T, H] in hidden_states' dtype.

    top_k_index: expert ids in [0, E) (as transformers requires; other ids are never used to
    address memory, and the output of their tokens is then unspecified).
    backend: "triton" (three launches up to SMALL["max_assignments"] assignments, else the
    sort and two grouped launches) or "torch" (`experts_reference` on `up_proj.dequantize()` /
    `down_proj.dequantize()` in the activation dtype).
    cfg: a `moe_config(...)` dict to force a launch shape; its optional "small" key forces the
    path.
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
    cfg = dict(cfg or moe_config(a, n_exp, x.device, dtype))
    # The in-kernel-routing path by default up to its size (the register-fed units run sorted only).
    small = cfg.pop("small", cfg.get("gemv", False) or (a <= SMALL["max_assignments"] and not cfg.get("mma")))
    lut = cfg.pop("lut", lut_tile(cfg)) and use_lut(dtype, _moe_up_kernel)
    if a == 0:
        return torch.zeros_like(x)
    if not small and cfg.pop("gemv", False):
        raise ValueError(f"{_WHAT}: the CUDA-core tiles (gemv) run on the in-kernel-routing path only (small)")
    if cfg.get("mma") and (small or dtype == torch.float32):
        raise ValueError(f"{_WHAT}: the register-fed matrix units run on the sorted path only, for bf16/fp16 "
                         f"activations on a GPU (got {dtype} on {x.device}, small={small})")
    run = _moe_small if small else _moe_sorted
    return run(x, top_k_index, top_k_weights.reshape(-1).to(torch.float32).contiguous(), up_proj, down_proj,
               cfg, lut)


def _split_k(programs: int, k: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(splits, K per split): split K while there are fewer than SMALL["programs_per_sm"]
    programs per multiprocessor, at most SMALL["max_parts"] ways, never below one K tile."""
    k_blocks = cdiv(k, block_k)
    want = SMALL["programs_per_sm"] * _sm_count(device)
    split = 1 if programs >= want else max(1, min(k_blocks, want // max(programs, 1), SMALL["max_parts"]))
    k_per_split = cdiv(k_blocks, split) * block_k
    return cdiv(k, k_per_split), k_per_split


def _moe_small(x, top_k_index, weights, up, down, cfg, lut):
    """Three launches, no host-side routing: up (fp32 split-K partials per assignment), down
    (reading relu^2 of the up partials; fp32 partials), combine (routing weights, top-k sum).
    cfg["gemv"]: the projections on the CUDA cores (`_gemv_accumulate`), else the matrix units."""
    t, top_k = top_k_index.shape
    n_exp, inter, hid = up.shape
    a = t * top_k
    dtype, device = x.dtype, x.device
    ids = top_k_index.reshape(-1).contiguous()
    by_assignment = a < n_exp
    slots = a if by_assignment else n_exp
    gemv = cfg.pop("gemv", False)
    if gemv:
        lut = DEQUANT["lut"] and not interpreted(_moe_small_kernel)  # the block-dot PTX takes any dtype
        if device.type == "cuda":
            cfg_up, cfg_dn = _gemv_k_tile(hid, cfg), _gemv_k_tile(inter, cfg)
        else:
            cfg_up = cfg_dn = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], 64))
        view = torch.int64
    else:
        cfg_up = cfg_dn = cfg
        view = torch.int32
    common = dict(A_PAD=max(next_power_of_2(a), 2), BY_ASSIGNMENT=by_assignment, ACT=_TL_DTYPES[dtype],
                  IEEE=dtype == torch.float32, LUT=lut, GEMV=gemv, **launch_options())
    bn = cfg["BLOCK_N"]
    s_up, kps_up = _split_k(slots * cdiv(inter, bn), hid, cfg_up["BLOCK_K"], device)
    # One split: the up kernel finishes the activation itself; more: fp32 partials, finished by
    # the down kernel as it reads them.
    if s_up == 1:
        part_up = torch.empty((a, inter), dtype=dtype, device=device)
    else:
        part_up = torch.empty((s_up, a, inter), dtype=torch.float32, device=device)
    x, x4 = int64_activations(x) if gemv else (x, x)
    _moe_small_kernel[(slots, cdiv(inter, bn), s_up)](
        x, x4, ids, up.packed.view(view), up.block_scale.view(torch.uint8),
        up.global_scale, part_up, a, n_exp, inter, hid, top_k, kps_up, 0, UP=True, X_PARTS=0, RELU2_OUT=s_up == 1,
        EVEN_N=inter % bn == 0, EVEN_K=hid % cfg_up["BLOCK_K"] == 0, **cfg_up, **common)
    s_dn, kps_dn = _split_k(slots * cdiv(hid, bn), inter, cfg_dn["BLOCK_K"], device)
    part_dn = torch.empty((s_dn, a, hid), dtype=torch.float32, device=device)
    part_up, part_up4 = int64_activations(part_up) if gemv else (part_up, part_up)
    _moe_small_kernel[(slots, cdiv(hid, bn), s_dn)](
        part_up, part_up4, ids, down.packed.view(view),
        down.block_scale.view(torch.uint8), down.global_scale, part_dn, a, n_exp, hid, inter, top_k, kps_dn,
        a * inter, UP=False, X_PARTS=0 if s_up == 1 else s_up, RELU2_OUT=False, EVEN_N=hid % bn == 0,
        EVEN_K=inter % cfg_dn["BLOCK_K"] == 0, **cfg_dn, **common)
    out = torch.empty((t, hid), dtype=dtype, device=device)
    block = min(1024, next_power_of_2(hid))
    _moe_combine_kernel[(t, cdiv(hid, block))](
        part_dn, ids, weights, out, a, n_exp, hid, PARTS=s_dn, TOPK=top_k, ACT=_TL_DTYPES[dtype], BLOCK=block,
        **launch_options())
    return out


def _moe_sorted(x, top_k_index, weights, up, down, cfg, lut):
    """Two grouped launches over the assignments sorted by expert (any number of tokens)."""
    t, top_k = top_k_index.shape
    n_exp, inter, hid = up.shape
    a = t * top_k
    dtype, device = x.dtype, x.device
    # Sort the assignments (token * k + slot) by expert; offsets[e]..offsets[e+1] is expert e's run.
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(n_exp + 1, device=device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # int64, read as is by the kernels
    ieee = dtype == torch.float32
    inter_act = torch.empty((a, inter), dtype=dtype, device=device)
    if cfg.get("mma"):
        return _moe_sorted_mma(x, top_k, weights, up, down, cfg, order, offsets, inter_act)
    _moe_up_kernel[(n_exp, cdiv(inter, cfg["BLOCK_N"]))](
        x, order, offsets, up.packed.view(torch.int32), up.block_scale.view(torch.uint8), up.global_scale,
        inter_act, hid, inter, top_k, IEEE=ieee, LUT=lut,
        EVEN_N=inter % cfg["BLOCK_N"] == 0, EVEN_K=hid % cfg["BLOCK_K"] == 0, **cfg, **launch_options())
    per_slot = torch.empty((a, hid), dtype=torch.float32, device=device)
    _moe_down_kernel[(n_exp, cdiv(hid, cfg["BLOCK_N"]))](
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
    _moe_up_mma_kernel[(n_exp, cdiv(inter, cfg["BLOCK_N"]))](
        x4, order, offsets, up.packed.view(torch.int64), up_scales, up.global_scale, inter_act, hid, inter, top_k,
        x.stride(0) // 4, EVEN_K=hid % 128 == 0, SCALE_PAIRS=up_pairs,
        VEC=mma_vec(up.packed, x4, x.stride(0) // 4, hid, _moe_up_mma_kernel), **opts)
    per_slot = torch.empty((a, hid), dtype=torch.float32, device=x.device)
    down_scales, down_pairs = mma_scales(down)
    _moe_down_mma_kernel[(n_exp, cdiv(hid, cfg["BLOCK_N"]))](
        inter_act.view(torch.int64), order, offsets, weights, down.packed.view(torch.int64), down_scales,
        down.global_scale, per_slot, hid, inter, inter // 4, EVEN_K=inter % 128 == 0, SCALE_PAIRS=down_pairs,
        VEC=mma_vec(down.packed, inter_act, inter // 4, inter, _moe_down_mma_kernel), ACT_DTYPE=_TL_DTYPES[x.dtype],
        **opts)
    return per_slot.view(t, top_k, hid).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Benchmark entry
# --------------------------------------------------------------------------------------------
def _bf16_grouped_baseline(n_exp, hid, inter, top_k, up_w, down_w):
    """transformers' NemotronHExperts with experts_implementation="grouped_mm", else a direct
    torch._grouped_mm pipeline. Returns (callable(hidden, ids, weights), name)."""
    try:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        cfg = NemotronHConfig(n_routed_experts=n_exp, hidden_size=hid, moe_intermediate_size=inter,
                              num_experts_per_tok=top_k, mlp_hidden_act="relu2")
        cfg._experts_implementation = "grouped_mm"
        mod = NemotronHExperts(cfg).to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            mod.up_proj.copy_(up_w)
            mod.down_proj.copy_(down_w)
        return (lambda h, i, w: mod(h, i, w)), "transformers NemotronHExperts (grouped_mm)"
    except Exception as exc:  # noqa: BLE001 -- the fallback is named in the results
        reason = f"{type(exc).__name__}: {exc}"

    def run(h, ids, w):
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        counts = torch.bincount(sorted_ids, minlength=n_exp)
        offs = counts.cumsum(0).to(torch.int32)
        xs = h[order // top_k]
        y = torch._grouped_mm(xs, up_w.transpose(1, 2), offs=offs)
        y = torch.square(torch.relu(y))
        y = torch._grouped_mm(y, down_w.transpose(1, 2), offs=offs) * w.reshape(-1)[order, None]
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        out.index_add_(0, order // top_k, y.float())
        return out.to(h.dtype)

    return run, f"torch._grouped_mm ({reason})"


def bench(tokens=(1, 8, 64, 256, 2048), n_exp=128, top_k=6, hid=2688, inter=1856):
    """Median times of this grouped kernel and of a bf16 grouped baseline, side by side: CUDA
    graph replays where the call can be captured, and eager."""
    from triton.testing import do_bench, do_bench_cudagraph

    from .quantize import quantize

    up_w = torch.randn((n_exp, inter, hid), dtype=torch.bfloat16, device="cuda") * 0.02
    down_w = torch.randn((n_exp, hid, inter), dtype=torch.bfloat16, device="cuda") * 0.02
    up_q, down_q = quantize(up_w), quantize(down_w)
    baseline, name = _bf16_grouped_baseline(n_exp, hid, inter, top_k, up_w, down_w)

    def graph_time(fn):
        try:
            return do_bench_cudagraph(fn, rep=50, return_mode="median"), None
        except Exception as exc:  # noqa: BLE001 -- e.g. a host sync inside the baseline
            torch.cuda.synchronize()
            return None, f"{type(exc).__name__}: {str(exc)[:120]}"

    rows = []
    for t in tokens:
        h = torch.randn((t, hid), dtype=torch.bfloat16, device="cuda")
        scores = torch.rand((t, n_exp), device="cuda")
        ids = scores.topk(top_k, dim=-1).indices
        w = torch.rand((t, top_k), device="cuda")
        with torch.no_grad():
            fp4 = lambda: moe_experts(h, ids, w, up_q, down_q)  # noqa: E731
            bf16 = lambda: baseline(h, ids, w)  # noqa: E731
            row = {"tokens": t, "baseline": name}
            row["ms_w4a16_eager"] = do_bench(fp4, warmup=10, rep=50, return_mode="median")
            row["ms_bf16_eager"] = do_bench(bf16, warmup=10, rep=50, return_mode="median")
            row["ms_w4a16_graph"], row["graph_error_w4a16"] = graph_time(fp4)
            row["ms_bf16_graph"], row["graph_error_bf16"] = graph_time(bf16)
            both_graphs = row["ms_w4a16_graph"] is not None and row["ms_bf16_graph"] is not None
            row["timing"] = "cuda-graph" if both_graphs else "eager"
            row["ms_w4a16"] = row["ms_w4a16_graph"] if both_graphs else row["ms_w4a16_eager"]
            row["ms_bf16"] = row["ms_bf16_graph"] if both_graphs else row["ms_bf16_eager"]
            row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_w4a16"]
            row["speedup_vs_bf16_eager"] = row["ms_bf16_eager"] / row["ms_w4a16_eager"]
            ref = baseline(h, ids, w).float()
            got = fp4().float()
            row["rel_diff_vs_bf16_weights"] = float((got - ref).norm() / ref.norm())
            a = t * top_k
            cfg = moe_config(a, n_exp, h.device)
            row["path"] = ("small-gemv" if cfg.get("gemv") else "sorted-mma" if cfg.get("mma") else
                           "small" if a <= SMALL["max_assignments"] else "sorted")
            if row["path"] != "sorted":  # the wgmma paths at the same size, for the record
                base = matrix_unit_config(a, n_exp, h.device)
                row["ms_w4a16_sorted_graph"], _ = graph_time(
                    lambda: moe_experts(h, ids, w, up_q, down_q, cfg=dict(base, small=False)))
                if row["path"] == "small-gemv":
                    row["ms_w4a16_small_matrix_unit_graph"], _ = graph_time(
                        lambda: moe_experts(h, ids, w, up_q, down_q, cfg=dict(base, small=True)))
                if row["path"] != "sorted-mma":
                    row["ms_w4a16_sorted_mma_graph"], _ = graph_time(
                        lambda: moe_experts(h, ids, w, up_q, down_q, cfg=dict(moe_mma_config(), small=False)))
        rows.append(row)
    return rows
