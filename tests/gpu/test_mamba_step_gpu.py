"""fp4kit.models.mamba_step on a CUDA GPU, on Nemotron-3-Nano's Mamba shapes: eagerly the conv and
SSM states are transformers' bit for bit and the outputs within one bf16 unit in the last place;
compiled by torch.compile (as `generate(compile=True)` runs them) the states stay within fp32
rounding of transformers' and the outputs within two units plus what a state's bf16 rounding
one unit away moves.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fp4kit.models import mamba_step  # noqa: E402

pytestmark = pytest.mark.gpu


def _compiled(fn):
    """As `generate(compile=True)` compiles the step: inductor rounding to bf16 where eager does."""
    return torch.compile(fn, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})


def _ulp(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def _nano_state_inputs(batch: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf, heads, head_dim, size, groups = torch.bfloat16, 64, 64, 128, 8

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    state = randn(batch, heads, head_dim, size)
    x = randn(batch, heads, head_dim).to(bf)
    dt = randn(batch, heads, 1).to(bf).expand(-1, -1, head_dim)
    A = -torch.exp(randn(heads)).float()[:, None, None].expand(-1, head_dim, size)
    B, C = randn(batch, groups, size).to(bf), randn(batch, groups, size).to(bf)
    D = randn(heads).to(bf)[:, None].expand(-1, head_dim)
    dt_bias = randn(heads).to(bf)[:, None].expand(-1, head_dim)
    return state, x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("compiled", [False, True])
def test_state_update_on_nano_shapes(batch, compiled):
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    state, x, dt, A, B, C, D, dt_bias = _nano_state_inputs(batch, seed=batch)
    ref_state, mine = state.clone(), state.clone()
    ref = m.mamba2_selective_state_update(ref_state, x, dt, A, B, C, D, z=None, dt_bias=dt_bias, dt_softplus=True)
    fn = _compiled(mamba_step.state_update) if compiled else mamba_step.state_update
    out = fn(mine, x, dt, A, B, C, D, z=None, dt_bias=dt_bias, dt_softplus=True)
    if compiled:  # inductor may fuse the update into one fma, and computes exp its own way
        assert torch.allclose(mine, ref_state, rtol=1e-5, atol=1e-6)
        # The state is rounded to bf16 before its contraction with C; an fp32 state a rounding
        # away can round to the neighbouring bf16 value, moving its term by one unit of the
        # state's times |C| (measured on an H200: up to 6 units of the output where terms cancel).
        per = state.shape[1] // C.shape[1]
        slack = (_ulp(ref_state) * C.float().repeat_interleave(per, dim=1)[:, :, None, :].abs()).sum(-1)
        assert ((out.float() - ref.float()).abs() <= 2 * _ulp(ref) + slack).all()
    else:
        assert torch.equal(mine, ref_state)
        assert ((out.float() - ref.float()).abs() <= _ulp(ref)).all()


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("compiled", [False, True])
def test_conv_update_on_nano_shapes(batch, compiled):
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    g = torch.Generator(device="cuda").manual_seed(batch)
    bf, channels = torch.bfloat16, 4096 + 2 * 8 * 128
    conv_state = torch.randn(batch, channels, 4, device="cuda", generator=g).to(bf)
    column = torch.randn(batch, channels, 1, device="cuda", generator=g).to(bf)
    weight = torch.randn(channels, 4, device="cuda", generator=g).to(bf)
    bias = torch.randn(channels, device="cuda", generator=g).to(bf)
    ref_state, mine = conv_state.clone(), conv_state.clone()
    ref = m.causal_conv1d_update(column, ref_state, weight, bias, activation="silu")
    fn = _compiled(mamba_step.conv_update) if compiled else mamba_step.conv_update
    out = fn(column, mine, weight, bias, activation="silu")
    assert torch.equal(mine, ref_state)
    assert ((out.float() - ref.float()).abs() <= (2 if compiled else 1) * _ulp(ref)).all()
