"""A probe of the W4A16 GEMV's loop (fp4kit.kernels.w4a16_gemm's CUDA-core kernel) with part of its
work left out, to place its time (`benchlib.w4a16.gemv_limits`); tests check each part's result."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.kernels.backend import interpreted, launch_options
from fp4kit.kernels.tiles import gemv_accumulate, int64_activations, k_ahead, load_blocks

# Parts of the GEMV's loop for `_gemv_probe_kernel`.
PROBE_ALL, PROBE_LOADS, PROBE_ARITHMETIC = 0, 1, 2


@triton.jit
def _gemv_probe_kernel(x_ptr, x4_ptr, wb_ptr, ws_ptr, gs_ptr, out_ptr, N, K, k_from,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LUT: tl.constexpr, PART: tl.constexpr,
                       KB: tl.constexpr):
    """The GEMV's loop at one activation row (no split; N % BLOCK_N == 0, K % BLOCK_K == 0) with
    part of its work left out, to place its time (`gemv_limits`). PART: PROBE_ALL, the whole loop
    (`gemv_accumulate`: `w4a16_gemm._gemv_kernel`'s result); PROBE_LOADS, the same weight loads with their
    bits folded by xor instead of decoded (the memory traffic alone; each row gets the sum over
    its thread slots of the fold's bytes xor-ed together); PROBE_ARITHMETIC, the whole
    loop with every program reading the first BLOCK_N weight rows (a few KB that stay in cache:
    the decoding and multiply-adds alone), so row n gets the result of row n % BLOCK_N. k_from:
    the loop's first K offset (0), a run-time value as the split GEMV's is: with a compile-time
    0 Triton lays the weight loads out differently (16-byte vectors, then a layout conversion
    through shared memory) and the probe would time another loop."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, BLOCK_N)  # counted from the program's first row, as `w4a16_gemm._gemv_kernel` does
    if PART == 2:
        first = tl.zeros((), dtype=tl.int64)
    else:
        first = (tl.program_id(0) * BLOCK_N).to(tl.int64) * KB
    wb_ptr += first
    ws_ptr += first
    if PART == 1:
        fold = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.int64)
        codes, sc = load_blocks(wb_ptr, ws_ptr, rows, n_ok, k_from, K, BLOCK_N, BLOCK_K, True, True, KB)
        for k0 in range(k_from, K, BLOCK_K):
            codes_next, sc_next = load_blocks(wb_ptr, ws_ptr, rows, n_ok, k_ahead(k0, K, BLOCK_K, True), K, BLOCK_N,
                                               BLOCK_K, True, True, KB)
            fold = fold ^ codes ^ sc.to(tl.int64)
            codes, sc = codes_next, sc_next
        fold = fold ^ (fold >> 32)  # every bit loaded reaches the low byte, which is summed
        fold = fold ^ (fold >> 16)
        fold = fold ^ (fold >> 8)
        y = tl.sum(fold & 0xFF, axis=1).to(tl.float32)
    else:
        acc = tl.zeros((1, BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        acc = gemv_accumulate(acc, x_ptr, x4_ptr, tl.zeros((1, 1), dtype=tl.int64), tl.arange(0, 1) < 1, wb_ptr,
                               ws_ptr, tl.load(gs_ptr), rows, n_ok, K, k_from, K, BLOCK_N, BLOCK_K, LUT, True, True,
                               KB=KB)
        y = tl.sum(tl.sum(acc, axis=2), axis=0) * 64.0
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_probe(x: torch.Tensor, w: nvfp4.NVFP4Tensor, part: int, cfg: dict, lut: bool = True) -> torch.Tensor:
    """`_gemv_probe_kernel` on one row x [1, K] (bf16/fp16) with a GEMV launch shape cfg
    (`w4a16_gemm.config`); lut: the block decode's inline PTX on a GPU (the launch table's
    DEQUANT["lut"]), as the GEMV runs it."""
    n, k = w.shape
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if x.shape != (1, k) or n % bn or k % bk:
        raise ValueError(f"gemv_probe: the GEMV probe takes one row and whole tiles, got x {tuple(x.shape)}, "
                         f"W {tuple(w.shape)}, tile ({bn}, {bk})")
    x2, x4 = int64_activations(x)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_probe_kernel[(n // bn,)](x2, x4, w.packed.view(torch.int64), w.block_scale.view(torch.uint8), w.global_scale,
                                   out, n, k, 0, BLOCK_N=bn, BLOCK_K=bk,
                                   LUT=lut and not interpreted(_gemv_probe_kernel), PART=part, KB=k // 16,
                                   num_warps=cfg["num_warps"], num_stages=1, **launch_options())
    return out
