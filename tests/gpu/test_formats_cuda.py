"""The emulator gives the same bytes on a CUDA device as on the CPU."""

import pytest
import torch

from fp4kit.formats import e2m1, e4m3, fp8, nvfp4

pytestmark = pytest.mark.gpu


def random_weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 4, shape[:-1] + (1,), generator=g).float())
    w.view(-1, 16)[::37] = 0
    return w.to(dtype)


def test_codecs_on_cuda_match_cpu_and_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    xc = x.cuda()
    assert torch.equal(e4m3.encode(xc).cpu(), e4m3.encode(x))
    # torch's CUDA cast saturates only in newer releases (older ones give NaN above 464): compare
    # where every torch defines the result.
    inside = xc.abs() <= 448
    assert torch.equal(e4m3.encode(xc[inside]), xc[inside].to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(e2m1.encode(xc).cpu(), e2m1.encode(x))


@pytest.mark.parametrize("mode", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_nvfp4_on_cuda_matches_cpu(dtype, rule, mode):
    w = random_weight((8, 256, 512), dtype, seed=1)
    cpu = nvfp4.quantize(w, scale_rule=rule, arith=mode)
    gpu = nvfp4.quantize(w.cuda(), scale_rule=rule, arith=mode)
    assert torch.equal(gpu.packed.cpu(), cpu.packed)
    assert torch.equal(gpu.block_scale.cpu().view(torch.uint8), cpu.block_scale.view(torch.uint8))
    assert torch.equal(gpu.global_scale.cpu(), cpu.global_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_on_cuda_matches_cpu_and_torch_promotion(dtype):
    w = random_weight((512, 1024), dtype, seed=2)
    q_cpu, s_cpu = fp8.quantize_per_tensor(w, arith="cuda")
    q_gpu, s_gpu = fp8.quantize_per_tensor(w.cuda(), arith="cuda")
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
    # ModelOpt's expression, `w / scale` with torch's own promotion, on the GPU:
    assert torch.equal((w.cuda() / s_gpu).to(torch.float8_e4m3fn).view(torch.uint8).cpu(), q_cpu.view(torch.uint8))


def test_kernels_fp8_cast_on_cuda_equals_encode_everywhere():
    """torch's CUDA cast after the clamp: every finite bf16 and fp16 value, and fp32 around every
    E4M3 midpoint and beyond 448 (where older CUDA casts give NaN without the clamp)."""
    from fp4kit.kernels import fp8 as kfp8

    for dtype in (torch.bfloat16, torch.float16):
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        x = x[torch.isfinite(x)]
        assert torch.equal(kfp8.cast_e4m3(x.cuda()).view(torch.uint8).cpu(), e4m3.encode(x))
    pos = e4m3.decode(torch.arange(0, 0x7F, dtype=torch.uint8))
    mids = ((pos[:-1].double() + pos[1:].double()) / 2).float()
    x = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)), pos, torch.tensor([463.99, 464.0, 500.0, 3.4e38])])
    x = torch.cat([x, -x])
    assert torch.equal(kfp8.cast_e4m3(x.cuda()).view(torch.uint8).cpu(), e4m3.encode(x))


@pytest.mark.parametrize("mode", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_fp8_on_cuda_writes_the_references_bytes(dtype, mode):
    from fp4kit.kernels import fp8 as kfp8

    w = random_weight((512, 1024), dtype, seed=4)
    q_ref, s_ref = fp8.quantize_per_tensor(w, arith=mode)
    q, s = kfp8.quantize_per_tensor(w.cuda(), arith=mode)
    assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8))
    assert torch.equal(s.cpu(), s_ref)


@pytest.mark.parametrize("rounds", [5, 10])
def test_ssm_state_kernel_equals_the_emulator_on_cuda(rounds):
    """The compiled stochastic-rounding kernel (Triton's Philox on the GPU) against the CPU
    emulator, bit for bit, on a state of the Nano's Mamba shape (64 heads x 64 x 128) x 3 slots."""
    from fp4kit.formats import fp16sr
    from fp4kit.kernels import ssm_state

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, 64, 128, generator=g) * torch.exp2(torch.randint(-30, 17, (3, 64, 64, 128), generator=g).float())
    for seed, offset in ((0, 0), (123456789, 5), (2**40 + 3, 2**33 + 1)):
        want = fp16sr.round_state(x, seed, rounds, offset)
        got = ssm_state.round_state(x.cuda(), seed, rounds, offset).cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_philox_and_stochastic_rounding_stay_on_cuda_with_the_cpus_bits():
    from fp4kit.formats import fp16sr
    from fp4kit.formats.philox import philox4x32

    counters = torch.arange(64, dtype=torch.int64).reshape(16, 4)
    keys = torch.stack([torch.arange(16, dtype=torch.int64) * 7919, torch.full((16,), 3, dtype=torch.int64)], dim=-1)
    want = philox4x32(counters, keys, 5)
    got = philox4x32(counters.cuda(), keys, 5)  # a batched key on the CPU goes to the counters' device
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)

    bits = fp16sr.random_bits((8, 8), 1234, 5, offset=12, device="cuda")
    assert bits.device.type == "cuda" and torch.equal(bits.cpu(), fp16sr.random_bits((8, 8), 1234, 5, offset=12))

    x = torch.randn(8, 8)
    rand = fp16sr.random_bits(x.shape, 99, 5)
    got = fp16sr.round_stochastic(x.cuda(), rand)  # random bits on the CPU for a state on CUDA
    assert got.device.type == "cuda" and torch.equal(got.cpu().view(torch.int16), fp16sr.round_stochastic(x, rand).view(torch.int16))
