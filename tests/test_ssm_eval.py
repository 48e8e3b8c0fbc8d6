"""fp4kit eval --ssm-state: the SSM state held in fp32, fp16 or fp16 with stochastic rounding."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp4kit import ssm_eval
from fp4kit.decode import ssm_states
from fp4kit.cli import main
from fp4kit.formats import fp16sr
from fp4kit.models.tiny import load_tiny_model


def test_variants_parse_with_fp32_first():
    vs = ssm_eval.parse_variants("fp16-sr,fp16", "5,10")
    assert [v.label for v in vs] == ["fp32", "fp16-sr R=5", "fp16-sr R=10", "fp16"]
    for bad in ("", "bf16", "fp16,fp8"):
        with pytest.raises(ValueError, match="--ssm-state"):
            ssm_eval.parse_variants(bad)
    for bad in ("", "0", "five"):
        with pytest.raises(ValueError, match="--philox-rounds"):
            ssm_eval.parse_variants("fp16-sr", bad)


class _Layer:
    def __init__(self, t):
        self.recurrent_states = {0: t}


class _Cache:
    def __init__(self, *ts):
        self.layers = [_Layer(t) for t in ts]


def test_each_row_is_rounded_as_its_variant():
    from fp4kit import decode

    g = torch.Generator().manual_seed(0)
    before = [torch.randn(3, 2, 4, 8, generator=g) for _ in range(2)]
    rows = (["fp32", "fp16", "fp16-sr"], [1, 1, 5])
    states = [b.clone() for b in before]
    held = decode._StateFormat(*rows, states, torch.tensor([11 << 32]), "torch")
    held.after_step()
    for layer, (s, b) in enumerate(zip(states, before)):
        assert torch.equal(s[0], b[0])  # fp32: untouched
        assert torch.equal(s[1], b[1].half().float())  # fp16: round to nearest
        want = fp16sr.round_state(b[2].contiguous(), (11 << 32) + layer, 5, 2 * b[0].numel()).float()
        assert torch.equal(s[2], want)
        assert not torch.equal(s[2], s[1])
    assert int(held.seed) == (11 << 32) + 2  # the next step's first seed
    # a prefill's state is stored with a plain cast in every fp16 row
    states = [b.clone() for b in before]
    decode._StateFormat(*rows, states, torch.tensor([11 << 32]), "torch").after_prefill()
    assert all(torch.equal(s[0], b[0]) and torch.equal(s[2], b[2].half().float()) for s, b in zip(states, before))
    # rows that all keep fp32 are left alone
    states = [b.clone() for b in before]
    held = decode._StateFormat(["fp32"] * 3, [5] * 3, states, torch.tensor([7]), "torch")
    held.after_prefill()
    held.after_step()
    assert all(torch.equal(s, b) for s, b in zip(states, before))
    # rows of one format are rounded as one tensor, which draws the same words as row by row
    states = [b.clone() for b in before]
    decode._StateFormat(["fp16-sr"] * 3, [5] * 3, states, torch.tensor([7]), "torch").after_step()
    for layer, (s, b) in enumerate(zip(states, before)):
        for i in range(3):
            assert torch.equal(s[i], fp16sr.round_state(b[i].contiguous(), 7 + layer, 5, i * b[0].numel()).float())


def test_a_non_fp32_state_is_refused():
    with pytest.raises(ValueError, match="float32"):
        ssm_states(_Cache(torch.zeros(1, 2, 2, 2, dtype=torch.bfloat16)))


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model(device="cpu")


def test_teacher_forced_rows_on_the_embedded_model(tiny):
    model, _ = tiny
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    vs = ssm_eval.parse_variants("fp16,fp16-sr", "5")
    r = ssm_eval.teacher_forced(model, tokens, vs, state_error=True)
    base, *rest = r["rows"]
    assert r["positions"] == 23 and list(base["buckets"]) == ["0-512"]
    b0 = base["buckets"]["0-512"]
    assert b0["kl_mean"] == 0.0 and b0["top1_agreement"] == 1.0 and b0["state_rel_error"] == 0.0
    for row in rest:
        e = row["buckets"]["0-512"]
        assert e["kl_mean"] > 0 and 0 < e["state_rel_error"] < 0.05  # fp16 keeps ~3 significant digits
    # the fp32 row is the plain model reading the text: its perplexity is that of one forward over it
    with torch.inference_mode():
        logits = model(input_ids=tokens[None]).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, tokens[1:])
    assert math.log(base["perplexity"]) == pytest.approx(nll.item(), rel=1e-3)  # bf16: steps round apart from one pass


def test_cli_writes_json_markdown_and_plot(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # transformers says each kernel fallback once per process
    out = tmp_path / "ssm"
    code = main(["eval", "--ssm-state", "fp16,fp16-sr", "--philox-rounds", "5", "--tokens", "20", "--generate", "6",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads((out / "ssm-state.json").read_text())
    assert doc["variants"] == ["fp32", "fp16", "fp16-sr R=5"]
    assert doc["teacher_forced"]["positions"] == 19 and doc["free_generation"]["new_tokens"] == 6
    assert {"date", "command", "versions"} <= set(doc)
    assert (out / "ssm-state.md").read_text().startswith("Teacher-forced over 19 tokens")
    assert (out / "ssm-state.png").stat().st_size > 0
    captured = capfd.readouterr()
    assert "| fp16-sr R=5 |" in captured.out
    assert "falling back" not in captured.err and "Loading weights" not in captured.err


@pytest.mark.parametrize("argv,msg", [
    (["--ssm-state", "bf16"], "--ssm-state takes"),
    (["--ssm-state", "fp16", "--compare-recipes"], "takes no --compare-recipes"),
    (["--ssm-state", "fp16", "--philox-rounds", "0"], "--philox-rounds"),
    (["--ssm-state", "fp16", "--quantized", "/nonexistent/q"], "quantized checkpoint"),
])
def test_cli_refusals(argv, msg, capsys):
    assert main(["eval", *argv]) == 2
    assert msg in capsys.readouterr().err
