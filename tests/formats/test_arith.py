import pytest
import torch

from fp4kit.formats import fp8, nvfp4
from fp4kit.formats.arith import div_const


@pytest.mark.parametrize("c", [2688.0, 1536.0, 6.0, 448.0])
def test_both_divisions_against_float64(c):
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 100
    # float64 holds x * fp32(1/c) exactly and rounds x / c to 53 bits, which then rounds to
    # fp32 without a double-rounding error: both references are exact.
    inv = (torch.tensor(1.0) / torch.tensor(c)).double()
    assert torch.equal(div_const(x, c, "cuda"), (x.double() * inv).float())
    assert torch.equal(div_const(x, c, "cpu"), (x.double() / c).float())
    differ = (div_const(x, c, "cuda") != div_const(x, c, "cpu")).float().mean().item()
    assert differ > 0.05  # the two ModelOpt arithmetics really differ


def test_modes_reach_the_bytes_and_bad_mode_is_refused():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    a = nvfp4.quantize(w, arith="cuda")
    b = nvfp4.quantize(w, arith="cpu")
    assert a.global_scale.item() == div_const(w.abs().max(), 2688.0, "cuda").item()
    assert b.global_scale.item() == div_const(w.abs().max(), 2688.0, "cpu").item()
    assert fp8.quantize_per_tensor(w, arith="cuda")[1].item() == div_const(w.abs().max(), 448.0, "cuda").item()
    with pytest.raises(ValueError, match="arith must be one of"):
        nvfp4.quantize(w, arith="fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_division_by_a_0d_scale(dtype):
    from fp4kit.formats.arith import div_by_scale

    w = (torch.randn(1 << 14, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    scale = torch.tensor(0.0123456789, dtype=torch.float32)
    assert torch.equal(div_by_scale(w, scale, "cpu"), w / scale)  # torch on the CPU is the oracle
    cuda_rule = (w.float() / scale.to(dtype).float()).to(dtype)
    assert torch.equal(div_by_scale(w, scale, "cuda"), cuda_rule)
    if dtype != torch.float32:
        assert not torch.equal(div_by_scale(w, scale, "cuda"), div_by_scale(w, scale, "cpu"))
