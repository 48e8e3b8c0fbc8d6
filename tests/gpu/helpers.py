"""Shared helpers of the GPU kernel tests (imported only where CUDA is present)."""

from __future__ import annotations

import torch

from fp4kit.formats import nvfp4

DEV = "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> bool:
    return (torch.equal(a.packed.cpu(), b.packed.cpu())
            and torch.equal(_bits(a.block_scale).cpu(), _bits(b.block_scale).cpu())
            and torch.equal(_bits(a.global_scale).cpu(), _bits(b.global_scale).cpu()))


def _randn(*shape, dtype=torch.bfloat16, seed=0, scale=0.02):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)
