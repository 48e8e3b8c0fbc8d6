"""fp4kit/models/mamba_step.py: the Mamba-2 mixer's one-token decode functions written element-wise
give transformers' conv and SSM states bit for bit and its outputs within one bf16 unit in the last
place (the contraction with C and the convolution sum the same exact products in another order),
and `generate` runs them in its steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fp4kit import decode
from fp4kit.models import mamba_step

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parent / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


def _reference():
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    return m


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 values (at the smallest normal for zeros)."""
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def _state_inputs(batch, heads, head_dim, size, groups, seed, param_dtype=torch.bfloat16):
    """Arguments as the mixer passes them: dt, D and dt_bias expanded over head_dim, A over
    (head_dim, state)."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    state = torch.randn(batch, heads, head_dim, size, generator=g)
    x = torch.randn(batch, heads, head_dim, generator=g).to(bf)
    dt = torch.randn(batch, heads, 1, generator=g).to(bf).expand(-1, -1, head_dim)
    A = -torch.exp(torch.randn(heads, generator=g)).to(param_dtype).float()[:, None, None].expand(-1, head_dim, size)
    B = torch.randn(batch, groups, size, generator=g).to(bf)
    C = torch.randn(batch, groups, size, generator=g).to(bf)
    D = torch.randn(heads, generator=g).to(param_dtype)[:, None].expand(-1, head_dim)
    dt_bias = torch.randn(heads, generator=g).to(param_dtype)[:, None].expand(-1, head_dim)
    return state, x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("shape", [(2, 8, 16, 32, 2), (1, 64, 64, 128, 8), (3, 4, 8, 16, 1)])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_state_update_gives_transformers_state_and_output(shape, param_dtype):
    state, x, dt, A, B, C, D, dt_bias = _state_inputs(*shape, seed=sum(shape), param_dtype=param_dtype)
    ref_state, state_ = state.clone(), state.clone()
    ref = _reference().mamba2_selective_state_update(ref_state, x, dt, A, B, C, D, z=None, dt_bias=dt_bias,
                                                     dt_softplus=True)
    out = mamba_step.state_update(state_, x, dt, A, B, C, D, z=None, dt_bias=dt_bias, dt_softplus=True)
    assert torch.equal(state_, ref_state) and not torch.equal(state_, state)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert ((out.float() - ref.float()).abs() <= _ulp(ref)).all()


def test_state_update_takes_each_heads_own_group():
    """Heads h = g * H / G + r read group g's B and C: moving group 1's B moves exactly the state
    of heads 4..7 (of 8 in 2 groups)."""
    state, x, dt, A, B, C, D, dt_bias = _state_inputs(1, 8, 4, 16, 2, seed=5)
    a, b = state.clone(), state.clone()
    moved = B.clone()
    moved[:, 1] += 1
    mamba_step.state_update(a, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True)
    mamba_step.state_update(b, x, dt, A, moved, C, D, dt_bias=dt_bias, dt_softplus=True)
    assert (a != b).flatten(2).any(-1)[0].tolist() == [h >= 4 for h in range(8)]


def test_state_update_gate_and_no_skip_as_transformers():
    state, x, dt, A, B, C, _, _ = _state_inputs(2, 4, 8, 16, 2, seed=9)
    z = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref_state, state_ = state.clone(), state.clone()
    ref = _reference().mamba2_selective_state_update(ref_state, x, dt, A, B, C, None, z=z)
    out = mamba_step.state_update(state_, x, dt, A, B, C, None, z=z)
    assert torch.equal(state_, ref_state)
    assert ((out.float() - ref.float()).abs() <= _ulp(ref)).all()


@pytest.mark.parametrize("channels,taps,state_len,bias", [(64, 4, 4, True), (48, 4, 4, False), (32, 3, 5, True)])
def test_conv_update_gives_transformers_state_and_output(channels, taps, state_len, bias):
    g = torch.Generator().manual_seed(channels)
    bf = torch.bfloat16
    conv_state = torch.randn(3, channels, state_len, generator=g).to(bf)
    column = torch.randn(3, channels, 1, generator=g).to(bf)
    weight = torch.randn(channels, taps, generator=g).to(bf)
    b = torch.randn(channels, generator=g).to(bf) if bias else None
    ref_state, state = conv_state.clone(), conv_state.clone()
    ref = _reference().causal_conv1d_update(column, ref_state, weight, b, activation="silu")
    out = mamba_step.conv_update(column, state, weight, b, activation="silu")
    assert torch.equal(state, ref_state)
    assert torch.equal(state[:, :, -1:], column) and torch.equal(state[:, :, :-1], conv_state[:, :, 1:])
    assert out.shape == ref.shape == (3, channels, 1) and out.dtype == bf
    assert ((out.float() - ref.float()).abs() <= _ulp(ref)).all()
    # Without the activation: the fp32 sum of the bias and the taps' exact products, rounded once.
    exact = (conv_state[:, :, state_len - taps + 1:].double() * weight[:, :taps - 1].double()).sum(-1) \
        + column[:, :, 0].double() * weight[:, -1].double() + (b.double() if bias else 0)
    plain = mamba_step.conv_update(column, conv_state.clone(), weight, b)
    assert ((plain[:, :, 0].double() - exact).abs() <= _ulp(exact.float()) / 2 + 1e-6 * exact.abs()).all()


def test_conv_update_takes_one_column():
    with pytest.raises(ValueError, match="one new column"):
        mamba_step.conv_update(torch.zeros(1, 4, 2), torch.zeros(1, 4, 4), torch.zeros(4, 4))


def test_the_block_switches_the_mixers_functions_and_gives_them_back(monkeypatch):
    module = _reference()
    model = models.build_nemotron_h()
    before = (module.causal_conv1d_update, module.mamba2_selective_state_update)
    with pytest.raises(RuntimeError, match="inside"):
        with mamba_step.elementwise_mamba_step(model) as switched:
            assert switched == 1
            assert module.causal_conv1d_update is mamba_step.conv_update
            assert module.mamba2_selective_state_update is mamba_step.state_update
            raise RuntimeError("inside")
    assert (module.causal_conv1d_update, module.mamba2_selective_state_update) == before
    # A model without Mamba mixers switches nothing.
    with mamba_step.elementwise_mamba_step(models.build_llama()) as switched:
        assert switched == 0 and module.causal_conv1d_update is before[0]
    # Where a kernel package imports, transformers runs its kernels: they stay.
    monkeypatch.setattr("fp4kit.models.nemotron_h.mamba_kernels", lambda: {"mamba_ssm": "2.3.0", "causal_conv1d": None})
    with mamba_step.elementwise_mamba_step(model) as switched:
        assert switched == 0 and module.mamba2_selective_state_update is before[1]


@pytest.mark.parametrize("ops", ["fp4kit", "transformers"])
def test_generate_steps_run_the_functions_asked_for(monkeypatch, ops):
    model = models.build_nemotron_h()
    model.generation_config.eos_token_id = None
    calls = []
    for name in ("conv_update", "state_update"):
        original = getattr(mamba_step, name)
        monkeypatch.setattr(mamba_step, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False)[:, 7:].tolist()
    result = decode.generate(model, None, ids.tolist(), 6, step_ops=ops)
    assert result.tokens == expected
    mixers = sum(type(m).__name__.endswith("Mamba2Mixer") for m in model.modules())
    assert mixers >= 1
    if ops == "fp4kit":
        assert calls.count("state_update") == calls.count("conv_update") == 5 * mixers
    else:
        assert calls == []
    with pytest.raises(ValueError, match="step_ops"):
        decode.generate(model, None, ids.tolist(), 2, step_ops="fast")


def test_state_update_writes_a_strided_state_in_place():
    state, x, dt, A, B, C, D, dt_bias = _state_inputs(2, 4, 8, 16, 2, seed=11)
    ref_state = state.clone()
    strided = state.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, not contiguous
    assert not strided.is_contiguous()
    ref = _reference().mamba2_selective_state_update(ref_state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True)
    out = mamba_step.state_update(strided, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True)
    assert torch.equal(strided, ref_state)
    assert ((out.float() - ref.float()).abs() <= _ulp(ref)).all()


@torch.inference_mode()
def _one_step(model, ids: torch.Tensor, block):
    """The logits of one decode step after a prefill of `ids`, run within `block`, and the cache's
    state tensors after it."""
    from fp4kit.models import cache_argument

    out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    with block:
        step = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{cache_argument(model): cache})
    return step.logits, _cache_tensors(cache)


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Copies of every tensor a cache's layers hold (states, key/values, token counts)."""
    out = []
    for layer in cache.layers:
        for name, value in sorted(vars(layer).items()):
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            out.extend(t.clone() for t in values if isinstance(t, torch.Tensor))
    return out


def test_the_one_launch_step_is_the_element_wise_step_bit_for_bit(monkeypatch):
    # With the torch backend the one-launch forward runs `kernels.mamba.mamba_step_reference`:
    # the same logits and cache states as the mixer's own forward on the element-wise functions.
    from fp4kit.kernels import mamba as mamba_kernels

    model = models.build_nemotron_h(hybrid_override_pattern="ME*M").to(torch.bfloat16)
    ids = torch.randint(3, 512, (3, 7), generator=torch.Generator().manual_seed(5))
    want, want_states = _one_step(model, ids, mamba_step.switched(mamba_step.mixer_modules(model)))
    calls = []
    monkeypatch.setattr(mamba_step, "step_backend", lambda x: "torch")
    monkeypatch.setattr(mamba_kernels, "mamba_step", lambda *a, _f=mamba_kernels.mamba_step, **k: calls.append(k) or _f(*a, **k))
    mixers = mamba_step.one_launch_mixers(model)
    got, got_states = _one_step(model, ids, mamba_step.one_launch(mixers))
    assert len(mixers) == 2 and calls == [{"backend": "torch"}] * 2
    assert torch.equal(got, want)
    assert len(got_states) == len(want_states) and all(torch.equal(a, b) for a, b in zip(got_states, want_states))


def test_an_fp8_out_proj_takes_its_input_from_the_one_launch_step_bit_for_bit(monkeypatch, tmp_path):
    # A checkpoint of the default recipe (Mamba in_proj and out_proj FP8): the step quantizes
    # out_proj's input itself, and the logits and cache states are the element-wise step's.
    from fp4kit.export.load import load_quantized
    from fp4kit.export.modelopt import export_checkpoint
    from fp4kit.kernels import mamba as mamba_kernels
    from fp4kit.quantize import quantize
    from fp4kit.recipe import DEFAULT_RECIPE, load_recipe

    calib = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    export_checkpoint(quantize(models.build_nemotron_h(hybrid_override_pattern="ME*M"), load_recipe(DEFAULT_RECIPE),
                               calib, progress=False), tmp_path / "nvfp4", progress=False)
    model = load_quantized(tmp_path / "nvfp4")
    mixers = mamba_step.one_launch_mixers(model)
    assert len(mixers) == 2 and all(callable(getattr(m.out_proj, "forward_fp8", None)) for m in mixers)
    ids = torch.randint(3, 512, (2, 6), generator=torch.Generator().manual_seed(6))
    want, want_states = _one_step(model, ids, mamba_step.switched(mamba_step.mixer_modules(model)))
    scales = []
    monkeypatch.setattr(mamba_step, "step_backend", lambda x: "torch")
    monkeypatch.setattr(mamba_kernels, "mamba_step",
                        lambda *a, _f=mamba_kernels.mamba_step, **k: scales.append(a[11]) or _f(*a, **k))
    got, got_states = _one_step(model, ids, mamba_step.one_launch(mixers))
    assert len(scales) == 2 and all(s is not None and s.dtype == torch.float32 for s in scales)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_states, want_states))


def test_one_launch_switches_the_mixers_within_the_block_only(monkeypatch):
    model = models.build_nemotron_h(hybrid_override_pattern="ME*M")
    mixers = mamba_step.one_launch_mixers(model)
    base = type(mixers[0])
    with pytest.raises(RuntimeError, match="inside"):
        with mamba_step.one_launch(mixers) as switched:
            assert switched == 2 and all(type(m).forward is mamba_step._one_launch_forward for m in mixers)
            raise RuntimeError("inside")
    assert all(type(m) is base for m in mixers)
    # Off a GPU the switched mixers run their own forward (the prefill always does).
    calls = []
    monkeypatch.setattr(base, "forward", lambda self, *a, _f=base.forward, **k: calls.append(1) or _f(self, *a, **k))
    with mamba_step.one_launch(mixers):
        model(input_ids=torch.tensor([[3, 4, 5]]))
    assert len(calls) == 2
    # A mixer with a forward of its own (accelerate's hooks) and other models are left alone.
    mixers[0].forward = mixers[0].forward
    assert mamba_step.one_launch_mixers(model) == mixers[1:]
    assert mamba_step.one_launch_mixers(models.build_llama()) == []


def test_an_in_proj_that_changes_the_dtype_leaves_the_step_to_the_mixer(monkeypatch):
    from fp4kit.kernels import mamba as mamba_kernels

    model = models.build_nemotron_h(hybrid_override_pattern="ME*M").to(torch.bfloat16)
    for m in mamba_step.one_launch_mixers(model):
        linear = m.in_proj
        m.in_proj = torch.nn.Sequential(linear, type("StepToFloat", (torch.nn.Module,), {  # the prefill fills a bf16 cache
            "forward": lambda self, x: x.float() if x.shape[1] == 1 else x})())
    ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(8))
    want, _ = _one_step(model, ids, mamba_step.switched(mamba_step.mixer_modules(model)))
    calls = []
    monkeypatch.setattr(mamba_step, "step_backend", lambda x: "torch")
    monkeypatch.setattr(mamba_kernels, "mamba_step", lambda *a, **k: calls.append(1))
    got, _ = _one_step(model, ids, mamba_step.one_launch(mamba_step.one_launch_mixers(model)))
    assert calls == [] and torch.equal(got, want)


def test_decode_states_read_either_cache_layout():
    from types import SimpleNamespace

    conv, ssm = torch.zeros(1, 8, 4), torch.zeros(1, 2, 4, 8)

    class Old:  # transformers 5.18: the layer's state lists, has_previous_state
        def __init__(self, previous, record):
            self.previous = previous
            self.layers = [SimpleNamespace(conv_states={0: conv}, recurrent_states={0: ssm}, record_past=record)]

        def has_previous_state(self, layer_idx):
            return self.previous

    class New:  # 5.2x: the cache's accessors
        def __init__(self, previous, record):
            self.previous, self.record = previous, record

        def get_conv_state(self, layer_idx):
            return conv if self.previous else None

        def get_recurrent_state(self, layer_idx, state_idx=0):
            return ssm

        def is_recording_past(self, layer_idx):
            return self.record

    for kind, counts in ((Old, False), (New, True)):
        got = mamba_step.decode_states(kind(True, False), 0)
        assert got[0] is conv and got[1] is ssm and got[2] is counts
        assert mamba_step.decode_states(kind(False, False), 0) is None  # the prefill
        assert mamba_step.decode_states(kind(True, True), 0) is None  # recording its past
    assert mamba_step.decode_states(None, 0) is None
