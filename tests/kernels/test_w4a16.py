"""fp4kit.kernels.w4a16_gemm: dequantize bit for bit, the GEMM within stated tolerances, launch picks."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fp4kit.formats import e2m1, nvfp4  # noqa: E402
from fp4kit.formats.errors import FormatError  # noqa: E402
from fp4kit.kernels import backend, moe_gemm, packed_gemm, quantize as kquant, w4a16_gemm  # noqa: E402

from .helpers import DEVICE, _bits, _rand, assert_same_nvfp4  # noqa: E402


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
def _gemm_tolerance(x, wdq, dtype):
    """Elementwise bound: rounding of the output to `dtype` (half an ulp, relative) plus fp32
    accumulation error K * 2^-24 * sum|x||w| (products of fp16/fp32 inputs: the fp32 reference's
    own error counted twice)."""
    k = x.shape[-1]
    out_ulp = {torch.float32: 2.0**-24, torch.float16: 2.0**-11}[dtype]
    return lambda ref: out_ulp * ref.abs() + 2 * k * 2.0**-24 * (x.double().abs() @ wdq.double().abs().T) + 1e-30


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
    assert torch.all((y.double() - ref).abs() <= _gemm_tolerance(x, wdq, dtype)(ref))
    torch_y = w4a16_gemm.w4a16_matmul(x, wq, backend="torch")
    assert torch_y.shape == y.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("nk", [(72, 160), (64, 256)])  # ragged (masked) and even tiles
def test_w4a16_gemv(dtype, m, nk, monkeypatch):
    # The CUDA-core kernel for a few rows (w4a16_gemm.GEMV), with and without split-K. Its
    # weights are W.dequantize()'s fp32 values (not rounded to the activation dtype).
    monkeypatch.setitem(w4a16_gemm.GEMV, "max_m", 4)
    monkeypatch.setitem(w4a16_gemm.MMA, "max_m", 0)
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=12), scale_rule="4o6")
    x = _rand(m, k, seed=13, dtype=dtype)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE))
    assert cfg["gemv"]
    for split in (cfg["SPLIT"], 1):
        forced = dict(cfg, SPLIT=split, k_per_split=cfg["k_per_split"] if split > 1 else k)
        y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=forced).cpu()
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.all((y.double() - ref).abs() <= _gemm_tolerance(x, wdq, dtype)(ref)), split


@pytest.mark.parametrize("m", [1, 5, 9, 16])
@pytest.mark.parametrize("nk", [(40, 256), (72, 400), (64, 224)])
@pytest.mark.parametrize("launch", [(2, 4, 2, 0), (1, 8, 1, 0), (1, 1, 2, 0, 4), (2, 2, 1, 0, 2)])
def test_w4a16_mma(m, nk, launch):
    # The register-fed matrix-unit kernel (w4a16_gemm.MMA), forced: on a GPU its inline PTX, here
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
    assert w4a16_gemm.mma_vec(packed, x4, k // 4, k, compiled)
    assert not w4a16_gemm.mma_vec(packed, x4, k // 4 + 1, k, compiled)  # rows 8 bytes off
    assert not w4a16_gemm.mma_vec(packed.view(-1)[8:], x4, k // 4, k, compiled)
    assert not w4a16_gemm.mma_vec(packed, x4.view(-1)[1:], k // 4, k, compiled)
    assert not w4a16_gemm.mma_vec(packed, x4, k // 4, k + 16, compiled)  # K % 32 == 16
    if w4a16_gemm.interpreted(w4a16_gemm._mma_kernel):
        assert not w4a16_gemm.mma_vec(packed, x4, k // 4, k, w4a16_gemm._mma_kernel)


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
    counters = w4a16_gemm.split_counters(torch.device(DEVICE), 1)
    assert int(counters.abs().sum()) == 0
    assert all(torch.equal(y, ys[0]) for y in ys)
    ref = x.cpu().double() @ wq.dequantize().double().T
    assert torch.all((ys[0].double() - ref).abs() <= _gemm_tolerance(x.cpu(), wq.dequantize(), torch.float32)(ref))


def test_split_counters_per_stream_and_per_capture(monkeypatch):
    # Eager launches share a buffer per (device, stream); the launches of one graph capture share
    # a buffer of their own, zeroed when it is made; the next capture gets a new one; without a
    # capture id every launch in the capture gets a fresh one.
    dev = torch.device("cpu")
    state = {"value": (7, False, None)}
    monkeypatch.setattr(w4a16_gemm, "_stream_state", lambda device: state["value"])
    monkeypatch.setattr(w4a16_gemm, "_COUNTERS", {})
    monkeypatch.setattr(w4a16_gemm, "_CAPTURE_COUNTERS", {})
    eager = w4a16_gemm.split_counters(dev, 10)
    assert eager is w4a16_gemm.split_counters(dev, 10) and int(eager.abs().sum()) == 0
    state["value"] = (8, False, None)
    assert w4a16_gemm.split_counters(dev, 10) is not eager  # another stream
    state["value"] = (7, True, 41)
    eager[:3] = 5  # a graph's buffer is not the eager one, and starts at zero
    first = w4a16_gemm.split_counters(dev, 10)
    assert first is not eager and int(first.abs().sum()) == 0
    assert w4a16_gemm.split_counters(dev, 100) is first  # the same capture
    bigger = w4a16_gemm.split_counters(dev, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and int(bigger.abs().sum()) == 0
    state["value"] = (7, True, 42)  # the next capture on the stream
    second = w4a16_gemm.split_counters(dev, 10)
    assert second is not bigger and int(second.abs().sum()) == 0
    state["value"] = (7, True, None)  # capturing, id unknown
    a, b = w4a16_gemm.split_counters(dev, 10), w4a16_gemm.split_counters(dev, 10)
    assert a is not b and a.numel() == 10 and int(a.abs().sum()) == 0
    state["value"] = (7, False, None)
    assert w4a16_gemm.split_counters(dev, 10) is eager


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



def test_pick_decode_sums_over_shapes_and_keeps_register_cap():
    base = {"K": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}
    rows = [dict(base, N=n, M=1, maxnreg=mr, ms=t) for n, mr, t in
            ((1, None, 1.0), (2, None, 5.0), (1, 96, 2.0), (2, 96, 3.0), (1, 80, None), (2, 80, 0.1))]
    # None: 6.0, 96: 5.0, 80: failed once (inf) -> 96, carried as maxnreg
    assert w4a16_gemm.pick_decode(rows) == dict({k: v for k, v in base.items() if k != "K"}, maxnreg=96)
    rows = [dict(r, maxnreg=None, ms=1.0) if r["maxnreg"] == 96 else r for r in rows]
    assert "maxnreg" not in w4a16_gemm.pick_decode(rows)


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


def test_pick_mma_sums_relative_times_over_problems():
    def row(n, m, launch, t):
        nw, pps, rows, pf, kw = launch
        r = {"N": n, "K": n, "M": m, "num_warps": nw, "programs_per_sm": pps, "rows": rows, "prefetch": pf, "ms": t}
        return r if kw is None else dict(r, kwarps=kw)

    # a (a row of an older sweep, without K groups: 1), b, c: the same but for the K groups.
    # Problems 1 (small) and 2 (large). Summed times would pick b (10.9 against 11.0); relative
    # to each problem's best: a 1 + 10/9 = 2.11, b 1.9 + 1 = 2.9, c 1.2 + 9.5/9 = 2.26 -> a.
    a, b, c = (2, 4, 2, 2, None), (4, 8, 1, 0, 1), (4, 8, 1, 0, 4)
    rows = [row(1, 2, a, 1.0), row(2, 4, a, 10.0), row(1, 2, b, 1.9), row(2, 4, b, 9.0), row(1, 2, c, 1.2),
            row(2, 4, c, 9.5)]
    assert w4a16_gemm.pick_mma(rows) == {"num_warps": 2, "programs_per_sm": 4, "rows": 2, "prefetch": 2, "kwarps": 1}
    # a failed launch (None) never wins: without a, problem 1's best is c's 1.2: b 2.58, c 2.06
    rows[0]["ms"] = None
    assert w4a16_gemm.pick_mma(rows) == {"num_warps": 4, "programs_per_sm": 8, "rows": 1, "prefetch": 0, "kwarps": 4}
    rows[4]["ms"] = None
    assert w4a16_gemm.pick_mma(rows) == {"num_warps": 4, "programs_per_sm": 8, "rows": 1, "prefetch": 0, "kwarps": 1}


def test_pick_mma_wide_launch_and_reach():
    def row(n, m, kernel, t, launch=None):
        r = {"N": n, "K": 1000, "M": m, "kernel": kernel, "ms": t}
        if launch:
            r.update(zip(("num_warps", "programs_per_sm", "rows", "prefetch"), launch))
        return r

    a, b = (1, 8, 2, 2), (2, 4, 2, 2)
    rows = []
    # wgmma, a, b per (N, M): a is nearer each problem's best; summed over M it wins at N >= 200 (at N = 400
    # though it loses at M = 16), loses at N = 100
    for n, m, base, ta, tb in ((100, 12, 5.0, 6.0, 4.0), (100, 16, 5.0, 6.0, 9.0), (200, 12, 9.0, 8.0, 9.5),
                               (200, 16, 9.0, 8.5, 9.5), (400, 12, 20.0, 15.0, 18.0), (400, 16, 20.0, 21.0, 18.0)):
        rows += [row(n, m, "matrix-unit", base), row(n, m, "mma", ta, a), row(n, m, "mma", tb, b)]
    want = {"rows": 2, "num_warps": 1, "programs_per_sm": 8, "prefetch": 2, "kwarps": 1}
    assert w4a16_gemm.pick_mma_wide(rows) == dict(want, min_weights=200 * 1000)
    # a loss on the middle shape in the sum: reach only from the largest
    rows = [dict(r, ms=10.5) if r["kernel"] == "mma" and r["N"] == 200 and r["M"] == 16 and r["rows"] == 2
            and r["num_warps"] == 1 else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(rows)["min_weights"] == 400 * 1000
    # losing on the largest shape: never
    slow = [dict(r, ms=30.0) if r["kernel"] == "mma" and r["N"] == 400 else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(slow) == dict(want, min_weights=None)
    # a failed launch (None) never wins: b, which beats the wgmma kernel on the largest shape only
    rows = [dict(r, ms=None) if r["kernel"] == "mma" and r["N"] == 400 and r["M"] == 12 and r["num_warps"] == 1
            else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(rows) == {"rows": 2, "num_warps": 2, "programs_per_sm": 4, "prefetch": 2,
                                              "kwarps": 1, "min_weights": 400 * 1000}


def test_pick_mma_wide_judges_a_launch_where_it_would_run():
    # c is nearer the best on the small shape (where a loses to the wgmma kernel and would not run)
    # but far from it on the large one: over all problems c is the nearer (what pick_mma takes),
    # routed (a from N = 400 up, the wgmma kernel below) a is
    def row(n, m, kernel, t, launch=None):
        r = {"N": n, "K": 1000, "M": m, "kernel": kernel, "ms": t}
        if launch:
            r.update(zip(("num_warps", "programs_per_sm", "rows", "prefetch", "kwarps"), launch))
        return r

    a, c = (1, 8, 2, 2, 1), (1, 2, 2, 2, 4)
    rows = []
    for n, base, ta, tc in ((100, 5.0, 10.0, 4.2), (400, 40.0, 20.0, 30.0)):
        for m in (12, 16):
            rows += [row(n, m, "matrix-unit", base), row(n, m, "mma", ta, a), row(n, m, "mma", tc, c)]
    assert w4a16_gemm.pick_mma([r for r in rows if r["kernel"] == "mma"])["kwarps"] == 4
    assert w4a16_gemm.pick_mma_wide(rows) == {"num_warps": 1, "programs_per_sm": 8, "rows": 2, "prefetch": 2,
                                              "kwarps": 1, "min_weights": 400 * 1000}
    # where c's routing is the nearer (a no faster than c on the large shape), c and its reach
    rows = [dict(r, ms=30.0) if r["kernel"] == "mma" and r["N"] == 400 and r.get("kwarps") == 1 else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(rows) == {"num_warps": 1, "programs_per_sm": 2, "rows": 2, "prefetch": 2,
                                              "kwarps": 4, "min_weights": 100 * 1000}


def test_mma_wide_routing(monkeypatch):
    # 9-16 rows of 16-bit activations on a GPU go to the register-fed kernel's two activation tiles
    # for weights of MMA_WIDE["min_weights"] elements or more; smaller weights, fp32 activations,
    # 17 rows and the interpreter keep the wgmma kernel.
    monkeypatch.setattr(w4a16_gemm, "_sm_count", lambda device: 132)
    monkeypatch.setitem(w4a16_gemm.MMA_WIDE, "min_weights", 8192 * 8192)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    w = w4a16_gemm.MMA_WIDE
    for m in (9, 12, 16):
        cfg = w4a16_gemm.config(m, 8192, 8192, cuda, torch.float16)
        assert cfg["mma"] and cfg["BLOCK_M"] == 16 and cfg["num_warps"] == w["num_warps"]
        assert cfg["BLOCK_N"] == 16 * w["rows"] * w["num_warps"] and cfg["PREFETCH"] == w["prefetch"]
        assert w4a16_gemm.path(m, 8192, 8192, cuda) == "mma"
    for m, n, k, dtype, device in ((12, 3712, 2688, torch.bfloat16, cuda), (17, 8192, 8192, torch.bfloat16, cuda),
                                   (12, 8192, 8192, torch.float32, cuda), (12, 8192, 8192, torch.float16, cpu)):
        assert not w4a16_gemm.config(m, n, k, device, dtype).get("mma"), (m, n, k, dtype, device)
    monkeypatch.setitem(w4a16_gemm.MMA_WIDE, "min_weights", None)
    assert not w4a16_gemm.config(12, 8192, 8192, cuda).get("mma")


def test_row_mma_routing(monkeypatch):
    # One row of 16-bit activations on a GPU goes to the register-fed kernel (MMA's launch shape)
    # where the weight has ROW_MMA["min_weights"] elements or more and the GEMV's K step does not
    # divide K; smaller weights, a K the GEMV's step divides, fp32 activations, the interpreter
    # and a reach of None keep the GEMV.
    monkeypatch.setattr(w4a16_gemm, "_sm_count", lambda device: 132)
    monkeypatch.setitem(w4a16_gemm.ROW_MMA, "min_weights", 32768 * 1856)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for n, k, dtype in ((131072, 2688, torch.bfloat16), (32768, 1856, torch.float16), (65536, 3712, torch.bfloat16)):
        cfg = w4a16_gemm.config(1, n, k, cuda, dtype)
        assert cfg["mma"] and cfg["BLOCK_M"] == 8 and cfg["num_warps"] == w4a16_gemm.MMA["num_warps"], (n, k)
        assert w4a16_gemm.path(1, n, k, cuda, dtype) == "mma"
    for n, k, dtype, device in ((16384, 2688, torch.bfloat16, cuda), (32768, 1840, torch.bfloat16, cuda),
                                (65536, 4096, torch.bfloat16, cuda), (131072, 8192, torch.bfloat16, cuda),
                                (131072, 2688, torch.float32, cuda), (131072, 2688, torch.bfloat16, cpu)):
        assert w4a16_gemm.config(1, n, k, device, dtype).get("gemv"), (n, k, dtype, device)
    monkeypatch.setitem(w4a16_gemm.ROW_MMA, "min_weights", None)
    assert w4a16_gemm.config(1, 131072, 2688, cuda).get("gemv")


def test_pick_row_mma_reach():
    # ROW_MMA's reach: the smallest size from which the mma kernel is faster on every ragged-step
    # shape at least as large (same-size shapes summed; shapes whose GEMV step divides K do not
    # count; a failed launch counts as never faster).
    def rows(n, k, gemv, mma, ragged=True):
        return [{"N": n, "K": k, "M": 1, "kernel": "gemv", "ragged": ragged, "ms": gemv},
                {"N": n, "K": k, "M": 1, "kernel": "mma", "ragged": ragged, "ms": mma}]

    base = rows(100, 10, 1.0, 2.0) + rows(200, 10, 2.0, 1.5) + rows(400, 10, 4.0, 3.0) + rows(50, 80, 4.5, 4.0)
    assert w4a16_gemm.pick_row_mma(base) == {"min_weights": 2000}
    # a smaller shape where the mma kernel wins does not reach past a larger one where it loses
    assert w4a16_gemm.pick_row_mma(base + rows(10, 10, 1.0, 0.5) + rows(300, 10, 1.0, 1.0)) == {"min_weights": 4000}
    # same-size shapes are summed: one loss outweighed by a larger win keeps the size
    assert w4a16_gemm.pick_row_mma(base + rows(20, 100, 1.0, 1.2)) == {"min_weights": 2000}
    # a shape whose GEMV step divides K is ignored, however slow the mma kernel is there
    assert w4a16_gemm.pick_row_mma(base + rows(1000, 10, 1.0, 9.0, ragged=False)) == {"min_weights": 2000}
    # the largest ragged shape failing on the mma kernel: never
    assert w4a16_gemm.pick_row_mma(base + rows(800, 10, 1.0, None)) == {"min_weights": None}


@pytest.mark.parametrize("nk", [(32, 256), (16, 128)])
def test_gemv_probe_parts(nk):
    # The GEMV probe's three parts (`gemv_limits`): the whole loop is the GEMV's result bit for
    # bit; the arithmetic-only part gives row n the result of row n % BLOCK_N; the loads-only part
    # folds the weight's code words and scale bytes by xor per thread slot, then each fold's bytes,
    # and sums them.
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=40), scale_rule="4o6").to(DEVICE)
    x = _rand(1, k, seed=41, dtype=torch.float16).to(DEVICE)
    cfg = w4a16_gemm.config(1, n, k, torch.device(DEVICE), torch.float16)
    if cfg.get("mma"):
        cfg = dict(cfg, **{key: w4a16_gemm.GEMV["1"][key] for key in ("BLOCK_N", "num_warps")}, BLOCK_K=64)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    gemv_cfg = dict(gemv=True, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=1,
                    SPLIT=1, k_per_split=k)
    y = w4a16_gemm.w4a16_matmul(x, wq, cfg=gemv_cfg)[0]
    whole = w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_ALL, gemv_cfg)
    assert torch.equal(whole.cpu().view(torch.int16), y.cpu().view(torch.int16))
    arith = w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_ARITHMETIC, gemv_cfg)
    assert torch.equal(arith.cpu().view(torch.int16), y.cpu()[torch.arange(n) % bn].view(torch.int16))
    loads = w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_LOADS, gemv_cfg).cpu()
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
        w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_ALL, dict(gemv_cfg, BLOCK_K=3 * k))


def test_pick_gemv_max_m_stops_at_first_loss():
    def gemv(n, m, bn, t, pps=8):
        return {"N": n, "M": m, "kernel": "gemv", "tile": [m, bn, 2048, 4], "programs_per_sm": pps, "maxnreg": None,
                "ms": t}

    rows = []
    for n in (1, 2):
        for m, base_ms, gemv_ms in ((1, 3.0, 2.0), (2, 3.0, 2.5), (4, 3.0, 4.0)):
            rows.append({"N": n, "M": m, "kernel": "matrix-unit", "ms": base_ms})
            rows.append(gemv(n, m, 8, gemv_ms))
            rows.append(gemv(n, m, 16, gemv_ms + (0.1 if n == 1 else -0.3)))  # 16 wins the sum over shapes
    rows.append(gemv(1, 1, 8, None, pps=4))  # a failed launch shape is never picked
    rows.append(gemv(2, 1, 8, 0.1, pps=4))
    got = w4a16_gemm.pick_gemv(rows)
    assert got["1"] == {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 4, "programs_per_sm": 8}
    assert got["max_m"] == 2  # loses at M = 4
    rows = [dict(r, ms=5.0) if r["kernel"] == "gemv" and r["M"] == 1 and r["N"] == 2 else r for r in rows]
    assert w4a16_gemm.pick_gemv(rows)["max_m"] == 0


def test_gemv_k_tile_pads_k_least():
    # The CUDA-core K step is halved with the warps while that pads K less; among equal padding
    # the most warps. Activation rows per program: 1, 2, or 4 for 3-4 rows.
    tile = {"BLOCK_K": 2048, "num_warps": 4, "BLOCK_N": 8}
    got = {k: (c["BLOCK_K"], c["num_warps"]) for k in (8192, 2688, 3712, 1856, 4112)
           for c in [w4a16_gemm._gemv_k_tile(k, tile)]}
    assert got == {8192: (2048, 4), 2688: (1024, 2), 3712: (2048, 4), 1856: (2048, 4), 4112: (512, 1)}
    assert w4a16_gemm._gemv_k_tile(2688, tile)["BLOCK_N"] == 8
    assert [w4a16_gemm.gemv_block_m(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
