"""fp4kit.generate on a CUDA GPU: the decode step captured once as a CUDA graph and replayed per
token gives the tokens of the same step run eagerly and of transformers' model.generate, for the
embedded tiny Nemotron-H in BF16 and loaded quantized with the Triton kernels.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fp4kit.decode import generate  # noqa: E402
from fp4kit.export.load import load_quantized  # noqa: E402
from fp4kit.export.modelopt import export_checkpoint  # noqa: E402
from fp4kit.models.tiny import corpus_path, load_tiny_model  # noqa: E402
from fp4kit.quantize import quantize  # noqa: E402
from fp4kit.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach, dear friends, once more"]
NEW = 24


def reference(model, tok, prompts):
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left").to("cuda")
    out = model.generate(**enc, max_new_tokens=NEW, do_sample=False)[:, enc.input_ids.shape[1]:]
    eos = model.generation_config.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in out.tolist()]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model(device="cuda")


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    model, tok = tiny
    calib = torch.tensor(tok(corpus_path("calibration").read_text()[:40000])["input_ids"][: 4 * 256]).reshape(4, 256)
    folder = tmp_path_factory.mktemp("generate") / "nvfp4"
    export_checkpoint(quantize(model, load_recipe(DEFAULT_RECIPE), calib.cuda(), progress=False), folder, progress=False)
    return load_quantized(folder, device="cuda", backend="triton", act_quant=False)


def check(model, tok, prompts):
    graphed = generate(model, tok, prompts, NEW, graph=True)
    eager = generate(model, tok, prompts, NEW, graph=False)
    assert graphed.graph and graphed.captures == 1 and graphed.replays == graphed.steps > 0
    assert not eager.graph and eager.captures == 0 and eager.replays == 0
    assert graphed.tokens == eager.tokens
    assert graphed.tokens == reference(model, tok, prompts)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "two-left-padded"])
def test_graph_replay_equals_eager_and_model_generate_bf16(tiny, prompts):
    check(*tiny, prompts)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "two-left-padded"])
def test_graph_replay_equals_eager_and_model_generate_quantized_triton(quantized, tiny, prompts):
    assert any(type(m).__name__ == "NVFP4Experts" and m.backend == "triton" for m in quantized.modules())
    check(quantized, tiny[1], prompts)


@pytest.mark.parametrize("which", ["bf16", "quantized-triton"])
def test_a_compiled_graph_gives_the_tokens_of_the_eager_step(tiny, quantized, which):
    """compile=True: Inductor's fused kernels round where the eager operators do, and the
    trained model's greedy margins are wide, so the tokens are the same."""
    model, tok = (tiny[0], tiny[1]) if which == "bf16" else (quantized, tiny[1])
    compiled = generate(model, tok, PROMPTS, NEW, graph=True, compile=True)
    assert compiled.graph and compiled.captures == 1
    assert compiled.tokens == generate(model, tok, PROMPTS, NEW, graph=False).tokens


@pytest.mark.parametrize("which", ["bf16", "quantized-triton"])
def test_the_compiled_step_is_one_graph(tiny, quantized, which):
    """The step's one-launch Mamba steps and attention are chosen by constants while dynamo traces,
    so the whole forward is one graph (Inductor can then fuse each layer's residual add into the
    next layer's norm). Asking a compiled Triton kernel's type at trace time broke the graph at
    every Mamba mixer and attention layer. The profile shows both one-launch kernels ran."""
    from torch._dynamo.utils import counters

    model, tok = (tiny[0], tiny[1]) if which == "bf16" else (quantized, tiny[1])
    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    generate(model, tok, PROMPTS[:1], 4, graph=True, compile=True)
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs + 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        generate(model, tok, PROMPTS[:1], 4, graph=False, compile=True)
    names = {e.name for e in prof.events()}
    assert any("_mamba_step_kernel" in n for n in names) and any("_decode_attention_kernel" in n for n in names)


def test_a_batch_is_padded_up_to_its_bucket(tiny):
    model, tok = tiny
    three = PROMPTS + PROMPTS[:1]
    result = generate(model, tok, three, 8, graph=True, batch_buckets=(1, 4))
    assert result.batch == 4 and len(result.tokens) == 3
    assert result.tokens == generate(model, tok, three, 8, graph=False).tokens


@pytest.mark.parametrize("fmt,rounds", [("fp16", 5), ("fp16-sr", 5), ("fp16-sr", 10)])
def test_an_fp16_ssm_state_replays_as_it_runs_eagerly(tiny, fmt, rounds):
    # The stochastic seeds live on the device, so each replay of the captured step draws that
    # step's own words: the graph's tokens equal the eager step's (the same Triton kernel).
    model, tok = tiny
    graphed = generate(model, tok, PROMPTS, NEW, graph=True, ssm_state=fmt, philox_rounds=rounds, ssm_seed=7)
    eager = generate(model, tok, PROMPTS, NEW, graph=False, ssm_state=fmt, philox_rounds=rounds, ssm_seed=7)
    assert graphed.replays == graphed.steps > 0
    assert graphed.tokens == eager.tokens


def test_the_ssm_state_eval_replays_as_it_runs_eagerly(tiny):
    # `fp4kit eval --ssm-state` reads the text through the captured step: the replayed graph
    # gives the eager step's states exactly (their errors, the top-1 agreement, the positions)
    # and its likelihoods to the eager step's own run-to-run spread. The BF16 model's eager
    # forward at 4 rows is not bitwise repeatable on an H200: between two eager runs of this test
    # one position of the last row (10 Philox rounds) moved its NLL by 1.8e-5 and its KL by
    # 7e-8, with the routers' own forward and with torch's deterministic algorithms alike.
    from fp4kit import ssm_eval

    model, tok = tiny
    text = corpus_path("eval").read_text()[:4000]
    tokens = torch.tensor(tok(text)["input_ids"][:300])
    variants = ssm_eval.parse_variants("fp16,fp16-sr", "5,10")
    graphed = ssm_eval.teacher_forced(model, tokens, variants, seed=3, state_error=True, graph=True)
    eager = ssm_eval.teacher_forced(model, tokens, variants, seed=3, state_error=True, graph=False)
    assert graphed["positions"] == eager["positions"] and len(graphed["rows"]) == len(eager["rows"]) == 4
    for g, e in zip(graphed["rows"], eager["rows"]):
        assert g["state"] == e["state"] and g["buckets"].keys() == e["buckets"].keys()
        assert g["perplexity"] == pytest.approx(e["perplexity"], rel=1e-6)
        for name, gb in g["buckets"].items():
            eb = e["buckets"][name]
            assert (gb["positions"], gb["top1_agreement"], gb["state_rel_error"]) == \
                (eb["positions"], eb["top1_agreement"], eb["state_rel_error"])
            assert gb["kl_mean"] == pytest.approx(eb["kl_mean"], rel=1e-5, abs=1e-9)
    assert graphed["rows"][0]["buckets"]["0-512"]["kl_mean"] == 0.0  # row 0 against itself
    assert graphed["rows"][2]["buckets"]["0-512"]["state_rel_error"] > 0


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_grouped_decode_attention_on_nano_shapes(batch):
    """The decode step's attention on Nemotron-3-Nano's shapes (32 query heads over 2 key/value
    heads of 128, a 1024-slot static cache, part of it closed): at most twice as far from float64
    as the repeated form (transformers 5.18's) is; so is the one-launch kernel (step_ops
    "triton"), which also stays within half a bf16 step of float64 plus the rounding of its tf32
    probabilities and values (each cut to 11 significant bits, so each product within 2^-9 of its
    own size: at most 2^-9 of sum p |v| / sum p), and replays from a CUDA graph what it computes
    eagerly."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from fp4kit.decode import grouped_decode_sdpa

    class Attention:
        num_key_value_groups = 16
        is_causal = True

    g = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, 1, 32 * 128, device="cuda", generator=g).bfloat16().view(batch, 1, 32, 128).transpose(1, 2)
    k = torch.randn(batch, 2, 1024, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(batch, 2, 1024, 128, device="cuda", generator=g).bfloat16()
    mask = torch.zeros(batch, 1, 1, 1024, dtype=torch.bool, device="cuda")
    mask[..., : 600] = True
    mask[0, ..., :37] = False  # a left-padded row
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), repeat_kv(k.double(), 16), repeat_kv(v.double(), 16), attn_mask=mask, scale=128 ** -0.5)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 16), repeat_kv(v, 16), attn_mask=mask, scale=128 ** -0.5)
    out, _ = grouped_decode_sdpa(Attention(), q, k, v, mask, scaling=128 ** -0.5)
    error = (out.double() - exact.transpose(1, 2)).abs().max().item()
    assert error <= 2 * (repeated.double() - exact).abs().max().item()

    from fp4kit.kernels.attention import decode_attention

    from .test_decode_kernels_gpu import graphed

    kernel = decode_attention(q, k, v, mask, 128 ** -0.5)
    distance = (kernel.double() - exact.transpose(1, 2)).abs()
    assert distance.max().item() <= 2 * (repeated.double() - exact).abs().max().item()
    tf32 = torch.nn.functional.scaled_dot_product_attention(
        q.double(), repeat_kv(k.double(), 16), repeat_kv(v.double().abs(), 16), attn_mask=mask, scale=128 ** -0.5)
    bound = (2**-8 * exact.abs() + 2**-9 * tf32) * (1 + 2**-8) + 1e-6
    assert (distance <= bound.transpose(1, 2)).all()
    first, replayed = graphed(lambda: decode_attention(q, k, v, mask, 128 ** -0.5))
    assert torch.equal(first, kernel) and torch.equal(replayed, kernel)
