"""FP8 (E4M3) per-tensor weight quantization on the GPU, without a host synchronisation.

Contract: `fp4kit.formats.fp8.quantize_per_tensor`: same arguments, same bytes, same errors. The
reference rounds to E4M3 on the bits in float64 (`e4m3.encode`), exact on every device but a
dozen passes over a float64 copy of the weight; here the quotient, clamped to +-448, goes through
torch's own float8_e4m3fn cast, which rounds to nearest-even exactly as `e4m3.encode` does for
every finite fp32/fp16/bf16 value inside +-448 (tests/kernels/test_fp8.py: every bf16 and fp16
value, and fp32 around every E4M3 midpoint; tests/gpu for the CUDA cast). Clamping first gives
`encode`'s saturation, which older torch casts do not. The finiteness check reads one scalar
(max|W| is NaN or Inf exactly when W holds a NaN or an Inf), and can be deferred like
`kernels.quantize.quantize`'s.
"""

from __future__ import annotations

import torch

from fp4kit.formats import fp8
from fp4kit.formats.arith import DEFAULT_ARITH, check_mode, div_by_scale, div_const
from fp4kit.formats.constants import FP8_MAX
from fp4kit.formats.errors import check_finite, check_float_tensor

from .deferred import DeferredCheck

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


def quantize_per_tensor(w: torch.Tensor, arith: str = DEFAULT_ARITH, *, amax_multipliers: tuple[float, ...] | None = None,
                        deferred: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (float8_e4m3fn tensor of W's shape, fp32 0-d weight_scale), as the reference.

    amax_multipliers: the reference's range search (`search_amax`: `fp8.search_amax` without
    reading its errors back). deferred: a list the finiteness check is appended to (a callable that
    raises the reference's error) instead of running now."""
    check_float_tensor(w, _WHAT)
    check_mode(arith)
    if amax_multipliers is not None:
        if deferred is None:
            check_finite(w, _WHAT)
        amax = search_amax(w, amax_multipliers)
    else:
        amax = w.abs().amax().float()

    def check() -> None:
        if not bool(torch.isfinite(amax)):
            check_finite(w, _WHAT)

    if deferred is None:
        check()
    else:
        deferred.append(DeferredCheck(~torch.isfinite(amax), check))
    scale = torch.where(amax == 0, torch.ones_like(amax), div_const(amax, FP8_MAX, arith))
    return cast_e4m3(div_by_scale(w, scale, arith)), scale
