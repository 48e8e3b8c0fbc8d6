"""kernels.error against the reference's float64 SQNR terms, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from fp4kit.formats import e2m1, e4m3, nvfp4
from fp4kit.formats.metrics import sqnr_terms
from fp4kit.kernels import error


def _close(got, want) -> None:
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and g.dim() == 0
        assert abs(float(g) - float(w)) <= 2e-6 * abs(float(w)) + 1e-30, (float(g), float(w))


@pytest.mark.parametrize("shape,tiles", [((64,), 1), ((3, 48), 1), ((5, 32, 64), 2), ((2, 3, 16, 32), 1),
                                         ((200, 48), 3), ((70, 32), 16)])
@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_terms_match_the_reference(shape, tiles, rule):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))).to(torch.bfloat16)
    qt = nvfp4.quantize(w, scale_rule=rule)
    _close(error.nvfp4_error_terms(w, qt, tiles=tiles), sqnr_terms(w, qt.dequantize()))


def test_every_code_and_every_scale_byte_decodes_as_the_reference():
    """All 16 E2M1 codes against all 126 positive finite E4M3 scales (and 0): the kernel's noise
    term is sum (x - code * scale * g)^2; with x = 0 it is the sum of the squared dequantized values."""
    scales = torch.arange(0, 127, dtype=torch.uint8)  # 0x00 .. 0x7E: zero, subnormals, normals
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(scales.numel(), 1)  # one 16-element block per scale
    block_scale = scales.view(torch.float8_e4m3fn).reshape(-1, 1)
    for g in (1.0, 0.0078125, 3.0e-5):
        qt = nvfp4.NVFP4Tensor(packed, block_scale, torch.tensor(g))
        x = torch.zeros(scales.numel(), 16)
        want = qt.dequantize().double().pow(2).sum()
        assert float(error.nvfp4_error_terms(x, qt, tiles=1)[1]) == pytest.approx(float(want), rel=1e-6)
        # and one scale at a time: a wrong decode of any single byte would show
        for i in (1, 7, 8, 63, 64, 120, 126):
            one = nvfp4.NVFP4Tensor(packed[i : i + 1], block_scale[i : i + 1], torch.tensor(g))
            ref = (e2m1.decode(codes).double() * float(e4m3.decode(scales[i : i + 1])[0]) * g).pow(2).sum()
            assert float(error.nvfp4_error_terms(torch.zeros(1, 16), one, tiles=1)[1]) == pytest.approx(float(ref), rel=1e-6)


def test_members_use_their_own_global_scale():
    w = torch.randn(4, 16, 32)
    w[2] *= 1000
    qt = nvfp4.quantize(w, scale_rule="4o6")
    swapped = nvfp4.NVFP4Tensor(qt.packed, qt.block_scale, qt.global_scale.flip(0))
    _close(error.nvfp4_error_terms(w, qt, tiles=1), sqnr_terms(w, qt.dequantize()))
    _close(error.nvfp4_error_terms(w, swapped, tiles=1), sqnr_terms(w, swapped.dequantize()))


def test_shape_mismatch_is_refused():
    qt = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="source shape"):
        error.nvfp4_error_terms(torch.randn(4, 16), qt)
