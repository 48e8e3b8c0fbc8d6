"""E2M1 (`float4_e2m1fn`): the 4-bit element format of NVFP4.

code = sign << 3 | index, index 0..7 -> magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6.

`encode` is ModelOpt's export cast (`NVFP4QTensor._cast_fp4`), stated exactly:
- round to nearest, ties to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
  2.5 -> 2, 3.5 -> 4, 5 -> 4;
- saturate: anything above 5 (including +-Inf) becomes +-6;
- the sign comes from `x < 0`, so a small negative value that rounds to zero is 0x8 and -0.0 is
  0x0;
- NaN (either sign) becomes 0x7 (+6), as ModelOpt's export writes it.
Comparisons happen in the input's own dtype; every midpoint is exact in fp16, bf16 and fp32, so
no input is rounded twice.
"""

from __future__ import annotations

import torch

from .constants import E2M1_MIDPOINTS, E2M1_NAN_CODE, E2M1_TIES_UP, E2M1_VALUES

_TABLES: dict[torch.device, torch.Tensor] = {}
_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


# Intended mirror of e4m3._value_table: each format keeps its own decode table per device.
def _value_table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        # From page-locked memory the copy is queued, not waited for (a pageable one would
        # block the host); the source stays referenced by the copy's stream until it runs.
        host = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        _TABLES[device] = table
    return table


def _pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: a packed byte's two values, the low nibble's first (from `_value_table`)."""
    table = _PAIR_TABLES.get(device)
    if table is None:
        values = _value_table(device)
        table = _PAIR_TABLES[device] = torch.stack((values.repeat(16), values.repeat_interleave(16)), dim=-1)
    return table


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes (uint8 [..., K/2], two per byte, the low nibble first) -> float32 [..., K]:
    `decode(pack.unpack_nibbles(packed))` by one lookup per byte. Every byte holds two valid
    codes, so nothing is checked or read back."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() == 0:
        raise TypeError(f"e2m1.decode_packed: expected a uint8 tensor of at least one dimension, got "
                        f"{getattr(packed, 'dtype', type(packed))}")
    return _pair_table(packed.device).index_select(0, packed.reshape(-1).int()).reshape(
        *packed.shape[:-1], packed.shape[-1] * 2)


def encode(x: torch.Tensor) -> torch.Tensor:
    """Round a float tensor to E2M1 codes (uint8, one code 0..15 per element)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"e2m1.encode: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    a = x.abs()
    bounds = torch.tensor(E2M1_MIDPOINTS, dtype=x.dtype, device=x.device)
    # Number of midpoints strictly below |x| = the index for every non-tie value.
    index = torch.bucketize(a, bounds, right=False).to(torch.uint8)
    # At the three midpoints whose upper neighbour is even, move up.
    for tie in E2M1_TIES_UP:
        index += (a == tie).to(torch.uint8)
    index = torch.where(torch.isnan(x), torch.full_like(index, E2M1_NAN_CODE), index)
    sign = (x < 0).to(torch.uint8) << 3
    return sign | index


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32 values; code 0x8 decodes to -0.0."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"e2m1.decode: expected a uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"e2m1.decode: codes must be 0..15, found {int(codes.max())}")
    return _value_table(codes.device).index_select(0, codes.reshape(-1).int()).reshape(codes.shape)
