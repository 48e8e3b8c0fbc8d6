"""FP8 (E4M3) per-tensor weight quantization on the GPU, without a host synchronisation.

Contract: `fp4kit.formats.fp8.quantize_per_tensor`: same arguments, same bytes, same errors. The
reference rounds to E4M3 on the bits in float64 (`e4m3.encode`), exact on every device but a
dozen passes over a float64 copy of the weight. Here the quantization is one Triton pass
(`_fp8_kernel`: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): the quotient by the scale
(IEEE division, rounded to the weight's dtype as torch rounds it), the clamp to +-448 (which gives
`encode`'s saturation), and the E4M3 rounding on the bits (`_e4m3_signed`). It equals
`cast_e4m3(div_by_scale(w, scale))`, torch's own float8_e4m3fn cast after the clamp, which in turn
equals `e4m3.encode` (tests/kernels/test_fp8.py: every bf16 and fp16 value at many scales, fp32
around every E4M3 midpoint; tests/gpu for the CUDA cast). With a `terms` list the pass also sums
the two SQNR terms of its result (`fp4kit.formats.metrics.sqnr_terms(w,
fp8.dequantize_per_tensor(q, scale))`, fp32 partial sums added in float64, as `kernels.error`), so
one read of the weight serves both. The range is max|W| from `kernels.quantize.member_amax` (+Inf
where W holds a NaN or an Inf), or the reference's search (`search_amax`, in torch); the kernel
makes the scale from it as the reference does, so a weight costs two launches and no other
operation. The finiteness check reads that one scalar and can be deferred like
`kernels.quantize.quantize`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.formats import fp8
from fp4kit.formats.arith import DEFAULT_ARITH, check_mode, fp32_reciprocal
from fp4kit.formats.constants import FP8_MAX
from fp4kit.formats.errors import check_finite, check_float_tensor

from .backend import cdiv, launch_cached, launch_options
from .deferred import DeferredCheck
from .quantize import _e4m3_code, _e4m3_round, member_amax

_WHAT = "kernels.fp8.quantize_per_tensor"


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`e4m3.cast(x)` for finite fp32/fp16/bf16 x, by torch's cast after clamping to +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fake_quant_modelopt(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """`fp8.fake_quant_modelopt` for finite x, with torch's E4M3 cast in place of the bit-level
    rounding (the two agree on every clamped fp32 value: `cast_e4m3`)."""
    scale = 448.0 / amax.float()
    return cast_e4m3(x.float() * scale).float() * (1.0 / scale)


def search_amax(w: torch.Tensor, multipliers) -> torch.Tensor:
    """The range `fp8.search_amax` returns (ModelOpt's `mse` FP8 weight calibration), without a
    host wait: the same candidates, the same fp64 error sums, the first smallest (argmin keeps the
    first of equal minima). A non-finite W gives a non-finite range."""
    mults = [float(c) for c in multipliers]
    if not mults or not all(c > 0 and c == c and c != float("inf") for c in mults):
        fp8.search_amax(w[:0], multipliers)  # raises the reference's error
    x = w.float()
    amax = w.abs().amax().float()
    ranges = torch.stack([amax * c for c in mults])  # no host-to-device copy: that would wait
    errors = torch.stack([((x - fake_quant_modelopt(x, r)).double() ** 2).sum() for r in ranges.unbind(0)])
    chosen = ranges.gather(0, torch.argmin(errors).view(1))[0].to(w.dtype).float()  # a tensor index: no read-back
    chosen = torch.where(amax == 0, amax, chosen)
    return torch.where(torch.isfinite(amax), chosen, amax)


@triton.jit
def _round_half(x, HALF: tl.constexpr):
    """fp32 x rounded to the 16-bit dtype (HALF 1: bf16, on the bits, half to even; 2: fp16) and
    back; HALF 0 leaves it. NaN stays NaN."""
    if HALF == 1:
        b = x.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        out = tl.where(x != x, x, r)
    elif HALF == 2:
        out = x.to(tl.float16).to(tl.float32)
    else:
        out = x
    return out


@triton.jit
def _e4m3_signed(q):
    """(fp32 value, E4M3 byte as int32) of e4m3(q) for |q| <= 448 or NaN: round to nearest, ties
    to even; the sign kept on zeros (-0.0 and negatives that round to 0 give 0x80), as torch's
    cast and `e4m3.encode`. The magnitude is rounded and coded as the block scales are
    (`kernels.quantize._e4m3_round`, which also takes |q| below 2^-9, and `_e4m3_code`)."""
    b = q.to(tl.int32, bitcast=True)
    mag = _e4m3_round(tl.abs(q))
    code = _e4m3_code(mag) | ((b >> 24) & 0x80)
    return tl.where(b < 0, -mag, mag), code


@triton.jit
def _fp8_kernel(w_ptr, amax_ptr, scale_ptr, q_ptr, part_ptr, n, r448, HALF: tl.constexpr, ROUND_SCALE: tl.constexpr,
                SCALE_GIVEN: tl.constexpr, ERROR: tl.constexpr, OFFSET_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                TILES: tl.constexpr):
    """q = e4m3(clamp(round_w(w / s), -448, 448)) over TILES runs of BLOCK elements; s = the fp32
    scale, first rounded to w's dtype where ROUND_SCALE (CUDA's 0-d operand cast). The scale is
    read from scale_ptr where SCALE_GIVEN; else it is amax / 448 (1 where amax is 0), which
    program 0 writes to scale_ptr: `arith.div_const`'s quotient, amax * r448 (the fp32
    reciprocal) in "cuda" mode (ROUND_SCALE), else the IEEE one. ERROR: this program's sums of
    w^2 and (w - e4m3 value * scale)^2 (the unrounded fp32 scale, as `fp8.dequantize_per_tensor`)
    to part_ptr[pid, 0:2]."""
    pid = tl.program_id(0)
    if SCALE_GIVEN:
        s_deq = tl.load(scale_ptr)
    else:
        amax = tl.load(amax_ptr)
        if ROUND_SCALE:
            s_deq = amax * r448
        else:
            s_deq = tl.math.div_rn(amax, 448.0)
        s_deq = tl.where(amax == 0.0, 1.0, s_deq)
        tl.store(scale_ptr, s_deq, mask=pid == 0)
    s = _round_half(s_deq, HALF) if ROUND_SCALE else s_deq
    signal = tl.zeros((BLOCK,), dtype=tl.float32)
    noise = tl.zeros((BLOCK,), dtype=tl.float32)
    for t in range(TILES):
        offs = (pid * TILES + t).to(OFFSET_DTYPE) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        q = _round_half(tl.math.div_rn(x, s), HALF)
        q = tl.where(q < -448.0, -448.0, tl.where(q > 448.0, 448.0, q))  # NaN passes, as torch.clamp
        v, code = _e4m3_signed(q)
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=ok)
        if ERROR:
            d = x - v * s_deq
            signal += x * x
            noise += d * d
    if ERROR:
        tl.store(part_ptr + pid * 2, tl.sum(signal, axis=0))
        tl.store(part_ptr + pid * 2 + 1, tl.sum(noise, axis=0))


_BLOCK = 1024
_TILES = 8


_R448 = fp32_reciprocal(FP8_MAX)


def _fp8_pass(w: torch.Tensor, arith: str, terms: list | None, *, amax: torch.Tensor | None = None,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`cast_e4m3(div_by_scale(w, scale, arith))`, scale) in one pass (w contiguous), with the
    fp32 0-d `scale` given, or made by the kernel from a 0-d `amax` as the reference makes it,
    `torch.where(amax == 0, 1.0, div_const(amax, FP8_MAX, arith))`; with `terms`, the
    per-program SQNR partial sums of the result appended to it."""
    n = w.numel()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    given = scale is not None
    if not given:
        scale = torch.empty((), dtype=torch.float32, device=w.device)
    programs = max(1, cdiv(n, _BLOCK * _TILES))
    part = torch.empty((programs, 2), dtype=torch.float32, device=w.device) if terms is not None else q
    half = {torch.bfloat16: 1, torch.float16: 2}.get(w.dtype, 0)
    launch_cached(
        _fp8_kernel, (programs,),
        w, scale if given else amax, scale, q.view(torch.uint8), part, n, _R448, HALF=half,
        ROUND_SCALE=arith == "cuda", SCALE_GIVEN=given, ERROR=terms is not None,
        OFFSET_DTYPE=tl.int32 if n < 2**31 - 2**20 else tl.int64, BLOCK=_BLOCK, TILES=_TILES, num_warps=4,
        **launch_options())
    if terms is not None:
        terms.append(part)
    return q, scale


def _quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, arith: str, terms: list | None) -> torch.Tensor:
    """`cast_e4m3(div_by_scale(w, scale, arith))` in one pass, for a given fp32 scale."""
    return _fp8_pass(w, arith, terms, scale=scale.float().reshape(()))[0]


def quantize_per_tensor(w: torch.Tensor, arith: str = DEFAULT_ARITH, *, amax_multipliers: tuple[float, ...] | None = None,
                        deferred: list | None = None, terms: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (float8_e4m3fn tensor of W's shape, fp32 0-d weight_scale), as the reference.

    amax_multipliers: the reference's range search (`search_amax`: `fp8.search_amax` without
    reading its errors back). deferred: a list the finiteness check is appended to (a callable that
    raises the reference's error) instead of running now. terms: a list that receives
    the quantizing pass's per-program partial sums of w^2 and (w - dequantized)^2, an fp32
    [programs, 2] tensor on w's device whose column sums in float64 are the SQNR terms (no host
    wait: the caller sums them when it reads them)."""
    check_float_tensor(w, _WHAT)
    check_mode(arith)
    w = w.contiguous()
    if amax_multipliers is not None:
        if deferred is None:
            check_finite(w, _WHAT)
        amax = search_amax(w, amax_multipliers)
    else:
        amax = member_amax(w.reshape(1, -1))  # one member; +Inf where w holds a NaN or an Inf

    def check() -> None:
        if not bool(torch.isfinite(amax)):
            check_finite(w, _WHAT)

    if deferred is None:
        check()
    else:
        deferred.append(DeferredCheck(check, finite=[amax]))
    return _fp8_pass(w, arith, terms, amax=amax)
