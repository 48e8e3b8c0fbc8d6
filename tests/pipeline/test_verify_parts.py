"""`fp4kit verify` without a model, down to the lines a mutation run showed no other test pinning:
the report's text, byte comparison, tensor-parallel rules on hand-made headers, vLLM's bf16 KV
scales, the 4/6 re-derivation helpers, and what `verify` runs after each kind of conformance
finding."""

from __future__ import annotations

import importlib
import json
import re
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from fp4kit.formats import nvfp4
from fp4kit.formats.constants import FOUR_OVER_SIX_MULTIPLIERS, FP8_NORM_4O6
from fp4kit.verify import (
    Check,
    VerifyReport,
    _bytes_equal,
    _count,
    _expected_nvfp4,
    _format_of,
    _mamba_in_proj,
    _tensor_headers,
    four_over_six_from_weight,
    kv_scales_as_bf16,
    modelopt_mse_algorithm,
    tensor_parallel,
    verify,
)

# imported here rather than first inside against_modelopt: a process that forks for each test run
# (a mutation run) then pays for it once
importlib.import_module("modelopt.torch.quantization.qtensor.nvfp4_tensor")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
from test_conformance import make_configs, make_tensors, write_checkpoint  # noqa: E402


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- counting and comparing bytes ---


def test_count_puts_the_plural_on_everything_but_one():
    assert [_count(n, "tensor") for n in (0, 1, 2)] == ["0 tensors", "1 tensor", "2 tensors"]


def test_bytes_equal_counts_the_bytes_that_differ():
    a = torch.tensor([1.0, 2.0], dtype=torch.float32)
    assert _bytes_equal(a, a.clone()) == (True, "")
    b = a.clone()
    b.view(torch.uint8)[0] ^= 1
    b.view(torch.uint8)[5] ^= 1
    assert _bytes_equal(b, a) == (False, "2 of 8 bytes differ")
    assert _bytes_equal(a.to(torch.bfloat16), a) == (
        False, "dtype/shape torch.bfloat16(2,) != expected torch.float32(2,)")
    assert _bytes_equal(a.reshape(1, 2), a) == (False, "dtype/shape torch.float32(1, 2) != expected torch.float32(2,)")
    # -0.0 == 0.0 as numbers, not as bytes
    assert _bytes_equal(torch.tensor([-0.0]), torch.tensor([0.0])) == (False, "1 of 4 bytes differ")


# --- the report ---


def test_report_ok_dict_and_text():
    r = VerifyReport("ck")
    assert r.ok and r.text() == "fp4kit verify ck: PASS"
    r.add("rederive", True, "", "a.weight")
    r.add("rederive", False, "1 of 8 bytes differ", "b.weight")
    r.add("modelopt", True, "", "c.weight")
    assert not r.ok
    assert r.to_dict() == {
        "checkpoint": "ck", "ok": False,
        "checks": [{"name": "rederive", "ok": True, "detail": "", "tensor": "a.weight"},
                   {"name": "rederive", "ok": False, "detail": "1 of 8 bytes differ", "tensor": "b.weight"},
                   {"name": "modelopt", "ok": True, "detail": "", "tensor": "c.weight"}],
    }
    assert r.text().splitlines() == [
        "fp4kit verify ck: FAIL",
        "  FAIL rederive: 1 of 2 tensors differ",
        "       b.weight 1 of 8 bytes differ",
        "  ok   modelopt: 0 of 1 sampled tensor differ",
    ]
    r.sections["extra"] = {"x": 1}
    assert r.to_dict()["extra"] == {"x": 1}


def test_report_text_shows_conformance_warnings_tensor_parallel_and_kv_scales():
    r = VerifyReport("ck")
    r.add("conformance", True, "[kv_scales_absent] no scales", "attn")
    r.add("conformance", True, "all engine loader rules hold")
    r.sections["conformance"] = {"errors": 0, "warnings": 1, "tensors": 1}
    r.sections["tensor_parallel"] = {"tp": 2, "ep": True, "ok": False, "count": 1, "problems": ["x: K=3"]}
    r.add("tensor_parallel", False, "x: K=3")
    r.sections["kv_scales_bf16"] = [{"tensor": "k", "value": 0.1, "bf16": 0.10009765625, "rel_change": 0.0009765625}]
    assert r.text().splitlines() == [
        "fp4kit verify ck: FAIL",
        "  ok   conformance: 0 errors, 1 warning over 1 tensor",
        "       warning attn [kv_scales_absent] no scales",
        "  FAIL tensor_parallel: TP=2 with expert parallelism: does NOT shard cleanly, 1 problem",
        "       x: K=3",
        "  info k: 0.1, 0.10009766 as vLLM's bf16 parameter (+0.098%)",
    ]
    r.sections["tensor_parallel"] = {"tp": 4, "ep": False, "ok": True, "count": 0, "problems": []}
    r.checks[-1] = Check("tensor_parallel", True, "")
    r.sections["conformance"] = {"errors": 2, "warnings": 0, "tensors": 7}
    lines = r.text().splitlines()
    assert lines[0] == "fp4kit verify ck: PASS"
    assert lines[1] == "  ok   conformance: 2 errors, 0 warnings over 7 tensors"
    assert lines[3] == "  ok   tensor_parallel: TP=4: shards cleanly"


def test_report_text_lists_twenty_failures_and_counts_the_rest():
    r = VerifyReport("ck")
    for i in range(23):
        r.add("rederive", False, "bad", f"t{i}")
    lines = r.text().splitlines()
    assert lines[1] == "  FAIL rederive: 23 of 23 tensors differ"
    assert lines[2:22] == [f"       t{i} bad" for i in range(20)]
    assert lines[22:] == ["       ... and 3 more"]
    r = VerifyReport("ck")
    for i in range(21):
        r.add("conformance", False, "[x] bad", f"t{i}")
    assert r.text().splitlines()[-1] == "       ... and 1 more"
    r = VerifyReport("ck")
    for i in range(20):
        r.add("modelopt", False, "bad", f"t{i}")
    assert r.text().splitlines()[-1] == "       t19 bad"


# --- tensor parallelism on hand-made headers ---


def write_folder(folder: Path, tensors: dict, config: dict, *, index: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if index:
        names = sorted(tensors)
        half = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
        for file, part in half.items():
            save_file({n: tensors[n] for n in part}, str(folder / file))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {n: f for f, part in half.items() for n in part}}))
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def u8(n, k2):
    return torch.zeros(n, k2, dtype=torch.uint8)


def bf16(n, k):
    return torch.zeros(n, k, dtype=torch.bfloat16)


def test_tensor_parallel_row_column_and_block_rules(tmp_path):
    t = {
        "model.layers.0.mlp.down_proj.weight": u8(8, 24),  # NVFP4 K=48: tp=2 -> 24, not whole blocks
        "model.layers.0.mlp.up_proj.weight": bf16(6, 16),  # N=6
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(5, 16, dtype=torch.float8_e4m3fn),  # N=5: odd
        "model.layers.0.self_attn.o_proj.weight": bf16(8, 7),  # K=7: odd
        "model.layers.0.mlp.up_proj.weight_scale": torch.zeros(5, 3, dtype=torch.float8_e4m3fn),  # not a weight
        "model.layers.0.input_layernorm.weight": bf16(5, 5),  # norm
        "model.embed_tokens.weight": bf16(5, 5),
        "lm_head.weight": bf16(5, 5),
        "model.layers.0.mlp.gate.weight": bf16(5, 5),  # router
        "mtp.layers.0.mlp.up_proj.weight": bf16(5, 5),
        "model.layers.0.mlp.bias_like.weight": torch.zeros(5),  # 1-D
    }
    folder = write_folder(tmp_path / "c", t, {"model_type": "llama"})
    out = tensor_parallel(folder, 2)
    assert out == {"tp": 2, "ep": False, "ok": False, "count": 3, "problems": [
        "model.layers.0.mlp.down_proj (NVFP4): K=48 splits into 24 per rank, not a whole number of 16-element blocks",
        "model.layers.0.mlp.gate_proj (FP8): N=5 does not split into 2 equal parts",
        "model.layers.0.self_attn.o_proj (BF16): K=7 does not split into 2 equal parts",
    ]}
    assert tensor_parallel(folder, 1) == {"tp": 1, "ep": False, "ok": True, "problems": [], "count": 0}
    # tp=3: K=48 -> 16 per rank is whole blocks; N=6 splits; 5 and 7 do not
    assert tensor_parallel(folder, 3)["problems"] == [
        "model.layers.0.mlp.gate_proj (FP8): N=5 does not split into 3 equal parts",
        "model.layers.0.self_attn.o_proj (BF16): K=7 does not split into 3 equal parts",
    ]


def test_tensor_parallel_reports_each_reason_once_but_counts_all(tmp_path):
    t = {f"model.layers.{i}.mlp.up_proj.weight": bf16(5, 16) for i in range(3)}
    t["model.layers.0.mlp.down_proj.weight"] = bf16(8, 5)
    out = tensor_parallel(write_folder(tmp_path / "c", t, {}, index=True), 2)
    assert out["count"] == 4 and out["ok"] is False
    assert out["problems"] == [
        "model.layers.0.mlp.down_proj (BF16): K=5 does not split into 2 equal parts",
        "model.layers.0.mlp.up_proj (BF16): N=5 does not split into 2 equal parts",
    ]


def test_tensor_parallel_experts_and_attention_heads(tmp_path):
    t = {
        "model.layers.0.mlp.experts.0.up_proj.weight": bf16(5, 16),
        "model.layers.0.self_attn.q_proj.weight": bf16(5, 16),
        "model.layers.0.self_attn.k_proj.weight": bf16(5, 16),
    }
    config = {"num_attention_heads": 6, "num_key_value_heads": 3}
    folder = write_folder(tmp_path / "c", t, config)
    assert tensor_parallel(folder, 2)["problems"] == [
        "model.layers.0.mlp.experts.0.up_proj (BF16): N=5 does not split into 2 equal parts",
        "attention: num_key_value_heads=3 and tp=2: neither divides the other",
    ]
    assert tensor_parallel(folder, 2, ep=True)["problems"] == [
        "attention: num_key_value_heads=3 and tp=2: neither divides the other"]
    assert tensor_parallel(folder, 4, ep=True)["problems"] == [
        "attention: num_attention_heads=6 is not divisible by tp=4",
        "attention: num_key_value_heads=3 and tp=4: neither divides the other",
    ]
    assert tensor_parallel(folder, 6, ep=True)["ok"]  # 3 divides 6
    assert tensor_parallel(folder, 3, ep=True)["ok"]
    # heads counted only where the checkpoint has attention
    del t["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.k_proj.weight"]
    assert tensor_parallel(write_folder(tmp_path / "d", t, config), 4, ep=True)["ok"]
    # non-int head counts are not checked
    folder = write_folder(tmp_path / "e", {"model.layers.0.self_attn.v_proj.weight": bf16(5, 16)},
                          {"num_attention_heads": "6", "num_key_value_heads": None})
    assert tensor_parallel(folder, 4)["ok"]


NEMOTRON = {"model_type": "nemotron_h", "mamba_num_heads": 8, "mamba_head_dim": 4, "n_groups": 2, "ssm_state_size": 4}


def test_tensor_parallel_splits_a_mamba_in_proj_by_its_blocks(tmp_path):
    n = 2 * 32 + 2 * 8 + 8  # 88
    t = {"backbone.layers.0.mixer.in_proj.weight": bf16(n, 16), "backbone.layers.0.mixer.out_proj.weight": bf16(16, 32)}
    folder = write_folder(tmp_path / "c", t, NEMOTRON)
    assert tensor_parallel(folder, 2)["ok"]
    assert tensor_parallel(folder, 4)["problems"] == [
        "backbone.layers.0.mixer.in_proj (BF16): Mamba in_proj N=88 = z 32 + x 32 + B 8 + C 8 + dt 8, each block split "
        "by tp=4: every block divides, but the engines need mamba_num_heads (8) and n_groups (2) divisible by tp (or n_groups == 1)"
    ]
    # the same in_proj in a model that is not nemotron_h is a plain column-parallel layer
    folder = write_folder(tmp_path / "d", t, {**NEMOTRON, "model_type": "llama"})
    assert tensor_parallel(folder, 4)["ok"]


def test_mamba_in_proj_rules():
    what = "m (FP8)"
    # incomplete config: N alone decides
    assert _mamba_in_proj(what, 10, True, {}, 4) == "m (FP8): N=10 does not split into 4 equal parts"
    assert _mamba_in_proj(what, 12, True, {**NEMOTRON, "n_groups": 0}, 4) is None
    assert _mamba_in_proj(what, 10, True, {**NEMOTRON, "ssm_state_size": "4"}, 4) == "m (FP8): N=10 does not split into 4 equal parts"
    # complete: heads 8, head_dim 4 -> inner 32; groups 2, state 4 -> bc 8
    assert _mamba_in_proj(what, 88, True, NEMOTRON, 2) is None
    assert _mamba_in_proj(what, 88, True, NEMOTRON, 8) == (
        "m (FP8): Mamba in_proj N=88 = z 32 + x 32 + B 8 + C 8 + dt 8, each block split by tp=8: every block divides, but "
        "the engines need mamba_num_heads (8) and n_groups (2) divisible by tp")
    odd = {**NEMOTRON, "mamba_num_heads": 6, "mamba_head_dim": 3, "ssm_state_size": 3}  # inner 18, bc 6, heads 6
    assert _mamba_in_proj(what, 54, False, odd, 4) == (
        "m (FP8): Mamba in_proj N=54 = z 18 + x 18 + B 6 + C 6 + dt 6, each block split by tp=4: z=18, x=18, B=6, C=6, "
        "dt=6 not divisible; the engines need mamba_num_heads (6) and n_groups (2) divisible by tp (or n_groups == 1)")
    # n_groups == 1: replicated B/C for an unquantized in_proj, refused for a quantized one
    one = {**NEMOTRON, "n_groups": 1}
    assert _mamba_in_proj(what, 80, False, one, 4) is None
    assert _mamba_in_proj(what, 80, True, one, 4) == (
        "m (FP8): Mamba in_proj N=80 = z 32 + x 32 + B 4 + C 4 + dt 8, each block split by tp=4: every block divides, but "
        "the engines need mamba_num_heads (8) and n_groups (1) divisible by tp")
    assert _mamba_in_proj(what, 80, True, one, 1) is None
    # heads not divisible although every block is
    heads = {**NEMOTRON, "mamba_num_heads": 2, "mamba_head_dim": 8, "n_groups": 4}
    assert _mamba_in_proj(what, 0, False, heads, 4).endswith("dt=2 not divisible; the engines need mamba_num_heads (2) "
                                                              "and n_groups (4) divisible by tp (or n_groups == 1)")


def test_format_names_and_headers_from_an_index(tmp_path):
    info = SimpleNamespace
    assert [_format_of(info(dtype=d)) for d in ("U8", "F8_E4M3", "BF16", "F32")] == ["NVFP4", "FP8", "BF16", "F32"]
    t = {"a.weight": bf16(2, 2), "b.weight": u8(2, 2), "c.weight": bf16(1, 2)}
    folder = write_folder(tmp_path / "c", t, {}, index=True)
    (folder / "stray.safetensors").write_bytes(b"")  # not in the index: not read
    headers = _tensor_headers(folder)
    assert sorted(headers) == ["a.weight", "b.weight", "c.weight"]
    assert headers["b.weight"].dtype == "U8" and headers["b.weight"].shape == (2, 2)


# --- KV scales as vLLM keeps them ---


def test_kv_scales_as_bf16(tmp_path):
    t = {
        "m.k_proj.k_scale": torch.tensor(0.1),
        "m.v_proj.v_scale": torch.tensor(3.0),
        "n.k_proj.k_scale": torch.tensor(0.0),
        "m.q_proj.weight_scale": torch.tensor(0.1),  # not a KV scale
        "o.k_proj.k_scale": torch.tensor(0.1, dtype=torch.float64),  # not F32
        "p.k_proj.k_scale": torch.tensor([0.1, 0.2]),  # not one value
    }
    folder = write_folder(tmp_path / "c", t, {})
    out = kv_scales_as_bf16(folder)
    bf = float(torch.tensor(0.1).to(torch.bfloat16).float())
    value = float(torch.tensor(0.1))
    assert out == [
        {"tensor": "m.k_proj.k_scale", "value": value, "bf16": bf, "rel_change": pytest.approx((bf - value) / value, rel=1e-6)},
        {"tensor": "m.v_proj.v_scale", "value": 3.0, "bf16": 3.0, "rel_change": 0.0},
        {"tensor": "n.k_proj.k_scale", "value": 0.0, "bf16": 0.0, "rel_change": 0.0},
    ]
    assert out[0]["rel_change"] == float((torch.tensor(bf) - torch.tensor(value)) / torch.tensor(value))


# --- ModelOpt's range search ---


def test_modelopt_mse_algorithm_messages():
    assert modelopt_mse_algorithm(()) == "max"
    assert modelopt_mse_algorithm((1.0,)) == "max"
    with pytest.raises(ValueError) as e:
        modelopt_mse_algorithm((0.9,))
    assert str(e.value) == "amax_search [0.9]: ModelOpt's mse search cannot try a single multiplier other than 1.0"
    with pytest.raises(ValueError) as e:
        modelopt_mse_algorithm((1.0, 1.5, 1.75))
    assert str(e.value) == ("amax_search [1.0, 1.5, 1.75] is not an increasing, evenly spaced list: ModelOpt's mse "
                            "search takes start_multiplier, stop_multiplier and step_size")
    assert modelopt_mse_algorithm((1.0, 1.25, 1.5)) == {
        "method": "mse", "start_multiplier": 1.0, "stop_multiplier": 1.5, "step_size": 0.25}
    assert modelopt_mse_algorithm((0.5, 1.0, 1.5, 2.0)) == {
        "method": "mse", "start_multiplier": 0.5, "stop_multiplier": 2.0, "step_size": 0.5}


# --- re-deriving a 4/6 weight ---


def rule(importance: bool, scale_rule: str = "4o6"):
    return SimpleNamespace(importance=importance, scale_rule=scale_rule)


def same(a, b):
    return (torch.equal(a.packed, b.packed) and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
            and torch.equal(a.global_scale, b.global_scale))


@pytest.mark.parametrize("arith", ["cpu", "cuda"])
def test_expected_nvfp4_without_importance_is_the_recipes_quantize(arith):
    w = rand(4, 64, seed=1)
    for scale_rule in ("6", "4o6"):
        for g in (None, 9.0):
            want = nvfp4.quantize(w, scale_rule=scale_rule, global_amax=g, arith=arith)
            assert same(_expected_nvfp4(w, rule(False, scale_rule), g, None, arith), want)


@pytest.mark.parametrize("arith", ["cpu", "cuda"])
def test_expected_nvfp4_with_importance_takes_the_stored_choice(arith):
    w = rand(4, 64, seed=2)
    importance = rand(64, seed=3).abs() + 0.1
    for g in (None, 7.5):
        stored = nvfp4.quantize(w, scale_rule="4o6", global_amax=g, importance=importance, arith=arith)
        got = _expected_nvfp4(w, rule(True), g, stored.block_scale, arith)
        assert same(got, stored)
    # a stored choice other than the squared-error rule's is taken as stored
    plain, chose4 = nvfp4.quantize(w, scale_rule="4o6", arith=arith, return_choice=True)
    flip = ~chose4
    g = w.abs().amax().float()
    mult = torch.where(flip, FOUR_OVER_SIX_MULTIPLIERS[1], FOUR_OVER_SIX_MULTIPLIERS[0])
    flipped = nvfp4.quantize_static(w, nvfp4.block_amax(w) * mult, g, fp8_norm=FP8_NORM_4O6, arith=arith)
    assert same(_expected_nvfp4(w, rule(True), None, flipped.block_scale, arith), flipped)
    assert four_over_six_from_weight(w, rule(True), flipped.block_scale, arith).equal(nvfp4.four_over_six_choice(
        flipped.block_scale, nvfp4.block_amax(w), g, arith)[0])
    assert four_over_six_from_weight(w, rule(False), flipped.block_scale, arith).equal(chose4)


def test_a_stored_scale_that_is_neither_candidate_is_refused():
    w = rand(4, 64, seed=4)
    stored = nvfp4.quantize(w, scale_rule="4o6", arith="cpu").block_scale.clone()
    raw = stored.view(torch.uint8)
    raw[0, 0] ^= 0x10
    raw[2, 3] ^= 0x10
    for call in (lambda: _expected_nvfp4(w, rule(True), None, stored, "cpu"),
                 lambda: four_over_six_from_weight(w, rule(True), stored, "cpu")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == "2 block scales are neither 4/6 candidate"


# --- what verify runs after conformance ---


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    config, hf_quant = make_configs()
    return write_checkpoint(tmp_path / "ckpt", make_tensors(), config, hf_quant)


def test_verify_of_a_conformant_checkpoint(checkpoint):
    r = verify(checkpoint, tp=2)
    tp = tensor_parallel(checkpoint, 2)
    assert [(c.name, c.ok, c.detail, c.tensor) for c in r.checks] == [
        ("conformance", True, "all engine loader rules hold", None),
        ("tensor_parallel", tp["ok"], "; ".join(tp["problems"][:3]), None),
    ]
    assert r.checkpoint == str(checkpoint)
    assert r.sections["conformance"]["ok"] is True and r.sections["conformance"]["tensors"] > 0
    assert [kv["tensor"] for kv in r.sections["kv_scales_bf16"]] == [
        "backbone.layers.0.mixer.k_proj.k_scale", "backbone.layers.0.mixer.v_proj.v_scale"]
    assert r.sections["tensor_parallel"] == tp
    assert "tensor_parallel" not in verify(checkpoint).sections


def test_verify_lists_warnings_as_passing_checks(checkpoint):
    (checkpoint / "generation_config.json").unlink()
    r = verify(checkpoint)
    assert r.ok
    assert [(c.name, c.ok, c.detail, c.tensor) for c in r.checks] == [
        ("conformance", True, "[missing_file] no generation_config.json (engines fall back to defaults)",
         "generation_config.json")]
    assert "kv_scales_bf16" in r.sections


def test_verify_goes_on_after_a_config_error_but_reports_no_kv_values(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["mamba_n_groups"] = 8
    (checkpoint / "config.json").write_text(json.dumps(config))
    r = verify(checkpoint, tp=3)
    assert [(c.name, c.ok) for c in r.checks] == [("conformance", False), ("tensor_parallel", False)]
    assert r.checks[0].detail == "[config_mismatch] 8 but n_groups is 1"
    assert "kv_scales_bf16" not in r.sections
    assert r.checks[1].detail == "; ".join(r.sections["tensor_parallel"]["problems"][:3])
    assert r.sections["tensor_parallel"]["count"] > 3


@pytest.mark.parametrize("damage", ["header_too_large", "truncated_file", "missing_shard", "bad_header"])
def test_verify_stops_at_an_unreadable_file(checkpoint, damage):
    """A file conformance cannot read ends the report there: no tensor-parallel section (whose
    header reader would raise on it), nothing re-derived."""
    shard = checkpoint / "model-00002-of-00002.safetensors"
    if damage == "header_too_large":
        shard.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    elif damage == "truncated_file":
        shard.write_bytes(b"abc")
    elif damage == "missing_shard":
        shard.unlink()
    else:
        shard.write_bytes(struct.pack("<Q", 2) + b"[]")
    r = verify(checkpoint, tp=2, source=str(checkpoint / "no-such-model"))
    assert not r.ok
    assert [c.name for c in r.checks] == ["conformance"]
    assert r.checks[0].detail.startswith(f"[{damage}]")
    assert set(r.sections) == {"conformance"}


def test_verify_refuses_an_unknown_against_and_against_without_source(checkpoint):
    with pytest.raises(ValueError) as e:
        verify(checkpoint, against="gptq")
    assert str(e.value) == "--against must be one of ('modelopt',), got 'gptq'"
    with pytest.raises(ValueError) as e:
        verify(checkpoint, against="modelopt")
    assert str(e.value) == "--against modelopt needs --source (the BF16 weights to re-quantize)"


# --- re-derivation and ModelOpt on a real (tiny) checkpoint: what each kind of difference says ---


def quantized_checkpoint(base: Path, source, recipe) -> Path:
    """`source` saved under base/source and quantized by `recipe` in ModelOpt's CPU arithmetic
    into base/ckpt; returns base."""
    from fp4kit.export.modelopt import export_checkpoint
    from fp4kit.quantize import load_model, quantize

    source.save_pretrained(base / "source")
    model, _ = load_model(str(base / "source"), device="cpu", tokenizer=False)
    samples = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    qm = quantize(model, recipe, samples, progress=False, arith="cpu")
    export_checkpoint(qm, base / "ckpt", progress=False)
    return base


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    """The tiny Nemotron-H quantized by the modelopt-lightning recipe in ModelOpt's CPU arithmetic."""
    from fp4kit.recipe import load_recipe
    from tiny_models import build_nemotron_h

    return quantized_checkpoint(tmp_path_factory.mktemp("lightning-verify"), build_nemotron_h(), load_recipe("modelopt-lightning"))


def edited(base: Path, name: str, *, drop=(), add=None, meta=None) -> Path:
    """A copy of the checkpoint without the tensors `drop`, with the tensors `add`, and with
    fp4kit.json edited by `meta` (None: deleted when meta is False)."""
    import shutil

    from safetensors.torch import load_file

    from fp4kit.export.checkpoint import CheckpointReader

    dst = base / name
    shutil.copytree(base / "ckpt", dst)
    reader = CheckpointReader(dst)
    first = sorted(set(reader.where.values()))[0]
    for shard in sorted(set(reader.where.values())):
        data = load_file(str(dst / shard))
        data = {n: t for n, t in data.items() if n not in drop}
        if shard == first:
            data.update(add or {})
        save_file(data, str(dst / shard), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        doc["weight_map"] = {n: s for n, s in doc["weight_map"].items() if n not in drop} | {n: first for n in add or {}}
        index.write_text(json.dumps(doc))
    if meta is False:
        (dst / "fp4kit.json").unlink()
    elif meta is not None:
        doc = json.loads((dst / "fp4kit.json").read_text())
        meta(doc)
        (dst / "fp4kit.json").write_text(json.dumps(doc))
    return dst


def rederived(ckpt: Path, source: Path) -> list[tuple]:
    from fp4kit.verify import rederive

    r = VerifyReport(str(ckpt))
    rederive(r, ckpt, str(source))
    return r


IN_PROJ = "backbone.layers.0.mixer.in_proj"
O_PROJ = "backbone.layers.2.mixer.o_proj"
NORM = "backbone.layers.0.norm"


def test_rederive_names_each_kind_of_missing_or_extra_tensor(lightning):
    good = rederived(lightning / "ckpt", lightning / "source")
    assert good.ok and len(good.checks) > 50
    names = {c.tensor for c in good.checks}
    assert {f"{IN_PROJ}.weight", f"{IN_PROJ}.weight_scale", f"{O_PROJ}.weight", f"{NORM}.weight"} <= names
    ckpt = edited(lightning, "holes", drop=(f"{IN_PROJ}.weight_scale", f"{O_PROJ}.weight", f"{NORM}.weight"),
                  add={"extra.weight": torch.zeros(2), "extra.k_scale": torch.tensor(1.0)})
    bad = [(c.ok, c.detail, c.tensor) for c in rederived(ckpt, lightning / "source").checks if not c.ok]
    assert sorted(bad, key=str) == sorted([
        (False, "missing ['weight_scale']", IN_PROJ),
        (False, "missing from the checkpoint", f"{O_PROJ}.weight"),
        (False, "missing from the checkpoint", f"{NORM}.weight"),
        (False, "not produced by the recorded recipe from the source", "extra.weight"),
    ], key=str)
    assert len([c for c in rederived(ckpt, lightning / "source").checks if c.ok]) == len(good.checks) - 4  # in_proj's weight and weight_scale, o_proj, norm


def test_rederive_and_modelopt_need_the_recipe(lightning):
    from fp4kit.verify import against_modelopt

    ckpt = edited(lightning, "no-meta", meta=False)
    r = rederived(ckpt, lightning / "source")
    assert [(c.name, c.ok, c.detail, c.tensor) for c in r.checks] == [
        ("rederive", False, "fp4kit.json with the recipe is missing: nothing to re-derive from", None)]
    r = VerifyReport(str(ckpt))
    against_modelopt(r, ckpt, str(lightning / "source"))
    assert [(c.name, c.ok, c.detail, c.tensor) for c in r.checks] == [("modelopt", False, "fp4kit.json is missing", None)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_modelopt_on_the_cuda_arithmetic_is_refused_without_cuda(lightning):
    from fp4kit.verify import against_modelopt

    ckpt = edited(lightning, "cuda-arith", meta=lambda m: m.__setitem__("arith", "cuda"))
    with pytest.raises(ValueError) as e:
        against_modelopt(VerifyReport(str(ckpt)), ckpt, "no-such-source")
    assert str(e.value) == (
        "--against modelopt: this checkpoint uses ModelOpt's CUDA arithmetic (arith 'cuda'), so ModelOpt must run on a "
        "CUDA device to reproduce it; none is available")
    missing = edited(lightning, "no-arith", meta=lambda m: m.pop("arith"))  # ModelOpt's default is CUDA's
    with pytest.raises(ValueError, match="arith 'cuda'"):
        against_modelopt(VerifyReport(str(missing)), missing, "no-such-source")


def test_modelopt_samples_evenly_and_at_most_sample(lightning):
    from fp4kit.verify import against_modelopt

    def sampled(n):
        r = VerifyReport("x")
        against_modelopt(r, lightning / "ckpt", str(lightning / "source"), sample=n)
        assert r.ok, r.text()
        return [c.tensor for c in r.checks]

    def modules(tensors):
        return list(dict.fromkeys(t.rpartition(".")[0] for t in tensors))

    every = modules(sampled(100))
    assert len(every) == 11
    assert modules(sampled(1)) == every[:1]
    assert modules(sampled(3)) == every[::3][:3]  # every 11 // 3 = 3rd module
    assert modules(sampled(5)) == every[::2][:5]
    r = VerifyReport("x")
    against_modelopt(r, lightning / "ckpt", str(lightning / "source"))  # 8 of its 11 modules by default
    assert len({c.tensor.rpartition(".")[0] for c in r.checks}) == 8


# --- ModelOpt's FP8 range search, as verify runs it ---


def test_modelopt_fp8_calibrates_in_the_weights_dtype():
    """ModelOpt's mse search fake-quantizes in the Linear's dtype; for this bf16 weight a float32
    Linear would settle on 0.000773838605 instead."""
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import to_quantized_weight

    from fp4kit.verify import _modelopt_fp8

    w = (torch.randn(16, 32, generator=torch.Generator().manual_seed(4)) * 0.08).to(torch.bfloat16)
    qw, scale = _modelopt_fp8(w, (1.0, 1.25, 1.5))
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert scale.item() == 0.0007760184234939516
    assert qw.dtype == torch.float8_e4m3fn and torch.equal(qw.view(torch.uint8),
                                                            to_quantized_weight(w, scale, QUANTIZATION_FP8).view(torch.uint8))


def test_modelopt_mse_algorithm_compares_the_multipliers_in_fp32():
    # 2^24 + 1 has no float32: linspace's float32 grid holds 2^24, which the list then matches
    assert modelopt_mse_algorithm((1, 16777217)) == {
        "method": "mse", "start_multiplier": 1, "stop_multiplier": 16777217, "step_size": 16777216.0}


def test_verify_runs_every_part_it_is_asked_for(lightning):
    from fp4kit.verify import against_modelopt

    r = verify(lightning / "ckpt", source=str(lightning / "source"), against="modelopt", tp=2, ep=True)
    names = [c.name for c in r.checks]
    assert names == sorted(names, key=["conformance", "rederive", "modelopt", "tensor_parallel"].index)
    assert names.count("conformance") == 1 and names.count("tensor_parallel") == 1
    assert names.count("rederive") == len(rederived(lightning / "ckpt", lightning / "source").checks)
    modelopt = VerifyReport("x")
    against_modelopt(modelopt, lightning / "ckpt", str(lightning / "source"))
    assert [(c.ok, c.tensor) for c in r.checks if c.name == "modelopt"] == [(c.ok, c.tensor) for c in modelopt.checks]
    assert all(c.ok for c in r.checks if c.name != "tensor_parallel")
    assert r.sections["tensor_parallel"] == tensor_parallel(lightning / "ckpt", 2, True)


def test_tensor_parallel_of_a_quantized_mamba_in_proj_refuses_one_group(tmp_path):
    one = {**NEMOTRON, "n_groups": 1}
    n = 2 * 32 + 2 * 4 + 8  # 80 rows, one group of state 4
    for dtype, weight in (("U8", u8(n, 8)), ("F8_E4M3", torch.zeros(n, 16, dtype=torch.float8_e4m3fn))):
        folder = write_folder(tmp_path / dtype, {"backbone.layers.0.mixer.in_proj.weight": weight}, one)
        assert tensor_parallel(folder, 4)["problems"] == [
            f"backbone.layers.0.mixer.in_proj ({'NVFP4' if dtype == 'U8' else 'FP8'}): Mamba in_proj N=80 = z 32 + x 32 + "
            "B 4 + C 4 + dt 8, each block split by tp=4: every block divides, but the engines need mamba_num_heads (8) and "
            "n_groups (1) divisible by tp"]
    folder = write_folder(tmp_path / "bf16", {"backbone.layers.0.mixer.in_proj.weight": bf16(n, 16)}, one)
    assert tensor_parallel(folder, 4)["ok"]


# --- a dense model: NVFP4 with scale 6, 4/6 weighted by importance, and fused siblings ---

DENSE_RECIPE = {
    "name": "test-dense", "version": 1,
    "rules": [
        {"roles": ["attention_qkv", "attention_o"], "format": "nvfp4_w4a16", "scale_rule": "6"},
        {"roles": ["dense_mlp"], "format": "nvfp4_w4a16", "scale_rule": "4o6", "importance": True},
    ],
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from fp4kit.recipe import recipe_from_dict
    from tiny_models import build_llama

    return quantized_checkpoint(tmp_path_factory.mktemp("dense-verify"), build_llama(), recipe_from_dict(DENSE_RECIPE))


def test_dense_checkpoint_passes_and_modelopt_leaves_out_fused_nvfp4(dense):
    from fp4kit.verify import against_modelopt

    r = verify(dense / "ckpt", source=str(dense / "source"))
    assert r.ok, r.text()
    m = VerifyReport("x")
    against_modelopt(m, dense / "ckpt", str(dense / "source"), sample=100)
    assert m.ok, m.text()
    modules = {c.tensor.rpartition(".")[0].rpartition(".")[2] for c in m.checks}
    assert modules == {"o_proj", "down_proj"}  # q/k/v and gate/up share a global scale ModelOpt's per-tensor code would not


def test_a_block_scale_neither_4_6_candidate_is_named(dense):
    from fp4kit.export.checkpoint import CheckpointReader
    from fp4kit.verify import against_modelopt

    name = "model.layers.0.mlp.down_proj.weight_scale"
    scale = CheckpointReader(dense / "ckpt").get(name).clone()
    scale.view(torch.uint8)[0, 0] ^= 0x10
    ckpt = edited(dense, "bad-4o6", add={name: scale})
    r = rederived(ckpt, dense / "source")
    assert [(c.name, c.ok, c.detail, c.tensor) for c in r.checks if not c.ok] == [
        ("rederive", False, "1 block scales are neither 4/6 candidate", name)]
    m = VerifyReport("x")
    against_modelopt(m, ckpt, str(dense / "source"), sample=100)
    assert [(c.name, c.ok, c.detail, c.tensor) for c in m.checks if not c.ok] == [
        ("modelopt", False, "1 block scales are neither 4/6 candidate", name)]
    good = VerifyReport("x")
    against_modelopt(good, dense / "ckpt", str(dense / "source"), sample=100)
    assert len(m.checks) == len(good.checks) - 2  # that module's three checks become one; the rest go on


def test_modelopt_refuses_an_fp8_range_search_it_cannot_run_and_goes_on(lightning):
    """A recipe whose amax_search is no linspace: each FP8 module gets the refusal, the rest are compared."""
    from fp4kit.verify import against_modelopt

    def search(meta):
        for rule in meta["recipe"]["rules"]:
            if rule["format"] == "fp8":
                rule["amax_search"] = [1.0, 1.2, 1.5]

    ckpt = edited(lightning, "uneven-search", meta=search)
    r = VerifyReport("x")
    against_modelopt(r, ckpt, str(lightning / "source"), sample=100)
    bad = [(c.name, c.ok, c.detail, c.tensor) for c in r.checks if not c.ok]
    message = ("amax_search [1.0, 1.2, 1.5] is not an increasing, evenly spaced list: ModelOpt's mse search takes "
               "start_multiplier, stop_multiplier and step_size")
    assert bad == [("modelopt", False, message, f"{m}.weight_scale") for m in
                   ("backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj")]
    assert len(r.checks) == 2 + 9 * 3 and all(c.ok for c in r.checks if c.detail != message)


def test_modelopt_names_the_bytes_that_differ(lightning):
    from fp4kit.export.checkpoint import CheckpointReader
    from fp4kit.verify import against_modelopt

    name = f"{IN_PROJ}.weight"
    w = CheckpointReader(lightning / "ckpt").get(name).clone()
    w.view(torch.uint8)[0, :3] ^= 1
    ckpt = edited(lightning, "flipped-fp8", add={name: w})
    r = VerifyReport("x")
    against_modelopt(r, ckpt, str(lightning / "source"), sample=100)
    assert [(c.name, c.ok, c.detail, c.tensor) for c in r.checks if not c.ok] == [
        ("modelopt", False, f"3 of {w.numel()} bytes differ", name)]
    assert {c.name for c in r.checks} == {"modelopt"}


def test_the_4_6_choice_is_made_in_the_checkpoints_arithmetic():
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(63)) * 0.01).to(torch.bfloat16)
    cpu, cuda = (nvfp4.quantize(w, scale_rule="4o6", arith=a, return_choice=True) for a in ("cpu", "cuda"))
    assert not torch.equal(cpu[1], cuda[1])  # a weight on which the two arithmetics choose differently
    for arith, (qt, chose4) in (("cpu", cpu), ("cuda", cuda)):
        assert four_over_six_from_weight(w, rule(False), qt.block_scale, arith).equal(chose4)
        assert four_over_six_from_weight(w, rule(True), qt.block_scale, arith).equal(chose4)


def test_report_text_lists_a_failure_without_a_tensor_by_its_detail_alone():
    r = VerifyReport("ck")
    r.add("conformance", False, "[bad_json] config.json is not valid JSON")
    r.sections["conformance"] = {"errors": 1, "warnings": 0, "tensors": 0}
    assert r.text().splitlines()[2] == "        [bad_json] config.json is not valid JSON"


def test_only_conformance_lists_passing_checks_as_warnings():
    r = VerifyReport("ck")
    r.add("rederive", True, "[looks like a code] but passed", "a.weight")
    r.add("rederive", False, "1 of 8 bytes differ", "b.weight")
    assert r.text().splitlines()[1:] == ["  FAIL rederive: 1 of 2 tensors differ", "       b.weight 1 of 8 bytes differ"]


def test_mamba_in_proj_with_a_zero_config_field_falls_back_to_n():
    assert _mamba_in_proj("m (FP8)", 10, True, {**NEMOTRON, "n_groups": 0}, 4) == "m (FP8): N=10 does not split into 4 equal parts"
    assert _mamba_in_proj("m (FP8)", 10, True, {**NEMOTRON, "mamba_head_dim": 0}, 4) == "m (FP8): N=10 does not split into 4 equal parts"


def test_mamba_in_proj_with_one_group_unquantized_replicates_b_and_c():
    one = {**NEMOTRON, "n_groups": 1, "ssm_state_size": 3}  # B and C: 3 each, not divisible by 2
    n = 2 * 32 + 2 * 3 + 8
    assert _mamba_in_proj("m (BF16)", n, False, one, 2) is None
    assert _mamba_in_proj("m (FP8)", n, True, one, 2) == (
        f"m (FP8): Mamba in_proj N={n} = z 32 + x 32 + B 3 + C 3 + dt 8, each block split by tp=2: B=3, C=3 not divisible; "
        "the engines need mamba_num_heads (8) and n_groups (1) divisible by tp")
    odd = {**one, "mamba_num_heads": 3, "mamba_head_dim": 1}  # z, x, dt: 3 each
    assert _mamba_in_proj("m (BF16)", 3 + 3 + 6 + 3, False, odd, 2) == (
        "m (BF16): Mamba in_proj N=15 = z 3 + x 3 + B 3 + C 3 + dt 3, each block split by tp=2: z=3, x=3, dt=3 not divisible; "
        "the engines need mamba_num_heads (3) and n_groups (1) divisible by tp (or n_groups == 1)")


def test_tensor_parallel_merges_reasons_by_everything_after_the_module(tmp_path):
    n = 2 * 32 + 2 * 8 + 8  # 88
    t = {
        # the same reason after the module name: one line, whatever the formats
        "backbone.layers.0.mixer.out_proj.weight": bf16(16, 33),
        "backbone.layers.1.mixer.out_proj.weight": torch.zeros(16, 33, dtype=torch.float8_e4m3fn),
        # in_proj reasons that differ after their second colon (the unquantized one may replicate n_groups == 1)
        "backbone.layers.2.mixer.in_proj.weight": bf16(n, 16),
        "backbone.layers.3.mixer.in_proj.weight": torch.zeros(n, 16, dtype=torch.float8_e4m3fn),
        # ... and one that differs between its first and second colon (another N)
        "backbone.layers.4.mixer.in_proj.weight": bf16(n + 8, 16),
    }
    out = tensor_parallel(write_folder(tmp_path / "c", t, NEMOTRON), 4)
    assert out["count"] == 5
    assert [p.split(":", 1)[0] for p in out["problems"]] == [
        "backbone.layers.0.mixer.out_proj (BF16)",
        "backbone.layers.2.mixer.in_proj (BF16)",
        "backbone.layers.3.mixer.in_proj (FP8)",
        "backbone.layers.4.mixer.in_proj (BF16)",
    ]


def test_expected_bytes_with_importance_follow_the_checkpoints_arithmetic():
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(63)) * 0.01).to(torch.bfloat16)
    for arith in ("cpu", "cuda"):
        qt = nvfp4.quantize(w, scale_rule="4o6", arith=arith)
        assert same(_expected_nvfp4(w, rule(True), None, qt.block_scale, arith), qt)


def test_report_add_keeps_an_empty_detail():
    r = VerifyReport("ck")
    r.add("rederive", True)
    assert r.checks == [Check("rederive", True, "", None)]


def _tuples(report) -> list[tuple]:
    return sorted(((c.name, c.ok, c.detail, c.tensor) for c in report.checks), key=str)


def _all_rederived(folder: Path):
    """verify's rederive on a quantized_checkpoint folder: it passes, with one check per tensor that
    is not an activation scale. Returns the report and the checkpoint's tensor names."""
    from fp4kit.export.checkpoint import CheckpointReader

    good = rederived(folder / "ckpt", folder / "source")
    names = CheckpointReader(folder / "ckpt").names()
    assert {(c.name, c.ok, c.detail) for c in good.checks} == {("rederive", True, "")}
    assert sorted(c.tensor for c in good.checks) == sorted(n for n in names if not n.endswith(("k_scale", "v_scale", "input_scale")))
    return good, names


def test_rederive_checks_every_tensor_and_reports_each_hole_in_its_place(lightning):
    good, names = _all_rederived(lightning)
    expert0 = "backbone.layers.1.mixer.experts.0.up_proj"
    drop = (f"{IN_PROJ}.weight_scale", f"{expert0}.weight_scale", f"{O_PROJ}.weight", f"{NORM}.weight")
    ckpt = edited(lightning, "every-hole", drop=drop, add={"extra.weight": torch.zeros(2)})
    gone = {f"{IN_PROJ}.weight", f"{IN_PROJ}.weight_scale", f"{expert0}.weight", f"{expert0}.weight_scale",
            f"{expert0}.weight_scale_2", f"{O_PROJ}.weight", f"{NORM}.weight"}
    want = [t for t in _tuples(good) if t[3] not in gone] + [
        ("rederive", False, "missing ['weight_scale']", IN_PROJ),
        ("rederive", False, "missing ['weight_scale']", expert0),
        ("rederive", False, "missing from the checkpoint", f"{O_PROJ}.weight"),
        ("rederive", False, "missing from the checkpoint", f"{NORM}.weight"),
        ("rederive", False, "not produced by the recorded recipe from the source", "extra.weight"),
    ]
    assert _tuples(rederived(ckpt, lightning / "source")) == sorted(want, key=str)


def edited_source(lightning: Path, tmp_path: Path, edit) -> Path:
    """A copy of the fixture's BF16 source whose tensors `edit` changes in place (a dict)."""
    import shutil

    from safetensors.torch import load_file

    source = tmp_path / "source"
    shutil.copytree(lightning / "source", source)
    tensors = load_file(str(source / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    return source


def test_rederive_compares_the_source_tensors_transformers_drops(lightning, tmp_path):
    mtp = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    source = edited_source(lightning, tmp_path, lambda t: t.update({"mtp.layers.0.fc.weight": mtp, "mtp.layers.0.norm.weight": mtp[0].clone()}))
    good = _tuples(rederived(lightning / "ckpt", lightning / "source"))
    missing = [("rederive", False, "in the source but missing from the checkpoint", f"mtp.layers.0.{n}.weight") for n in ("fc", "norm")]
    assert _tuples(rederived(lightning / "ckpt", source)) == sorted([*good, *missing], key=str)
    for name, value, result in (("with-mtp", mtp, (True, "")), ("other-mtp", mtp + 1, (False, "11 of 16 bytes differ"))):
        ckpt = edited(lightning, name, add={"mtp.layers.0.fc.weight": value})
        assert _tuples(rederived(ckpt, source)) == sorted([*good, ("rederive", *result, "mtp.layers.0.fc.weight"), missing[1]], key=str)


def test_rederive_takes_the_cuda_arithmetic_when_the_checkpoint_names_none(lightning):
    meta = json.loads((lightning / "ckpt" / "fp4kit.json").read_text())
    assert meta["arith"] == "cpu"
    ckpt = edited(lightning, "arith-unnamed", meta=lambda doc: doc.pop("arith"))
    named = edited(lightning, "arith-named-cuda", meta=lambda doc: doc.update(arith="cuda"))
    bad = _tuples(rederived(ckpt, lightning / "source"))
    assert bad == _tuples(rederived(named, lightning / "source")) and not all(ok for _, ok, _, _ in bad)


def test_rederive_of_an_untied_model_reports_its_missing_lm_head_and_skips_a_tied_one(dense, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp4kit.recipe import recipe_from_dict

    ckpt = edited(dense, "no-lm-head", drop=("lm_head.weight",))
    assert [t for t in _tuples(rederived(ckpt, dense / "source")) if not t[1]] == [
        ("rederive", False, "missing from the checkpoint", "lm_head.weight")]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    tied = quantized_checkpoint(tmp_path / "tied", LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), recipe_from_dict(DENSE_RECIPE))
    r = rederived(tied / "ckpt", tied / "source")
    assert r.ok and "lm_head.weight" not in {c.tensor for c in r.checks}
    assert "model.embed_tokens.weight" in {c.tensor for c in r.checks}


def test_rederive_names_the_checkpoints_fp4kit_json_in_a_recipe_error(lightning):
    from fp4kit.recipe import RecipeError
    from fp4kit.verify import rederive

    ckpt = edited(lightning, "bad-recipe", meta=lambda doc: doc["recipe"]["rules"][0].update(bogus=1))
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(ckpt))}/fp4kit.json: rules\[0\]: unknown key"):
        rederive(VerifyReport(str(ckpt)), ckpt, str(lightning / "source"))


def test_rederive_from_a_hub_id_reads_no_source_folder(lightning, monkeypatch):
    import fp4kit.verify as v

    real = v.load_model
    monkeypatch.setattr(v, "load_model", lambda source, **kw: real(str(lightning / "source"), **kw))
    r = VerifyReport("ck")
    v.rederive(r, lightning / "ckpt", "some-org/some-model")
    assert _tuples(r) == _tuples(rederived(lightning / "ckpt", lightning / "source"))


@pytest.fixture(scope="module")
def bf16_experts(tmp_path_factory):
    """The tiny Nemotron-H with its Mamba projections in FP8 and its expert stacks left in BF16."""
    from fp4kit.recipe import recipe_from_dict
    from tiny_models import build_nemotron_h

    recipe = recipe_from_dict({"name": "fp8-mamba", "rules": [{"roles": ["mamba_in_proj", "mamba_out_proj"], "format": "fp8"}]})
    return quantized_checkpoint(tmp_path_factory.mktemp("bf16-experts"), build_nemotron_h(), recipe)


def test_rederive_checks_every_member_of_a_bf16_expert_stack(bf16_experts):
    good, names = _all_rederived(bf16_experts)
    member0 = "backbone.layers.1.mixer.experts.0.up_proj.weight"
    assert member0 in names and "backbone.layers.1.mixer.experts.1.up_proj.weight" in names
    ckpt = edited(bf16_experts, "no-member-0", drop=(member0,))
    want = [t for t in _tuples(good) if t[3] != member0] + [("rederive", False, "missing from the checkpoint", member0)]
    assert _tuples(rederived(ckpt, bf16_experts / "source")) == sorted(want, key=str)


def test_rederive_names_a_stack_member_it_cannot_quantize_and_checks_the_rest(lightning, tmp_path):
    expert0 = "backbone.layers.1.mixer.experts.0.up_proj"

    def nan_in_expert0(tensors):
        tensors[f"{expert0}.weight"] = tensors[f"{expert0}.weight"].clone()
        tensors[f"{expert0}.weight"][0, 0] = float("nan")

    source = edited_source(lightning, tmp_path, nan_in_expert0)
    good = _tuples(rederived(lightning / "ckpt", lightning / "source"))
    got = _tuples(rederived(lightning / "ckpt", source))
    failed = [t for t in got if not t[1]]
    assert len(failed) == 1 and failed[0][3] == f"{expert0}.weight_scale" and "NaN" in failed[0][2]
    assert [t for t in got if t[1]] == [t for t in good if not t[3].startswith(expert0 + ".")]
