"""fp4kit.kernels.w4a16_gemm: dequantize bit for bit, the GEMM within stated tolerances, routing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.formats import nvfp4  # noqa: E402
from fp4kit.formats.errors import FormatError  # noqa: E402
from fp4kit.kernels import backend, launch, mma, tiles, w4a16_gemm  # noqa: E402

from .helpers import DEVICE, _bits, _rand, gemm_tolerance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchlib import gemv_probe  # noqa: E402

W4A16 = launch.table("w4a16")


# --------------------------------------------------------------------------------------------
# dequantize: the GEMM's in-register weights equal W.dequantize() bit for bit
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_dequantize_exact(dtype, rule):
    w = _rand(40, 80, seed=7)  # K=80: a partial 64-wide tile; N=40: a partial row tile
    w[3] = 0.0
    w[5, :16] *= 1e-7  # subnormal e4m3 block scales
    wq = nvfp4.quantize(w, scale_rule=rule)
    got = w4a16_gemm.dequantize(wq.to(DEVICE), dtype)
    assert torch.equal(_bits(got).cpu(), _bits(wq.dequantize(dtype)))


def test_dequantize_every_code_and_scale_byte():
    # All 256 packed bytes against all 126 finite positive scale bytes (subnormals included).
    codes = torch.arange(256, dtype=torch.uint8).repeat(126, 1)  # [126, 256] -> K = 512
    scale_bytes = torch.arange(1, 127, dtype=torch.uint8)[:, None].repeat(1, 32)
    wq = nvfp4.NVFP4Tensor(codes, scale_bytes.view(torch.float8_e4m3fn), torch.tensor(0.37))
    for dtype in (torch.float32, torch.float16):
        got = w4a16_gemm.dequantize(wq.to(DEVICE), dtype)
        assert torch.equal(_bits(got).cpu(), _bits(wq.dequantize(dtype)))


# --------------------------------------------------------------------------------------------
# W4A16 GEMM
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 17, 70, 140])
@pytest.mark.parametrize("split", [None, 1])
def test_w4a16_matmul(dtype, m, split):
    n, k = 72, 160
    wq = nvfp4.quantize(_rand(n, k, seed=8), scale_rule="4o6")
    x = _rand(m, k, seed=9, dtype=dtype)
    cfg = None
    if split == 1:
        cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE))
        cfg.update(SPLIT=1, k_per_split=k)
    y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=cfg).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    # the CUDA-core GEMV and the mma kernel (GPU) multiply by the fp32 weights, the wgmma kernel
    # by them in x's dtype
    used = cfg or w4a16_gemm.config(m, n, k, torch.device(DEVICE), dtype)
    wdq = wq.dequantize(torch.float32 if used.get("gemv") or used.get("mma") else dtype)
    ref = x.double() @ wdq.double().T
    assert torch.all((y.double() - ref).abs() <= gemm_tolerance(x, wdq, dtype)(ref))
    torch_y = w4a16_gemm.w4a16_matmul(x, wq, backend="torch")
    assert torch_y.shape == y.shape


@pytest.mark.parametrize("m", [3, 17])
def test_w4a16_bf16_on_the_matrix_units(m):
    # bf16 activations where the matrix units take them: on the CPU the wgmma tiles
    # (`tiles.accumulate`), whose tl.dot runs in the interpreter on exact fp32 operands
    # (`backend.exact_dot`: the interpreter's own bf16 dot returns wrong values). Against the
    # product with the bf16-dequantized weights; the interpreter's fp32 -> bf16 casts truncate
    # (each rounded value up to 2^-7 towards zero), so the bound is loose, but a wrong product is off
    # by O(1) or more.
    n, k = 64, 128
    wq = nvfp4.quantize(_rand(n, k, seed=30), scale_rule="4o6")
    x = _rand(m, k, seed=31, dtype=torch.bfloat16)
    if backend.interpreted(w4a16_gemm._w4a16_kernel):
        cfg = w4a16_gemm.config(m, n, k, torch.device("cpu"), torch.bfloat16)
        assert not cfg.get("gemv") and not cfg.get("mma")
    y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE)).cpu()
    ref = x.double() @ wq.dequantize(torch.bfloat16).double().T
    assert y.dtype == torch.bfloat16 and float((y.double() - ref).norm() / ref.norm()) < 5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("nk", [(72, 160), (64, 256)])  # ragged (masked) and even tiles
def test_w4a16_gemv(dtype, m, nk):
    # The CUDA-core kernel for a few rows (the launch table's GEMV), with and without split-K. Its
    # weights are W.dequantize()'s fp32 values (not rounded to the activation dtype).
    tables = launch.override(W4A16, GEMV={"max_m": 4}, MMA={"max_m": 0})
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=12), scale_rule="4o6")
    x = _rand(m, k, seed=13, dtype=dtype)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE), tables=tables)
    assert cfg["gemv"]
    assert w4a16_gemm.config(m, n, k, torch.device(DEVICE)).get("gemv", False) == (m <= 2)  # the table given decides
    for split in (cfg["SPLIT"], 1):
        forced = dict(cfg, SPLIT=split, k_per_split=cfg["k_per_split"] if split > 1 else k)
        y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=forced).cpu()
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.all((y.double() - ref).abs() <= gemm_tolerance(x, wdq, dtype)(ref)), split


@pytest.mark.parametrize("nk", [(72, 160), (64, 256), (40, 400)])  # ragged K, even K, more K tiles than in flight
def test_w4a16_gemv_tiles_in_flight_change_no_bit(nk):
    # AHEAD only moves the weights' loads earlier: every K tile is summed in the same order, so
    # 2 and 3 tiles in flight give AHEAD = 1's output bit for bit, whole and split over K.
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=31), scale_rule="4o6")
    x = _rand(1, k, seed=32, dtype=torch.float16)
    base = dict(gemv=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=32, num_warps=1, num_stages=1)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    for split in (1, 2):  # two splits: the first one's tiles in flight run past its K range
        cfg = dict(base, SPLIT=split, k_per_split=-(-k // (32 * split)) * 32)
        one = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=dict(cfg, AHEAD=1)).cpu()
        assert torch.equal(one, w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=cfg).cpu())  # the default
        assert torch.all((one.double() - ref).abs() <= gemm_tolerance(x, wdq, torch.float16)(ref)), split
        for ahead in (2, 3):
            got = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=dict(cfg, AHEAD=ahead)).cpu()
            assert torch.equal(got, one), (split, ahead)
    with pytest.raises(Exception, match="AHEAD"):
        w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=dict(base, SPLIT=1, k_per_split=k, AHEAD=4))


@pytest.mark.parametrize("m", [1, 5, 9, 16])
@pytest.mark.parametrize("nk", [(40, 256), (72, 400), (64, 224)])
@pytest.mark.parametrize("launch", [(2, 4, 2, 0), (1, 8, 1, 0), (1, 1, 2, 0, 4), (2, 2, 1, 0, 2)])
def test_w4a16_mma(m, nk, launch):
    # The register-fed matrix-unit kernel (the launch table's MMA), forced: on a GPU its inline PTX, here
    # its interpreter form (the same lanes, loads, K order and epilogue; the warp's mma.sync
    # emulated). One or two activation tiles (9, 16 rows) and weight tiles per warp, ragged N
    # (rows past N read the last one), K of 2, 3.125 (K / 16 odd: scale bytes one at a time)
    # and 1.75 steps, split-K and not; the K range shared by 2 or 4 groups of warps (runs of whole
    # steps, the last one ragged or masked, groups left without a step where there are fewer
    # steps than groups). Its weights are W.dequantize()'s fp32 values (E2M1 times
    # the scale exactly, the global scale applied to the sum): within fp32-accumulation error,
    # counted for tensor-core accumulation as in tests/gpu.
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=30), scale_rule="4o6")
    x = _rand(m, k, seed=31, dtype=torch.float16)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    bound = 2.0**-11 * ref.abs() + 4 * k * 2.0**-24 * (x.double().abs() @ wdq.double().abs().T)
    cfg = w4a16_gemm.mma_config(m, n, k, torch.device(DEVICE), *launch)
    assert cfg["BLOCK_M"] == (8 if m <= 8 else 16) and cfg["KWARPS"] == (launch[4] if len(launch) > 4 else 1)
    for forced in (cfg, dict(cfg, SPLIT=1, k_per_split=-(-k // 128) * 128)):
        y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=dict(forced)).cpu()
        assert y.dtype == torch.float16 and y.shape == (m, n)
        assert torch.all((y.double() - ref).abs() <= bound), forced["SPLIT"]


def test_mma_vec_needs_aligned_rows_and_k_multiple_of_32():
    # 16-byte loads only where every address they read is 16-byte aligned, and never in the
    # interpreter (which runs the kernels' emulation instead of their PTX).
    k = 2688
    packed = torch.zeros(64, k // 2, dtype=torch.uint8)
    x = torch.zeros(4, k, dtype=torch.bfloat16)
    x4 = x.view(torch.int64)
    compiled = object()  # anything but an interpreted kernel
    assert packed.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
    assert mma.mma_vec(packed, x4, k // 4, k, compiled)
    assert not mma.mma_vec(packed, x4, k // 4 + 1, k, compiled)  # rows 8 bytes off
    assert not mma.mma_vec(packed.view(-1)[8:], x4, k // 4, k, compiled)
    assert not mma.mma_vec(packed, x4.view(-1)[1:], k // 4, k, compiled)
    assert not mma.mma_vec(packed, x4, k // 4, k + 16, compiled)  # K % 32 == 16
    if backend.interpreted(w4a16_gemm._mma_kernel):
        assert not mma.mma_vec(packed, x4, k // 4, k, w4a16_gemm._mma_kernel)


def test_mma_kernel_picks_and_refusals():
    # Picked for 2-8 rows of 16-bit activations on a GPU only; fp32 activations are refused, and
    # warps or K groups of warps that are not powers of 2 (a program's lanes are a power of 2).
    for bad in ((3, 4, 2, 2, 1), (1, 4, 2, 2, 3)):
        with pytest.raises(ValueError, match="powers of 2"):
            w4a16_gemm.mma_config(4, 64, 256, torch.device("cpu"), *bad)
    n, k = 64, 256
    for m in (1, 2, 8, 9):
        assert not w4a16_gemm.config(m, n, k, torch.device("cpu"), torch.float16).get("mma")
    wq = nvfp4.quantize(_rand(n, k, seed=14), scale_rule="4o6")
    x = _rand(4, k, seed=15)
    cfg = w4a16_gemm.mma_config(4, n, k, torch.device(DEVICE))
    with pytest.raises(ValueError, match="register-fed matrix-unit kernel takes bf16/fp16 activations"):
        w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=cfg)


def test_split_k_counters_reset_between_launches():
    # Split-K sums its partials in the launch itself (the last program of each tile); the tile
    # counters are left at 0, so the same buffer serves the next launch: repeated calls agree
    # bit for bit with a launch that does not split.
    n, k, m = 72, 320, 3
    wq = nvfp4.quantize(_rand(n, k, seed=21), scale_rule="4o6")
    x = _rand(m, k, seed=22).to(DEVICE)
    cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE))
    assert cfg["SPLIT"] > 1
    ys = [w4a16_gemm.w4a16_matmul(x, wq.to(DEVICE), cfg=cfg).cpu() for _ in range(3)]
    counters = tiles.split_counters(torch.device(DEVICE), 1)
    assert int(counters.abs().sum()) == 0
    assert all(torch.equal(y, ys[0]) for y in ys)
    ref = x.cpu().double() @ wq.dequantize().double().T
    assert torch.all((ys[0].double() - ref).abs() <= gemm_tolerance(x.cpu(), wq.dequantize(), torch.float32)(ref))


def test_split_counters_per_stream_and_per_capture(monkeypatch):
    # Eager launches share a buffer per (device, stream); the launches of one graph capture share
    # a buffer of their own, zeroed when it is made; the next capture gets a new one; without a
    # capture id every launch in the capture gets a fresh one.
    dev = torch.device("cpu")
    state = {"value": (7, False, None)}
    monkeypatch.setattr(tiles, "_stream_state", lambda device: state["value"])
    monkeypatch.setattr(tiles, "_COUNTERS", {})
    monkeypatch.setattr(tiles, "_CAPTURE_COUNTERS", {})
    eager = tiles.split_counters(dev, 10)
    assert eager is tiles.split_counters(dev, 10) and int(eager.abs().sum()) == 0
    state["value"] = (8, False, None)
    assert tiles.split_counters(dev, 10) is not eager  # another stream
    state["value"] = (7, True, 41)
    eager[:3] = 5  # a graph's buffer is not the eager one, and starts at zero
    first = tiles.split_counters(dev, 10)
    assert first is not eager and int(first.abs().sum()) == 0
    assert tiles.split_counters(dev, 100) is first  # the same capture
    bigger = tiles.split_counters(dev, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and int(bigger.abs().sum()) == 0
    state["value"] = (7, True, 42)  # the next capture on the stream
    second = tiles.split_counters(dev, 10)
    assert second is not bigger and int(second.abs().sum()) == 0
    state["value"] = (7, True, None)  # capturing, id unknown
    a, b = tiles.split_counters(dev, 10), tiles.split_counters(dev, 10)
    assert a is not b and a.numel() == 10 and int(a.abs().sum()) == 0
    state["value"] = (7, False, None)
    assert tiles.split_counters(dev, 10) is eager


def test_w4a16_matmul_batched_input_and_errors():
    wq = nvfp4.quantize(_rand(32, 64, seed=10))
    x = _rand(2, 3, 64, seed=11)
    y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE)).cpu()
    ref = x.double() @ wq.dequantize().double().T
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(FormatError, match="does not end in K=64"):
        w4a16_gemm.w4a16_matmul(_rand(3, 48).to(DEVICE), wq.to(DEVICE))
    with pytest.raises(TypeError, match="expected an NVFP4Tensor"):
        w4a16_gemm.w4a16_matmul(x, torch.zeros(32, 64))





def test_split_count_balances_long_k_only():
    # About programs_per_sm programs per multiprocessor; with balance (0.9, 16) a split count
    # that leaves the busiest multiprocessors with a program more than most is raised while a
    # split's K range keeps 16 K tiles: 448 tiles of 64 K tiles on 132 multiprocessors fill 448 / 528
    # of 4 slots each -> 2 splits (896 / 924). Balanced counts stay; short K is not split further.
    sc = w4a16_gemm.split_count
    assert sc(448, 64, 132, 4) == 1 and sc(448, 64, 132, 4, (0.9, 16)) == 2
    assert sc(128, 64, 132, 4) == sc(128, 64, 132, 4, (0.9, 16)) == 4  # 512 of 528
    assert sc(58, 21, 132, 4) == sc(58, 21, 132, 4, (0.9, 16)) == 9  # 21 K tiles: nothing to spare
    assert sc(448, 30, 132, 4, (0.9, 16)) == 1  # 2 splits would be 15 K tiles each
    assert sc(448, 31, 132, 4, (0.9, 16)) == 2  # 16 and 15
    assert sc(1000, 8, 132, 4, (0.9, 1)) == 1  # more tiles than wanted programs: one split
    # a share never reached: the first count stays
    assert sc(133, 64, 132, 1, (1.0, 64)) == 1








def test_mma_wide_routing(monkeypatch):
    # 9-16 rows of 16-bit activations on a GPU go to the register-fed kernel's two activation tiles
    # for weights of MMA_WIDE["min_weights"] elements or more; smaller weights, fp32 activations,
    # 17 rows and the interpreter keep the wgmma kernel. (An H200's 132 multiprocessors.)
    monkeypatch.setattr(backend, "sm_count", lambda device: 132)
    tables = launch.override(W4A16, MMA_WIDE={"min_weights": 8192 * 8192})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    w = tables["MMA_WIDE"]
    for m in (9, 12, 16):
        cfg = w4a16_gemm.config(m, 8192, 8192, cuda, torch.float16, tables)
        assert cfg["mma"] and cfg["BLOCK_M"] == 16 and cfg["num_warps"] == w["num_warps"]
        assert cfg["BLOCK_N"] == 16 * w["rows"] * w["num_warps"] and cfg["PREFETCH"] == w["prefetch"]
        assert w4a16_gemm.path(m, 8192, 8192, cuda, tables=tables) == "mma"
    for m, n, k, dtype, device in ((12, 3712, 2688, torch.bfloat16, cuda), (17, 8192, 8192, torch.bfloat16, cuda),
                                   (12, 8192, 8192, torch.float32, cuda), (12, 8192, 8192, torch.float16, cpu)):
        assert not w4a16_gemm.config(m, n, k, device, dtype, tables).get("mma"), (m, n, k, dtype, device)
    never = launch.override(W4A16, MMA_WIDE={"min_weights": None})
    assert not w4a16_gemm.config(12, 8192, 8192, cuda, tables=never).get("mma")
    # from the table's own reach up, by the table given
    reach = launch.override(W4A16, MMA_WIDE={"min_weights": 3712 * 2688})
    assert w4a16_gemm.config(12, 3712, 2688, cuda, tables=reach)["mma"]


def test_row_mma_routing(monkeypatch):
    # One row of 16-bit activations on a GPU goes to the register-fed kernel (MMA's launch shape)
    # where the weight has ROW_MMA["min_weights"] elements or more and the GEMV's K step does not
    # divide K; smaller weights, a K the GEMV's step divides, fp32 activations, the interpreter
    # and a reach of None keep the GEMV. (An H200's 132 multiprocessors.)
    monkeypatch.setattr(backend, "sm_count", lambda device: 132)
    tables = launch.override(W4A16, ROW_MMA={"min_weights": 32768 * 1856})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for n, k, dtype in ((131072, 2688, torch.bfloat16), (32768, 1856, torch.float16), (65536, 3712, torch.bfloat16)):
        cfg = w4a16_gemm.config(1, n, k, cuda, dtype, tables)
        assert cfg["mma"] and cfg["BLOCK_M"] == 8 and cfg["num_warps"] == tables["MMA"]["num_warps"], (n, k)
        assert w4a16_gemm.path(1, n, k, cuda, dtype, tables) == "mma"
    for n, k, dtype, device in ((16384, 2688, torch.bfloat16, cuda), (32768, 1840, torch.bfloat16, cuda),
                                (65536, 4096, torch.bfloat16, cuda), (131072, 8192, torch.bfloat16, cuda),
                                (131072, 2688, torch.float32, cuda), (131072, 2688, torch.bfloat16, cpu)):
        assert w4a16_gemm.config(1, n, k, device, dtype, tables).get("gemv"), (n, k, dtype, device)
    never = launch.override(W4A16, ROW_MMA={"min_weights": None})
    assert w4a16_gemm.config(1, 131072, 2688, cuda, tables=never).get("gemv")




@pytest.mark.parametrize("nk", [(32, 256), (16, 128)])
def test_gemv_probe_parts(nk):
    # The GEMV probe's three parts (scripts/benchlib, `gemv_limits`): the whole loop is the GEMV's result bit for
    # bit; the arithmetic-only part gives row n the result of row n % BLOCK_N; the loads-only part
    # folds the weight's code words and scale bytes by xor per thread slot, then each fold's bytes,
    # and sums them.
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=40), scale_rule="4o6").to(DEVICE)
    x = _rand(1, k, seed=41, dtype=torch.float16).to(DEVICE)
    cfg = w4a16_gemm.config(1, n, k, torch.device(DEVICE), torch.float16)
    if cfg.get("mma"):
        cfg = dict(cfg, **{key: W4A16["GEMV"]["1"][key] for key in ("BLOCK_N", "num_warps")}, BLOCK_K=64)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    gemv_cfg = dict(gemv=True, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=1,
                    SPLIT=1, k_per_split=k)
    y = w4a16_gemm.w4a16_matmul(x, wq, cfg=gemv_cfg)[0]
    whole = gemv_probe.gemv_probe(x, wq, gemv_probe.PROBE_ALL, gemv_cfg)
    assert torch.equal(whole.cpu().view(torch.int16), y.cpu().view(torch.int16))
    arith = gemv_probe.gemv_probe(x, wq, gemv_probe.PROBE_ARITHMETIC, gemv_cfg)
    assert torch.equal(arith.cpu().view(torch.int16), y.cpu()[torch.arange(n) % bn].view(torch.int16))
    loads = gemv_probe.gemv_probe(x, wq, gemv_probe.PROBE_LOADS, gemv_cfg).cpu()
    codes = wq.packed.cpu().view(torch.int64).view(n, k // bk, bk // 16)
    scales = wq.block_scale.cpu().view(torch.uint8).to(torch.int64).view(n, k // bk, bk // 16)
    fold = torch.zeros((n, bk // 16), dtype=torch.int64)
    for step in range(k // bk):
        fold ^= codes[:, step] ^ scales[:, step]
    for shift in (32, 16, 8):
        fold ^= fold >> shift
    want = (fold & 0xFF).sum(dim=1).to(torch.float32).to(torch.float16)
    assert want.abs().max() > 0 and torch.isfinite(want).all()
    assert torch.equal(loads, want)
    with pytest.raises(ValueError, match="GEMV probe takes one row and whole tiles"):
        gemv_probe.gemv_probe(x, wq, gemv_probe.PROBE_ALL, dict(gemv_cfg, BLOCK_K=3 * k))




def test_gemv_k_tile_pads_k_least():
    # The CUDA-core K step is halved with the warps while that pads K less; among equal padding
    # the most warps. Activation rows per program: 1, 2, or 4 for 3-4 rows.
    tile = {"BLOCK_K": 2048, "num_warps": 4, "BLOCK_N": 8}
    got = {k: (c["BLOCK_K"], c["num_warps"]) for k in (8192, 2688, 3712, 1856, 4112)
           for c in [tiles.gemv_k_tile(k, tile)]}
    assert got == {8192: (2048, 4), 2688: (1024, 2), 3712: (2048, 4), 1856: (2048, 4), 4112: (512, 1)}
    assert tiles.gemv_k_tile(2688, tile)["BLOCK_N"] == 8
    assert [w4a16_gemm.gemv_block_m(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_the_launch_shape_is_chosen_once_per_problem_shape(monkeypatch):
    w = nvfp4.quantize(_rand(48, 64))
    chosen = []
    real = w4a16_gemm.config
    monkeypatch.setattr(w4a16_gemm, "config", lambda *a, **k: chosen.append(a[:3]) or real(*a, **k))
    w4a16_gemm._default_plan.cache_clear()
    first = w4a16_gemm.w4a16_matmul(_rand(2, 64, seed=1), w)
    again = w4a16_gemm.w4a16_matmul(_rand(2, 64, seed=1), w)
    w4a16_gemm.w4a16_matmul(_rand(3, 64, seed=2), w)
    assert chosen == [(2, 48, 64), (3, 48, 64)]
    assert torch.equal(first, again)


def test_a_weight_is_checked_and_viewed_once(monkeypatch):
    w = nvfp4.quantize(_rand(48, 64, seed=3))
    checked = []
    real = w4a16_gemm.check_weight
    monkeypatch.setattr(w4a16_gemm, "check_weight", lambda *a, **k: checked.append(a[0]) or real(*a, **k))
    first = w4a16_gemm.w4a16_matmul(_rand(2, 64, seed=1), w)
    ops = w4a16_gemm.weight_operands(w)
    again = w4a16_gemm.w4a16_matmul(_rand(2, 64, seed=1), w)
    assert checked == [w]
    assert w4a16_gemm.weight_operands(w) is ops and ops.scales.data_ptr() == w.block_scale.data_ptr()
    assert torch.equal(first, again) and first.shape == (2, 48)
    # The per-call checks stay: the activations, and any backend or device but the weight's own.
    with pytest.raises(FormatError, match="does not end in K=64"):
        w4a16_gemm.w4a16_matmul(_rand(2, 32), w)
    with pytest.raises(ValueError, match="backend must be one of"):
        w4a16_gemm.w4a16_matmul(_rand(2, 64), w, backend="cutlass")
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        w4a16_gemm.w4a16_matmul(_rand(2, 64).to("meta"), w)
    # A weight made anew (another object) is checked anew.
    w4a16_gemm.w4a16_matmul(_rand(2, 64), nvfp4.NVFP4Tensor(w.packed, w.block_scale, w.global_scale))
    assert len(checked) == 2


def test_a_launch_of_a_known_class_is_kept_per_weight_and_relaunched_without_classifying(monkeypatch):
    """The key w4a16_matmul keeps a weight's launches under: a call of another row count, dtype,
    16-byte alignment or row stride goes through launch_cached again (run here with a recording
    stand-in for both launch paths, since the interpreter keeps no compiled kernel)."""
    cached, kept = [], []
    monkeypatch.setattr(w4a16_gemm, "interpreted", lambda kernel: False)
    monkeypatch.setattr(w4a16_gemm, "current_device", lambda: 0)
    monkeypatch.setattr(w4a16_gemm, "launch_cached",
                        lambda kernel, grid, *args, constants: cached.append((kernel, grid, args)) or ("kept", len(cached)))
    monkeypatch.setattr(w4a16_gemm, "launch_kept", lambda entry, grid, *args, device: kept.append((entry, grid, args)))
    monkeypatch.setattr(w4a16_gemm, "_KEPT_PER_WEIGHT", 4)
    w = nvfp4.quantize(_rand(48, 64, seed=4))
    x = _rand(2, 64, seed=5)
    w4a16_gemm.w4a16_matmul(x, w)
    w4a16_gemm.w4a16_matmul(x.clone(), w)
    assert len(cached) == 1 and len(kept) == 1
    entry, grid, args = kept[0]
    assert entry == ("kept", 1) and grid == cached[0][1]
    # The kept launch passes the same arguments, its tensors by their addresses: the weight's as
    # the first call's; the activations and output are the new call's.
    first = cached[0][2]
    assert len(args) == len(first)
    for a, b in zip(args, first):
        if isinstance(b, torch.Tensor):
            assert type(a) is int
            if b.data_ptr() in {w.packed.data_ptr(), w.block_scale.data_ptr(), w.global_scale.data_ptr()}:
                assert a == b.data_ptr()
        else:
            assert a == b
    # Each of these is a call of another class: through launch_cached, then kept under its own key.
    wide = torch.zeros(2, 64 + 1)  # rows 65 apart; the second view's start 4 bytes past 16-byte alignment
    for other in (_rand(3, 64), x.half(), wide[:, :64].copy_(x), wide[:, 1:].copy_(x)):
        before = len(cached)
        w4a16_gemm.w4a16_matmul(other, w)
        assert len(cached) == before + 1, (other.shape, other.dtype, other.stride(), other.data_ptr() % 16)
    assert len(w4a16_gemm.weight_operands(w).launches) == 4
    w4a16_gemm.w4a16_matmul(_rand(5, 64), w)  # past the cap: launched, not kept
    assert len(w4a16_gemm.weight_operands(w).launches) == 4 and len(cached) == 6
    # A forced launch shape is never kept.
    w4a16_gemm.w4a16_matmul(x, w, cfg=w4a16_gemm.config(2, 48, 64, x.device))
    assert len(cached) == 7 and len(kept) == 1


def test_a_copied_or_pickled_weight_makes_its_own_operands():
    import copy
    import io

    def saved_and_loaded(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    w = nvfp4.quantize(_rand(48, 64, seed=6))
    y = w4a16_gemm.w4a16_matmul(_rand(2, 64, seed=7), w)
    w4a16_gemm.weight_operands(w).launches["k"] = (lambda: None, ())  # as a compiled kernel: no pickling it
    for other in (copy.deepcopy(w), saved_and_loaded(w)):
        assert getattr(other, "_w4a16_operands") is None
        assert torch.equal(w4a16_gemm.w4a16_matmul(_rand(2, 64, seed=7), other), y)
        ops = w4a16_gemm.weight_operands(other)
        assert ops.launches == {} and ops.scales.data_ptr() == other.block_scale.data_ptr() != w.block_scale.data_ptr()
