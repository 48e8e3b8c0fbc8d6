"""Shared helpers of the interpreter kernel tests."""

from __future__ import annotations

import torch

from fp4kit.formats import nvfp4

DEVICE = "cpu"  # the interpreter's


def _rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_nvfp4(got: nvfp4.NVFP4Tensor, ref: nvfp4.NVFP4Tensor) -> None:
    assert got.packed.shape == ref.packed.shape
    assert torch.equal(got.packed.cpu(), ref.packed.cpu()), "packed codes differ"
    assert torch.equal(_bits(got.block_scale).cpu(), _bits(ref.block_scale).cpu()), "block scales differ"
    assert torch.equal(_bits(got.global_scale).cpu(), _bits(ref.global_scale).cpu()), "global scales differ"


def gemm_tolerance(x, wdq, dtype):
    """Elementwise bound: rounding of the output to `dtype` (half an ulp, relative) plus fp32
    accumulation error K * 2^-24 * sum|x||w| (products of fp16/fp32 inputs: the fp32 reference's
    own error counted twice)."""
    k = x.shape[-1]
    out_ulp = {torch.float32: 2.0**-24, torch.float16: 2.0**-11}[dtype]
    return lambda ref: out_ulp * ref.abs() + 2 * k * 2.0**-24 * (x.double().abs() @ wdq.double().abs().T) + 1e-30
