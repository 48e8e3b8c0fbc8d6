"""How far a quantized tensor is from its original."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def sqnr_terms(w: torch.Tensor, w_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w^2, sum (w - w_hat)^2) as float64 0-d tensors on w's device, without a host sync;
    terms of disjoint parts of a tensor add up to the whole tensor's (`sqnr_db_of`)."""
    w = w.double()
    return w.pow(2).sum(), (w - w_hat.double()).pow(2).sum()


class Terms(NamedTuple):
    """What the quantize stage reports of one NVFP4 weight: `part`, partial sums on its device, a
    [parts, 3] tensor whose column sums in float64 (`sums`) are sum w^2, sum (w - dequantized)^2
    and the number of blocks on the 4/6 rule's 4 candidate, out of `blocks` (an int). The GPU
    kernels leave one fp32 row per program, and the quantize stage adds every weight's rows once
    all are queued, so that queueing a weight launches no reduction; the fraction is divided out
    where it is read (`frac4`)."""

    part: torch.Tensor
    blocks: int

    @classmethod
    def of(cls, signal, noise, count4, blocks: int) -> "Terms":
        """Terms from the three sums as separate 0-d tensors (on one device)."""
        sums = [torch.as_tensor(v, dtype=torch.float64) for v in (signal, noise, count4)]
        return cls(torch.stack(sums).reshape(1, 3), blocks)

    @property
    def sums(self) -> torch.Tensor:
        """float64 [3]: sum w^2, sum (w - dequantized)^2, blocks on the 4 candidate."""
        return self.part.sum(0, dtype=torch.float64)

    @property
    def signal(self) -> torch.Tensor:
        return self.sums[0]

    @property
    def noise(self) -> torch.Tensor:
        return self.sums[1]

    @property
    def count4(self) -> torch.Tensor:
        return self.sums[2]

    @property
    def frac4(self) -> float:
        """The fraction of blocks on the 4 candidate (reads count4 back)."""
        return float(self.count4) / self.blocks


def sqnr_db_of(signal: float, noise: float) -> float:
    """10 log10(signal / noise): inf for a lossless copy, -inf for an all-zero original quantized
    with loss."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(sum w^2 / sum (w - w_hat)^2) in dB, the sums
    in float64 (so a figure does not depend on the tensor's size or dtype); inf for a lossless
    copy, -inf for an all-zero original quantized with loss."""
    signal, noise = sqnr_terms(w, w_hat)
    return sqnr_db_of(float(signal), float(noise))
