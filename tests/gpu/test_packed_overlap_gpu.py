"""The Gluon W4A16 GEMM with overlapped K tiles (`kernels.packed_overlap`) on an sm_90 GPU: its
bytes equal `packed_gemm.packed_matmul`'s with the same BLOCK_M and split (the same tiles, wgmma
and sums in the same order), on ragged shapes, bf16 and fp16, eagerly and from a CUDA graph.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the overlapped kernel is written for sm_90", allow_module_level=True)

from fp4kit.kernels import packed_gemm as pg  # noqa: E402
from fp4kit.kernels import packed_overlap as po  # noqa: E402
from fp4kit.kernels.quantize import quantize  # noqa: E402

pytestmark = pytest.mark.gpu


def _same_launch(x, w, cfg):
    c = po.config(x.shape[0], w.n, w.k, x.device, cfg)
    return pg.packed_matmul(x, w, cfg={"BLOCK_M": c["BLOCK_M"], "num_warps": 4, "SPLIT": c["SPLIT"]})


def _check(n, k, m, dtype, cfgs):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = pg.pack(quantize(torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02), dtype)
    x = torch.randn((m, k), generator=g, device="cuda", dtype=dtype)
    ref = x.float() @ w.unpack().dequantize().T
    for cfg in cfgs:
        got = po.packed_matmul_overlapped(x, w, cfg=cfg)
        assert got.dtype == dtype and got.shape == (m, n)
        assert torch.equal(got, _same_launch(x, w, cfg)), cfg
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("n, k", [(3712, 2688), (200, 1008), (64, 128)])
@pytest.mark.parametrize("m", [5, 37, 64])
def test_overlapped_gemm_equals_the_packed_kernel_byte_for_byte(n, k, m):
    # ragged N (200: past the last slab) and K (1008: past the last tile, zeros by TMA); one
    # activation tile (m <= 64), a single K tile (k = 128); 1-3 tiles in flight, loads 2 or 3
    # tiles ahead, with and without L2 prefetch
    _check(n, k, m, torch.bfloat16, ({}, {"SPLIT": 1, "STAGES": 2}, {"STAGES": 4, "AHEAD": 3, "PREFETCH": 4},
                                     {"BLOCK_M": 16, "SPLIT": 2, "PREFETCH": 6}))


def test_overlapped_gemm_fp16_and_several_row_programs():
    _check(2688, 3712, 100, torch.float16, ({}, {"AHEAD": 3}))


def test_overlapped_gemm_replays_from_a_cuda_graph():
    w = pg.pack(quantize(torch.randn((3712, 2688), device="cuda", dtype=torch.bfloat16) * 0.02))
    x = torch.randn((64, 2688), device="cuda", dtype=torch.bfloat16)
    want = po.packed_matmul_overlapped(x, w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        po.packed_matmul_overlapped(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = po.packed_matmul_overlapped(x, w)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, po.packed_matmul_overlapped(x, w))


def test_overlapped_gemm_refuses_what_it_cannot_run():
    w = pg.pack(quantize(torch.randn((64, 128), device="cuda", dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="packed for"):
        po.packed_matmul_overlapped(torch.randn((4, 128), device="cuda", dtype=torch.float16), w)
    with pytest.raises(RuntimeError, match="CUDA device"):
        po.packed_matmul_overlapped(torch.randn((4, 128), dtype=torch.bfloat16), w)
    for stages in (1, 5):
        with pytest.raises(ValueError, match="STAGES"):
            po.packed_matmul_overlapped(torch.randn((4, 128), device="cuda", dtype=torch.bfloat16), w,
                                        cfg={"STAGES": stages})
