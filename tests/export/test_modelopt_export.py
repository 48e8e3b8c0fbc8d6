"""The ModelOpt-format exporter, line by line: both config files in full, BF16 expert stacks, tied
and shared storage, carried source tensors, the source config.json's rewrites, fp4kit.json, the
progress bar and the tokenizer. The rules a mutation run showed no other test pinning."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import fp4kit
from fp4kit.export import modelopt
from fp4kit.export.modelopt import export_checkpoint, quant_configs, unloaded_source_tensors
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe, recipe_from_dict

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parents[1] / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

SAMPLES = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
PRODUCER = {"name": "fp4kit", "version": fp4kit.__version__}
MAMBA_FP8 = {"name": "mamba-fp8", "rules": [{"roles": ["mamba_in_proj", "mamba_out_proj"], "format": "fp8"}]}
TOKENIZER = Path(fp4kit.__file__).parent / "data" / "tiny-nemotron-h"


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def mamba_fp8():
    """Nemotron-H with only the Mamba projections in FP8: one format, every expert stack BF16."""
    model = models.build_nemotron_h()
    return quantize(model, recipe_from_dict(MAMBA_FP8), SAMPLES, progress=False)


# --- the two config files ---

def test_a_single_format_config_in_full():
    qm = quantize(models.build_llama(), load_recipe("nvfp4-w4a16"), SAMPLES, progress=False)
    nested, flat = quant_configs(qm)
    assert nested == {"producer": PRODUCER, "quantization": {
        "quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"], "kv_cache_quant_algo": None}}
    assert flat == {"quant_method": "modelopt", "producer": PRODUCER, "quant_algo": "W4A16_NVFP4",
                    "group_size": 16, "ignore": ["lm_head"]}


def test_an_fp8_config_has_no_group_size_and_states_the_kv_scheme():
    qm = quantize(models.build_llama(), load_recipe("fp8"), SAMPLES, progress=False)
    nested, flat = quant_configs(qm)
    assert nested == {"producer": PRODUCER, "quantization": {
        "quant_algo": "FP8", "exclude_modules": ["lm_head"], "kv_cache_quant_algo": "FP8"}}
    assert flat == {"quant_method": "modelopt", "producer": PRODUCER, "quant_algo": "FP8", "ignore": ["lm_head"],
                    "kv_cache_quant_algo": "FP8", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}


def test_the_recipe_decides_the_kv_cache_entry_even_without_attention():
    model = models.build_nemotron_h(hybrid_override_pattern="ME")
    qm = quantize(model, recipe_from_dict({**MAMBA_FP8, "kv_cache": "fp8"}), SAMPLES, progress=False)
    assert qm.kv_scales == {}
    nested, flat = quant_configs(qm)
    assert nested["quantization"]["kv_cache_quant_algo"] == "FP8" == flat["kv_cache_quant_algo"]


def test_a_recipe_that_quantized_nothing_is_named():
    recipe = recipe_from_dict({"name": "experts-only", "rules": [{"roles": ["routed_experts"], "format": "nvfp4_w4a16"}]})
    qm = quantize(models.build_llama(), recipe, SAMPLES, progress=False)
    with pytest.raises(ValueError) as err:
        quant_configs(qm)
    assert str(err.value) == "recipe 'experts-only' quantized no weight of this model"


# --- BF16 expert stacks, carried tensors, tied and shared storage ---

def test_a_bf16_expert_stack_is_excluded_whole_and_written_per_expert(mamba_fp8, tmp_path):
    nested, flat = quant_configs(mamba_fp8)
    excluded = nested["quantization"]["exclude_modules"]
    assert excluded == flat["ignore"]
    assert "backbone.layers.1.mixer.experts" in excluded and "backbone.layers.3.mixer.experts" in excluded
    assert not any(".experts." in name for name in excluded)
    tensors = read_all(export_checkpoint(mamba_fp8, tmp_path / "ckpt", progress=False))
    stack = mamba_fp8.model.model.layers[1].mixer.experts.up_proj.detach()
    for e in range(stack.shape[0]):
        assert torch.equal(tensors[f"backbone.layers.1.mixer.experts.{e}.up_proj.weight"], stack[e])
    assert not any(k.startswith("backbone.layers.1.mixer.experts.up_proj") for k in tensors)


def test_carried_source_tensors_are_excluded_and_the_source_config_is_the_base(tmp_path):
    from safetensors.torch import load_file, save_file

    from fp4kit.quantize import load_model

    src = tmp_path / "src"
    models.build_nemotron_h().save_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    mtp = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tensors["mtp.layers.0.mixer.q_proj.weight"] = mtp
    tensors["mtp.layers.0.norm.bias"] = mtp[0].clone()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(str(src), device="cpu", tokenizer=False)
    config = json.loads((src / "config.json").read_text())
    config["source_only_key"] = 7  # not in the loaded model's config
    (src / "config.json").write_text(json.dumps(config))
    qm = quantize(model, recipe_from_dict(MAMBA_FP8), SAMPLES, progress=False)
    out = export_checkpoint(qm, tmp_path / "ckpt", source_dir=src, progress=False)
    nested = json.loads((out / "hf_quant_config.json").read_text())
    assert "mtp.layers.0.mixer.q_proj" in nested["quantization"]["exclude_modules"]
    assert not any(n.startswith("mtp.layers.0.norm") for n in nested["quantization"]["exclude_modules"])
    assert torch.equal(read_all(out)["mtp.layers.0.mixer.q_proj.weight"], mtp)
    written = json.loads((out / "config.json").read_text())
    assert written["source_only_key"] == 7 and written["quantization_config"]["ignore"] == nested["quantization"]["exclude_modules"]


def test_tied_embeddings_are_stored_once(tmp_path):
    qm = quantize(tied_llama(), load_recipe("nvfp4-w4a16"), SAMPLES, progress=False)
    tensors = read_all(export_checkpoint(qm, tmp_path / "ckpt", progress=False))
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    assert "model.norm.weight" in tensors


@pytest.mark.parametrize("declared", [True, False], ids=["untied", "undeclared"])
def test_shared_storage_is_written_twice_unless_the_config_ties_it(declared, tmp_path):
    from transformers import PreTrainedConfig

    model = models.build_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # one storage, the config says untied
    qm = quantize(model, load_recipe("nvfp4-w4a16"), SAMPLES, progress=False)
    if not declared:  # a config class without the key at all, as transformers' base config is
        qm.model.config = PreTrainedConfig()
        assert not hasattr(qm.model.config, "tie_word_embeddings")
    tensors = read_all(export_checkpoint(qm, tmp_path / "ckpt", progress=False))
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_empty_tensors_are_never_taken_for_tied_copies(tmp_path):
    model = tied_llama()
    model.model.register_buffer("first_empty", torch.zeros(0))
    model.model.register_buffer("second_empty", torch.zeros(0, 3))
    qm = quantize(model, load_recipe("nvfp4-w4a16"), SAMPLES, progress=False)
    tensors = read_all(export_checkpoint(qm, tmp_path / "ckpt", progress=False))
    assert tensors["model.first_empty"].shape == (0,) and tensors["model.second_empty"].shape == (0, 3)


# --- the source config.json's rewrites ---

def source_config_of(config, source: dict | None, tmp_path, model_name="NemotronHForCausalLM"):
    """`_source_config` for a model whose config object is `config`, the source folder holding
    `source` as its config.json."""
    model = type(model_name, (), {"config": config})()
    src = None
    if source is not None:
        src = tmp_path / "src"
        src.mkdir(exist_ok=True)
        (src / "config.json").write_text(json.dumps(source))
    return modelopt._source_config(SimpleNamespace(model=model), src)


BLOCKS = ["linear_attention", "moe", "full_attention", "moe"]


def test_nemotron_h_configs_get_pattern_strings_and_mamba_n_groups(tmp_path):
    config = models.nemotron_h_config()
    source = {**config.to_dict(), "quantization_config": {"quant_method": "stale"}, "architectures": ["Kept"]}
    out = source_config_of(config, source, tmp_path)
    assert "quantization_config" not in out and out["architectures"] == ["Kept"]
    assert out["hybrid_override_pattern"] == "ME*E" and "layers_block_type" not in out
    assert out["mtp_hybrid_override_pattern"] == "*E" and "mtp_layers_block_type" not in out
    assert out["n_groups"] == 2 and out["mamba_n_groups"] == 2


def test_the_source_file_decides_n_groups_and_the_model_fills_what_it_lacks(tmp_path):
    config = models.nemotron_h_config()
    assert source_config_of(config, {"n_groups": 4}, tmp_path)["mamba_n_groups"] == 4
    out = source_config_of(config, {"model_type": "nemotron_h"}, tmp_path)
    assert out["mamba_n_groups"] == 2 and out["architectures"] == ["NemotronHForCausalLM"]
    assert out["hybrid_override_pattern"] == "ME*E" and out["mtp_hybrid_override_pattern"] == "*E"


def test_a_config_without_pattern_strings_keeps_its_block_lists(tmp_path):
    # A config object whose pattern attribute is None keeps the list the source file has; one
    # without the attribute at all writes nothing for it.
    config = SimpleNamespace(model_type="nemotron_h", hybrid_override_pattern=None, mtp_hybrid_override_pattern="*E")
    out = source_config_of(config, {"layers_block_type": BLOCKS}, tmp_path)
    assert out == {"layers_block_type": BLOCKS, "mtp_hybrid_override_pattern": "*E", "architectures": ["NemotronHForCausalLM"]}
    bare = SimpleNamespace(model_type="nemotron_h")
    assert source_config_of(bare, {"architectures": ["A"]}, tmp_path) == {"architectures": ["A"]}


def test_other_models_configs_are_copied(tmp_path):
    config = SimpleNamespace(n_groups=3)  # no model_type: not Nemotron-H
    out = source_config_of(config, {"layers_block_type": BLOCKS}, tmp_path, model_name="OtherForCausalLM")
    assert out == {"layers_block_type": BLOCKS, "architectures": ["OtherForCausalLM"]}


def test_unloaded_source_tensors_needs_patterns_and_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert unloaded_source_tensors(torch.nn.Linear(2, 2), tmp_path) == []  # no such attribute
    assert unloaded_source_tensors(models.build_nemotron_h(), tmp_path) == []  # no tensor files


# --- what export_checkpoint writes besides the tensors ---

def test_metadata_tokenizer_timing_and_progress(mamba_fp8, tmp_path, capfd):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    capfd.readouterr()
    t0 = time.perf_counter()
    out = export_checkpoint(mamba_fp8, tmp_path / "ckpt", tokenizer=tokenizer, card_extra={"source": "org/base"})
    elapsed = time.perf_counter() - t0
    assert 0 < mamba_fp8.timings["export"] <= elapsed
    meta = json.loads((out / "fp4kit.json").read_text())
    assert meta == {"producer": PRODUCER, "recipe": mamba_fp8.recipe.to_dict(), "calibration": mamba_fp8.calibration,
                    "arith": mamba_fp8.arith, "source": "org/base"}
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    n = len(mamba_fp8.model.state_dict())
    err = capfd.readouterr().err
    assert "export: 100%" in err and f"| {n}/{n} [" in err and "tensor/s]" in err  # one tick per tensor


def test_no_progress_bar_when_asked(mamba_fp8, tmp_path, capfd):
    capfd.readouterr()
    export_checkpoint(mamba_fp8, tmp_path / "ckpt", progress=False)
    assert "export" not in capfd.readouterr().err


def test_a_model_without_a_generation_config_writes_none(mamba_fp8, tmp_path, monkeypatch):
    monkeypatch.delattr(mamba_fp8.model, "generation_config")
    out = export_checkpoint(mamba_fp8, tmp_path / "ckpt", progress=False)
    assert not (out / "generation_config.json").exists() and (out / "config.json").is_file()


def test_the_progress_bar_of_a_tied_model_reaches_its_total(tmp_path, capfd):
    qm = quantize(tied_llama(), load_recipe("nvfp4-w4a16"), SAMPLES, progress=False)
    n = len(qm.model.state_dict())
    capfd.readouterr()
    export_checkpoint(qm, tmp_path / "ckpt")
    assert f"| {n}/{n} [" in capfd.readouterr().err
