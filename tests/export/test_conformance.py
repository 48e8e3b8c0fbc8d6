"""check_checkpoint on small synthetic Nemotron-H-like checkpoints: a conformant one, then one defect each."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp4kit.export.conformance import (
    MAX_HEADER_BYTES,
    check_checkpoint,
    read_safetensors_header,
    sglang_excluded,
    sglang_mixed_algo,
    vllm_excluded,
    vllm_mixed_algo,
)

H = 32  # hidden size
I = 32  # expert width
E = 4  # routed experts
V = 64  # vocab
HEADS, HEAD_DIM, STATE, GROUPS = 4, 16, 8, 2
INNER = HEADS * HEAD_DIM
IN_PROJ = 2 * INNER + 2 * GROUPS * STATE + HEADS
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
EXPERT0_SCALE = "backbone.layers.1.mixer.experts.0.up_proj.weight_scale"


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _nvfp4(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
        "weight_scale": (torch.rand(n, k // 16, generator=g) * 4 + 0.5).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(0.01 + seed * 1e-4),
    }


def _fp8(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": (torch.rand(n, k, generator=g) * 2 - 1).to(torch.float8_e4m3fn),
        "weight_scale": torch.tensor(0.02),
        "input_scale": torch.tensor(0.05),
    }


def make_tensors() -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {"backbone.embeddings.weight": _bf16(V, H), "backbone.norm_f.weight": _bf16(H)}
    t["lm_head.weight"] = _bf16(V, H, seed=1)
    for i in range(3):
        t[f"backbone.layers.{i}.norm.weight"] = _bf16(H, seed=i)
    a = "backbone.layers.0.mixer"  # attention, BF16 weights, FP8 KV cache
    for name, n in (("q_proj", H), ("k_proj", H // 2), ("v_proj", H // 2), ("o_proj", H)):
        t[f"{a}.{name}.weight"] = _bf16(n, H, seed=len(t))
    t[f"{a}.k_proj.k_scale"] = torch.tensor(0.1)
    t[f"{a}.v_proj.v_scale"] = torch.tensor(0.2)
    m = "backbone.layers.1.mixer"  # MoE, routed experts W4A16 NVFP4
    for e in range(E):
        for proj, (n, k) in (("up_proj", (I, H)), ("down_proj", (H, I))):
            for leaf, value in _nvfp4(n, k, seed=10 * e + len(proj)).items():
                t[f"{m}.experts.{e}.{proj}.{leaf}"] = value
    t[f"{m}.shared_experts.up_proj.weight"] = _bf16(2 * I, H, seed=3)
    t[f"{m}.shared_experts.down_proj.weight"] = _bf16(H, 2 * I, seed=4)
    t[f"{m}.gate.weight"] = torch.randn(E, H)
    t[f"{m}.gate.e_score_correction_bias"] = torch.zeros(E)
    s = "backbone.layers.2.mixer"  # Mamba, FP8 in_proj / out_proj
    for leaf, value in _fp8(IN_PROJ, H, seed=5).items():
        t[f"{s}.in_proj.{leaf}"] = value
    for leaf, value in _fp8(H, INNER, seed=6).items():
        t[f"{s}.out_proj.{leaf}"] = value
    t[f"{s}.conv1d.weight"] = _bf16(INNER + 2 * GROUPS * STATE, 1, 4)
    t[f"{s}.conv1d.bias"] = _bf16(INNER + 2 * GROUPS * STATE)
    t[f"{s}.A_log"] = torch.zeros(HEADS)
    t[f"{s}.D"] = torch.ones(HEADS)
    t[f"{s}.dt_bias"] = torch.zeros(HEADS)
    t[f"{s}.norm.weight"] = _bf16(INNER)
    return t


def make_quantized_layers() -> dict[str, dict]:
    layers = {}
    for e in range(E):
        for proj in ("up_proj", "down_proj"):
            layers[f"backbone.layers.1.mixer.experts.{e}.{proj}"] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    for proj in ("in_proj", "out_proj"):
        layers[f"backbone.layers.2.mixer.{proj}"] = {"quant_algo": "FP8"}
    return layers


def make_configs() -> tuple[dict, dict]:
    producer = {"name": "fp4kit", "version": "0.1.0"}
    layers = make_quantized_layers()
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "*EM",
        "num_hidden_layers": 3,
        "hidden_size": H,
        "n_routed_experts": E,
        "n_groups": 1,
        "mamba_n_groups": 1,
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8",
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "producer": producer,
            "ignore": [],
            "quantized_layers": layers,
        },
    }
    hf_quant = {
        "producer": producer,
        "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": json.loads(json.dumps(layers))},
    }
    return config, hf_quant


def write_checkpoint(root: Path, tensors: dict, config: dict, hf_quant: dict, *, index_extra: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    parts: tuple[dict, dict] = ({}, {})
    for name, value in tensors.items():
        parts[0 if ".layers.0." in name or ".layers.1." in name else 1][name] = value.contiguous()
    weight_map = {}
    for shard, part in zip(SHARDS, parts):
        save_file(part, str(root / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in part})
    weight_map.update(index_extra or {})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    config, hf_quant = make_configs()
    return write_checkpoint(tmp_path / "ckpt", make_tensors(), config, hf_quant)


def test_conformant_checkpoint_passes(checkpoint):
    report = check_checkpoint(checkpoint)
    assert report.errors == [], report.errors
    assert report.warnings == [], report.warnings
    assert report.ok
    d = report.to_dict()
    assert d["ok"] is True and d["errors"] == 0 and d["findings"] == []


def test_layers_block_type_in_sglang_names_passes(tmp_path):
    config, hf_quant = make_configs()
    config["layers_block_type"] = ["attention", "moe", "mamba"]
    assert check_checkpoint(write_checkpoint(tmp_path / "c", make_tensors(), config, hf_quant)).findings == []


def test_conformant_single_algo_checkpoint_passes(tmp_path):
    """W4A16_NVFP4 everywhere that is quantized, BF16 elsewhere excluded by name."""
    tensors = make_tensors()
    for proj, (n, k) in (("in_proj", (IN_PROJ, H)), ("out_proj", (H, INNER))):
        for leaf in ("weight", "weight_scale", "input_scale"):
            del tensors[f"backbone.layers.2.mixer.{proj}.{leaf}"]
        tensors[f"backbone.layers.2.mixer.{proj}.weight"] = _bf16(n, k)
    ignore = [
        "lm_head",
        "backbone.layers.0.mixer.q_proj",
        "backbone.layers.0.mixer.k_proj",
        "backbone.layers.0.mixer.v_proj",
        "backbone.layers.0.mixer.o_proj",
        "backbone.layers.1.mixer.shared_experts*",
        "backbone.layers.2.mixer.in_proj",
        "backbone.layers.2.mixer.out_proj",
        "backbone.layers.2.mixer.conv1d",
    ]
    config, _ = make_configs()
    q = config["quantization_config"]
    del q["quantized_layers"]
    q.update(quant_algo="W4A16_NVFP4", group_size=16, ignore=ignore)
    hf_quant = {
        "producer": q["producer"],
        "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": ignore},
    }
    report = check_checkpoint(write_checkpoint(tmp_path / "single", tensors, config, hf_quant))
    assert report.errors == [], report.errors


# --- one defect per case: (edit tensors, edit config, edit hf_quant, edit files) -> (code, key) ---


def _set(tensors, name, value):
    tensors[name] = value


def _nan_byte(tensors):
    raw = tensors[EXPERT0_SCALE].view(torch.uint8).clone()
    raw[3, 1] = 0x7F
    tensors[EXPERT0_SCALE] = raw.view(torch.float8_e4m3fn)


def _both(edit):
    """Apply the same edit to config.json's flat section and hf_quant_config.json's nested one."""

    def config_edit(config):
        edit(config["quantization_config"])

    def hf_edit(hf_quant):
        edit(hf_quant["quantization"])

    return config_edit, hf_edit


def _ignore(entry):
    def edit(section):
        section["ignore" if "quant_method" in section else "exclude_modules"] = [entry]

    return _both(edit)


def _truncate(nbytes):
    def edit(root):
        path = root / SHARDS[1]
        data = path.read_bytes()
        path.write_bytes(data[:nbytes] if nbytes >= 0 else data[:nbytes])

    return edit


def _huge_header(root):
    path = root / SHARDS[0]
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    path.write_bytes(bytes(data))


JUNK = "backbone.layers.2.mixer.in_proj.\u0000backbone.pt_name_sentinel"
DEFECTS = {
    "wrong_dtype": dict(
        tensors=lambda t: _set(t, EXPERT0_SCALE, t[EXPERT0_SCALE].float()),
        expect=("wrong_dtype", EXPERT0_SCALE),
    ),
    "wrong_shape": dict(
        tensors=lambda t: _set(
            t,
            "backbone.layers.1.mixer.experts.2.down_proj.weight_scale",
            torch.ones(H, 3).to(torch.float8_e4m3fn),
        ),
        expect=("wrong_shape", "backbone.layers.1.mixer.experts.2.down_proj.weight_scale"),
    ),
    "nan_scale_byte": dict(tensors=_nan_byte, expect=("nan_scale", EXPERT0_SCALE)),
    "zero_global_scale": dict(
        tensors=lambda t: _set(t, "backbone.layers.1.mixer.experts.3.down_proj.weight_scale_2", torch.tensor(0.0)),
        expect=("nonpositive_scale", "backbone.layers.1.mixer.experts.3.down_proj.weight_scale_2"),
    ),
    "zero_fp8_input_scale": dict(
        tensors=lambda t: _set(t, "backbone.layers.2.mixer.in_proj.input_scale", torch.tensor(0.0)),
        expect=("nonpositive_scale", "backbone.layers.2.mixer.in_proj.input_scale"),
    ),
    "fp8_without_input_scale": dict(
        tensors=lambda t: t.pop("backbone.layers.2.mixer.out_proj.input_scale"),
        expect=("missing_tensor", "backbone.layers.2.mixer.out_proj.input_scale"),
    ),
    "kv_scale_under_dropped_name": dict(
        tensors=lambda t: _set(t, "backbone.layers.0.mixer.qkv_proj.k_scale", t.pop("backbone.layers.0.mixer.k_proj.k_scale")),
        expect=("kv_scale_dropped", "backbone.layers.0.mixer.qkv_proj.k_scale"),
    ),
    "missing_shard": dict(files=lambda root: (root / SHARDS[1]).unlink(), expect=("missing_shard", SHARDS[1])),
    "tensor_in_index_not_in_shard": dict(
        index_extra={"backbone.layers.2.mixer.ghost": SHARDS[1]},
        expect=("index_tensor_missing", "backbone.layers.2.mixer.ghost"),
    ),
    "junk_ignore_name": dict(config_pair=_ignore(JUNK), expect=("junk_module_name", "pt_name_sentinel")),
    "ignore_matching_nothing": dict(
        config_pair=_ignore("backbone.layers.7.mixer.in_proj"),
        expect=("pattern_matches_nothing", "backbone.layers.7.mixer.in_proj"),
    ),
    "partially_excluded_moe": dict(
        config_pair=_ignore("backbone.layers.1.mixer.experts.2.*"),
        expect=("partial_moe_exclusion", "backbone.layers.1.mixer.experts.2.*"),
    ),
    "moe_layer_with_mixed_declarations": dict(
        config_pair=_both(lambda s: s["quantized_layers"].__setitem__("backbone.layers.1.mixer.experts.3.up_proj", {"quant_algo": "NVFP4", "group_size": 16})),
        expect=("mixed_moe_layer", "backbone.layers.1.mixer.experts"),
    ),
    "config_json_vs_hf_quant_config": dict(
        hf_quant=lambda h: h["quantization"].__setitem__("quant_algo", "NVFP4"),
        expect=("config_mismatch", "quant_algo"),
    ),
    "kv_declared_in_one_file_only": dict(
        hf_quant=lambda h: h["quantization"].pop("kv_cache_quant_algo"),
        expect=("config_mismatch", "kv_cache_scheme"),
    ),
    "unknown_quant_algo": dict(
        config_pair=_both(lambda s: s.__setitem__("quant_algo", "NVFP5")),
        expect=("unknown_quant_algo", "config.json:quantization_config.quant_algo"),
    ),
    "truncated_safetensors_data": dict(files=_truncate(-3), expect=("offset_past_eof", "backbone.")),
    "truncated_safetensors_header": dict(files=_truncate(5), expect=("truncated_file", SHARDS[1])),
    "header_claiming_huge_size": dict(files=_huge_header, expect=("header_too_large", SHARDS[0])),
    "missing_hybrid_override_pattern": dict(
        config=lambda c: c.pop("hybrid_override_pattern"),
        expect=("missing_key", "config.json:hybrid_override_pattern"),
    ),
    "mamba_n_groups_missing": dict(
        config=lambda c: c.pop("mamba_n_groups"),
        expect=("missing_key", "config.json:mamba_n_groups"),
    ),
    "mamba_n_groups_differs": dict(
        config=lambda c: c.__setitem__("mamba_n_groups", 8),
        expect=("config_mismatch", "config.json:mamba_n_groups"),
    ),
    "layers_block_type_in_transformers_names": dict(
        config=lambda c: c.__setitem__("layers_block_type", ["full_attention", "moe", "linear_attention"]),
        expect=("bad_value", "config.json:layers_block_type"),
    ),
    "layers_block_type_disagrees_with_pattern": dict(
        config=lambda c: c.__setitem__("layers_block_type", ["attention", "mamba", "moe"]),
        expect=("config_mismatch", "config.json:layers_block_type"),
    ),
    "pattern_disagrees_with_tensors": dict(
        config=lambda c: c.__setitem__("hybrid_override_pattern", "*ME"),
        expect=("layer_type_mismatch", "backbone.layers.1"),
    ),
    "quantized_module_not_declared": dict(
        config_pair=_both(lambda s: s["quantized_layers"].pop("backbone.layers.2.mixer.out_proj")),
        expect=("not_declared", "backbone.layers.2.mixer.out_proj"),
    ),
}


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_defect_is_an_error_naming_the_tensor_or_key(tmp_path, name):
    d = DEFECTS[name]
    tensors = make_tensors()
    config, hf_quant = make_configs()
    if "tensors" in d:
        d["tensors"](tensors)
    if "config" in d:
        d["config"](config)
    if "hf_quant" in d:
        d["hf_quant"](hf_quant)
    if "config_pair" in d:
        d["config_pair"][0](config)
        d["config_pair"][1](hf_quant)
    root = write_checkpoint(tmp_path / "ckpt", tensors, config, hf_quant, index_extra=d.get("index_extra"))
    if "files" in d:
        d["files"](root)

    report = check_checkpoint(root)

    code, key = d["expect"]
    assert not report.ok
    hits = [f for f in report.errors if f.code == code and f.tensor_or_key is not None and key in f.tensor_or_key]
    assert hits, [(f.code, f.tensor_or_key, f.message) for f in report.findings]


def test_kv_scales_absent_is_only_a_warning(tmp_path):
    tensors = make_tensors()
    del tensors["backbone.layers.0.mixer.k_proj.k_scale"], tensors["backbone.layers.0.mixer.v_proj.v_scale"]
    report = check_checkpoint(write_checkpoint(tmp_path / "c", tensors, *make_configs()))
    assert report.ok
    assert [(f.code, f.tensor_or_key) for f in report.warnings] == [("kv_scales_absent", "backbone.layers.0.mixer")]


def test_missing_side_files_are_warnings(checkpoint):
    (checkpoint / "generation_config.json").unlink()
    (checkpoint / "tokenizer_config.json").unlink()
    report = check_checkpoint(checkpoint)
    assert report.ok
    assert sorted(f.tensor_or_key for f in report.warnings) == ["generation_config.json", "tokenizer"]


def test_model_type_argument_overrides_config(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["hybrid_override_pattern"]
    config["model_type"] = "something_else"
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert check_checkpoint(checkpoint).ok
    assert not check_checkpoint(checkpoint, model_type="nemotron_h").ok


def test_tensor_in_two_shards_is_an_error(tmp_path):
    tensors = make_tensors()
    root = write_checkpoint(tmp_path / "c", tensors, *make_configs())
    extra = {"backbone.norm_f.weight": tensors["backbone.norm_f.weight"], "backbone.layers.0.norm.weight": tensors["backbone.layers.0.norm.weight"]}
    second = {name: t for name, t in tensors.items() if ".layers.0." not in name and ".layers.1." not in name}
    second.update(extra)
    save_file(second, str(root / SHARDS[1]))
    report = check_checkpoint(root)
    assert any(f.code == "duplicate_tensor" and f.tensor_or_key == "backbone.layers.0.norm.weight" for f in report.errors)


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_header_parser_rejects_byte_count_mismatch_and_keeps_good_entries(tmp_path):
    path = _raw_safetensors(
        tmp_path / "x.safetensors",
        {
            "good": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "short": {"dtype": "F32", "shape": [3], "data_offsets": [8, 16]},
            "odd": {"dtype": "Q4", "shape": [1], "data_offsets": [16, 17]},
        },
        bytes(17),
    )
    tensors, problems = read_safetensors_header(path)
    assert list(tensors) == ["good"] and tensors["good"].shape == (2,)
    assert sorted((code, name) for code, name, _ in problems) == [("byte_count_mismatch", "short"), ("unknown_dtype", "odd")]


def test_header_parser_limits(tmp_path):
    from fp4kit.export import conformance

    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(conformance._HeaderError, match="header claims"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(conformance._HeaderError, match="not a JSON object"):
        read_safetensors_header(path)


def test_engine_exclusion_rules():
    # vLLM: plain substring -- "model.layers.1" also excludes layers 10..19; SGLang matches on dots.
    assert vllm_excluded("model.layers.12.mixer.in_proj", ["model.layers.1"])
    assert not sglang_excluded("model.layers.12.mixer.in_proj", ["model.layers.1"])
    assert sglang_excluded("model.layers.1.mixer.in_proj", ["model.layers.1"])
    # One expert entry excludes the whole MoE layer in vLLM, and nothing in SGLang.
    experts = "model.layers.1.mixer.experts"
    assert vllm_excluded(experts, ["model.layers.1.mixer.experts.3.up_proj"])
    assert not sglang_excluded(experts, ["model.layers.1.mixer.experts.3.up_proj"])
    assert sglang_excluded(experts, ["model.layers.1.mixer.experts"])
    # Fused q/k/v: all shards or none.
    qkv = ("q_proj", "k_proj", "v_proj")
    names = ["model.layers.0.mixer.q_proj", "model.layers.0.mixer.k_proj", "model.layers.0.mixer.v_proj"]
    assert vllm_excluded("model.layers.0.mixer.qkv_proj", names, qkv)
    assert sglang_excluded("model.layers.0.mixer.qkv_proj", names, qkv)
    for rule in (vllm_excluded, sglang_excluded):
        with pytest.raises(ValueError, match="some but not all"):
            rule("model.layers.0.mixer.qkv_proj", names[:1], qkv)


def test_engine_mixed_lookup_first_entry_decides_a_moe_layer():
    layers = {"model.layers.1.mixer.experts.0.up_proj": "NVFP4", "model.layers.1.mixer.experts.1.up_proj": "FP8"}
    assert vllm_mixed_algo("model.layers.1.mixer.experts", layers) == "NVFP4"
    assert sglang_mixed_algo("model.layers.1.mixer.experts", layers) == "NVFP4"
    # vLLM falls back to any entry under the mixer; SGLang does not.
    shared = {"model.layers.1.mixer.shared_experts.up_proj": "FP8"}
    assert vllm_mixed_algo("model.layers.1.mixer.experts", shared) == "FP8"
    assert sglang_mixed_algo("model.layers.1.mixer.experts", shared) is None


def test_bf16_routed_experts_next_to_quantized_shared_experts_is_an_error(tmp_path):
    """vLLM would give the BF16 routed experts the shared experts' algo."""
    tensors = make_tensors()
    layers = make_quantized_layers()
    for e in range(E):
        for proj, (n, k) in (("up_proj", (I, H)), ("down_proj", (H, I))):
            m = f"backbone.layers.1.mixer.experts.{e}.{proj}"
            for leaf in ("weight", "weight_scale", "weight_scale_2"):
                del tensors[f"{m}.{leaf}"]
            tensors[f"{m}.weight"] = _bf16(n, k)
            del layers[m]
    for proj, (n, k) in (("up_proj", (2 * I, H)), ("down_proj", (H, 2 * I))):
        m = f"backbone.layers.1.mixer.shared_experts.{proj}"
        tensors.update({f"{m}.{leaf}": v for leaf, v in _nvfp4(n, k, seed=7).items()})
        layers[m] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    config, hf_quant = make_configs()
    config["quantization_config"]["quantized_layers"] = layers
    hf_quant["quantization"]["quantized_layers"] = layers
    report = check_checkpoint(write_checkpoint(tmp_path / "c", tensors, config, hf_quant))
    assert [(f.code, f.message.split()[0]) for f in report.errors] == [("not_excluded", "vLLM")]
