"""E4M3 (`float8_e4m3fn`): the block-scale format of NVFP4 and the element format of FP8.

bias 7, 3 mantissa bits, max 448, smallest subnormal 2^-9, no Inf, NaN = 0x7F / 0xFF.

`encode` rounds to nearest, ties to even, directly from the input value (no intermediate cast),
and saturates: every finite |x| > 448 and +-Inf become +-448 (0x7E / 0xFE), as torch 2.13's
cast does. The sign bit is copied from the input (-0.0 and negative values that round to zero
give 0x80). NaN keeps its sign: 0x7F or 0xFF. This agrees with `x.to(torch.float8_e4m3fn)` for
fp32, fp16 and bf16 inputs; for float64 inputs it rounds once, where torch goes through fp32.
"""

from __future__ import annotations

import torch

from .constants import (
    E4M3_EXP_BIAS,
    E4M3_MANTISSA_BITS,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_MIN_SUBNORMAL,
    E4M3_NAN_CODE,
    E4M3_VALUES,
)

_TABLES: dict[torch.device, torch.Tensor] = {}
_MIN_NORMAL_EXP = -6  # log2(E4M3_MIN_NORMAL)


# Intended mirror of e2m1._value_table: each format keeps its own decode table per device.
def _value_table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        # From page-locked memory the copy is queued, not waited for (a pageable one would
        # block the host); the source stays referenced by the copy's stream until it runs.
        host = torch.tensor(E4M3_VALUES, dtype=torch.float32)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        _TABLES[device] = table
    return table


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """|x| rounded to the nearest E4M3 magnitude (float64, saturated at 448; NaN stays NaN)."""
    # float64 holds every fp32/fp16/bf16 value exactly, and dividing by a power of two is exact,
    # so `round(a / quantum)` is the one and only rounding step.
    a = x.to(torch.float64).abs()
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1): floor(log2 a) = exp - 1
    binade = torch.clamp(exp - 1, min=_MIN_NORMAL_EXP)  # subnormals share the 2^-6 binade's step
    quantum = torch.ldexp(torch.ones_like(a), binade - E4M3_MANTISSA_BITS)
    return torch.clamp(torch.round(a / quantum) * quantum, max=E4M3_MAX)  # round(): half to even


def encode(x: torch.Tensor) -> torch.Tensor:
    """Round a float tensor to E4M3 bytes (uint8)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"e4m3.encode: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    r = round_to_e4m3(x)
    normal = r >= E4M3_MIN_NORMAL
    mant, exp = torch.frexp(torch.where(normal, r, torch.ones_like(r)))
    # Normal: r = (1 + man/8) * 2^(e-7), e = exp - 1 + 7, man = (2 * mant - 1) * 8.
    man = ((2.0 * mant - 1.0) * 8.0).to(torch.int32)
    normal_code = ((exp - 1 + E4M3_EXP_BIAS) << E4M3_MANTISSA_BITS) | man
    subnormal_code = (r / E4M3_MIN_SUBNORMAL).to(torch.int32)  # 0..7, exact
    code = torch.where(normal, normal_code, subnormal_code)
    code = torch.where(torch.isnan(r), torch.full_like(code, E4M3_NAN_CODE), code)
    code = code | (torch.signbit(x).to(torch.int32) << 7)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8, or a float8_e4m3fn tensor) -> float32 values."""
    if isinstance(codes, torch.Tensor) and codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"e4m3.decode: expected a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    return _value_table(codes.device).index_select(0, codes.reshape(-1).int()).reshape(codes.shape)


def cast(x: torch.Tensor) -> torch.Tensor:
    """`encode` viewed as a float8_e4m3fn tensor."""
    return encode(x).view(torch.float8_e4m3fn)
