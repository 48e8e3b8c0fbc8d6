"""Philox-4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), any
number of rounds, in pure torch on any device.

A counter of four 32-bit words and a key of two are mixed by R rounds of

    (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2      (32 x 32 -> 64-bit products)
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

with the key bumped by the Weyl constants (k0 += W0, k1 += W1, mod 2^32) before every round but
the first. R = 10 is the published generator (Random123's `philox4x32_10`); serving engines run
fewer rounds for speed (R = 5 or 7).

Words are held in int64 tensors with values in [0, 2^32). The 32 x 32-bit products are formed
from 16-bit halves so that no intermediate leaves int64's range: the result is the same on every
device and does not rest on wrap-around of signed overflow.
"""

from __future__ import annotations

import torch

from .errors import FormatError

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF


def mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a constant a < 2^32 and int64 words b in [0, 2^32)."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    t0 = a * b_lo  # < 2^48
    t1 = a * b_hi  # < 2^48
    mid = t0 + ((t1 & 0xFFFF) << 16)  # < 2^49
    return (t1 >> 16) + (mid >> 32), mid & MASK32


def _word(x, what: str, device) -> torch.Tensor:
    t = torch.as_tensor(x, device=device)
    if t.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16):
        raise FormatError(f"philox: {what} must be integer words, got {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and (bool((t < 0).any()) or bool((t > MASK32).any())):
        raise FormatError(f"philox: {what} words must lie in [0, 2^32)")
    return t


def philox4x32(counter, key, rounds: int = 10) -> torch.Tensor:
    """Philox-4x32-R of counters [..., 4] under keys [..., 2] (broadcast together; int64 words in
    [0, 2^32)) -> int64 words [..., 4]."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise FormatError(f"philox: rounds must be a positive integer, got {rounds!r}")
    device = counter.device if isinstance(counter, torch.Tensor) else None
    c = _word(counter, "counter", device)
    k = _word(key, "key", c.device)
    if c.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise FormatError(f"philox: counter must end in 4 words and key in 2, got {tuple(c.shape)} and {tuple(k.shape)}")
    c0, c1, c2, c3 = c.unbind(-1)
    k0, k1 = k.unbind(-1)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)
