"""NVFP4 and FP8 bytes against nvidia-modelopt 0.47, installed and called here as the oracle.

ModelOpt runs on the CPU here, so fp4kit is asked for torch's CPU arithmetic (`arith="cpu"`);
tests/gpu/ holds the same comparison on CUDA (fp4kit's default arith).
"""

import itertools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("modelopt")
from modelopt.torch.export.model_config import QUANTIZATION_FP8  # noqa: E402
from modelopt.torch.export.quant_utils import to_quantized_weight  # noqa: E402
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: E402

from fp4kit.formats import fp8, nvfp4  # noqa: E402
from fp4kit.formats.constants import FP8_NORM_4O6, FP8_NORM_PLAIN, FP8_MAX  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EXACT = "cpu"  # ModelOpt as torch runs it on the CPU
SHAPES = ((16, 16), (64, 256), (48, 1024))
MAGNITUDES = (1e-6, 1e-2, 1.0, 1e3)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def modelopt_plain(w: torch.Tensor):
    q, scale, scale2 = NVFP4QTensor.quantize(w.clone(), 16)
    return q._quantized_data, scale, scale2


def modelopt_static(w: torch.Tensor, block_amax: torch.Tensor, global_amax: torch.Tensor, norm: float):
    """ModelOpt's export of a static NVFP4 quantizer holding these amaxes (what 4/6 calibration leaves)."""
    quantizer = SimpleNamespace(
        global_amax=global_amax,
        _amax=block_amax.reshape(-1, 1),
        block_sizes={-1: 16, "type": "static", "scale_bits": (4, 3), "four_over_six": norm == FP8_NORM_4O6},
    )
    scale2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer)
    scale, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, scale2)
    q, _, _ = NVFP4QTensor.quantize(w.clone(), 16, scale, scale2)
    return q._quantized_data, scale, scale2


def assert_same(ours: nvfp4.NVFP4Tensor, packed, scale, scale2):
    assert torch.equal(ours.packed, packed)
    assert torch.equal(u8(ours.block_scale), u8(scale))
    assert ours.global_scale.dtype == torch.float32 and scale2.dtype == torch.float32
    assert torch.equal(ours.global_scale.view(torch.int32), scale2.reshape(ours.global_scale.shape).view(torch.int32))


@pytest.mark.parametrize(("dtype", "shape", "magnitude"), list(itertools.product(DTYPES, SHAPES, MAGNITUDES)))
def test_plain_rule_bytes_identical(weight_factory, dtype, shape, magnitude):
    w = weight_factory(shape, dtype, seed=hash((shape, magnitude)) % 1000, magnitude=magnitude)
    assert_same(nvfp4.quantize(w, arith=EXACT), *modelopt_plain(w))


@pytest.mark.parametrize(("dtype", "norm", "magnitude"), list(itertools.product(DTYPES, (FP8_NORM_PLAIN, FP8_NORM_4O6), MAGNITUDES)))
def test_static_path_with_given_multipliers_identical(weight_factory, dtype, norm, magnitude):
    w = weight_factory((64, 512), dtype, seed=7, magnitude=magnitude)
    g = torch.Generator().manual_seed(3)
    block_amax = w.view(64, 32, 16).abs().amax(-1).float()
    mult = torch.where(torch.rand(block_amax.shape, generator=g) < 0.5, 1.0, 1.5)
    if norm == FP8_NORM_PLAIN:
        mult = torch.ones_like(mult)  # the 448 normalisation has no room for the 1.5 candidate
    global_amax = w.abs().amax().float()
    ours = nvfp4.quantize_static(w, block_amax * mult, global_amax, fp8_norm=norm, arith=EXACT)
    assert_same(ours, *modelopt_static(w, block_amax * mult, global_amax, norm))


@pytest.mark.parametrize("dtype", DTYPES)
def test_four_over_six_is_modelopts_static_export_of_its_choices(weight_factory, dtype):
    w = weight_factory((128, 512), dtype, seed=11, magnitude=0.02)
    ours, choice = nvfp4.quantize(w, scale_rule="4o6", return_choice=True, arith=EXACT)
    assert 0.2 < choice.float().mean().item() < 0.7
    block_amax = w.view(128, 32, 16).abs().amax(-1).float()
    mult = torch.where(choice, torch.tensor(1.5), torch.tensor(1.0))
    assert_same(ours, *modelopt_static(w, block_amax * mult, w.abs().amax().float(), FP8_NORM_4O6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_on_the_e2m1_grid(dtype):
    # global amax 2688 -> weight_scale_2 = 1; a block with max 6 gets scale 1.0, so its other
    # elements land exactly on the E2M1 midpoints.
    w = torch.zeros(2, 32)
    w[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0])
    w[1, 16] = 2688.0
    w = w.to(dtype)
    ours = nvfp4.quantize(w, arith=EXACT)
    assert_same(ours, *modelopt_plain(w))
    assert ours.global_scale.item() == 1.0 and ours.block_scale[0, 0].float().item() == 1.0
    assert ours.codes()[0, :16].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]


def test_dequantize_matches_modelopt(weight_factory):
    w = weight_factory((64, 256), torch.bfloat16, seed=5, magnitude=0.1)
    ours = nvfp4.quantize(w, arith=EXACT)
    q, scale, scale2 = NVFP4QTensor.quantize(w.clone(), 16)
    theirs = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale2, block_sizes={-1: 16})
    assert torch.equal(ours.dequantize(), theirs)  # value-equal (ModelOpt decodes code 0x8 as +0.0)


def test_expert_stack_is_per_expert(weight_factory):
    w = weight_factory((4, 32, 64), torch.bfloat16, seed=9, magnitude=0.05)
    w[2] *= 100.0
    stack = nvfp4.quantize(w, arith=EXACT)
    assert stack.global_scale.shape == (4,)
    for e in range(4):
        assert_same(nvfp4.NVFP4Tensor(stack.packed[e], stack.block_scale[e], stack.global_scale[e]), *modelopt_plain(w[e]))


@pytest.mark.parametrize(("dtype", "magnitude"), list(itertools.product(DTYPES, MAGNITUDES)))
def test_fp8_per_tensor_identical(weight_factory, dtype, magnitude):
    w = weight_factory((96, 160), dtype, seed=13, magnitude=magnitude)
    ours, scale = fp8.quantize_per_tensor(w, arith=EXACT)
    theirs_scale = w.abs().amax().float() / FP8_MAX
    theirs = to_quantized_weight(w, theirs_scale, QUANTIZATION_FP8)
    assert torch.equal(scale.view(torch.int32), theirs_scale.view(torch.int32))
    assert torch.equal(u8(ours), u8(theirs))


def test_fp8_divides_in_the_weight_dtype():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(128, 256, generator=g)).to(torch.bfloat16)
    ours, scale = fp8.quantize_per_tensor(w)
    fp32_division = (w.float() / scale).to(torch.float8_e4m3fn)
    assert not torch.equal(u8(ours), u8(fp32_division)), "bf16 double rounding should change some bytes"
