"""A study of `packed_matmul`'s split-K epilogue (`tiles.store_split`): the packed kernel's K loop
with its epilogue in parts, for scripts/bench_split_epilogue.py. Nothing in the library calls it.

Epilogues ("EPI"), each after the same K loop as `packed_gemm._packed_kernel` (one K tile per step):
  0  `mma.store_unscaled` as the library runs it: each program stores its fp32 partial, counts
     itself in at its tile's counter, and the last to arrive sums the partials in order and stores;
  1  the partial stores and the counter, the last program storing its own partial only;
  2  the counter only, the last program storing its own partial;
  3  each program storing its own partial to the output (no partials, no counter);
  4  the partial stores, then each program storing its own;
  5  the partial stores only, then a second launch summing them in order s = 0, 1, ...
Only 0 and 5 compute the product (5 gives 0's bytes); 1 to 4 leave parts out to time the rest."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.kernels.backend import cdiv, interpreted, launch_options
from fp4kit.kernels.mma import MMA_UNSCALE, store_unscaled
from fp4kit.kernels.packed_gemm import SLAB, _dot, _offsets, _tile_decode, _tile_load, _x_tile, config
from fp4kit.kernels.tiles import split_counters

EPILOGUES = (0, 1, 2, 3, 4, 5)
RIGHT = (0, 5)  # the epilogues whose output is the product


@triton.jit
def _epilogue_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, N16, KT, stride_xm,
                     kt_per_split, BLOCK_M: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr, F16: tl.constexpr,
                     EVEN_K: tl.constexpr, EMULATE: tl.constexpr, EPI: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    woff, soff = _offsets(pid_n, N16, KT, W)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    xoff = m[None, :].to(tl.int64) * stride_xm + tl.arange(0, 128)[:, None]
    xmask = (m < M)[None, :]
    kt0 = pid_s * kt_per_split
    kt1 = tl.minimum(kt0 + kt_per_split, KT)
    acc = tl.zeros((16 * W, BLOCK_M), dtype=tl.float32)
    for kt in range(kt0, kt1):
        w0, s0, w1, s1 = _tile_load(w_ptr, s_ptr, woff + kt * 512, soff + kt * 128, W)
        xt = _x_tile(x_ptr, x_ptr, xoff, xmask, pid_m * BLOCK_M, kt, K, EVEN_K, False)
        acc = _dot(acc, _tile_decode(w0, s0, w1, s1, W, F16, EMULATE), xt, EMULATE)
    toks = m[None, :]
    rows = (pid_n * (16 * W) + tl.arange(0, 16 * W))[:, None]
    if EPI == 0:
        store_unscaled(acc, gs_ptr, out_ptr, part_ptr, cnt_ptr, toks, rows, M, N, pid_m, pid_n, pid_s, SPLIT)
    else:
        y = acc * (tl.load(gs_ptr) * MMA_UNSCALE)
        off = toks.to(tl.int64) * N + rows
        ok = (toks < M) & (rows < N)
        if EPI == 1 or EPI == 4 or EPI == 5:
            tl.store(part_ptr + pid_s.to(tl.int64) * (M * N) + off, y, mask=ok)
        if EPI == 1 or EPI == 2:
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=ok)
                tl.store(cnt_ptr + tile, 0)
        if EPI == 3 or EPI == 4:
            tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    total = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(part_ptr + s * MN.to(tl.int64) + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=ok)


def epilogue_matmul(x: torch.Tensor, p, epi: int, cfg: dict) -> torch.Tensor:
    """x [M, K] bf16 @ the packed weight p^T with epilogue `epi` (module docstring), the launch
    shape `packed_gemm.config(..., cfg)` with one K tile per loop step."""
    if epi not in EPILOGUES:
        raise ValueError(f"epi must be one of {EPILOGUES}, got {epi}")
    n, k = p.shape
    m = x.shape[0]
    c = config(m, n, k, x.device, dict(cfg, UNROLL=1, PREFETCH=0))
    grid = (cdiv(cdiv(n, SLAB), c["num_warps"]), cdiv(m, c["BLOCK_M"]), c["SPLIT"])
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((c["SPLIT"], m, n), dtype=torch.float32, device=x.device)
    counters = split_counters(x.device, grid[0] * grid[1])
    _epilogue_kernel[grid](x, p.words, p.scales, p.global_scale, out, part, counters, m, n, k, *p.words.shape[:2],
                           x.stride(0), c["kt_per_split"], BLOCK_M=c["BLOCK_M"], W=c["num_warps"], SPLIT=c["SPLIT"],
                           F16=x.dtype == torch.float16, EVEN_K=k % 128 == 0, EMULATE=interpreted(_epilogue_kernel),
                           EPI=epi, num_warps=c["num_warps"], num_stages=1, **launch_options())
    if epi == 5:
        _sum_partials_kernel[(cdiv(m * n, 1024),)](part, out, m * n, SPLIT=c["SPLIT"], BLOCK=1024, num_warps=4,
                                                   **launch_options())
    return out
