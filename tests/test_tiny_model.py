"""The bundled tiny Nemotron-H: shape, quantizability and that it is the trained checkpoint."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import fp4kit
from fp4kit.models.tiny import (
    DOC_SEPARATOR,
    SPLITS,
    corpus_documents,
    corpus_path,
    heldout_slice,
    load_tiny_model,
    tiny_model_path,
)

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tiny-model.json"
NVFP4_BLOCK = 16


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    return load_tiny_model()


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RESULTS.read_text())


def test_shipped_inside_the_package():
    path = tiny_model_path()
    assert path.is_relative_to(pathlib.Path(fp4kit.__file__).parent)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".py")) for n in names)  # safetensors only, no code
    assert sum(p.stat().st_size for p in path.iterdir()) <= 32 * 2**20


def test_config_json_carries_the_pattern(loaded):
    model, _ = loaded
    config = json.loads((tiny_model_path() / "config.json").read_text())
    assert config["model_type"] == "nemotron_h"
    assert config["hybrid_override_pattern"] == model.config.hybrid_override_pattern


def test_hybrid_moe_config(loaded):
    model, _ = loaded
    cfg = model.config
    assert {"M", "E", "*"} <= set(cfg.hybrid_override_pattern)
    assert cfg.n_routed_experts >= 16 and cfg.num_experts_per_tok >= 2
    assert cfg.n_shared_experts >= 1 and cfg.moe_shared_expert_intermediate_size > 0
    assert cfg.mlp_hidden_act == "relu2"
    assert cfg.n_groups >= 2
    assert sum(p.numel() for p in model.parameters()) <= 16_000_000
    moe = [layer.mixer for layer in model.model.layers if hasattr(layer.mixer, "experts")]
    assert len(moe) == cfg.hybrid_override_pattern.count("E")
    assert all(hasattr(m, "shared_experts") for m in moe)


def test_every_quantized_dim_is_a_multiple_of_the_block(loaded):
    model, _ = loaded
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes[name] = tuple(module.weight.shape)
        elif name.endswith("mixer.experts"):
            shapes[name + ".up_proj"] = tuple(module.up_proj.shape[-2:])
            shapes[name + ".down_proj"] = tuple(module.down_proj.shape[-2:])
    assert any(".in_proj" in n for n in shapes) and any(".experts." in n for n in shapes)
    assert "lm_head" in shapes and any(n.endswith("q_proj") for n in shapes)
    bad = {n: s for n, s in shapes.items() if any(d % NVFP4_BLOCK for d in s)}
    assert not bad


def test_corpus_splits_are_disjoint_plays():
    titles = {}
    for split in SPLITS:
        docs = corpus_documents(split)
        assert docs and all(doc.strip() and "\f" not in doc for doc in docs)
        assert corpus_path(split).read_text().count(DOC_SEPARATOR) == len(docs) - 1
        titles[split] = {doc.split("\n", 1)[0] for doc in docs}
    assert not titles["eval"] & (titles["train"] | titles["calibration"])
    assert not titles["train"] & titles["calibration"]


def test_it_is_the_trained_model(loaded, recorded):
    model, tokenizer = loaded
    ids = heldout_slice(tokenizer)
    assert list(ids.shape) == [recorded["heldout_slice"]["rows"], recorded["heldout_slice"]["seq_len"]]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss <= recorded["heldout_slice"]["loss"] * 1.05
    assert loss < 0.75 * recorded["heldout_slice"]["unigram_loss"]


def test_greedy_generation_is_text(loaded):
    model, tokenizer = loaded
    enc = tokenizer("ROMEO.\n", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert new.strip()
