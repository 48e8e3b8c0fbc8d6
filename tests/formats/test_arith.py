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
    assert torch.equal(div_const(x, c, "reciprocal"), (x.double() * inv).float())
    assert torch.equal(div_const(x, c, "exact"), (x.double() / c).float())
    differ = (div_const(x, c, "reciprocal") != div_const(x, c, "exact")).float().mean().item()
    assert differ > 0.05  # the two ModelOpt arithmetics really differ


def test_modes_reach_the_bytes_and_bad_mode_is_refused():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    a = nvfp4.quantize(w, scalar_div="reciprocal")
    b = nvfp4.quantize(w, scalar_div="exact")
    assert a.global_scale.item() == div_const(w.abs().max(), 2688.0, "reciprocal").item()
    assert b.global_scale.item() == div_const(w.abs().max(), 2688.0, "exact").item()
    assert fp8.quantize_per_tensor(w, scalar_div="reciprocal")[1].item() == div_const(w.abs().max(), 448.0, "reciprocal").item()
    with pytest.raises(ValueError, match="scalar_div must be one of"):
        nvfp4.quantize(w, scalar_div="fast")
