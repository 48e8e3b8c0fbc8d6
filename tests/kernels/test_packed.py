"""fp4kit.kernels.packed_gemm: the pre-packed layout round trip and its GEMM."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.formats import e2m1, nvfp4  # noqa: E402
from fp4kit.formats.errors import FormatError  # noqa: E402
from fp4kit.kernels import launch, packed_gemm  # noqa: E402

from .helpers import _bits, _rand, gemm_tolerance  # noqa: E402

PACKED = launch.table("packed")


# --------------------------------------------------------------------------------------------
# W4A16 GEMM on a pre-packed weight (packed_gemm)
# --------------------------------------------------------------------------------------------
def _any_weight(n, k, seed):
    """Random codes and block-scale bytes of both signs (not NaN), global scale 0.37."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.int32)
    scales = finite[torch.randint(0, len(finite), (n, k // 16), generator=g)].to(torch.uint8)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.tensor(0.37))


@pytest.mark.parametrize("nk", [(16, 128), (40, 272), (200, 1008), (64, 2704)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_layout_round_trip(nk, dtype):
    # pack -> unpack gives the checkpoint bytes back, ragged N (rows past N zero) and ragged K
    # (K tiles of 128: 1008 = 7.9, 2704 = 21.1) included; the padding is zero codes and scales.
    n, k = nk
    w = _any_weight(n, k, seed=n + k)
    p = packed_gemm.pack(w, dtype)
    assert p.words.shape == (-(-n // 16), -(-k // 128), 32, 16) and p.scales.dtype == dtype
    back = p.unpack()
    assert torch.equal(back.packed, w.packed)
    assert torch.equal(_bits(back.block_scale), _bits(w.block_scale))
    assert torch.equal(_bits(back.global_scale), _bits(w.global_scale))
    full = nvfp4.NVFP4Tensor(torch.full((n, k // 2), 0xFF, dtype=torch.uint8),
                             torch.ones(n, k // 16).to(torch.float8_e4m3fn), torch.tensor(1.0))
    pf = packed_gemm.pack(full, dtype)  # every code 15 (four bits set): the padding adds none
    bits = (pf.words.to(torch.int32) & 0xFFFF).reshape(-1, 1) >> torch.arange(16) & 1
    assert int(bits.sum()) == 4 * n * k
    assert int(torch.count_nonzero(pf.scales)) == n * k // 16


def test_packed_fragments_exact():
    # The weights the kernel's matrix units get, decoded by the kernel's own code path (here the
    # interpreter's arithmetic on the same words): E2M1 * scale * 2^-7 of every element, fp16,
    # signed zeros included, zero in the padding. (bf16: tests/gpu, on the PTX path too.)
    w = _any_weight(128, 384, seed=3)
    got = packed_gemm.fragments(packed_gemm.pack(w, torch.float16), warps=4)
    want = (e2m1.decode(w.codes()).reshape(128, -1, 16) * w.block_scale.float().unsqueeze(-1) * 2.0 ** -7)
    assert torch.equal(_bits(got), _bits(want.reshape(128, 384).to(torch.float16)))


@pytest.mark.parametrize("m", [1, 5, 17, 40])
@pytest.mark.parametrize("nk", [(64, 256), (40, 272), (72, 160)])
@pytest.mark.parametrize("cfg", [None, {"SPLIT": 1}, {"SPLIT": 2, "BLOCK_M": 16}, {"num_warps": 8},
                                 {"SPLIT": 1, "UNROLL": 2}, {"SPLIT": 1, "UNROLL": 2, "PREFETCH": 3}])
def test_packed_matmul(m, nk, cfg):
    # fp16 activations (the interpreter's bf16 is not reliable); ragged N and K; split-K with
    # the partials summed in the launch and not; several row programs (BLOCK_M 16 below M);
    # 8 warps per program (two warpgroups); two K tiles per loop step (2 or 3 tiles here).
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=10), scale_rule="4o6")
    x = _rand(m, k, seed=11, dtype=torch.float16)
    p = packed_gemm.pack(wq, torch.float16)
    y = packed_gemm.packed_matmul(x, p, cfg=cfg)
    assert y.dtype == torch.float16 and y.shape == (m, n)
    wdq = wq.dequantize(torch.float32)  # E2M1 * scale exactly, times the global scale at the end
    ref = x.double() @ wdq.double().T
    assert torch.all((y.double() - ref).abs() <= gemm_tolerance(x, wdq, torch.float16)(ref))
    y_torch = packed_gemm.packed_matmul(x, p, backend="torch")
    assert torch.equal(y_torch, torch.nn.functional.linear(x, wq.dequantize(torch.float16)))


@pytest.mark.parametrize("unroll", [1, 2])
@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_packed_matmul_long_k(split, unroll):
    # K ranges of 7, 4 + 3, 3 + 3 + 1 and 1 x 7 tiles (the last ragged), each program's range
    # from its own start, one or two tiles per loop step (odd ranges end on a half step):
    # every tile's weights are distinct, so a tile used twice or skipped changes the sums
    # beyond the bound.
    cfg = {"SPLIT": split, "UNROLL": unroll}
    n, k = 24, 784
    wq = nvfp4.quantize(_rand(n, k, seed=13), scale_rule="6")
    x = _rand(3, k, seed=14, dtype=torch.float16)
    y = packed_gemm.packed_matmul(x, packed_gemm.pack(wq, torch.float16), cfg=cfg)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    assert torch.all((y.double() - ref).abs() <= gemm_tolerance(x, wdq, torch.float16)(ref))


def test_packed_matmul_batched_strided_and_errors():
    n, k = 48, 256
    wq = nvfp4.quantize(_rand(n, k, seed=12))
    p = packed_gemm.pack(wq, torch.float16)
    x = _rand(2, 3, 2 * k, seed=13, dtype=torch.float16)[..., :k]  # rows 2K apart
    y = packed_gemm.packed_matmul(x, p)
    assert y.shape == (2, 3, n)
    assert torch.equal(y, packed_gemm.packed_matmul(x.contiguous(), p))
    with pytest.raises(ValueError, match="packed for torch.float16"):
        packed_gemm.packed_matmul(x.to(torch.bfloat16), p)
    with pytest.raises(FormatError, match="does not end in K=256"):
        packed_gemm.packed_matmul(x[..., :128], p)
    with pytest.raises(TypeError, match="PackedNVFP4"):
        packed_gemm.packed_matmul(x, wq)
    with pytest.raises(ValueError, match="unknown launch keys"):
        packed_gemm.packed_matmul(x, p, cfg={"STAGES": 3})
    with pytest.raises(ValueError, match="backend"):
        packed_gemm.packed_matmul(x, p, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        packed_gemm.pack(wq, torch.float32)
    with pytest.raises(FormatError, match="words"):
        packed_gemm.PackedNVFP4(p.words[:, :1], p.scales, p.global_scale, n, k)


def test_packed_config():
    dev = torch.device("cpu")  # 4 multiprocessors
    c = packed_gemm.config(64, 8192, 8192, dev)
    assert (c["BLOCK_M"], c["num_warps"]) == (64, PACKED["PACKED"]["64"]["large"]["num_warps"])
    assert c["SPLIT"] * c["kt_per_split"] >= 64 > (c["SPLIT"] - 1) * c["kt_per_split"]
    assert packed_gemm.config(3, 64, 256, dev, {"SPLIT": 9})["SPLIT"] == 2  # no empty programs
    assert packed_gemm.row_class(1) == 16 and packed_gemm.row_class(17) == 32 and packed_gemm.row_class(999) == 128
    with pytest.raises(ValueError, match="BLOCK_M"):
        packed_gemm.config(3, 64, 256, dev, {"BLOCK_M": 8})
    with pytest.raises(ValueError, match="num_warps"):
        packed_gemm.config(3, 64, 256, dev, {"num_warps": 2})
    with pytest.raises(ValueError, match="UNROLL"):
        packed_gemm.config(3, 64, 256, dev, {"UNROLL": 4})
    assert packed_gemm.config(3, 64, 256, dev, {"UNROLL": 2})["UNROLL"] == 2
    with pytest.raises(ValueError, match="PREFETCH"):
        packed_gemm.config(3, 64, 256, dev, {"PREFETCH": 17})
    with pytest.raises(ValueError, match="PREFETCH"):
        packed_gemm.config(3, 64, 256, dev, {"PREFETCH": -1})
    assert packed_gemm.config(3, 64, 256, dev, {"PREFETCH": 16})["PREFETCH"] == 16
    for stages in (0, 5):
        with pytest.raises(ValueError, match="num_stages"):
            packed_gemm.config(3, 64, 256, dev, {"num_stages": stages})
    c = packed_gemm.config(3, 64, 256, dev, {"num_stages": 3, "TMA": True})
    assert (c["num_stages"], c["TMA"]) == (3, True)
    assert (packed_gemm.config(3, 64, 256, dev)["num_stages"], packed_gemm.config(3, 64, 256, dev)["TMA"]) == (1, False)
    x = torch.zeros((4, 64), dtype=torch.bfloat16)
    assert packed_gemm.tma_ready(x) and not packed_gemm.tma_ready(x[:, 1:]) and not packed_gemm.tma_ready(x.T)
    assert not packed_gemm.tma_ready(torch.zeros((4, 68), dtype=torch.bfloat16)[:, :64])  # rows 136 bytes apart
    # the table given decides
    tables = launch.override(PACKED, PACKED={"64": {"large": {"BLOCK_M": 32, "num_warps": 4, "programs_per_sm": 1,
                                                              "UNROLL": 2}}})
    c = packed_gemm.config(64, 8192, 8192, dev, tables=tables)
    assert (c["BLOCK_M"], c["num_warps"], c["UNROLL"]) == (32, 4, 2)
    assert packed_gemm.config(64, 8192, 8192, dev, tables=launch.override(PACKED, LARGE_WEIGHTS=1 << 40))["BLOCK_M"] == \
        PACKED["PACKED"]["64"]["small"]["BLOCK_M"]



def test_the_launch_shape_is_chosen_once_per_problem_shape(monkeypatch):
    n, k = 40, 272
    p = packed_gemm.pack(nvfp4.quantize(_rand(n, k, seed=15)), torch.float16)
    chosen = []
    real = packed_gemm.config
    monkeypatch.setattr(packed_gemm, "config", lambda *a, **kw: chosen.append(a[:3]) or real(*a, **kw))
    packed_gemm._default_plan.cache_clear()
    x = _rand(5, k, seed=16, dtype=torch.float16)
    first = packed_gemm.packed_matmul(x, p)
    again = packed_gemm.packed_matmul(x, p)
    packed_gemm.packed_matmul(x[:3], p)
    packed_gemm.packed_matmul(x, p, cfg={"SPLIT": 1})  # a forced launch shape is never kept
    packed_gemm.packed_matmul(x, p, cfg={"SPLIT": 1})
    assert chosen == [(5, n, k), (3, n, k), (5, n, k), (5, n, k)]
    assert torch.equal(first, again)
