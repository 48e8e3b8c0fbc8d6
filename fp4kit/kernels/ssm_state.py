"""The SSM-state write of a serving engine with `--mamba-ssm-cache-dtype float16
--enable-mamba-cache-stochastic-rounding`: fp32 state -> fp16 with stochastic rounding, on the GPU.

Contract: `fp4kit.formats.fp16sr.round_state` (the rule, the Philox-4x32-R stream and which random
word each element takes), bit for bit, for any seed < 2^63 and flat offset. Random words come
from Triton's own Philox (`tl.randint4x`: counter (offset lo, offset hi, 0, 0), key (seed lo,
seed hi)), one call per element for the group of four it belongs to.
Tests: tests/kernels/test_ssm_state.py (interpreter), tests/gpu/test_formats_cuda.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.formats import fp16sr
from fp4kit.formats.errors import FormatError

from .backend import cdiv, check_backend, launch_options

_BLOCK = 1024
_WHAT = "kernels.ssm_state.round_state"


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, seed, base_ptr, offset, ROUNDS: tl.constexpr, OUT_FP32: tl.constexpr,
                  BASE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    if BASE:  # the seed is seed + *base_ptr: read on the device, so a captured graph draws new words per replay
        seed = tl.load(base_ptr) + seed
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    o = i + offset
    j = o % 4
    r0, r1, r2, r3 = tl.randint4x(seed, o - j, ROUNDS)
    r = tl.where(j == 0, r0, tl.where(j == 1, r1, tl.where(j == 2, r2, r3))).to(tl.int32, bitcast=True) & 0x1FFF
    a = x.to(tl.int32, bitcast=True)
    sign = (a >> 16) & 0x8000
    mag = a & 0x7FFFFFFF
    e = mag >> 23
    shift = tl.minimum(tl.maximum(113 - e, 0), 31)
    sub = ((mag & 0x7FFFFF) | 0x800000) >> shift
    s = tl.where(e >= 113, mag - (112 << 23), tl.where(e >= 90, sub, 0))
    h = tl.minimum((s + r) >> 13, 0x7C00)
    h = tl.where(mag > 0x7F800000, 0x7E00, tl.where(mag == 0x7F800000, 0x7C00, h))
    y = (sign | h).to(tl.int16).to(tl.float16, bitcast=True)
    if OUT_FP32:
        tl.store(out_ptr + i, y.to(tl.float32), mask=ok)
    else:
        tl.store(out_ptr + i, y, mask=ok)


def round_state(x: torch.Tensor, seed: int, rounds: int, offset: int = 0, *, out: torch.Tensor | None = None,
                backend: str = "triton", base: torch.Tensor | None = None) -> torch.Tensor:
    """`fp16sr.round_state(x, seed, rounds, offset)`; with `out` (fp16, or fp32 to hold the fp16
    values, e.g. x itself) the result is written there and returned. base: a 1-element int64
    tensor on x's device added to the seed where the kernel runs (seed + base[0] must stay in
    [0, 2^63)), so that a launch replayed from a CUDA graph takes the seed the tensor holds then."""
    check_backend(backend, _round_kernel, x, what=_WHAT)
    if base is not None and (not isinstance(base, torch.Tensor) or base.dtype != torch.int64 or base.numel() != 1
                             or base.device != x.device):
        raise FormatError(f"{_WHAT}: base must be a 1-element int64 tensor on the state's device")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_contiguous():
        raise FormatError(f"{_WHAT}: the state must be a contiguous float32 tensor")
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise FormatError(f"{_WHAT}: seed must be an integer in [0, 2^63), got {seed!r}")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise FormatError(f"{_WHAT}: rounds must be a positive integer, got {rounds!r}")
    if out is None:
        out = torch.empty_like(x, dtype=torch.float16)
    if out.shape != x.shape or out.dtype not in (torch.float16, torch.float32) or not out.is_contiguous() \
            or out.device != x.device:
        raise FormatError(f"{_WHAT}: out must be a contiguous fp16 or fp32 tensor of the state's shape and device")
    if backend == "torch":
        out.copy_(fp16sr.round_state(x, seed + (int(base.item()) if base is not None else 0), rounds, offset))
        return out
    n = x.numel()
    if n:
        _round_kernel[(cdiv(n, _BLOCK),)](x, out, n, seed, x if base is None else base, offset, ROUNDS=rounds,
                                          OUT_FP32=out.dtype == torch.float32, BASE=base is not None,
                                          BLOCK=_BLOCK, **launch_options())
    return out
