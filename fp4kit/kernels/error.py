"""How far an NVFP4 tensor is from its source, on the GPU: the two SQNR terms in one pass.

Contract: `fp4kit.formats.metrics.sqnr_terms(w, qt.dequantize())`. Each program decodes its
tiles' E2M1 codes and E4M3 block scales on the bits, forms the dequantized values as
`NVFP4Tensor.dequantize` does (fp32 step = block scale * global scale, one rounding; value =
code value * step), and sums w^2 and (w - w_hat)^2 in fp32 over its tiles (1024 blocks by default); the
partial sums are added in float64. The terms agree with the reference's float64 sums to a
relative 1e-6 or so (fp32 partial sums), far below the 0.01 dB a report shows. One read of the
weight and of the packed codes, no host synchronisation: the quantize stage reads the terms of
every weight back at once.
Tests: tests/kernels/test_error.py (interpreter), tests/gpu/test_quantize_gpu.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.formats.constants import NVFP4_BLOCK_SIZE

from .backend import cdiv, launch_options

_BLOCKS = 64  # 16-element blocks per tile
_TILES = 16  # tiles per program, one pair of partial sums each


@triton.jit
def _pow2(k):
    """2^k as fp32 for integer k in the normal range, built on the exponent bits (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(c):
    """The value of E2M1 codes c (int32, 0..15): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign."""
    m = c & 7
    small = m < 2
    v = tl.where(small, m, 2 + (m & 1)).to(tl.float32) * _pow2(tl.where(small, -1, (m >> 1) - 2))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _e4m3_value(s):
    """The value of E4M3 bytes s (int32, finite codes): (8 + m) 2^(e - 10), or m 2^-9 if e = 0."""
    e = (s >> 3) & 15
    m = s & 7
    v = tl.where(e == 0, m, 8 + m).to(tl.float32) * _pow2(tl.maximum(e, 1) - 10)
    return tl.where((s & 128) != 0, -v, v)


@triton.jit
def _error_kernel(w_ptr, packed_ptr, scale_ptr, gs_ptr, part_ptr, n_blocks, blocks_per_member,
                  OFFSET_DTYPE: tl.constexpr, BLOCKS: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.arange(0, 8)[None, :]
    e = tl.arange(0, 16)[None, :]
    signal = tl.zeros((BLOCKS, 16), dtype=tl.float32)
    noise = tl.zeros((BLOCKS, 16), dtype=tl.float32)
    for t in range(TILES):
        blk = ((pid * TILES + t) * BLOCKS + tl.arange(0, BLOCKS)[:, None]).to(OFFSET_DTYPE)  # [BLOCKS, 1]
        ok = blk < n_blocks
        byte = tl.load(packed_ptr + blk * 8 + j, mask=ok, other=0).to(tl.int32)  # elements 2j, 2j+1
        x = tl.load(w_ptr + blk * 16 + e, mask=ok, other=0.0).to(tl.float32)  # one contiguous row per block
        s = tl.load(scale_ptr + blk, mask=ok, other=0).to(tl.int32)
        g = tl.load(gs_ptr + blk // blocks_per_member, mask=ok, other=0.0)
        step = _e4m3_value(s) * g
        # code values in element order: join puts element 2j + i at [j, i]
        v = tl.reshape(tl.join(_e2m1_value(byte & 15), _e2m1_value(byte >> 4)), (BLOCKS, 16))
        d = x - v * step
        signal += x * x
        noise += d * d
    out = part_ptr + pid * 2
    tl.store(out, tl.sum(tl.sum(signal, axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum(noise, axis=1), axis=0))


def nvfp4_error_terms(w: torch.Tensor, qt: nvfp4.NVFP4Tensor, *, tiles: int = _TILES) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w^2, sum (w - qt.dequantize())^2) as float64 0-d tensors on w's device, no host sync.

    w: the source, [..., N, K] (or [K]) of qt's shape, on the device qt lives on (CUDA, or the
    CPU under TRITON_INTERPRET=1). tiles: tiles of 64 blocks per program."""
    if tuple(w.shape) != qt.shape:
        raise ValueError(f"kernels.error: source shape {tuple(w.shape)} is not the quantized shape {qt.shape}")
    w = w.contiguous()
    k = w.shape[-1]
    n = w.shape[-2] if w.dim() >= 2 else 1
    n_blocks = w.numel() // NVFP4_BLOCK_SIZE
    blocks_per_member = n * (k // NVFP4_BLOCK_SIZE)
    programs = max(1, cdiv(n_blocks, _BLOCKS * tiles))
    part = torch.empty((programs, 2), dtype=torch.float32, device=w.device)
    gs = qt.global_scale.float().reshape(-1).contiguous()
    offset_dtype = tl.int32 if w.numel() < 2**31 - 2**20 else tl.int64
    opts = dict(num_warps=4, **launch_options())
    _error_kernel[(programs,)](
        w, qt.packed.contiguous(), qt.block_scale.contiguous().view(torch.uint8), gs, part, n_blocks,
        max(1, blocks_per_member), OFFSET_DTYPE=offset_dtype, BLOCKS=_BLOCKS, TILES=tiles, **opts)
    total = part.double().sum(0)
    return total[0], total[1]
