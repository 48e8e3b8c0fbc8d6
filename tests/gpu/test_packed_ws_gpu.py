"""The Gluon W4A16 GEMM with K split across each program's warpgroups (`kernels.packed_ws`) on an
sm_90 GPU: within bf16 rounding of the fp32 product of the dequantized weight, as close as
`packed_gemm.packed_matmul`, the same bytes call after call, on ragged shapes, bf16 and fp16, split
across programs too, eagerly and from a CUDA graph.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the warp-specialized kernel is written for sm_90", allow_module_level=True)

from fp4kit.kernels import packed_gemm as pg  # noqa: E402
from fp4kit.kernels import packed_linear as pl  # noqa: E402
from fp4kit.kernels import packed_ws as ws  # noqa: E402
from fp4kit.kernels.quantize import quantize  # noqa: E402

pytestmark = pytest.mark.gpu


def _check(n, k, m, dtype, cfgs):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = pg.pack(quantize(torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02), dtype)
    x = torch.randn((m, k), generator=g, device="cuda", dtype=dtype)
    ref = x.float() @ w.unpack().dequantize().T
    packed_err = ((pg.packed_matmul(x, w).float() - ref).norm() / ref.norm()).item()
    for cfg in cfgs:
        got = ws.packed_matmul_ws(x, w, cfg=cfg)
        assert got.dtype == dtype and got.shape == (m, n)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2 and err < 1.2 * packed_err, (cfg, err, packed_err)
        assert torch.equal(got, ws.packed_matmul_ws(x, w, cfg=cfg)), cfg


@pytest.mark.parametrize("n, k", [(3712, 2688), (200, 1008), (64, 128)])
@pytest.mark.parametrize("m", [5, 37, 64])
def test_warp_specialized_gemm_is_the_product(n, k, m):
    # ragged N (200: past the last slab) and K (1008: past the last tile, zeros by TMA); a single K
    # tile (k = 128: three of four warpgroups have none); 2 or 4 warpgroups, split across programs
    # too; activation buffers refilled (XS 2, 3) or not (the default: one per K tile, up to 8)
    _check(n, k, m, torch.bfloat16, ({}, {"P": 2}, {"P": 4, "BLOCK_M": 32, "SPLIT": 2}, {"P": 2, "BLOCK_M": 16, "SPLIT": 3},
                                     {"P": 4, "BLOCK_M": 64, "XS": 2}, {"P": 2, "XS": 3}, {"P": 4, "BLOCK_M": 16, "XS": 2}))


def test_warp_specialized_gemm_fp16_and_several_row_programs():
    _check(2688, 3712, 100, torch.float16, ({}, {"P": 2, "BLOCK_M": 32}, {"BLOCK_M": 32, "XS": 3}))


def test_warp_specialized_gemm_replays_from_a_cuda_graph():
    w = pg.pack(quantize(torch.randn((3712, 2688), device="cuda", dtype=torch.bfloat16) * 0.02))
    x = torch.randn((64, 2688), device="cuda", dtype=torch.bfloat16)
    cfg = {"P": 4, "BLOCK_M": 32, "XS": 3}
    want = ws.packed_matmul_ws(x, w, cfg=cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ws.packed_matmul_ws(x, w, cfg=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ws.packed_matmul_ws(x, w, cfg=cfg)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("n, k", [(3712, 2688), (2688, 3712)])
def test_a_rows_bytes_do_not_depend_on_where_its_block_of_rows_starts(n, k):
    # A last block of rows that M does not fill is moved back to end at row M: its rows sit at
    # other places in their block than in a launch over more rows, with the same bytes. (Where M
    # is below BLOCK_M nothing moves: the box's rows past M read as zeros.)
    w = pg.pack(quantize(torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02))
    x = torch.randn((64, k), device="cuda", dtype=torch.bfloat16)
    for cfg in ({"BLOCK_M": 16}, {"BLOCK_M": 32}, {"BLOCK_M": 32, "SPLIT": 2}, {"BLOCK_M": 16, "P": 2}):
        full = ws.packed_matmul_ws(x, w, cfg=cfg)
        rolled = ws.packed_matmul_ws(torch.roll(x, 4, 0), w, cfg=cfg)  # every row 4 places on
        assert torch.equal(torch.roll(rolled, -4, 0), full), cfg
        for m in (20, 40, 44, 60):
            if m >= cfg["BLOCK_M"]:
                assert torch.equal(ws.packed_matmul_ws(x[:m], w, cfg=cfg), full[:m]), (cfg, m)


def test_packed_linear_hands_16_to_64_rows_of_small_weights_to_it():
    w = pg.pack(quantize(torch.randn((3712, 2688), device="cuda", dtype=torch.bfloat16) * 0.02))
    dev = torch.device("cuda", torch.cuda.current_device())
    assert [pl.uses_ws(m, 3712, 2688, dev) for m in (1, 12, 15, 16, 33, 64, 65)] == [
        False, False, False, True, True, True, False]
    assert not pl.uses_ws(64, 131072, 2688, dev)  # a large weight: packed_matmul
    if torch.cuda.get_device_properties(dev).multi_processor_count == 132:  # H100 SXM, H200
        assert [pl.uses_ws(m, 2688, 3712, dev) for m in (16, 32, 33, 64)] == [False, False, True, True]
    for m in (16, 37, 64):
        x = torch.randn((m, 2688), device="cuda", dtype=torch.bfloat16)
        x16 = x.half()
        w16 = pg.pack(w.unpack(), torch.float16)
        assert torch.equal(pl.packed_linear(x16, w16), ws.packed_matmul_ws(x16, w16))  # fp16: packed_ws's rows
        if not pl.uses_cluster(m, 3712, 2688, dev):  # bf16: packed_cluster's rows first
            assert torch.equal(pl.packed_linear(x, w), ws.packed_matmul_ws(x, w))
        assert not torch.equal(pg.packed_matmul(x, w), ws.packed_matmul_ws(x, w))  # other sums, other bytes
    x = torch.randn((8, 2688), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(pl.packed_linear(x, w), pg.packed_matmul(x, w))


def test_rows_past_m_read_as_zeros_give_the_bytes_of_a_full_block():
    # fewer rows than BLOCK_M: the activation box's rows past M are TMA's zero fill; each row's
    # bytes are those of the same launch shape (SPLIT given: the one-wave rule splits by M) over a
    # full block, whether that block's other rows hold zeros or data
    g = torch.Generator(device="cuda").manual_seed(7)
    for n, k in ((3712, 2688), (2688, 3712)):
        w = pg.pack(quantize(torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02))
        x = torch.randn((64, k), generator=g, device="cuda", dtype=torch.bfloat16)
        for cfg in ({"BLOCK_M": 32, "SPLIT": 1}, {"BLOCK_M": 32, "SPLIT": 2}, {"BLOCK_M": 64, "P": 2, "SPLIT": 1}):
            full = ws.packed_matmul_ws(x[:cfg["BLOCK_M"]], w, cfg=cfg)
            for m in (5, 20):
                zeros = torch.zeros_like(x[:cfg["BLOCK_M"]])
                zeros[:m] = x[:m]
                got = ws.packed_matmul_ws(x[:m], w, cfg=cfg)
                assert torch.equal(got, full[:m]), (n, cfg, m)
                assert torch.equal(got, ws.packed_matmul_ws(zeros, w, cfg=cfg)[:m]), (n, cfg, m)
