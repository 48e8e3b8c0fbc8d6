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

_WHAT = "kernels.fp8.quantize_per_tensor"


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`e4m3.cast(x)` for finite fp32/fp16/bf16 x, by torch's cast after clamping to +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_per_tensor(w: torch.Tensor, arith: str = DEFAULT_ARITH, *, amax_multipliers: tuple[float, ...] | None = None,
                        deferred: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (float8_e4m3fn tensor of W's shape, fp32 0-d weight_scale), as the reference.

    amax_multipliers: the reference's range search (`fp8.search_amax`, which reads its errors
    back per candidate). deferred: a list the finiteness check is appended to (a callable that
    raises the reference's error) instead of running now."""
    check_float_tensor(w, _WHAT)
    check_mode(arith)
    if amax_multipliers is not None:
        check_finite(w, _WHAT)
        amax = fp8.search_amax(w, amax_multipliers)[0]
    else:
        amax = w.abs().amax().float()

    def check() -> None:
        if not bool(torch.isfinite(amax)):
            check_finite(w, _WHAT)

    if deferred is None:
        check()
    else:
        deferred.append(check)
    scale = torch.where(amax == 0, torch.ones_like(amax), div_const(amax, FP8_MAX, arith))
    return cast_e4m3(div_by_scale(w, scale, arith)), scale
