"""How far a quantized tensor is from its original."""

from __future__ import annotations

import math

import torch


def sqnr_terms(w: torch.Tensor, w_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w^2, sum (w - w_hat)^2) as float64 0-d tensors on w's device, without a host sync;
    terms of disjoint parts of a tensor add up to the whole tensor's (`sqnr_db_of`)."""
    w = w.double()
    return w.pow(2).sum(), (w - w_hat.double()).pow(2).sum()


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
