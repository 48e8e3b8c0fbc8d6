"""Exceptions raised by the formats when an input cannot be represented."""

from __future__ import annotations

import torch


class FormatError(ValueError):
    """An input the number formats refuse (bad shape, dtype, or non-finite values)."""


def check_float_tensor(x: object, what: str) -> torch.Tensor:
    """Raise a clear error unless `x` is a non-empty fp32/fp16/bf16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise FormatError(
            f"{what}: dtype {x.dtype} is not supported; expected float32, float16 or bfloat16"
        )
    if x.dim() == 0:
        raise FormatError(f"{what}: a 0-d tensor has no blocks to quantize")
    if x.numel() == 0:
        raise FormatError(f"{what}: tensor of shape {tuple(x.shape)} is empty")
    return x


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise naming the count and first position of NaN/Inf values, if any."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        first = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        raise FormatError(
            f"{what}: {n_nan} NaN and {n_inf} Inf values (first at index {first}); "
            "non-finite weights cannot be quantized"
        )
