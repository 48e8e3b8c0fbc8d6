"""FP8 (E4M3) per-tensor quantization as nvidia-modelopt 0.47 exports it (preset `fp8`).

    weight_scale = fp32(max|W|) / 448                   (0-d fp32; the division follows arith)
    bytes        = e4m3(W / weight_scale)               division in the WEIGHT dtype

With ModelOpt's `mse` algorithm (its Lightning recipe) the range max|W| is replaced by the
multiple of it with the smallest fake-quantization error (`search_amax`).

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


def quantize_per_tensor(w: torch.Tensor, arith: str = DEFAULT_ARITH, *,
                        amax_multipliers: tuple[float, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W -> (float8_e4m3fn tensor of W's shape, fp32 0-d weight_scale).

    amax_multipliers: ModelOpt's `mse` weight calibration (see `search_amax`): the range is
    the candidate c * max|W| whose fake quantization has the smallest squared error; None (or
    (1.0,)) keeps max|W|.
    """
    what = "fp8.quantize_per_tensor"
    check_float_tensor(w, what)
    check_finite(w, what)
    amax = w.abs().amax() if amax_multipliers is None else search_amax(w, amax_multipliers)[0]
    scale = scale_from_amax(amax, arith)
    quotient = div_by_scale(w, scale, arith)  # torch's `w / scale` on arith's device
    return e4m3.cast(quotient), scale


def fake_quant_modelopt(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's FP8 fake quantization of fp32 x with range amax (its eager `fp8_eager`):
    x * s clamped to +-448, rounded to E4M3, times 1 / s, with s = 448 / amax (fp32)."""
    scale = 448.0 / amax.float()
    return e4m3.decode(e4m3.encode((x.float() * scale).clamp(-FP8_MAX, FP8_MAX))) * (1.0 / scale)


def search_amax(w: torch.Tensor, multipliers) -> tuple[torch.Tensor, int, list[float]]:
    """ModelOpt 0.47's `mse` weight calibration of a per-tensor FP8 weight.

    For each candidate c (in order) the range c * max|W| (fp32) fake-quantizes W in fp32
    (`fake_quant_modelopt`); the squared errors are summed (in fp64 here: the choice must not
    hang on a summation order) and the first smallest wins. ModelOpt stores the winner in the
    weight's dtype, so the range returned is c * max|W| rounded to W's dtype (as fp32).
    Returns (range, index of the winner, the per-candidate errors).
    """
    mults = [float(c) for c in multipliers]
    if not mults or not all(c > 0 and c == c and c != float("inf") for c in mults):
        raise FormatError(f"fp8.search_amax: multipliers must be positive finite numbers, got {multipliers!r}")
    x = w.float()
    amax = w.abs().amax().float()
    if bool(amax == 0):
        return amax, 0, [0.0] * len(mults)
    errors = []
    for c in mults:
        xq = fake_quant_modelopt(x, amax * c)
        errors.append(float(((x - xq).double() ** 2).sum()))
    best = min(range(len(mults)), key=lambda i: (errors[i], i))
    return (amax * mults[best]).to(w.dtype).float(), best, errors


def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (e4m3.decode(q) * scale.float()).to(dtype)
