"""fp4kit.generate (fp4kit/decode.py) on the CPU: the static decode step, run eagerly, gives transformers'
`model.generate(do_sample=False)` tokens, for BF16 and load_quantized models, and keeps every
buffer it reads or writes at one address."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

import fp4kit
from fp4kit import decode as generate_module
from fp4kit.export.load import load_quantized
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.decode import generate
from fp4kit.models.tiny import load_tiny_model
from fp4kit.quantize import quantize
from fp4kit.recipe import DEFAULT_RECIPE, load_recipe

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parent / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

PROMPTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach, dear friends, once more"]
NEW = 6


def reference(model, ids: torch.Tensor, mask: torch.Tensor, new: int = NEW) -> list[list[int]]:
    """model.generate's new tokens per row, cut after the row's EOS (it pads finished rows)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)[:, ids.shape[1]:]
    eos = model.generation_config.eos_token_id
    rows = []
    for row in out.tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A small random Nemotron-H under the default recipe, written and loaded back."""
    calib = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("generate") / "nvfp4"
    export_checkpoint(quantize(models.build_nemotron_h(), load_recipe(DEFAULT_RECIPE), calib, progress=False), folder, progress=False)
    return load_quantized(folder)


# The embedded model's bf16 depthwise Mamba convolution takes seconds per call on the CPU.
@pytest.mark.slow
def test_greedy_tokens_equal_model_generate_on_the_embedded_model(tiny):
    model, tok = tiny
    enc = tok(PROMPTS[:1], return_tensors="pt")
    result = generate(model, tok, PROMPTS[:1], NEW)
    assert result.tokens == reference(model, enc.input_ids, enc.attention_mask)
    assert result.text == [tok.decode(result.tokens[0], skip_special_tokens=True)]
    assert not result.graph and result.captures == 0 and result.steps == NEW - 1
    assert result.tokens_per_s > 0


def test_decode_time_is_the_steps_alone(quantized):
    # decode_seconds runs from the prefill's token read back to the last step's: a slow prefill
    # stays out of it, what happens between the steps' reads (here a stream that sleeps) is in it.
    import time

    real = quantized.forward
    pause = 0.05

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:  # the prefill
            time.sleep(6 * pause)
        return real(*args, **kwargs)

    prompts = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(2)).tolist()
    quantized.forward = forward
    try:
        result = generate(quantized, None, prompts, 4, stream=lambda tokens: time.sleep(pause), stop_at_eos=False)
    finally:
        del quantized.forward
    assert result.steps == 3 and all(len(t) == 4 for t in result.tokens)
    assert 3 * pause <= result.decode_seconds <= result.seconds - 6 * pause
    assert result.decode_tokens_per_s == pytest.approx(2 * 3 / result.decode_seconds)
    assert result.tokens_per_s == pytest.approx(2 * 4 / result.seconds)


@pytest.mark.slow
def test_prompts_of_different_lengths_are_left_padded_as_generate_does(tiny):
    model, tok = tiny
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    assert (enc.attention_mask == 0).any()  # the rows really differ in length
    seen = []
    result = generate(model, tok, PROMPTS, NEW, stream=seen.append)
    assert result.tokens == reference(model, enc.input_ids, enc.attention_mask)
    # The stream saw every token of every row, one call per step.
    assert [[s[i] for s in seen if s[i] is not None] for i in range(2)] == result.tokens


def test_quantized_model_tokens_equal_model_generate(quantized):
    assert any(type(m).__name__ == "NVFP4Experts" for m in quantized.modules())
    prompts = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    ids = [prompts[0].tolist(), prompts[1, 4:].tolist()]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    left = prompts.clone()
    left[1, :4] = quantized.generation_config.pad_token_id
    left[1, 4:] = prompts[1, 4:]
    result = generate(quantized, None, ids, NEW)
    assert result.text is None
    assert result.tokens == reference(quantized, left, mask)


def test_dense_llama_tokens_equal_model_generate():
    model = models.build_llama()
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(2))
    assert generate(model, None, ids.tolist(), 16).tokens == reference(model, ids, torch.ones_like(ids), 16)


def test_the_step_reads_and_writes_buffers_at_fixed_addresses(monkeypatch):
    model = models.build_nemotron_h()
    seen = []
    forward = generate_module._forward

    def recording(model, s):
        layer_tensors = [t for layer in s.cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        layer_tensors += [t for layer in s.cache.layers for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
                          for t in states.values() if t is not None]
        seen.append([t.data_ptr() for t in [s.input_ids, s.position_ids, s.mask, *layer_tensors]])
        return forward(model, s)

    monkeypatch.setattr(generate_module, "_forward", recording)
    model.generation_config.eos_token_id = None  # run every step
    result = generate(model, None, [[5, 6, 7, 8]], NEW)
    assert result.steps == NEW - 1 == len(seen)
    assert len(seen[0]) > 3 + 2 * 2  # the keys and values of the attention layer, the Mamba states
    assert all(ptrs == seen[0] for ptrs in seen)


def _attention_inputs(b: int, kv: int, groups: int, length: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    d = 32
    # The query as the attention modules make it: [B, 1, H * D] viewed as [B, H, 1, D].
    q = torch.randn(b, 1, kv * groups * d, generator=g).to(dtype).view(b, 1, kv * groups, d).transpose(1, 2)
    k = torch.randn(b, kv, length, d, generator=g).to(dtype)
    v = torch.randn(b, kv, length, d, generator=g).to(dtype)
    mask = torch.rand(b, 1, 1, length, generator=g) < 0.6
    mask[:, ..., 0] = True  # every row attends somewhere
    return q, k, v, mask


class _Grouped:
    is_causal = True

    def __init__(self, groups):
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,kv,groups,length", [(1, 2, 16, 256), (3, 2, 2, 77), (2, 4, 4, 130)])
def test_grouped_decode_attention_is_sdpa_over_repeated_heads(dtype, b, kv, groups, length):
    """Against the repeated form (keys and values copied per query head, then one sdpa, as
    transformers 5.18 does it) and that form in float64 on the same inputs: the grouped result is
    at most twice as far from float64 as the repeated one (the kernels may sum in another order)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    q, k, v, mask = _attention_inputs(b, kv, groups, length, dtype, seed=length)
    module = _Grouped(groups)
    for m in (mask, torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)):  # sdpa's bool mask, eager's additive one
        exact = torch.nn.functional.scaled_dot_product_attention(
            q.double(), repeat_kv(k.double(), groups), repeat_kv(v.double(), groups), attn_mask=m.double() if
            m.is_floating_point() else m, scale=0.125).transpose(1, 2)
        repeated = torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=m, scale=0.125).transpose(1, 2)
        out, weights = generate_module.grouped_decode_sdpa(module, q, k, v, m, scaling=0.125)
        assert weights is None and out.dtype == dtype and out.shape == (b, 1, kv * groups, q.shape[-1])
        assert out.is_contiguous()
        error = (out.double() - exact).abs().max().item()
        assert error <= 2 * (repeated.double() - exact).abs().max().item()
    # A key/value head's query heads see only their own keys: each query row of the result moves
    # with its own key/value head's values and no other's.
    moved = v.clone()
    moved[:, 0] += 1.0
    out, _ = generate_module.grouped_decode_sdpa(module, q, k, moved, mask, scaling=0.125)
    base, _ = generate_module.grouped_decode_sdpa(module, q, k, v, mask, scaling=0.125)
    changed = (out != base)[0, 0].any(-1)  # [H]
    assert changed.tolist() == [h // groups == 0 for h in range(kv * groups)]


def test_grouped_decode_attention_leaves_other_calls_to_sdpa(monkeypatch):
    from transformers.integrations import sdpa_attention

    calls = []
    original = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda *a, **kw: calls.append(a[1].shape) or original(*a, **kw))
    q, k, v, mask = _attention_inputs(2, 2, 2, 40, torch.float32, seed=3)
    generate_module.grouped_decode_sdpa(_Grouped(2), q, k, v, mask)
    assert calls == []
    prompt = torch.randn(2, 4, 5, 32)  # five query positions
    generate_module.grouped_decode_sdpa(_Grouped(2), prompt, k, v, mask.expand(2, 1, 5, 40))
    generate_module.grouped_decode_sdpa(_Grouped(1), q[:, :2], k, v, mask)  # no grouping
    generate_module.grouped_decode_sdpa(_Grouped(2), q, k, v, mask.expand(2, 4, 1, 40))  # a mask per query head
    assert calls == [prompt.shape, q[:, :2].shape, q.shape]
    # Arguments that change the scores or ask for the weights go to transformers' sdpa (which
    # applies them or says it cannot).
    for extra in ({"softcap": 30.0}, {"s_aux": torch.zeros(4)}, {"position_bias": torch.zeros(1, 4, 1, 40)},
                  {"output_attentions": True}):
        calls.clear()
        try:
            generate_module.grouped_decode_sdpa(_Grouped(2), q, k, v, mask, **extra)
        except (ValueError, TypeError, RuntimeError):
            pass
        assert calls == [q.shape], extra
    generate_module.grouped_decode_sdpa(_Grouped(2), q, k, v, mask, position_ids=None, softcap=None)
    assert calls == [q.shape]  # arguments that change nothing keep the grouped form


@pytest.mark.parametrize("build", ["build_nemotron_h", "build_llama"])
def test_decode_steps_attend_without_repeating_the_cache(monkeypatch, build):
    """The steps do not repeat keys and values per query head, give model.generate's tokens, and
    leave the model on sdpa. transformers' sdpa repeats them under the step's mask: always in
    5.18, and in later versions while torch.compile traces (as a compiled step is), which the
    test stands in for by saying so to that module; with the block made a no-op the steps do."""
    import contextlib

    from transformers.integrations import sdpa_attention

    monkeypatch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: True, raising=False)
    model = getattr(models, build)()
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(4))
    expected = reference(model, ids, torch.ones_like(ids), 8)
    in_step, repeats = [False], []
    original_repeat, original_call = sdpa_attention.repeat_kv, generate_module._call

    def call(*args):
        in_step[0] = True
        try:
            return original_call(*args)
        finally:
            in_step[0] = False

    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: repeats.append(in_step[0]) or original_repeat(x, n))
    monkeypatch.setattr(generate_module, "_call", call)
    result = generate(model, None, ids.tolist(), 8)
    assert result.steps == 7 and True not in repeats
    assert result.tokens == expected
    assert model.config._attn_implementation == "sdpa"

    monkeypatch.setattr(generate_module, "grouped_attention", lambda model, **_: contextlib.nullcontext())
    assert generate(model, None, ids.tolist(), 8).tokens == expected
    assert repeats.count(True) >= 7 * 2  # keys and values at every step, at least one layer


def test_models_on_other_attention_keep_it_in_the_steps(monkeypatch):
    model = models.build_llama()
    model.config._attn_implementation = "eager"
    seen = []
    forward = generate_module._call
    monkeypatch.setattr(generate_module, "_call", lambda m, *a: seen.append(m.config._attn_implementation) or forward(m, *a))
    generate(model, None, [[5, 6, 7]], 4, stop_at_eos=False)
    assert seen == ["eager"] * 3


def test_refusals():
    model = models.build_llama()
    with pytest.raises(ValueError, match="CUDA graph"):
        generate(model, None, [[1, 2, 3]], 2, graph=True)
    model.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match="pad token"):
        generate(model, None, [[1, 2, 3], [4]], 2)
    with pytest.raises(ValueError, match="largest batch bucket"):
        generate_module.bucket_for(3, (1, 2))


def test_the_package_root_exports_generate():
    # The function, also after its module has been imported (a submodule named `generate` would
    # replace the package attribute on import).
    assert "fp4kit.decode" in __import__("sys").modules
    assert fp4kit.generate is generate


def test_the_cache_goes_under_the_name_the_forward_takes():
    # transformers 5.2x names it `cache`; 5.18 `past_key_values`. Under the other name it would be
    # swallowed by **kwargs and every step would run without its past.
    from fp4kit.models import cache_argument

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    assert cache_argument(New()) == "cache"
    assert cache_argument(Old()) == "past_key_values"
    assert cache_argument(models.build_llama()) in ("cache", "past_key_values")


def test_sampling_draws_from_the_generator_outside_the_step():
    # The pick of a sampled token runs after the step (the step takes only the argmax inside):
    # the same generator seed gives the same tokens, and a flat random model's draws are not its argmax.
    model = models.build_llama()
    model.generation_config.eos_token_id = None
    ids = [[5, 6, 7, 8]]
    draw = [generate(model, None, ids, 16, greedy=False, generator=torch.Generator().manual_seed(s)).tokens for s in (0, 0, 1)]
    assert draw[0] == draw[1] != draw[2]
    assert draw[0] != generate(model, None, ids, 16).tokens


def _rounded(state: torch.Tensor, fmt: str, seed: int, rounds: int = 5) -> torch.Tensor:
    """A step's fp32 SSM state as `generate` documents holding it: round to nearest fp16, or
    stochastic rounding with Philox `rounds` and `seed` (the torch emulator), back in fp32."""
    from fp4kit.formats import fp16sr

    if fmt == "fp16":
        return state.half().float()
    return fp16sr.round_state(state.contiguous(), seed, rounds).float()


@pytest.mark.parametrize("fmt", ["fp16", "fp16-sr"])
def test_the_ssm_state_is_held_in_fp16_between_steps(monkeypatch, fmt):
    # Each step's new state, as the model left it, against the state the next step starts from:
    # the documented rounding of it (seed (ssm_seed << 32) + (t - 1) * L + l for step t and Mamba
    # layer l), and the prefill's state cast to fp16 for the first step.
    model = models.build_nemotron_h(hybrid_override_pattern="ME*M")  # two Mamba layers: two seeds per step
    model.generation_config.eos_token_id = None
    starts, ends = [], []
    forward = generate_module._forward
    after_prefill = generate_module._StateFormat.after_prefill
    prefill = []

    def recording(model, s):
        starts.append([st.clone() for st in generate_module.ssm_states(s.cache)])
        logits = forward(model, s)
        ends.append([st.clone() for st in generate_module.ssm_states(s.cache)])
        return logits

    def recording_prefill(self):
        prefill.extend(st.clone() for st in self.states)
        after_prefill(self)

    monkeypatch.setattr(generate_module, "_forward", recording)
    monkeypatch.setattr(generate_module._StateFormat, "after_prefill", recording_prefill)
    seed = 3
    generate(model, None, [[5, 6, 7, 8, 9]], 8, ssm_state=fmt, ssm_seed=seed if fmt == "fp16-sr" else 0)
    assert len(starts) == len(ends) == 7 and len(prefill) == len(starts[0]) == 2
    for a, p in zip(starts[0], prefill):
        assert torch.equal(a, p.half().float())
    changed = False
    for t in range(1, len(starts)):  # starts[t]: step t + 1's state, ends[t - 1]: step t's new state
        for layer, (a, new) in enumerate(zip(starts[t], ends[t - 1])):
            assert torch.equal(a, a.half().float())  # fp16 values
            want = _rounded(new, fmt, (seed << 32) + (t - 1) * len(prefill) + layer)
            assert torch.equal(a, want), (fmt, t, layer)
            changed |= not torch.equal(a, new)
    assert changed  # the model's own states are not fp16: the rounding above did something
    # Kept in fp32, the state is not fp16 (the rounding above is the one generate applied).
    starts.clear()
    generate(model, None, [[5, 6, 7, 8, 9]], 3)
    assert not all(torch.equal(a, a.half().float()) for a in starts[-1])


def test_rows_in_different_state_formats_decode_as_each_alone(monkeypatch):
    model = models.build_nemotron_h(hybrid_override_pattern="ME*M")
    model.generation_config.eos_token_id = None
    prompt = [5, 6, 7, 8, 9]
    seen = []
    forward = generate_module._forward

    def recording(model, s):
        seen[:] = [st.clone() for st in generate_module.ssm_states(s.cache)]
        return forward(model, s)

    monkeypatch.setattr(generate_module, "_forward", recording)
    side = generate(model, None, [prompt] * 3, 10, ssm_state=["fp32", "fp16", "fp16-sr"], philox_rounds=[5, 5, 10], ssm_seed=2)
    last = list(seen)
    alone = [generate(model, None, [prompt], 10, ssm_state=f, philox_rounds=r, ssm_seed=2).tokens[0]
             for f, r in (("fp32", 5), ("fp16", 5))]
    assert side.tokens[:2] == alone
    # the states the last step read: row 0 in fp32, rows 1 and 2 in fp16, each rounded its own way
    assert all(torch.equal(st[i], st[i].half().float()) for st in last for i in (1, 2))
    assert not all(torch.equal(st[0], st[0].half().float()) for st in last)
    assert not all(torch.equal(st[1], st[2]) for st in last)
    with pytest.raises(ValueError, match="one value or one per prompt"):
        generate(model, None, [prompt] * 2, 2, ssm_state=["fp16"])


def test_ssm_state_refusals():
    model = models.build_nemotron_h()
    with pytest.raises(ValueError, match="ssm_state must be one of fp32, fp16, fp16-sr"):
        generate(model, None, [[1, 2]], 2, ssm_state="bf16")
    with pytest.raises(ValueError, match="philox_rounds"):
        generate(model, None, [[1, 2]], 2, ssm_state="fp16-sr", philox_rounds=0)
    with pytest.raises(ValueError, match="ssm_seed"):
        generate(model, None, [[1, 2]], 2, ssm_state="fp16-sr", ssm_seed=2**30)
    with pytest.raises(ValueError, match="no Mamba SSM state"):
        generate(models.build_llama(), None, [[1, 2]], 2, ssm_state="fp16")


@pytest.mark.slow
def test_the_command_holds_the_state_as_asked():
    import subprocess
    import sys

    from fp4kit.models.tiny import tiny_model_path

    base = [sys.executable, "-m", "fp4kit.cli", "generate", "--model", str(tiny_model_path()), "--prompt", "ROMEO:",
            "--max-new-tokens", "4", "--device", "cpu"]
    run = subprocess.run(base + ["--ssm-state", "fp16-sr", "--philox-rounds", "10"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ROMEO:")
    assert "4 tokens in" in run.stderr and "(eager, batch 1, SSM state fp16-sr R=10)" in run.stderr
    bad = subprocess.run(base + ["--ssm-state", "fp16-sr", "--philox-rounds", "0"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --philox-rounds must be at least 1")


def test_decoding_runs_with_the_model_gpu_current(monkeypatch):
    """CUDA graphs capture and replay on the current GPU's streams: a model on cuda:1 decodes with
    cuda:1 current, and a model on the CPU leaves the current GPU alone."""
    import contextlib

    import torch

    from fp4kit import decode

    entered = []

    @contextlib.contextmanager
    def current(device):
        entered.append(str(device))
        yield

    monkeypatch.setattr(torch.cuda, "device", current)
    seen = []
    run = decode.on_the_model_gpu(lambda model, x, *, y: seen.append((model, x, y, list(entered))) or "out")
    monkeypatch.setattr(decode, "input_device", lambda model: torch.device(model))
    assert run("cpu", 1, y=2) == "out" and seen[-1] == ("cpu", 1, 2, [])
    assert run("cuda:1", 3, y=4) == "out" and seen[-1] == ("cuda:1", 3, 4, ["cuda:1"])


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_a_compiled_step_gives_the_tokens_of_the_eager_one(tiny, quantized):
    """compile=True runs the step's forward through torch.compile, once per model and shape:
    the embedded model (bf16) and a loaded checkpoint give model.generate's tokens."""
    model, tok = tiny
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    before = _graphs_compiled()
    result = generate(model, tok, PROMPTS, 16, compile=True, stop_at_eos=False)
    assert _graphs_compiled() == before + 1
    ref = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=16,
                         min_new_tokens=16, do_sample=False)[:, enc.input_ids.shape[1]:].tolist()
    assert result.tokens == ref
    # Another length within the same cache granule reuses the compiled step.
    generate(model, tok, PROMPTS, 12, compile=True)
    assert _graphs_compiled() == before + 1

    prompts = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    q = generate(quantized, None, prompts.tolist(), NEW, compile=True)
    assert _graphs_compiled() > before + 1  # the reference backend's decoding breaks the graph per layer
    assert q.tokens == reference(quantized, prompts, torch.ones_like(prompts))


@pytest.mark.slow
def test_the_compiled_steps_inductor_kernels_are_programmatic_dependents_on_a_gpu(monkeypatch):
    # On CUDA the compiled step asks Inductor for programmatic dependent launches (where its torch
    # has the option); FP4KIT_INDUCTOR_PDL=0 turns that off; the CPU's options never carry it.
    import torch._inductor.config as inductor_config

    from fp4kit import decode

    has = hasattr(inductor_config.triton, "enable_pdl")
    monkeypatch.delenv(decode.INDUCTOR_PDL_ENV, raising=False)
    assert decode.inductor_pdl() == has
    assert decode.compile_options("cuda").get("triton.enable_pdl", False) == has
    assert "triton.enable_pdl" not in decode.compile_options("cpu") and decode.compile_options("cpu")["cpp.simdlen"] == 1
    monkeypatch.setenv(decode.INDUCTOR_PDL_ENV, "0")
    assert not decode.inductor_pdl() and "triton.enable_pdl" not in decode.compile_options("cuda")
    assert decode.compile_options("cuda")["emulate_precision_casts"]


def test_the_command_compiles_the_step_when_asked():
    import subprocess
    import sys

    from fp4kit.models.tiny import tiny_model_path

    run = subprocess.run([sys.executable, "-m", "fp4kit.cli", "generate", "--model", str(tiny_model_path()), "--prompt",
                          "ROMEO:", "--max-new-tokens", "4", "--device", "cpu", "--compile"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    assert "4 tokens in" in run.stderr and "(eager, compiled, batch 1)" in run.stderr


def test_the_command_runs_the_step_ops_asked_for(monkeypatch, capsys):
    from fp4kit import cli
    from fp4kit.models.tiny import tiny_model_path

    seen = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda *a, **k: seen.append(k["step_ops"]) or real(*a, **k))
    base = ["generate", "--model", str(tiny_model_path()), "--prompt", "ROMEO:", "--max-new-tokens", "2", "--device", "cpu"]
    assert cli.main(base + ["--step-ops", "fp4kit"]) == 0
    assert "(eager, step ops fp4kit, batch 1)" in capsys.readouterr().err
    assert cli.main(base) == 0  # the default: generate's
    assert "(eager, batch 1)" in capsys.readouterr().err and seen == ["fp4kit", "triton"]
    assert inspect.signature(real).parameters["step_ops"].default == "triton"
    with pytest.raises(SystemExit):
        cli.main(base + ["--step-ops", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Single-group routing: the router without its group step
# --------------------------------------------------------------------------------------------
def _routers(model):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    return [m for m in model.modules() if isinstance(m, NemotronHTopkRouter)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_short_router_gives_the_full_routers_experts_and_weights_bit_for_bit(dtype, rows):
    from fp4kit.models.nemotron_h import _one_group_route

    model = models.build_nemotron_h(n_routed_experts=16, num_experts_per_tok=4).to(dtype)
    g = torch.Generator().manual_seed(rows)
    for router in _routers(model):
        with torch.no_grad():
            router.e_score_correction_bias.normal_(0, 0.1, generator=g)
        x = torch.randn((2, rows, router.hidden_dim), generator=g).to(dtype)
        full, short = router(x), _one_group_route(router, x)
        for a, b in zip(full, short):
            assert a.dtype == b.dtype and torch.equal(a, b)
    router.norm_topk_prob = False
    assert all(torch.equal(a, b) for a, b in zip(router(x), _one_group_route(router, x)))


def test_only_single_group_routers_take_the_short_forward_and_only_within_the_block():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from fp4kit.models.nemotron_h import single_group_routing

    one = models.build_nemotron_h()
    grouped = models.build_nemotron_h(n_group=2, topk_group=1)
    with single_group_routing(one) as n_one, single_group_routing(grouped) as n_grouped:
        assert n_one == len(_routers(one)) > 0 and n_grouped == 0
        assert all(type(m) is not NemotronHTopkRouter for m in _routers(one))
        assert all(type(m) is NemotronHTopkRouter for m in _routers(grouped))
        with single_group_routing(one) as again:  # nested: nothing left to change, nothing undone early
            assert again == 0
        assert all(type(m) is not NemotronHTopkRouter for m in _routers(one))
    assert all(type(m) is NemotronHTopkRouter for m in _routers(one))
    with pytest.raises(RuntimeError, match="inside"):
        with single_group_routing(one):
            raise RuntimeError("inside")
    assert all(type(m) is NemotronHTopkRouter for m in _routers(one))


def test_a_single_group_router_whose_short_forward_differs_says_so_and_keeps_its_own(monkeypatch):
    import warnings

    from fp4kit.models import nemotron_h

    model = models.build_nemotron_h()
    real = nemotron_h._one_group_route

    def off_by_one_ulp(router, x):
        logits, weights, chosen = real(router, x)
        return logits, torch.nextafter(weights, torch.full_like(weights, 2.0)), chosen

    monkeypatch.setattr(nemotron_h, "_one_group_route", off_by_one_ulp)
    monkeypatch.setattr(nemotron_h, "_VERDICTS", nemotron_h.weakref.WeakKeyDictionary())
    with pytest.warns(RuntimeWarning, match="keeps transformers' full forward.*differ from the full forward"):
        with nemotron_h.single_group_routing(model) as n:
            assert n == 0
    monkeypatch.setattr(nemotron_h, "_one_group_route", lambda router, x: 1 / 0)
    monkeypatch.setattr(nemotron_h, "_VERDICTS", nemotron_h.weakref.WeakKeyDictionary())
    with pytest.warns(RuntimeWarning, match="failed on a probe \\(ZeroDivisionError"):
        with nemotron_h.single_group_routing(model) as n:
            assert n == 0
    # a router with groups is not meant to take it: no word
    grouped = models.build_nemotron_h(n_group=2, topk_group=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nemotron_h.single_group_routing(grouped) as n:
            assert n == 0
    # and one whose short forward agrees takes it without a word
    monkeypatch.setattr(nemotron_h, "_one_group_route", real)
    monkeypatch.setattr(nemotron_h, "_VERDICTS", nemotron_h.weakref.WeakKeyDictionary())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nemotron_h.single_group_routing(model) as n:
            assert n == len(_routers(model)) > 0


def test_a_16_bit_router_keeps_an_fp32_copy_of_its_weight_within_the_block_only():
    from fp4kit.models.nemotron_h import single_group_routing

    model = models.build_nemotron_h().to(torch.bfloat16)
    routers = _routers(model)
    x = torch.randn((3, routers[0].hidden_dim)).to(torch.bfloat16)
    want = routers[0](x)
    with single_group_routing(model):
        for m in routers:
            assert m._weight_fp32.dtype == torch.float32 and torch.equal(m._weight_fp32, m.weight.float())
        got = routers[0](x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not any(hasattr(m, "_weight_fp32") for m in routers)
    fp32 = models.build_nemotron_h().to(torch.float32)
    with single_group_routing(fp32):  # already fp32: nothing to copy
        assert not any(hasattr(m, "_weight_fp32") for m in _routers(fp32))


def test_the_short_router_launches_one_top_k_where_the_full_one_launches_three():
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp4kit.models.nemotron_h import single_group_routing

    class TopK(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            TopK.calls += func.name() == "aten::topk"
            return func(*args, **(kwargs or {}))

    model = models.build_nemotron_h()
    router = _routers(model)[0]
    x = torch.randn((3, router.hidden_dim)).to(torch.bfloat16)
    counts = []
    for short in (False, True):
        with single_group_routing(model) if short else torch.no_grad():
            TopK.calls = 0
            with TopK():
                router(x)
            counts.append(TopK.calls)
    assert counts == [3, 1]


def test_generate_routes_single_groups_and_gives_the_routers_back(monkeypatch):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    seen = []
    real = generate_module._step

    def step(model, s):
        seen.append({type(m).__name__ for m in _routers(model)})
        return real(model, s)

    monkeypatch.setattr(generate_module, "_step", step)
    model = models.build_nemotron_h()
    generate(model, None, [[1, 2, 3]], 3, graph=False)
    assert seen and all(names == {"NemotronHTopkRouterOneGroup"} for names in seen)
    assert all(type(m) is NemotronHTopkRouter for m in _routers(model))


def test_a_router_with_a_forward_of_its_own_keeps_it():
    # accelerate's offloading hooks set `forward` on the instance, where a class would not reach it.
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from fp4kit.models.nemotron_h import single_group_routing

    model = models.build_nemotron_h()
    hooked, *rest = _routers(model)
    hooked.forward = hooked.forward  # the class's forward, bound and set on the instance
    with single_group_routing(model) as n:
        assert n == len(rest) and type(hooked) is NemotronHTopkRouter


class _LaggedReader(generate_module._TokenReader):
    """The GPU's reading order on the CPU: a step's tokens are read after the next step ran."""

    def __init__(self, n, dtype, device):
        super().__init__(n, dtype, torch.device("cpu"))
        self.lag = 1


@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_tokens_read_a_step_late_are_the_same_tokens(monkeypatch, stop_at_eos):
    # As on a GPU, where step t + 1 is queued before step t's tokens are read: the same tokens and
    # streamed entries; stopping at EOS then runs one step past the last row's EOS.
    model = models.build_nemotron_h()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    first = generate(model, None, prompts, 12, stop_at_eos=False).tokens
    # row 0 stops at its 4th token, row 1 at its 7th (their first EOS), when rows stop at EOS
    model.generation_config.eos_token_id = [first[0][3], first[1][6]]
    try:
        at_once_seen, late_seen = [], []
        at_once = generate(model, None, prompts, 12, stream=at_once_seen.append, stop_at_eos=stop_at_eos)
        monkeypatch.setattr(generate_module, "_TokenReader", _LaggedReader)
        late = generate(model, None, prompts, 12, stream=late_seen.append, stop_at_eos=stop_at_eos)
    finally:
        model.generation_config.eos_token_id = None
    assert late.tokens == at_once.tokens and late_seen == at_once_seen
    if stop_at_eos:
        assert [len(t) for t in at_once.tokens] == [first[0].index(first[0][3]) + 1, first[1].index(first[1][6]) + 1]
        assert at_once_seen[-1][0] is None and late.steps == at_once.steps + 1 == len(at_once_seen)
    else:
        assert at_once.tokens == first and late.steps == at_once.steps == 11


def test_the_triton_step_ops_run_attention_each_router_and_mamba_step_as_one_launch(monkeypatch):
    """step_ops="triton": in every decode step (not the prefill) each attention layer, each
    single-group router and each Mamba mixer's step between its projections is one kernel launch,
    and the tokens are those of the "fp4kit" ops. The kernels run on a GPU only; here the
    interpreter stands in for one."""
    from fp4kit.kernels import attention, mamba, router
    from fp4kit.models import mamba_step, nemotron_h

    model = models.build_nemotron_h().to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(4)).tolist()
    want = generate(model, None, ids, 6, step_ops="fp4kit")
    monkeypatch.setattr(generate_module, "_kernel_device", lambda query: True)
    monkeypatch.setattr(nemotron_h, "_kernel_rows", lambda x: True)
    monkeypatch.setattr(mamba_step, "step_backend", lambda x: "triton")
    launched = []
    for module in (attention, router, mamba):
        monkeypatch.setattr(module, "launch_cached",
                            lambda kernel, *a, _real=module.launch_cached, **k: launched.append(kernel) or _real(kernel, *a, **k))
    got = generate(model, None, ids, 6, step_ops="triton")
    kinds = model.config.layers_block_type
    steps = got.steps
    assert steps == 5 and got.tokens == want.tokens
    assert launched.count(router._route_kernel) == kinds.count("moe") * steps > 0
    assert launched.count(router._topk_gather_kernel) == kinds.count("moe")  # the prefill's routers
    assert launched.count(attention._decode_attention_kernel) == kinds.count("full_attention") * steps > 0
    assert launched.count(mamba._mamba_step_kernel) == len(mamba_step.one_launch_mixers(model)) * steps > 0
    assert not nemotron_h._ONE_LAUNCH and all(type(m).forward is not mamba_step._one_launch_forward
                                              for m in mamba_step.one_launch_mixers(model))
    launched.clear()
    assert generate(model, None, ids, 6, step_ops="fp4kit").tokens == want.tokens
    assert not {router._route_kernel, attention._decode_attention_kernel, mamba._mamba_step_kernel} & set(launched)
