"""The W4A16 GEMM with K split over a thread block cluster (`kernels.packed_cluster`, CUDA C++ by
NVRTC) on an sm_90 GPU: within bf16 rounding of the fp32 product of the dequantized weight, as close
as `packed_gemm.packed_matmul`, the same bytes call after call and whatever the other rows hold,
on ragged shapes, at every launch shape kind, eagerly and from a CUDA graph.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the cluster kernel is written for sm_90", allow_module_level=True)

from fp4kit.kernels import packed_cluster as pc  # noqa: E402
from fp4kit.kernels import packed_gemm as pg  # noqa: E402
from fp4kit.kernels import packed_linear as pl  # noqa: E402
from fp4kit.kernels.quantize import quantize  # noqa: E402

pytestmark = pytest.mark.gpu

LAUNCHES = ({}, {"CL": 1}, {"CL": 2, "DB": 0}, {"CL": 3, "PF": 3, "STAGES": 2}, {"CL": 8, "WG": 1, "STAGES": 4},
            {"CL": 5, "WG": 2}, {"CL": 4, "WG": 2, "WN": 2}, {"CL": 8, "WG": 1, "WN": 4}, {"CL": 6, "WG": 1, "WN": 3, "STAGES": 2},
            {"CL": 1, "WG": 1, "WN": 2, "PF": 3}, {"CL": 4, "WG": 2, "WN": 2, "DB": 1, "STAGES": 4},
            {"BN": 8, "CL": 2}, {"BN": 40, "WG": 2}, {"BN": 24, "CL": 4, "WG": 1, "WN": 2}, {"PDL": 1},
            {"BN": 56, "WG": 2, "PDL": 1})


def _weight(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return pg.pack(quantize(torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)), g


@pytest.mark.parametrize("n, k", [(3712, 2688), (2688, 3712), (200, 1008), (100, 1008), (64, 128)])
@pytest.mark.parametrize("m", [1, 5, 16, 37, 64])
def test_cluster_gemm_is_the_product(n, k, m):
    # ragged N (200, 100: past the last slab, 100 not a multiple of 8) and K (1008: past the last
    # tile, zeros by cp.async); a single K tile (k = 128: warpgroups with no tile)
    w, g = _weight(n, k, n + k + m)
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.unpack().dequantize().T
    packed_err = ((pg.packed_matmul(x, w).float() - ref).norm() / ref.norm()).item()
    for cfg in LAUNCHES:
        got = pc.packed_matmul_cluster(x, w, cfg=cfg)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2 and err < 1.2 * packed_err, (cfg, err, packed_err)
        assert torch.equal(got, pc.packed_matmul_cluster(x, w, cfg=cfg)), cfg


@pytest.mark.parametrize("cfg", [{"CL": 2, "WG": 4, "WN": 1}, {"CL": 4, "WG": 2, "WN": 2}, {"CL": 3, "WG": 1, "WN": 3}])
def test_the_plain_layout_gives_the_swizzled_layouts_bytes(cfg):
    # the activation tiles in plain core matrices (a timing variant) feed the wgmma the same values,
    # summed in the same order
    w, g = _weight(200, 1008, 11)
    for m in (5, 37, 64):
        x = torch.randn((m, 1008), generator=g, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(pc.packed_matmul_cluster(x, w, cfg=cfg, swizzle=False),
                           pc.packed_matmul_cluster(x, w, cfg=cfg)), (cfg, m)


def test_slices_of_weight_rows_and_overlapped_tiles_keep_the_sums_order():
    # WN slices of a block read one share's activation tiles, and DB 1 leaves a tile's wgmma running
    # while the next is decoded; the K parts, their tiles and the wgmma into each accumulator are
    # those of the same CL and WG with WN 1 and DB 0, in the same order, so the bytes are too
    w, g = _weight(3712, 2688, 13)
    for m in (7, 33, 64):
        x = torch.randn((m, 2688), generator=g, device="cuda", dtype=torch.bfloat16)
        for cl, wg in ((4, 2), (8, 1), (2, 1)):
            one = pc.packed_matmul_cluster(x, w, cfg={"CL": cl, "WG": wg, "WN": 1, "DB": 0})
            for wn in (1, 2, 3, 4):
                for db in (0, 1):
                    if wg * wn <= 4 and (wn, db) != (1, 0):
                        got = pc.packed_matmul_cluster(x, w, cfg={"CL": cl, "WG": wg, "WN": wn, "DB": db})
                        assert torch.equal(got, one), (cl, wg, wn, db)


def test_the_wgmmas_n_keeps_the_bytes():
    # BN (the wgmma's N, a multiple of 8; fewer than M: more blocks of rows) leaves each output's sum
    # over K that of the same CL and WG
    w, g = _weight(3712, 2688, 17)
    for m in (9, 36, 52, 64):
        x = torch.randn((m, 2688), generator=g, device="cuda", dtype=torch.bfloat16)
        for cl, wg in ((2, 4), (2, 2)):
            one = pc.packed_matmul_cluster(x, w, cfg={"CL": cl, "WG": wg})
            for bn in (8, 32, -(-m // 8) * 8, 64):
                got = pc.packed_matmul_cluster(x, w, cfg={"CL": cl, "WG": wg, "BN": bn})
                assert torch.equal(got, one), (m, cl, wg, bn)


def test_a_rows_bytes_do_not_depend_on_the_other_rows():
    # rows past M are cp.async's zero fill: a row's bytes are those of the same launch shape over
    # more rows, whether those hold zeros or data
    w, g = _weight(3712, 2688, 3)
    x = torch.randn((48, 2688), generator=g, device="cuda", dtype=torch.bfloat16)
    for cfg in ({"CL": 2, "BN": 48}, {"CL": 3, "WG": 2, "BN": 48}, {"CL": 4, "WG": 1, "WN": 4, "BN": 48}):
        full = pc.packed_matmul_cluster(x, w, cfg=cfg)
        for m in (33, 40, 47):  # the same wgmma N (48) as the full launch
            assert torch.equal(pc.packed_matmul_cluster(x[:m], w, cfg=cfg), full[:m]), (cfg, m)
            zeros = torch.zeros_like(x)
            zeros[:m] = x[:m]
            assert torch.equal(pc.packed_matmul_cluster(zeros, w, cfg=cfg)[:m], full[:m]), (cfg, m)


def test_the_default_launch_takes_any_leading_shape_and_layout():
    # the default launch (kept per problem shape) gives the bytes of the same launch shape asked for
    # through config, for 2-d, 3-d and strided activations, and no rows give no rows
    w, g = _weight(3712, 2688, 19)
    x = torch.randn((2, 24, 2688), generator=g, device="cuda", dtype=torch.bfloat16)
    flat = x.reshape(48, 2688)
    want = pc.packed_matmul_cluster(flat, w, cfg={})
    assert torch.equal(pc.packed_matmul_cluster(flat, w), want)
    assert torch.equal(pc.packed_matmul_cluster(x, w), want.reshape(2, 24, 3712))
    strided = torch.randn((48, 2 * 2688), generator=g, device="cuda", dtype=torch.bfloat16)[:, ::2]
    assert not strided.is_contiguous()
    assert torch.equal(pc.packed_matmul_cluster(strided, w), pc.packed_matmul_cluster(strided.contiguous(), w, cfg={}))
    assert pc.packed_matmul_cluster(x[:, :0], w).shape == (2, 0, 3712)


def test_cluster_gemm_replays_from_a_cuda_graph():
    w, g = _weight(2688, 3712, 5)
    x = torch.randn((40, 3712), generator=g, device="cuda", dtype=torch.bfloat16)
    want = pc.packed_matmul_cluster(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pc.packed_matmul_cluster(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_a_dependent_launch_waits_for_the_kernel_that_writes_its_activations():
    # PDL 1: the launch may start while the copy before it runs; it must read x only after that
    # copy is done (x holds NaN until then), eagerly and replayed from a graph
    w, g = _weight(3712, 2688, 19)
    x = torch.randn((48, 2688), generator=g, device="cuda", dtype=torch.bfloat16)
    want = pc.packed_matmul_cluster(x, w)
    staged = torch.full_like(x, float("nan"))

    def step():
        staged.fill_(float("nan"))
        torch.cuda._sleep(20_000)
        staged.copy_(x)
        return pc.packed_matmul_cluster(staged, w, cfg={"PDL": 1}) * 1

    for _ in range(20):
        assert torch.equal(step(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_the_launcher_refuses_other_activations():
    w, _ = _weight(64, 128, 1)
    with pytest.raises(ValueError, match="bf16 activations"):
        pc.packed_matmul_cluster(torch.randn((4, 128), device="cuda", dtype=torch.float16), w)
    with pytest.raises(ValueError, match="1 to 64 activation rows"):
        pc.packed_matmul_cluster(torch.randn((65, 128), device="cuda", dtype=torch.bfloat16), w)


def test_packed_linear_hands_it_the_rows_cluster_rows_names():
    w, g = _weight(3712, 2688, 9)
    dev = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_properties(dev).multi_processor_count == 132:  # H100 SXM, H200
        assert [pl.uses_cluster(m, 3712, 2688, dev) for m in (8, 15, 16, 48, 64)] == [False, False, True, True, True]
        assert pl.uses_cluster(32, 2688, 3712, dev)  # 84 blocks of 132, at least 0.6 of them
    for m in (16, 33, 48, 64):
        x = torch.randn((m, 2688), generator=g, device="cuda", dtype=torch.bfloat16)
        if pl.uses_cluster(m, 3712, 2688, dev):
            assert torch.equal(pl.packed_linear(x, w), pc.packed_matmul_cluster(x, w))
