"""fp4kit's default arithmetic is nvidia-modelopt's on CUDA, computed on the CPU.

ModelOpt divides by constants with a Python number (amax / 2688, a / 6, amax / 448); on CUDA
torch turns that into a multiplication by the fp32 reciprocal. `arith="cuda"` is
that arithmetic on any device: here fp4kit runs on the CPU and ModelOpt on the GPU.
"""

from types import SimpleNamespace

import pytest
import torch

from fp4kit.formats import fp8, nvfp4

modelopt = pytest.importorskip("modelopt")
pytestmark = pytest.mark.gpu


def weights(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 1024, generator=g) * torch.exp2(torch.randint(-10, 6, (256, 1), generator=g).float())
    w.view(-1, 16)[::29] = 0
    w.view(-1, 16)[5::31] *= 1e-7
    return w.to(dtype)


def u8(t):
    return t.reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_rule_equals_modelopt_on_cuda(dtype, seed):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = weights(dtype, seed)
    q, scale, scale2 = NVFP4QTensor.quantize(w.cuda().clone(), 16)
    ours = nvfp4.quantize(w, arith="cuda")  # on the CPU
    assert torch.equal(ours.packed, q._quantized_data.cpu())
    assert torch.equal(u8(ours.block_scale), u8(scale))
    assert torch.equal(u8(ours.global_scale), u8(scale2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_four_over_six_static_export_equals_modelopt_on_cuda(dtype):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = weights(dtype, 3)
    ours, choice = nvfp4.quantize(w, scale_rule="4o6", return_choice=True, arith="cuda")
    blocks = w.view(256, 64, 16).abs().amax(-1).float()
    mult = torch.where(choice, 1.5, 1.0)
    quantizer = SimpleNamespace(
        global_amax=w.abs().amax().float().cuda(), _amax=(blocks * mult).reshape(-1, 1).cuda(),
        block_sizes={-1: 16, "type": "static", "scale_bits": (4, 3), "four_over_six": True},
    )
    wc = w.cuda()
    scale2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer)
    scale, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, wc, scale2)
    q, _, _ = NVFP4QTensor.quantize(wc.clone(), 16, scale, scale2)
    assert torch.equal(ours.packed, q._quantized_data.cpu())
    assert torch.equal(u8(ours.block_scale), u8(scale))
    assert torch.equal(u8(ours.global_scale), u8(scale2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_equals_modelopt_on_cuda(dtype):
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import to_quantized_weight

    w = weights(dtype, 4)
    wc = w.cuda()
    scale = wc.abs().amax().float() / 448.0
    theirs = to_quantized_weight(wc, scale, QUANTIZATION_FP8)
    ours, our_scale = fp8.quantize_per_tensor(w, arith="cuda")
    assert torch.equal(u8(our_scale), u8(scale))
    assert torch.equal(u8(ours), u8(theirs))
