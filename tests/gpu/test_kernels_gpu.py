"""fp4kit.kernels on a CUDA GPU: bf16 inputs and real Nemotron-3-Nano shapes.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing the kernels: their decorators must not run here without CUDA
    # (tests/kernels may need them under TRITON_INTERPRET=1).
    pytest.skip("needs a CUDA device", allow_module_level=True)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from fp4kit.formats import e2m1, nvfp4  # noqa: E402
from fp4kit.kernels import launch, mma, moe_gemm, packed_gemm, quantize as kquant, router, tiles, w4a16_gemm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from benchlib import gemv_probe  # noqa: E402

from .helpers import DEV, _bits, _randn, eager_and_replayed, write_late  # noqa: E402

pytestmark = pytest.mark.gpu
W4A16 = launch.table("w4a16")
ARITH = launch.override(W4A16, DEQUANT={"lut": False})  # the table dequantization's PTX off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_table_path_equals_arithmetic_path(dtype):
    wq = kquant.quantize(_randn(3712, 2688, seed=17) * 40, scale_rule="4o6")
    lut = w4a16_gemm.dequantize(wq, dtype)
    arith = w4a16_gemm.dequantize(wq, dtype, tables=ARITH)
    assert torch.equal(_bits(lut), _bits(arith))
    assert torch.equal(_bits(lut), _bits(wq.dequantize(dtype)))


# --------------------------------------------------------------------------------------------
# dequantize / W4A16 GEMM
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_exact_on_gpu(dtype):
    wq = kquant.quantize(_randn(2688, 1856, seed=5), scale_rule="4o6")
    got = w4a16_gemm.dequantize(wq, dtype)
    assert torch.equal(_bits(got), _bits(wq.dequantize(dtype)))
    assert torch.equal(_bits(got).cpu(), _bits(wq.to("cpu").dequantize(dtype)))


def _assert_within_gemm_bound(y: torch.Tensor, x: torch.Tensor, wq: nvfp4.NVFP4Tensor, cfg: dict | None = None) -> None:
    """|y - ref| <= 2^-8 |ref| + 4 K 2^-24 (|x| @ |W|^T), elementwise, with ref = x @ Wdq^T in fp32.

    Wdq: the weights the path multiplies by: W.dequantize(bf16) on the wgmma kernel, the fp32
    W.dequantize() on the CUDA-core GEMV (the launch table's GEMV) and the register-fed mma kernel
    (MMA: E2M1 * scale exactly, times the global scale in fp32 at the end, which
    differs from the reference's E2M1 * RN(scale * global scale) by one fp32 rounding per term).
    Why: each product of a 16-bit activation and a weight is exact in fp32 (8 + 8 significant
    bits; the GEMV multiplies by the 2-bit E2M1 value and applies the block's step once per
    block, a rounding per block), so the kernel's fp32 sum differs from the exact sum by at most
    K * 2^-24 * sum|x||w| (any order); the fp32 reference has the same bound; x2 for tensor-core
    accumulation that may align addends before rounding. The output is then rounded to bf16:
    half an ulp, 2^-9 relative, plus the reference's own value rounding -> 2^-8 (fp16 output:
    less).
    """
    m, k = x.shape
    assert y.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16) and y.shape == (m, wq.shape[0])
    cfg = cfg or w4a16_gemm.config(m, wq.shape[0], k, x.device, x.dtype)
    exact = cfg.get("gemv", False) or cfg.get("mma", False)
    wdq = wq.dequantize(torch.float32 if exact else x.dtype).float()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = x.float() @ wdq.T
        bound = 2.0**-8 * ref.abs() + 4 * k * 2.0**-24 * (x.float().abs() @ wdq.abs().T)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    err = (y.float() - ref).abs()
    assert bool(torch.all(err <= bound)), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("nk", [(8192, 8192), (3712, 2688), (2688, 3712)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 1024, 4096])
@pytest.mark.parametrize("fused", [False, True])
def test_w4a16_matmul_bf16(nk, m, fused):
    n, k = nk
    wq = kquant.quantize(_randn(n, k, seed=6), scale_rule="4o6")
    x = _randn(m, k, seed=7, scale=1.0)
    if fused and m <= W4A16["LARGE_M"]:
        pytest.skip("the default path is the fused kernel already")
    cfg = w4a16_gemm.config(m, n, k, x.device) if fused else None  # forces the fused kernel
    _assert_within_gemm_bound(w4a16_gemm.w4a16_matmul(x, wq, cfg=cfg), x, wq, cfg)


@pytest.mark.parametrize("nk", [(3712, 2688), (200, 1856), (40, 2704)])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("launch", [(2, 4, 2, 2), (4, 8, 1, 0), (1, 8, 2, 2), (1, 1, 2, 2, 4), (2, 2, 1, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_mma(nk, m, launch, dtype):
    # The register-fed matrix-unit kernel forced at 1-16 rows (one or two activation tiles), one
    # or two weight tiles per warp, with and without L2 prefetch, the K range shared by 4 or 8
    # groups of warps (summed in the program) or not: ragged N (200, 40: rows past N read the
    # last row), ragged K (1856 = 14.5 steps, 2704 = 169 blocks: masked steps, scale bytes one at
    # a time), split-K and not.
    n, k = nk
    wq = kquant.quantize(_randn(n, k, seed=50) * 4, scale_rule="4o6")
    x = _randn(m, k, seed=51, scale=1.0).to(dtype)
    cfg = w4a16_gemm.mma_config(m, n, k, x.device, *launch)
    for forced in (cfg, dict(cfg, SPLIT=1, k_per_split=-(-k // 128) * 128)):
        _assert_within_gemm_bound(w4a16_gemm.w4a16_matmul(x, wq, cfg=dict(forced)), x, wq, forced)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_mma_weights_exact_every_scale_code_and_position(dtype):
    # The mma kernel's in-register weights on the hardware, read out one by one: one-hot
    # activation rows pick single weights, so each output is E2M1(code) * scale exactly (global
    # scale 1), in bf16 and fp16 alike. 2032 blocks give each E4M3 scale byte 0x00-0x7E every
    # code at every one of the 16 positions of a block (in fp16 the smallest in-register values
    # are subnormal).
    n, k = 254, 128
    b = torch.arange(n * k // 16, device=DEV)
    pos = torch.arange(16, device=DEV)
    codes = ((pos[None, :] + (b // 127)[:, None]) % 16).to(torch.uint8)  # [blocks, 16]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, k // 2)
    scale = (b % 127).to(torch.uint8).reshape(n, k // 16).view(torch.float8_e4m3fn)
    wq = nvfp4.NVFP4Tensor(packed, scale, torch.tensor(1.0, device=DEV))
    want = wq.dequantize(torch.float32).T  # [k, n]
    eye = torch.eye(k, device=DEV, dtype=dtype)
    for m0 in range(0, k, 8):
        cfg = w4a16_gemm.mma_config(8, n, k, eye.device)
        y = w4a16_gemm.w4a16_matmul(eye[m0:m0 + 8], wq, cfg=cfg)
        assert torch.equal(y.float(), want[m0:m0 + 8]), m0


@pytest.mark.parametrize("m", [9, 12, 16])
def test_w4a16_mma_wide_route(m):
    # 9-16 rows go to the register-fed kernel's two activation tiles (the table's MMA_WIDE) for
    # weights of at least min_weights elements: the call takes that path and is right.
    n, k = 1024, 2688
    tables = launch.override(W4A16, MMA_WIDE={"min_weights": n * k})
    wq = kquant.quantize(_randn(n, k, seed=54), scale_rule="4o6")
    x = _randn(m, k, seed=55, scale=1.0)
    assert w4a16_gemm.path(m, n, k, x.device, tables=tables) == "mma"
    _assert_within_gemm_bound(w4a16_gemm.w4a16_matmul(x, wq, tables=tables), x, wq,
                              w4a16_gemm.config(m, n, k, x.device, tables=tables))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_row_mma_route(dtype):
    # One row goes to the register-fed kernel (the table's ROW_MMA) where the GEMV's K step does
    # not divide K and the weight is large enough: the call takes that path and is right; a K
    # the GEMV's step divides keeps the GEMV.
    n, k = 2048, 1856
    tables = launch.override(W4A16, ROW_MMA={"min_weights": n * k})
    wq = kquant.quantize(_randn(n, k, seed=58), scale_rule="4o6")
    x = _randn(1, k, seed=59, scale=1.0).to(dtype)
    assert w4a16_gemm.path(1, n, k, x.device, dtype, tables) == "mma"
    _assert_within_gemm_bound(w4a16_gemm.w4a16_matmul(x, wq, tables=tables), x, wq,
                              w4a16_gemm.config(1, n, k, x.device, dtype, tables))
    assert w4a16_gemm.path(1, n, 2048, x.device, dtype, tables) == "gemv"


@pytest.mark.parametrize("nk", [(8192, 8192), (8192, 4096)])
def test_gemv_probe_loop_is_the_gemv(nk):
    # The GEMV probe's whole loop (scripts/benchlib, `gemv_limits`) is the GEMV's own result, bit for
    # bit, compiled.
    n, k = nk
    wq = kquant.quantize(_randn(n, k, seed=56) * 0.02, scale_rule="4o6")
    x = _randn(1, k, seed=57, scale=1.0)
    cfg = w4a16_gemm.config(1, n, k, x.device)
    assert cfg["gemv"] and cfg["SPLIT"] == 1
    y = w4a16_gemm.w4a16_matmul(x, wq)[0]
    assert torch.equal(gemv_probe.gemv_probe(x, wq, gemv_probe.PROBE_ALL, cfg), y)
    bn = cfg["BLOCK_N"]
    arith = gemv_probe.gemv_probe(x, wq, gemv_probe.PROBE_ARITHMETIC, cfg)
    assert torch.equal(arith, y[torch.arange(n, device=y.device) % bn])


def test_w4a16_mma_odd_scale_offset_and_strided_rows():
    # Scale bytes at an odd address (read one at a time) and activation rows with a stride: the
    # same products as the aligned case.
    n, k, m = 512, 2688, 6
    wq = kquant.quantize(_randn(n, k, seed=52), scale_rule="4o6")
    buf = torch.empty(wq.block_scale.numel() + 1, dtype=torch.uint8, device=DEV)
    odd = buf[1:].view(n, k // 16)
    odd.copy_(wq.block_scale.view(torch.uint8))
    assert odd.data_ptr() % 2 == 1
    w_odd = nvfp4.NVFP4Tensor(wq.packed, odd.view(torch.float8_e4m3fn), wq.global_scale)
    big = _randn(m, k + 64, seed=53, scale=1.0)
    x = big[:, :k]  # rows k + 64 apart
    cfg = w4a16_gemm.config(m, n, k, x.device)
    assert cfg["mma"]
    y = w4a16_gemm.w4a16_matmul(x, wq)
    assert torch.equal(w4a16_gemm.w4a16_matmul(x, w_odd), y)
    assert torch.equal(w4a16_gemm.w4a16_matmul(x.contiguous(), wq), y)
    _assert_within_gemm_bound(y, x.contiguous(), wq)


@pytest.mark.parametrize("nkm", [(512, 2688, 6), (384, 1856, 16)])
def test_w4a16_mma_16_byte_loads_equal_8_byte_loads(nkm):
    # Codes and activations read 16 bytes at a time (mma.mma_vec) or, where the codes or
    # the activations start only 8-byte aligned, 8 at a time: the same products bit for bit, at
    # one and two activation tiles, with a whole and a ragged number of K steps.
    n, k, m = nkm
    wq = kquant.quantize(_randn(n, k, seed=58), scale_rule="4o6")
    x = _randn(m, k, seed=59, scale=1.0)
    x8 = torch.empty(m * k + 4, dtype=x.dtype, device=DEV)[4:].view(m, k)
    x8.copy_(x)
    p8 = torch.empty(wq.packed.numel() + 8, dtype=torch.uint8, device=DEV)[8:].view(n, k // 2)
    p8.copy_(wq.packed)
    w8 = nvfp4.NVFP4Tensor(p8, wq.block_scale, wq.global_scale)
    kernel = w4a16_gemm._mma_kernel
    assert mma.mma_vec(wq.packed, x.view(torch.int64), k // 4, k, kernel)
    assert not mma.mma_vec(wq.packed, x8.view(torch.int64), k // 4, k, kernel)
    assert not mma.mma_vec(p8, x.view(torch.int64), k // 4, k, kernel)
    cfg = w4a16_gemm.mma_config(m, n, k, x.device)
    y = w4a16_gemm.w4a16_matmul(x, wq, cfg=dict(cfg))
    assert torch.equal(w4a16_gemm.w4a16_matmul(x8, wq, cfg=dict(cfg)), y)
    assert torch.equal(w4a16_gemm.w4a16_matmul(x, w8, cfg=dict(cfg)), y)
    _assert_within_gemm_bound(y, x, wq, cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_block_dot_ptx_equals_arithmetic(dtype):
    # The GEMV's inline-PTX block dot and its Triton arithmetic form: the same bits, for each
    # activation dtype, on a ragged K (masked blocks) and with split-K.
    n, k = 1000, 2688 + 16
    wq = kquant.quantize(_randn(n, k, seed=40) * 3, scale_rule="4o6")
    x = (_randn(1, k, seed=41, scale=1.0) * 7).to(dtype)
    cfg = w4a16_gemm.config(1, n, k, x.device)
    assert cfg["gemv"]
    for forced in (cfg, dict(cfg, SPLIT=1, k_per_split=k)):
        ptx = w4a16_gemm.w4a16_matmul(x, wq, cfg=dict(forced))
        arith = w4a16_gemm.w4a16_matmul(x, wq, cfg=dict(forced), tables=ARITH)
        assert torch.equal(_bits(ptx), _bits(arith))


@pytest.mark.parametrize("nk", [(8192, 8192), (3712, 2688), (2688, 3712)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_w4a16_gemv_bf16(nk, m):
    # The CUDA-core kernel (the table's GEMV launch shape), forced up to 4 rows.
    tables = launch.override(W4A16, GEMV={"max_m": 4}, MMA={"max_m": 0})
    n, k = nk
    wq = kquant.quantize(_randn(n, k, seed=19), scale_rule="4o6")
    x = _randn(m, k, seed=20, scale=1.0)
    assert w4a16_gemm.config(m, n, k, x.device, tables=tables)["gemv"]
    _assert_within_gemm_bound(w4a16_gemm.w4a16_matmul(x, wq, tables=tables), x, wq,
                              w4a16_gemm.config(m, n, k, x.device, tables=tables))
    if m >= 2:
        assert w4a16_gemm.config(m, n, k, x.device, tables=launch.override(tables, MMA={"max_m": 8}))["mma"]


# --------------------------------------------------------------------------------------------
# Grouped MoE
# --------------------------------------------------------------------------------------------
def _nano_moe(tokens, seed, n_exp=128, hid=2688, inter=1856, top_k=6):
    """Nano's expert stacks quantized with 4/6 on the GPU, bf16 hidden states, top-6 routing and
    its weights: (up, down, x, ids, weights)."""
    up = kquant.quantize(_randn(n_exp, inter, hid, seed=seed), scale_rule="4o6")
    down = kquant.quantize(_randn(n_exp, hid, inter, seed=seed + 1), scale_rule="4o6")
    x = _randn(tokens, hid, seed=seed + 2, scale=1.0)
    g = torch.Generator(device=DEV).manual_seed(seed + 3)
    ids = torch.stack([torch.randperm(n_exp, device=DEV, generator=g)[:top_k] for _ in range(tokens)])
    return up, down, x, ids, torch.rand((tokens, top_k), device=DEV, generator=g)


@pytest.mark.parametrize("tokens,path", [
    (1, None), (4, None), (8, None), (64, None), (300, None), (2048, None),  # 2048: the large-M launch shape
    (1, "sorted"), (64, "small"),  # each path where the other is the default (64: one program per expert)
    (1, "small-matrix-unit"), (64, "gemv"),  # the in-kernel-routing path on the other units
    (1, "mma"), (8, "mma"), (17, "mma"), (64, "sorted"),  # the sorted path on the register-fed / wgmma units
])
def test_moe_bf16_nano_shapes(tokens, path):
    n_exp, top_k = 128, 6
    up, down, x, ids, weights = _nano_moe(tokens, seed=8)
    cfg = None
    if path == "gemv":
        cfg = dict(moe_gemm.moe_config(0, n_exp, x.device))
        assert cfg["gemv"]
    elif path == "mma":
        cfg = dict(moe_gemm.moe_mma_config(), small=False)
    elif path is not None:
        cfg = dict(moe_gemm.matrix_unit_config(tokens * top_k, n_exp, x.device), small=path != "sorted")
    got = moe_gemm.moe_experts(x, ids, weights, up, down, cfg=cfg)
    # fp32 reference on the bf16-dequantized weights; the kernel rounds its intermediates to
    # bf16 as transformers does, so they differ by bf16 roundings: 1e-2 in relative norm.
    ref = moe_gemm.experts_reference(x.float(), ids, weights, up.dequantize(torch.bfloat16).float(),
                                     down.dequantize(torch.bfloat16).float())
    assert float((got.float() - ref).norm() / ref.norm()) < 1e-2
    torch_bf16 = moe_gemm.moe_experts(x, ids, weights, up, down, backend="torch")
    assert float((got.float() - torch_bf16.float()).norm() / torch_bf16.float().norm()) < 1e-2


@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_gemv_tiles_in_flight_nano_shapes(tokens):
    # Compiled for the GPU, MOE_GEMV's K tiles in flight (AHEAD) change no bit of either
    # projection on Nano's experts (K = 2688 and 1856: ragged last steps of 512), nor does the
    # dense GEMV's on the shared expert's shapes.
    up, down, x, ids, weights = _nano_moe(tokens, seed=70)
    cfg = dict(moe_gemm.moe_config(0, 128, x.device))
    outs = [moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg, AHEAD=a)) for a in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for n, k in ((3712, 2688), (2688, 3712)):
        w = kquant.quantize(_randn(n, k, seed=74), scale_rule="4o6")
        row = _randn(1, k, seed=75, scale=1.0)
        dense = w4a16_gemm.config(1, n, k, row.device, tables=launch.override(launch.table("w4a16"), MMA={"max_m": 0},
                                                                               ROW_MMA={"min_weights": None}))
        assert dense["gemv"]
        ys = [w4a16_gemm.w4a16_matmul(row, w, cfg=dict(dense, AHEAD=a)) for a in (1, 2, 3)]
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), (n, k)


@pytest.mark.parametrize("tokens,gemv", [(1, True), (4, True), (3, False), (16, False)])
def test_moe_small_down_launch_combines_as_the_third_launch_does(tokens, gemv):
    # The small path's down launch applies the routing weights itself (the last program of each
    # token's slice): bit for bit the separate combine launch, eagerly and replayed from a CUDA
    # graph, with the counters back at 0.
    from fp4kit.kernels.tiles import split_counters

    up, down, x, ids, weights = _nano_moe(tokens, seed=80)
    cfg = dict(moe_gemm.moe_config(0, 128, x.device)) if gemv else \
        dict(moe_gemm.matrix_unit_config(tokens * 6, 128, x.device), small=True)
    separate = moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg, combine=False))
    fused = moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg))
    assert torch.equal(fused, separate)
    assert not split_counters(x.device, tokens * 2688)[:tokens * 2688].any()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, separate)


@pytest.mark.parametrize("tokens,ahead", [(1, 1), (1, 3), (4, 2), (8, 1)])
def test_moe_down_launch_as_a_programmatic_dependent_is_the_plain_launch(tokens, ahead):
    # With "pdl" the up launch lets the down launch start early and the down programs request
    # their first weight tiles before they wait for it: bit for bit the plain launches, eagerly
    # and in many replays of a CUDA graph of two calls on different inputs (the second call's
    # up output may take the first's memory: a down program that read it before the wait would
    # see the first call's).
    assert moe_gemm.backend.pdl(torch.device(DEV), moe_gemm._moe_small_kernel)
    up, down, x, ids, weights = _nano_moe(tokens, seed=90)
    x2 = _randn(tokens, x.shape[1], seed=91, scale=1.0)
    cfg = dict(moe_gemm.moe_config(0, 128, x.device), AHEAD=ahead)
    plain = [moe_gemm.moe_experts(h, ids, weights, up, down, cfg=dict(cfg, pdl=False)) for h in (x, x2)]
    assert torch.equal(moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg, pdl=True)), plain[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = [moe_gemm.moe_experts(h, ids, weights, up, down, cfg=dict(cfg, pdl=True)) for h in (x, x2)]
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


@pytest.mark.parametrize("tokens", [1, 4])
def test_moe_up_launch_as_a_programmatic_dependent_reads_the_ids_only_after_the_launch_before(tokens):
    # "pdl_up": the up launch is a programmatic dependent of the launch before it and waits for it
    # before anything else, its own trigger for the down launch included (the down launch reads the
    # routed ids before its wait). Here the launch before lets it start at once and writes the ids
    # and the hidden states late: bit for bit the plain launches on the new ids, eagerly and over
    # replays of a CUDA graph (an up or down program that read the ids early would take the old
    # experts, whose outputs differ).
    up, down, x, ids, weights = _nano_moe(tokens, seed=95)
    old_ids = (ids + 1) % up.shape[0]
    x_old = _randn(tokens, x.shape[1], seed=96, scale=1.0)
    cfg = moe_gemm.moe_config(0, 128, x.device)
    assert cfg["gemv"] and moe_gemm.backend.pdl(torch.device(DEV), moe_gemm._moe_small_kernel)
    want = moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(cfg, pdl=False, pdl_up=False))
    assert not torch.equal(want, moe_gemm.moe_experts(x, old_ids, weights, up, down, cfg=dict(cfg, pdl=False)))
    # one buffer for both, so that one late launch writes them
    def as_bytes(*ts):
        return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in ts])

    new_bytes, old_bytes = as_bytes(x, ids), as_bytes(x_old, old_ids)
    buf = old_bytes.clone()
    nx = x.numel() * x.element_size()
    xs = buf[:nx].view(x.dtype).view(x.shape)
    ids_s = buf[nx:].view(ids.dtype).view(ids.shape)

    def step():
        buf.copy_(old_bytes)
        write_late(new_bytes, buf)
        return moe_gemm.moe_experts(xs, ids_s, weights, up, down, cfg=dict(cfg, pdl=True, pdl_up=True))

    def check(got):
        assert torch.equal(got, want)

    eager_and_replayed(step, check)


def test_the_router_lets_the_up_launch_start_early_and_the_experts_are_the_plain_launches():
    # ROUTE "trigger": the router lets the launch after it start at once; the up launch ("pdl_up")
    # waits for the router to complete before it reads the ids it writes: the block's output bit
    # for bit the plain launches', eagerly and over replays of a CUDA graph, for inputs whose
    # routing differs from call to call.
    up, down, x, _, _ = _nano_moe(1, seed=97)
    g = torch.Generator(device=DEV).manual_seed(98)
    w = torch.randn((up.shape[0], x.shape[1]), device=DEV, generator=g) * 0.05
    bias = torch.randn(up.shape[0], device=DEV, generator=g) * 0.01
    xs = [_randn(1, x.shape[1], seed=99 + i, scale=1.0) for i in range(3)]
    cfg = moe_gemm.moe_config(0, 128, x.device)
    route = {"experts": 4, "num_warps": 4}
    plain_t, early_t = {"ROUTE": dict(route)}, {"ROUTE": dict(route, trigger=True)}
    assert router._route_plan(128, x.shape[1], 6, True, early_t, torch.device(DEV))[1]["TRIGGER"]

    def block(h, tables, **pdl):
        _, weights, ids = router.route(h, w, bias, 6, norm=True, scale=2.5, tables=tables)
        return moe_gemm.moe_experts(h, ids, weights, up, down, cfg=dict(cfg, **pdl))

    want = [block(h, plain_t, pdl=False, pdl_up=False) for h in xs]
    assert not torch.equal(want[0], want[1])

    def step():
        return [block(h, early_t, pdl=True, pdl_up=True) for h in xs]

    def check(got):
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    eager_and_replayed(step, check)


@pytest.mark.parametrize("launch", [(2, 2, 2), (1, 4, 0)])
def test_moe_mma_fp16_ragged_shapes(launch):
    # The sorted path on the register-fed matrix units with fp16 activations, hidden and
    # intermediate sizes whose K is not a whole number of 128-steps and whose rows do not fill
    # the last tile, one and two weight tiles per warp: against the reference in fp32.
    n_exp, hid, inter, top_k, tokens = 8, 400, 208, 2, 37
    up = kquant.quantize(_randn(n_exp, inter, hid, seed=60), scale_rule="4o6")
    down = kquant.quantize(_randn(n_exp, hid, inter, seed=61), scale_rule="4o6")
    x = _randn(tokens, hid, seed=62, scale=1.0).to(torch.float16)
    g = torch.Generator(device=DEV).manual_seed(63)
    ids = torch.stack([torch.randperm(n_exp, device=DEV, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), device=DEV, generator=g)
    got = moe_gemm.moe_experts(x, ids, weights, up, down, cfg=dict(moe_gemm.moe_mma_config(*launch), small=False))
    ref = moe_gemm.experts_reference(x.float(), ids, weights, up.dequantize().float(), down.dequantize().float())
    assert got.dtype == torch.float16
    assert float((got.float() - ref).norm() / ref.norm()) < 5e-3


def _through_triton(kernel, grid, *args, constants=None, **consts):
    kernel[grid](*args, **(consts if constants is None else constants))


def test_cached_launches_equal_tritons_own(monkeypatch):
    # backend.launch_cached keeps the compiled binary of each class of call; its launches give
    # the bytes Triton's own dispatch gives, on every W4A16 route, the pre-packed layout's kernel
    # and the in-kernel-routing MoE, with the activations 16-byte aligned and only 8-byte
    # aligned, called in turn (so a binary kept for one alignment is never reused for the other).
    from fp4kit.kernels import backend

    n, k = 512, 2688
    wq = kquant.quantize(_randn(n, k, seed=70), scale_rule="4o6")
    xs = []
    for m in (1, 6, 40, 64):
        x = _randn(m, k, seed=71 + m, scale=1.0)
        x8 = torch.empty(m * k + 4, dtype=x.dtype, device=DEV)[4:].view(m, k)
        x8.copy_(x)
        xs += [x, x8]
    routes = {w4a16_gemm.path(x.shape[0], n, k, x.device) for x in xs}
    assert {"gemv", "mma", "fused"} <= routes, routes
    n_exp, hid, inter, top_k = 16, 2688, 1856, 6
    up = kquant.quantize(_randn(n_exp, inter, hid, seed=80), scale_rule="4o6")
    down = kquant.quantize(_randn(n_exp, hid, inter, seed=81), scale_rule="4o6")
    g = torch.Generator(device=DEV).manual_seed(82)
    ids = torch.stack([torch.randperm(n_exp, device=DEV, generator=g)[:top_k] for _ in range(2)])
    weights = torch.rand((2, top_k), device=DEV, generator=g)
    moe_x = _randn(2, hid, seed=83, scale=1.0)
    pk = packed_gemm.pack(wq, xs[0].dtype)

    def run():
        dense = [w4a16_gemm.w4a16_matmul(x, wq) for x in xs]
        packed = [packed_gemm.packed_matmul(x, pk) for x in xs]
        return dense + packed + [moe_gemm.moe_experts(moe_x, ids, weights, up, down)]

    backend._COMPILED.clear()
    relaunched = []
    real_kept = w4a16_gemm.launch_kept
    monkeypatch.setattr(w4a16_gemm, "launch_kept", lambda *a, **k: relaunched.append(a[0]) or real_kept(*a, **k))
    fast = [run() for _ in range(3)]  # the first through Triton, the others from the kept binaries
    kept = {key[0] for key in backend._COMPILED}
    assert {w4a16_gemm._gemv_kernel, w4a16_gemm._mma_kernel, w4a16_gemm._w4a16_kernel,
            moe_gemm._moe_small_kernel, packed_gemm._packed_kernel} <= kept
    # The dense calls of the second and third runs relaunch the weight's kept launches.
    assert len(relaunched) == 2 * len(xs)
    assert len(w4a16_gemm.weight_operands(wq).launches) == len(xs)
    w4a16_gemm.weight_operands(wq).launches.clear()
    monkeypatch.setattr(w4a16_gemm, "launch_kept", None)  # the reference never takes the kept path
    monkeypatch.setattr(w4a16_gemm, "launch_cached", _through_triton)
    monkeypatch.setattr(packed_gemm, "launch_cached", _through_triton)
    monkeypatch.setattr(moe_gemm, "launch_cached", _through_triton)
    ref = run()
    for again in fast:
        for got, want in zip(again, ref):
            assert torch.equal(_bits(got), _bits(want))


def test_cached_quantize_launches_equal_tritons_own(monkeypatch):
    # The quantize stage's kernels (the stack kernel, the max pass and the plain quantize kernel,
    # with and without a given global amax, and the FP8 pass) launched from kept binaries give
    # Triton's own bytes, scales and 4/6 counts; weights 16-byte aligned and only 8-byte aligned
    # in turn. The error sums agree to fp32 rounding: the stack kernel's programs take its tiles
    # in ticket order, so which program adds up which tile changes from run to run.
    from fp4kit.kernels import backend, fp8 as kfp8

    def misaligned(t):
        out = torch.empty(t.numel() + 4, dtype=t.dtype, device=DEV)[4:].view(t.shape)
        return out.copy_(t)

    stack = _randn(8, 512, 2688, seed=90)
    plain = _randn(512, 2688, seed=91)
    assert kquant.fused_stack(stack, 8, 512 * 2688 // 16)

    def run():
        exact, sums = [], []
        for w in (stack, misaligned(stack), plain, misaligned(plain)):
            for given in (None, w.abs().amax(dim=(-2, -1)).float() * 1.5):
                terms = []
                qt = kquant.quantize(w, scale_rule="4o6", global_amax=given, terms=terms)
                exact += [qt.packed, qt.block_scale, qt.global_scale, terms[0].count4]
                sums.append(terms[0].sums[:2])
        for w in (plain, misaligned(plain), misaligned(stack)):
            terms = []
            exact += list(kfp8.quantize_per_tensor(w, terms=terms))
            sums.append(terms[0].sum(0, dtype=torch.float64))
        return exact, sums

    backend._COMPILED.clear()
    fast = [run() for _ in range(3)]  # the first through Triton, the others from the kept binaries
    kept = {key[0] for key in backend._COMPILED}
    assert {kquant._stack_kernel, kquant._amax_kernel, kquant._quantize_kernel, kfp8._fp8_kernel} <= kept
    monkeypatch.setattr(kquant, "launch_cached", _through_triton)
    monkeypatch.setattr(kfp8, "launch_cached", _through_triton)
    ref_exact, ref_sums = run()
    for exact, sums in fast:
        assert len(exact) == len(ref_exact)
        for got, want in zip(exact, ref_exact):
            assert torch.equal(_bits(got), _bits(want))
        for got, want in zip(sums, ref_sums):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------
# Split-K summed in the launch: deterministic, counters reset, CUDA-graph capture
# --------------------------------------------------------------------------------------------
def test_split_k_repeatable_and_graph_captured(monkeypatch):
    n, k, m = 3712, 2688, 4
    wq = kquant.quantize(_randn(n, k, seed=30), scale_rule="4o6")
    x = _randn(m, k, seed=31, scale=1.0)
    cfg = w4a16_gemm.config(m, n, k, x.device)
    assert cfg["SPLIT"] > 1
    eager = [w4a16_gemm.w4a16_matmul(x, wq) for _ in range(3)]
    assert all(torch.equal(y, eager[0]) for y in eager)  # fixed summation order
    assert int(tiles.split_counters(x.device, 1).abs().sum()) == 0
    _assert_within_gemm_bound(eager[0], x, wq)
    _assert_graph_replays(lambda: w4a16_gemm.w4a16_matmul(x, wq), eager[0], monkeypatch)


def _assert_graph_replays(fn, want, monkeypatch):
    """fn captured twice, into two CUDA graphs on one stream, after eager launches there (each
    graph's split-K launches get counters of their own, zeroed in the graph): replayed in the
    other order, alternately and between eager launches, each gives `want` exactly; two
    launches in one capture share their counters."""
    monkeypatch.setattr(tiles, "_COUNTERS", {})
    monkeypatch.setattr(tiles, "_CAPTURE_COUNTERS", {})
    stream = torch.cuda.Stream()
    graphs, outs, bufs = [], [], []
    with torch.cuda.stream(stream):
        assert torch.equal(fn(), want)
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs.append(fn())
                bufs.append((tiles.split_counters(want.device, 1), tiles.split_counters(want.device, 1),
                             tiles.capture_id(stream.cuda_stream)))
            graphs.append(graph)
    assert tiles.capture_id(stream.cuda_stream) is None  # not capturing now
    assert all(a is b for a, b, _ in bufs) and bufs[0][0] is not bufs[1][0]
    assert None not in (bufs[0][2], bufs[1][2]) and bufs[0][2] != bufs[1][2]
    for i in (1, 0, 1, 1, 0):
        graphs[i].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[i], want)
        assert torch.equal(fn(), want)


# --------------------------------------------------------------------------------------------
# W4A16 GEMM on the pre-packed weight (packed_gemm): the PTX decoding and the wgmma kernel
# --------------------------------------------------------------------------------------------
def _any_weight(n, k, seed):
    """Random codes and block-scale bytes of both signs (not NaN), global scale 0.37."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, device=DEV, dtype=torch.int32).to(torch.uint8)
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.int32, device=DEV)
    pick = torch.randint(0, len(finite), (n, k // 16), generator=g, device=DEV)
    return nvfp4.NVFP4Tensor(packed, finite[pick].to(torch.uint8).view(torch.float8_e4m3fn),
                             torch.tensor(0.37, device=DEV))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_fragments_exact_every_scale_and_code(dtype):
    # The kernel's A operand read out through its own PTX decoding (`packed_gemm.fragments`):
    # E2M1 * scale * 2^-7 exactly, bit for bit (signed zeros too), for 32768 blocks covering every
    # non-NaN scale byte with every code; `pack` on the GPU writes the same words as on the CPU.
    w = _any_weight(256, 2048, seed=70)
    p = packed_gemm.pack(w, dtype)
    cpu = packed_gemm.pack(w.to("cpu"), dtype)
    assert torch.equal(p.words.cpu(), cpu.words) and torch.equal(_bits(p.scales).cpu(), _bits(cpu.scales))
    got = packed_gemm.fragments(p)
    want = (e2m1.decode(w.codes()).reshape(256, -1, 16) * w.block_scale.float().unsqueeze(-1) * 2.0 ** -7)
    assert torch.equal(_bits(got), _bits(want.reshape(256, 2048).to(dtype)))
    pairs = torch.unique(w.codes().reshape(256, -1, 16).int() * 256
                         + _bits(w.block_scale).int().unsqueeze(-1) % 256)
    assert len(pairs) == 16 * 254


@pytest.mark.parametrize("nk", [(8192, 8192), (3712, 2688), (2688, 3712), (200, 1008), (40, 2704)])
@pytest.mark.parametrize("m", [1, 5, 16, 37, 64, 100, 128, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_matmul(nk, m, dtype):
    # Every launch shape the rules pick, and forced: no split-K, 8 warps (two warpgroups),
    # 16-row programs (several along M), one and two K tiles per loop step; ragged N (200, 40:
    # slabs past N read the last) and K (1008, 2704: the tile past K reads zero codes and masked
    # activations). Weights E2M1 * scale exactly, the global scale applied in fp32 at the end:
    # the mma kernel's bound. The L2 prefetch distance is a hint: any distance, including one
    # past the program's K range, gives the same bytes as none; so do the software-pipelined
    # loop and the activations read by TMA (zeros past M and K, and past the program's K range
    # for the second tile of a step).
    n, k = nk
    if n * k >= 8192 * 8192 and (dtype == torch.float16 or m not in (1, 16, 64)):
        pytest.skip("the largest weight: bf16 at 1, 16 and 64 rows")
    wq = kquant.quantize(_randn(n, k, seed=71), scale_rule="4o6")
    p = packed_gemm.pack(wq, dtype)
    x = _randn(m, k, seed=72, scale=1.0).to(dtype)
    for cfg in (None, {"SPLIT": 1}, {"num_warps": 8}, {"BLOCK_M": 16}, {"UNROLL": 1}, {"UNROLL": 2, "SPLIT": 1}):
        y = packed_gemm.packed_matmul(x, p, cfg=cfg)
        _assert_within_gemm_bound(y, x, wq, {"mma": True})
        if cfg is None or cfg.get("UNROLL") == 2:
            for ahead in (0, 3, 16):
                assert torch.equal(packed_gemm.packed_matmul(x, p, cfg={**(cfg or {}), "PREFETCH": ahead}), y)
            for stages, tma in ((2, False), (2, True), (1, True)):
                assert torch.equal(packed_gemm.packed_matmul(x, p, cfg={**(cfg or {}), "num_stages": stages,
                                                                        "TMA": tma}), y)


def test_packed_matmul_split_repeatable_graph_and_strided_rows(monkeypatch):
    n, k, m = 3712, 2688, 16
    wq = kquant.quantize(_randn(n, k, seed=73), scale_rule="4o6")
    p = packed_gemm.pack(wq)
    x = _randn(m, 2 * k, seed=74, scale=1.0)[:, :k]  # rows 2K apart
    assert packed_gemm.config(m, n, k, x.device)["SPLIT"] > 1
    eager = [packed_gemm.packed_matmul(x, p) for _ in range(3)]
    assert all(torch.equal(y, eager[0]) for y in eager)  # fixed summation order
    assert torch.equal(eager[0], packed_gemm.packed_matmul(x.contiguous(), p))
    assert packed_gemm.tma_ready(x)  # rows 2K apart: TMA reads them as they are
    assert torch.equal(eager[0], packed_gemm.packed_matmul(x, p, cfg={"TMA": True, "num_stages": 3}))
    _assert_within_gemm_bound(eager[0], x.contiguous(), wq, {"mma": True})
    _assert_graph_replays(lambda: packed_gemm.packed_matmul(x, p), eager[0], monkeypatch)
