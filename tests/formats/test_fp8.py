import pytest
import torch

from fp4kit.formats import FormatError, e4m3, fp8


def test_round_trip_error_is_bounded():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = fp8.quantize_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == ()
    assert scale.item() == fp8.scale_from_amax(w.abs().max()).item()
    rel = ((fp8.dequantize_per_tensor(q, scale) - w.float()).abs() / w.float().abs().clamp(min=1e-3)).max()
    assert rel.item() < 0.07  # 3 mantissa bits: half an ulp is 1/16, plus the bf16 pre-rounding


def test_max_maps_to_448_and_zero_tensor():
    w = torch.tensor([[-3.0, 1.5, 0.0, 3.0]])
    q, scale = fp8.quantize_per_tensor(w)
    assert e4m3.decode(q).tolist() == [[-448.0, 224.0, 0.0, 448.0]]
    q0, s0 = fp8.quantize_per_tensor(torch.zeros(4, 4))
    assert s0.item() == 1.0 and bool((q0.view(torch.uint8) == 0).all())


def test_bad_input():
    with pytest.raises(FormatError, match="NaN"):
        fp8.quantize_per_tensor(torch.tensor([1.0, float("nan")]))
    with pytest.raises(FormatError, match="amax must be finite"):
        fp8.scale_from_amax(float("inf"))
