"""FP8 (E4M3) per-tensor quantization as nvidia-modelopt 0.47 exports it (preset `fp8`).

    weight_scale = fp32(max|W|) / 448                   (0-d fp32; the division follows arith)
    bytes        = e4m3(W / weight_scale)               division in the WEIGHT dtype

torch's type promotion keeps `bf16_tensor / fp32_scalar_tensor` in bf16: the quotient is
computed in fp32 and rounded to bf16, then cast to E4M3 -- a double rounding that ModelOpt's
bytes carry, and so do these. On CUDA the 0-d scale is also rounded to bf16 before dividing
(arith.div_by_scale). An all-zero tensor gets scale 1.0 (ModelOpt would divide by 0).
"""

from __future__ import annotations

import torch

from . import e4m3
from .arith import DEFAULT_ARITH, div_by_scale, div_const
from .constants import FP8_MAX
from .errors import FormatError, check_finite, check_float_tensor


def scale_from_amax(amax, arith: str = DEFAULT_ARITH) -> torch.Tensor:
    """amax / 448 as fp32 (weight, static input or KV scale); a zero amax gives 1.0."""
    a = torch.as_tensor(amax).float()
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise FormatError(f"fp8.scale_from_amax: amax must be finite and >= 0, got {a}")
    scale = div_const(a, FP8_MAX, arith)
    return torch.where(a == 0, torch.ones_like(scale), scale)


def quantize_per_tensor(w: torch.Tensor, arith: str = DEFAULT_ARITH) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (float8_e4m3fn tensor of W's shape, fp32 0-d weight_scale)."""
    what = "fp8.quantize_per_tensor"
    check_float_tensor(w, what)
    check_finite(w, what)
    scale = scale_from_amax(w.abs().amax(), arith)
    quotient = div_by_scale(w, scale, arith)  # torch's `w / scale` on arith's device
    return e4m3.cast(quotient), scale


def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (e4m3.decode(q) * scale.float()).to(dtype)
