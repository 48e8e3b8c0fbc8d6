"""Shared helpers of the GPU kernel tests (imported only where CUDA is present)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

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


@triton.jit
def _late_writer(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] (bytes), written late: the launch after this one may start at once
    (`gdc_launch_dependents` first), then each program spins `spin` dependent steps."""
    gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offs, mask=offs < n, other=0)
    t = v.to(tl.float32) + 1.0
    for _ in range(spin):
        t = t * 1.0000001 + 1e-7
    tl.store(dst_ptr + offs, tl.where(t == -1.0, 0, v), mask=offs < n)  # t is never -1: v, after the spin


def write_late(src: torch.Tensor, dst: torch.Tensor, spin: int = 20000) -> None:
    """dst's bytes = src's, by a launch that lets the launch after it start at once and writes
    tens of microseconds later: a programmatic dependent launch after it that reads dst before
    its wait sees the old bytes."""
    n = dst.numel() * dst.element_size()
    _late_writer[(triton.cdiv(n, 1024),)](src.view(torch.uint8), dst.view(torch.uint8), n, spin, BLOCK=1024)


def eager_and_replayed(step, check, replays: int = 10) -> None:
    """check(step()) on an eager call, then check(out) after each of `replays` replays of a CUDA
    graph of step (out: the graph's output)."""
    check(step())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        check(out)
