"""kernels.fp8 against the reference fp4kit.formats.fp8: the same bytes and scales, the same errors."""

from __future__ import annotations

import pytest
import torch

from fp4kit.formats import FormatError, e4m3, fp8
from fp4kit.formats.arith import div_by_scale, div_const
from fp4kit.formats.metrics import sqnr_terms
from fp4kit.kernels import fp8 as kfp8


def _all_finite(dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


def _around_midpoints() -> torch.Tensor:
    pos = e4m3.decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = ((pos[:-1].double() + pos[1:].double()) / 2).float()
    x = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.nextafter(mids, torch.zeros_like(mids)), pos,
                   torch.tensor([448.0, 463.99, 464.0, 464.01, 500.0, 1e30, 3.4e38, 1e-30, 0.0])])
    return torch.cat([x, -x])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_equals_encode_for_every_value(dtype):
    x = _all_finite(dtype)
    assert torch.equal(kfp8.cast_e4m3(x).view(torch.uint8), e4m3.encode(x))


def test_cast_equals_encode_around_every_midpoint_and_beyond_448_in_fp32():
    x = _around_midpoints()
    assert torch.equal(kfp8.cast_e4m3(x).view(torch.uint8), e4m3.encode(x))


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-8, 4, (shape[0], 1), generator=g).float())
    return w.to(dtype)


@pytest.mark.parametrize("arith", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mults", [None, (1.0, 1.5), (0.5, 0.75, 1.0)])  # below 1: saturated values
def test_bytes_and_scale_equal_the_reference(arith, dtype, mults):
    w = _weight((96, 256), dtype, seed=3)
    q, s = kfp8.quantize_per_tensor(w, arith, amax_multipliers=mults)
    q_ref, s_ref = fp8.quantize_per_tensor(w, arith, amax_multipliers=mults)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s.dtype == torch.float32 and s.dim() == 0 and torch.equal(s, s_ref)


@pytest.mark.parametrize("arith", ["cuda", "cpu"])
@pytest.mark.parametrize("shape", [(3, 40, 64), (2, 2, 8, 32), (512,)])
def test_any_shape_is_one_tensor_with_one_scale(arith, shape):
    # The range is max|W| over the whole tensor, whatever its leading dims, as the reference's.
    w = _weight((max(1, torch.Size(shape[:-1]).numel()), shape[-1]), torch.bfloat16, seed=5).reshape(shape)
    w.view(-1)[:7] *= 64  # the largest values in the first member
    q, s = kfp8.quantize_per_tensor(w, arith)
    q_ref, s_ref = fp8.quantize_per_tensor(w, arith)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("arith", ["cuda", "cpu"])
def test_the_kernel_makes_the_references_scale_from_the_range(arith):
    # amax / 448 in the reference's arithmetic (the fp32 reciprocal's product under "cuda", the
    # IEEE quotient otherwise; they differ on some ranges), and 1 for an all-zero weight.
    w = torch.ones(4, 32)
    products = 0
    for amax in [0.0, 1.0, 3.0, 7.0, 0.1, 313.6, 1e-30, 3e38, 2.0**-140] + torch.rand(200, generator=torch.Generator().manual_seed(1)).mul(1e4).tolist():
        a = torch.tensor(amax, dtype=torch.float32)
        _, got = kfp8._fp8_pass(w, arith, None, amax=a)
        want = torch.where(a == 0, 1.0, div_const(a, 448.0, arith))
        assert torch.equal(got, want), (amax, float(got), float(want))
        products += bool(div_const(a, 448.0, "cuda") != div_const(a, 448.0, "cpu"))
    assert products > 0  # the two modes are told apart


def test_all_zero_weight_gets_scale_one():
    q, s = kfp8.quantize_per_tensor(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert float(s) == 1.0 and not q.view(torch.uint8).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_raises_the_references_error_now_or_when_deferred(bad):
    w = torch.randn(8, 32)
    w[3, 5] = bad
    with pytest.raises(FormatError) as ref:
        fp8.quantize_per_tensor(w)
    with pytest.raises(FormatError) as now:
        kfp8.quantize_per_tensor(w)
    assert str(now.value).split(": ", 1)[1] == str(ref.value).split(": ", 1)[1]  # count and first position
    deferred: list = []
    kfp8.quantize_per_tensor(w, deferred=deferred)  # does not raise yet
    assert len(deferred) == 1
    with pytest.raises(FormatError, match=r"first at index \(3, 5\)"):
        deferred[0]()


def test_a_finite_weight_passes_its_deferred_check():
    deferred: list = []
    kfp8.quantize_per_tensor(torch.randn(8, 32), deferred=deferred)
    deferred[0]()


def test_bad_input_is_refused_like_the_reference():
    for bad in (torch.zeros(4, 4, dtype=torch.int32), torch.zeros(0, 4)):
        with pytest.raises(FormatError):
            fp8.quantize_per_tensor(bad)
        with pytest.raises(FormatError):
            kfp8.quantize_per_tensor(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mults", [(1.0, 1.5), (0.5, 0.75, 1.0, 1.25), (1.5, 1.0)])
def test_search_amax_equals_the_references_range(dtype, mults):
    w = _weight((64, 128), dtype, seed=5)
    assert torch.equal(kfp8.search_amax(w, mults), fp8.search_amax(w, mults)[0])


def test_search_amax_keeps_the_first_of_equal_errors():
    # Powers of two: 448 / 1 and 448 / 2 both map every value onto the E4M3 grid, so candidates
    # 1 and 2 both quantize without error; the first wins, as in the reference.
    w = torch.tensor([[1.0, -0.5, 0.25, 2.0**-6]] * 8)
    ref, best, errors = fp8.search_amax(w, (1.0, 2.0))
    assert errors == [0.0, 0.0] and best == 0
    assert torch.equal(kfp8.search_amax(w, (1.0, 2.0)), ref) and float(ref) == 1.0
    assert float(kfp8.search_amax(w, (2.0, 1.0))) == 2.0


def test_search_amax_of_a_zero_weight_and_bad_multipliers():
    assert float(kfp8.search_amax(torch.zeros(4, 16), (1.0, 1.5))) == 0.0
    for bad in [(), (0.0,), (1.0, float("nan")), (-1.0,)]:
        with pytest.raises(FormatError, match="multipliers must be positive finite"):
            kfp8.search_amax(torch.ones(4, 16), bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_searched_range_of_a_non_finite_weight_fails_its_deferred_check(bad):
    w = torch.randn(8, 32)
    w[2, 7] = bad
    assert not torch.isfinite(kfp8.search_amax(w, (1.0, 1.5)))
    deferred: list = []
    kfp8.quantize_per_tensor(w, amax_multipliers=(1.0, 1.5), deferred=deferred)
    with pytest.raises(FormatError, match=r"first at index \(2, 7\)"):
        deferred[0]()


# Scales that put every E4M3 binade, the subnormals and the saturation under the values: powers
# of two, and scales whose 16-bit roundings differ from them (`arith="cuda"` divides by those).
_SCALES = (1.0, 2.0**-10, 2.0**12, 0.7, 3.14159, 1.0 / 448, 1e-3, 123.456)


@pytest.mark.parametrize("arith", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_rounds_every_16_bit_value_as_torch(arith, dtype):
    x = _all_finite(dtype)
    for s in _SCALES:
        scale = torch.tensor(s, dtype=torch.float32)
        want = kfp8.cast_e4m3(div_by_scale(x, scale, arith)).view(torch.uint8)
        got = kfp8._quantize_with_scale(x, scale, arith, None).view(torch.uint8)
        assert torch.equal(got, want), (s, int((got != want).sum()))


@pytest.mark.parametrize("arith", ["cuda", "cpu"])
def test_the_kernel_rounds_fp32_around_every_midpoint_as_torch(arith):
    x = _around_midpoints()
    for s in (1.0, 0.75, 2.0**-20):
        scale = torch.tensor(s, dtype=torch.float32)
        want = kfp8.cast_e4m3(div_by_scale(x, scale, arith)).view(torch.uint8)
        assert torch.equal(kfp8._quantize_with_scale(x, scale, arith, None).view(torch.uint8), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mults", [None, (1.0, 1.5)])
def test_the_error_terms_of_the_quantizing_pass_are_the_references(dtype, mults):
    # fp32 partial sums added in float64: within 1e-6 of the reference's float64 sums.
    w = _weight((300, 96), dtype, seed=11)  # 28,800 elements: the last program's tile is partial
    terms: list = []
    q, s = kfp8.quantize_per_tensor(w, amax_multipliers=mults, terms=terms)
    (part,) = terms
    assert part.dtype == torch.float32 and part.shape[1] == 2
    signal, noise = part.sum(0, dtype=torch.float64).tolist()
    ref_signal, ref_noise = sqnr_terms(w, fp8.dequantize_per_tensor(q, s))
    assert float(noise) > 0
    assert abs(float(signal) / float(ref_signal) - 1) < 1e-6
    assert abs(float(noise) / float(ref_noise) - 1) < 1e-6
