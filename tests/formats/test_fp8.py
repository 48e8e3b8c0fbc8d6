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


def test_amax_search_is_modelopts_mse_choice():
    g = torch.Generator().manual_seed(5)
    # Gaussian weights with one outlier: the range chosen is the candidate whose ModelOpt fake
    # quantization has the smaller squared error, the first one on ties.
    for seed in range(6):
        w = (torch.randn(64, 96, generator=g) * 0.02).to(torch.bfloat16)
        w[0, seed] = 0.3
        amax, best, errors = fp8.search_amax(w, (1.0, 1.5))
        assert best == min(range(2), key=lambda i: (errors[i], i))
        for c, err in zip((1.0, 1.5), errors):
            ref = fp8.fake_quant_modelopt(w.float(), w.abs().amax().float() * c)
            assert err == pytest.approx(float(((w.float() - ref).double() ** 2).sum()), rel=1e-12)
        # ModelOpt keeps the winner in the weight dtype: the bf16 value of c * max|W|
        want = (w.abs().amax().float() * (1.0, 1.5)[best]).to(torch.bfloat16).float()
        assert torch.equal(amax, want)
        q, scale = fp8.quantize_per_tensor(w, amax_multipliers=(1.0, 1.5))
        assert torch.equal(scale, fp8.scale_from_amax(want))
        q1, s1 = fp8.quantize_per_tensor(w, amax_multipliers=(1.0,))
        q0, s0 = fp8.quantize_per_tensor(w)
        assert torch.equal(s1, s0) and torch.equal(q1.view(torch.uint8), q0.view(torch.uint8))
    picks = set()
    for seed in range(40):
        w = (torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
        picks.add(fp8.search_amax(w, (1.0, 1.5))[1])
    assert picks == {0, 1}  # both candidates win on some plain Gaussian weights


def test_amax_search_edge_cases():
    zero = torch.zeros(8, 16)
    amax, best, errors = fp8.search_amax(zero, (1.0, 1.5))
    assert float(amax) == 0.0 and best == 0
    assert fp8.quantize_per_tensor(zero, amax_multipliers=(1.0, 1.5))[1].item() == 1.0
    w = torch.full((4, 16), 0.5)
    assert fp8.search_amax(w, (1.0, 1.0))[1] == 0  # a tie keeps the first
    with pytest.raises(FormatError, match="positive finite"):
        fp8.search_amax(w, (1.0, 0.0))
