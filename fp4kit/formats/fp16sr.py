"""fp32 -> fp16 with stochastic rounding, as serving engines store a Mamba SSM state in fp16
(`--mamba-ssm-cache-dtype float16 --enable-mamba-cache-stochastic-rounding`).

The rule is the one of the PTX conversion `cvt.rs.f16x2.f32` (no `.satfinite`), stated as
FlashInfer's software path writes it (flashinfer 0.7.4, include/flashinfer/mamba/conversion.cuh):
13 random bits are added below the fp16 result's last mantissa bit, and the sum is truncated.

    |x| as fp32 bits a; e = a >> 23
    e >= 113 (fp16 normal range and above):  s = a - (112 << 23)            (exponent re-biased)
    90 <= e <= 112 (fp16 subnormal range):   s = (mantissa | 2^23) >> (113 - e)
    e < 90:                                  s = 0
    fp16 magnitude = min((s + r) >> 13, 0x7C00),  r = the 13 random bits

So a value between two fp16 neighbours goes up with probability (its distance from the lower one)
/ ulp, truncated to 13 bits (bits of an fp16-subnormal input below 2^-37 are dropped before the
random bits are added). Overflow is not saturated: anything that rounds past 65504 is +-Inf (at
random for 65504 < |x| < 65536). +-Inf stays +-Inf, NaN becomes the quiet NaN 0x7E00 with x's sign,
and the sign of zero is kept.

Random bits (`random_bits`): Philox-4x32-R keyed by the 64-bit seed (k0 = low word, k1 = high
word), counter = (o_lo, o_hi, 0, 0) for the flat offset o of the first element of each group of
four consecutive elements; element j of the group takes word j, low 13 bits. This is FlashInfer's
single-token selective-state-update kernel (kernel_selective_state_update_stp.cuh, 0.7.4), whose
counters are the elements' flat offsets in the state cache. vLLM's Triton kernel uses the same
counters and seeds but another word and bit assignment (word 0 of each element, bits 12..0 and
28..16 of a pair), so the two engines' streams differ; their rounding rule is the same. Engines
draw a fresh 32-bit seed per layer and decode step from torch's generator.
"""

from __future__ import annotations

import torch

from .errors import FormatError
from .philox import MASK32, philox4x32

RANDOM_BITS = 13
FP16_INF = 0x7C00
FP16_QNAN = 0x7E00


def round_stochastic(x: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """fp32 x -> fp16 by the rule above; rand: integer tensor of x's shape (or broadcasting), whose
    low 13 bits are used."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise FormatError(f"fp16sr.round_stochastic: expected a float32 tensor, got {getattr(x, 'dtype', type(x))}")
    a = x.view(torch.int32).to(torch.int64) & MASK32
    sign = (a >> 31) << 15
    mag = a & 0x7FFFFFFF
    e = mag >> 23
    normal = mag - (112 << 23)
    shift = (113 - e).clamp(min=0, max=31)
    sub = ((mag & 0x7FFFFF) | 0x800000) >> shift
    s = torch.where(e >= 113, normal, torch.where(e >= 90, sub, torch.zeros_like(mag)))
    r = torch.as_tensor(rand, device=x.device).to(torch.int64) & ((1 << RANDOM_BITS) - 1)
    h = ((s + r) >> RANDOM_BITS).clamp(max=FP16_INF)
    h = torch.where(mag > 0x7F800000, FP16_QNAN, torch.where(mag == 0x7F800000, FP16_INF, h))
    bits = sign | h
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)


def random_bits(shape, seed: int, rounds: int, offset: int = 0, device=None) -> torch.Tensor:
    """The 13 random bits of each element of a contiguous tensor of `shape` whose first element
    sits at flat `offset` (int64, values 0..8191)."""
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise FormatError(f"fp16sr.random_bits: seed must be an integer in [0, 2^64), got {seed!r}")
    if not isinstance(offset, int) or offset < 0:
        raise FormatError(f"fp16sr.random_bits: offset must be a non-negative integer, got {offset!r}")
    n = 1
    for d in shape:
        n *= int(d)
    o = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    base = o - (o % 4)
    counter = torch.stack([base & MASK32, base >> 32, torch.zeros_like(base), torch.zeros_like(base)], dim=-1)
    key = torch.tensor([seed & MASK32, seed >> 32], dtype=torch.int64, device=device)
    words = philox4x32(counter, key, rounds)
    return words.gather(-1, (o % 4).unsqueeze(-1)).squeeze(-1).reshape(tuple(shape)) & ((1 << RANDOM_BITS) - 1)


def round_state(x: torch.Tensor, seed: int, rounds: int, offset: int = 0) -> torch.Tensor:
    """A contiguous fp32 state tensor stored to fp16 with stochastic rounding (the engines' SSM-state
    write): `round_stochastic` with `random_bits` of its elements."""
    if not x.is_contiguous():
        raise FormatError("fp16sr.round_state: the state must be contiguous (its random bits follow flat offsets)")
    return round_stochastic(x, random_bits(x.shape, seed, rounds, offset, device=x.device))
