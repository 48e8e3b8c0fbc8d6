"""fp4kit.kernels.mamba: a Mamba-2 mixer's decode step between its projections in one launch, in
Triton's interpreter: the conv and SSM states bit for bit those of `mamba_step_reference` given the
interpreter's exp, log1p and rsqrt (`INTERPRETED_MATH`), the output within one unit in the last
place (two fp32 sums run in another order). tests/test_mamba_step.py shows the reference is
transformers' step; tests/gpu/test_decode_kernels_gpu.py runs the kernel compiled on
Nemotron-3-Nano's shapes against the reference with torch's own functions."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.kernels import mamba  # noqa: E402

# exp(dt) past fp32's range is +inf in the interpreter's numpy as in torch (softplus then takes dt)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(batch, heads, head_dim, size, groups, columns=4, taps=4, dtype=torch.bfloat16, param=torch.float32,
            bias=True, seed=0):
    """(proj, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight) with
    dt around 0, past softplus's threshold (20) and past where exp overflows, states of both signs."""
    g = torch.Generator().manual_seed(seed)
    inter = heads * head_dim
    channels = inter + 2 * groups * size
    proj = torch.randn(batch, inter + channels + heads, generator=g) * 2
    proj[:, -heads:] = torch.randn(batch, heads, generator=g) * 8 + torch.tensor([0.0, 22.0, 95.0]).repeat(heads)[:heads]
    return (proj.to(dtype), torch.randn(batch, channels, columns, generator=g).to(dtype),
            torch.randn(batch, heads, head_dim, size, generator=g),
            (torch.randn(channels, taps, generator=g) * 0.5).to(dtype),
            (torch.randn(channels, generator=g) * 0.1).to(dtype) if bias else None,
            torch.randn(heads, generator=g).to(param), (torch.rand(heads, generator=g) * 3).to(param),
            torch.randn(heads, generator=g).to(param), (1 + 0.1 * torch.randn(inter, generator=g)).to(dtype))


def _copy(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    bits = 7 if x.dtype == torch.bfloat16 else 10
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -14))) - bits)


@pytest.mark.parametrize("batch,heads,head_dim,size,groups,columns,taps", [
    (2, 8, 16, 32, 2, 4, 4),  # several programs per head and heads per group
    (1, 4, 64, 128, 1, 4, 4),  # Nemotron-3-Nano's head: one group
    (3, 6, 5, 12, 3, 3, 4),  # head_dim and N not powers of two; state one column short of the taps
    (2, 4, 8, 16, 2, 5, 3),  # a longer state than the taps read
])
@pytest.mark.parametrize("dtype,param,bias", [(torch.bfloat16, torch.float32, True), (torch.float16, torch.float32, True),
                                              (torch.bfloat16, torch.bfloat16, False), (torch.float16, torch.bfloat16, True)])
def test_the_states_are_the_references_bit_for_bit(batch, heads, head_dim, size, groups, columns, taps, dtype, param,
                                                   bias):
    args = _inputs(batch, heads, head_dim, size, groups, columns, taps, dtype, param, bias, seed=batch + heads + size)
    kernel, reference = _copy(args), _copy(args)
    out = mamba.mamba_step(*kernel, 1e-5, groups)
    want = mamba.mamba_step_reference(*reference, 1e-5, groups, math=mamba.INTERPRETED_MATH)
    assert torch.equal(kernel[1], reference[1]) and not torch.equal(kernel[1], args[1])  # conv state
    assert torch.equal(kernel[2], reference[2]) and not torch.equal(kernel[2], args[2])  # SSM state
    assert out.dtype == want.dtype == dtype and out.shape == want.shape == (batch, heads * head_dim)
    assert ((out.float() - want.float()).abs() <= _ulp(want)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp8_output_is_the_output_quantized_as_fp8_linear_quantizes_it(dtype):
    # The same step with out_scale: e4m3(clamp(out / scale, +-448)) of the 16-bit output, byte for
    # byte (a scale small enough that some values saturate), and the same states.
    from fp4kit.modules import e4m3_cast

    args = _inputs(2, 8, 16, 32, 2, dtype=dtype, seed=12)
    plain, quantized = _copy(args), _copy(args)
    out = mamba.mamba_step(*plain, 1e-5, 2)
    scale = torch.tensor([out.float().abs().max().item() / 600])
    q = mamba.mamba_step(*quantized, 1e-5, 2, scale)
    want = e4m3_cast(out.float() / scale)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert (want.float().abs() == 448).any() and (want.float().abs() < 448).any()
    assert all(torch.equal(a, b) for a, b in zip(plain[1:3], quantized[1:3]))
    reference = mamba.mamba_step_reference(*_copy(args), 1e-5, 2, scale, math=mamba.INTERPRETED_MATH)
    assert reference.dtype == torch.float8_e4m3fn
    assert ((reference.float() - q.float()).abs() <= 2 ** -3 * reference.float().abs()).all()  # one e4m3 step
    # The quotient is an IEEE division: a scale that puts one output on an e4m3 midpoint, where
    # multiplying by the scale's reciprocal rounds the other way.
    v = out.float().flatten()
    v = v[v.abs() > 0][:64, None]
    s0 = v.abs() / 1.0625  # 1.0625: halfway between e4m3's 1 and 1.125
    candidates = (s0.view(torch.int32) + torch.arange(-64, 65, dtype=torch.int32)).view(torch.float32)
    split = e4m3_cast(v / candidates).view(torch.uint8) != e4m3_cast(v * (1 / candidates)).view(torch.uint8)
    assert split.any()
    tie = candidates[split][:1]
    q = mamba.mamba_step(*_copy(args), 1e-5, 2, tie)
    assert torch.equal(q.view(torch.uint8), e4m3_cast(out.float() / tie).view(torch.uint8))


def test_each_group_is_normalised_on_its_own():
    # Scaling one group's gate rows changes that group's output only (and by the norm, barely).
    args = _inputs(2, 8, 8, 16, 4, seed=7)
    proj = args[0].clone()
    proj[:, 16:32] *= 4  # group 1 of 4 (16 channels each): its gate
    base = mamba.mamba_step(*_copy(args), 1e-5, 4)
    moved = mamba.mamba_step(*([proj] + _copy(args[1:])), 1e-5, 4)
    changed = (base != moved).any(0)
    assert changed[16:32].any() and not changed[:16].any() and not changed[32:].any()


def test_the_kernel_leaves_its_counters_at_zero_and_repeats_itself():
    from fp4kit.kernels.tiles import split_counters

    args = _inputs(2, 8, 16, 32, 2, seed=3)
    first, again = _copy(args), _copy(args)
    out = mamba.mamba_step(*first, 1e-5, 2)
    assert not split_counters(args[0].device, 4)[:4].any()
    assert torch.equal(mamba.mamba_step(*again, 1e-5, 2), out)
    assert all(torch.equal(a, b) for a, b in zip(first[1:3], again[1:3]))


def test_the_programmatic_dependent_launch_is_the_plain_one_bit_for_bit():
    # pdl: the state rows and the head's parameters are read before proj (on a GPU, before the
    # wait for the launch that writes proj): the same values, so the same output and states.
    args = _inputs(2, 8, 16, 32, 2, seed=5)
    plain, early = _copy(args), _copy(args)
    out = mamba.mamba_step(*plain, 1e-5, 2, pdl=False)
    assert torch.equal(mamba.mamba_step(*early, 1e-5, 2, pdl=True), out)
    assert all(torch.equal(a, b) for a, b in zip(plain[1:3], early[1:3]))


def test_the_dependent_launch_goes_native_only_where_the_device_allows_it(monkeypatch):
    # The native branch asks `backend.pdl` (a CPU device: never); in the interpreter the same loads
    # run in the dependent order whenever asked; None takes the launch table's "mamba" STEP "pdl".
    cpu = torch.device("cpu")
    assert not mamba._launch_pdl(True, cpu, native=True)
    assert mamba._launch_pdl(True, cpu, native=False)
    assert not mamba._launch_pdl(False, cpu, native=False)
    for on in (True, False):
        monkeypatch.setattr(mamba.launch, "tables", lambda gpu=None, on=on: {"mamba": {"STEP": {"pdl": on}}})
        assert mamba._launch_pdl(None, cpu, native=False) is on


def test_the_torch_backend_is_the_reference():
    args = _inputs(2, 4, 8, 16, 2, seed=5)
    ours, ref = _copy(args), _copy(args)
    out = mamba.mamba_step(*ours, 1e-5, 2, backend="torch")
    assert torch.equal(out, mamba.mamba_step_reference(*ref, 1e-5, 2))
    assert all(torch.equal(a, b) for a, b in zip(ours[1:3], ref[1:3]))


def test_nn_conv1d_weights_are_taken_as_they_are():
    args = _inputs(1, 4, 8, 16, 2, seed=6)
    flat, conv = _copy(args), _copy(args)
    conv[3] = conv[3][:, None, :]  # [CD, 1, K]
    assert torch.equal(mamba.mamba_step(*conv, 1e-5, 2), mamba.mamba_step(*flat, 1e-5, 2))


def test_bad_inputs_are_named():
    args = _inputs(2, 4, 8, 16, 2, seed=8)

    def call(i, value, groups=2, eps=1e-5):
        bad = _copy(args)
        if i is not None:
            bad[i] = value
        return mamba.mamba_step(*bad, eps, groups)

    with pytest.raises(ValueError, match="proj must be a bf16 or fp16"):
        call(0, args[0].float())
    with pytest.raises(ValueError, match=r"proj must be \[2, 132\]"):
        call(0, args[0][:, :-1])
    with pytest.raises(ValueError, match="ssm_state must be a contiguous fp32"):
        call(2, args[2].half())
    with pytest.raises(ValueError, match="groups must divide the 4 heads"):
        call(None, None, groups=3)
    with pytest.raises(ValueError, match="conv_state must be a contiguous torch.bfloat16"):
        call(1, args[1].float())
    with pytest.raises(ValueError, match="conv_weight must be a torch.bfloat16 .* K <= 5"):
        call(3, torch.zeros(96, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"D must be a bf16, fp16 or fp32 \[4\]"):
        call(7, args[7][:3])
    with pytest.raises(ValueError, match=r"norm_weight must be .* \[32\]"):
        call(8, args[8].double())
    with pytest.raises(ValueError, match="eps must be a float"):
        call(None, None, eps=-1.0)
    with pytest.raises(ValueError, match="out_scale must be a one-element fp32 tensor"):
        mamba.mamba_step(*_copy(args), 1e-5, 2, torch.ones(2))
    with pytest.raises(ValueError, match="backend must be one of"):
        mamba.mamba_step(*_copy(args), 1e-5, 2, backend="cuda")


def test_the_operator_is_the_launcher():
    from fp4kit.kernels import ops

    args = _inputs(1, 4, 8, 16, 2, seed=9)
    via_op, direct = _copy(args), _copy(args)
    assert torch.equal(ops.mamba_step(*via_op, 1e-5, 2), mamba.mamba_step(*direct, 1e-5, 2))
    assert all(torch.equal(a, b) for a, b in zip(via_op[1:3], direct[1:3]))
    for scale in (None, torch.tensor([0.01])):
        torch.library.opcheck(torch.ops.fp4kit.mamba_step.default, (*_copy(args), 1e-5, 2, scale),
                              test_utils=("test_schema", "test_faketensor"))
