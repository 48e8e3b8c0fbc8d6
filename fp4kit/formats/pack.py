"""Two E2M1 codes per byte: element 2j in the LOW nibble, element 2j+1 in the HIGH nibble.

So the pair (+6, -0.5) = codes (0x7, 0x9) packs to 0x97. Packed shape is [..., K/2].
"""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (each 0..15, K even) -> packed uint8 [..., K/2]."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles: expected uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_nibbles: codes must be 0..15, found {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> uint8 codes [..., K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles: expected uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_nibbles: expected at least one dimension")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
