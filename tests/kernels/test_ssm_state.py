"""kernels.ssm_state against fp4kit.formats.fp16sr: the same fp16 bits for a seed and an offset."""

from __future__ import annotations

import math

import pytest
import torch

from fp4kit.formats import FormatError, fp16sr
from fp4kit.kernels import ssm_state


def _state(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 18, (n,), generator=g).float())
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.0, -65535.0, 2.0**-25, 1e-30])
    x[: specials.numel()] = specials
    return x


@pytest.mark.parametrize("rounds", [5, 10])
@pytest.mark.parametrize("seed,offset", [(0, 0), (42, 3), (2**32 + 17, 2**32 - 2), (2**62 + 5, 1)])
def test_kernel_bits_equal_the_emulator(rounds, seed, offset):
    x = _state(3000, seed % 1000).reshape(3, 1000)
    want = fp16sr.round_state(x, seed, rounds, offset)
    got = ssm_state.round_state(x, seed, rounds, offset)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp32_out_holds_the_fp16_values_in_place():
    x = _state(777, 1)
    want = fp16sr.round_state(x, 9, 5).float()
    y = x.clone()
    ssm_state.round_state(y, 9, 5, out=y)
    assert torch.equal(y.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert torch.equal(y.isnan(), want.isnan())


def test_torch_backend_is_the_emulator_and_inputs_are_checked():
    x = _state(100, 2)
    assert torch.equal(ssm_state.round_state(x, 1, 5, backend="torch").view(torch.int16),
                       fp16sr.round_state(x, 1, 5).view(torch.int16))
    with pytest.raises(FormatError, match="contiguous float32"):
        ssm_state.round_state(x.half(), 1, 5)
    with pytest.raises(FormatError, match="seed"):
        ssm_state.round_state(x, 2**63, 5)
    with pytest.raises(FormatError, match="rounds"):
        ssm_state.round_state(x, 1, 0)
    with pytest.raises(FormatError, match="out must be"):
        ssm_state.round_state(x, 1, 5, out=torch.empty(99, dtype=torch.float16))
    with pytest.raises(FormatError, match="base must be"):
        ssm_state.round_state(x, 1, 5, base=torch.tensor([3], dtype=torch.int32))


@pytest.mark.parametrize("seed,base", [(0, 7), (5, 2**32), (2**32 + 1, 2**40 + 3)])
def test_a_seed_read_from_the_device_is_added_to_the_launch_seed(seed, base):
    # What a replayed graph does: the kernel reads base where it runs; the words are those of seed + base.
    x = _state(1500, 3)
    b = torch.tensor([base], dtype=torch.int64)
    want = fp16sr.round_state(x, seed + base, 5, 4)
    for backend in ("triton", "torch"):
        got = ssm_state.round_state(x, seed, 5, 4, base=b, backend=backend)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), backend
    assert not torch.equal(ssm_state.round_state(x, seed, 5, 4).view(torch.int16), want.view(torch.int16))
