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



def _rewrite_header(shard, change):
    """Edit one shard's safetensors header (JSON) in place, keeping the data bytes."""

    def edit(root):
        path = root / shard
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = change(json.loads(raw[8 : 8 + n]))
        new = header if isinstance(header, bytes) else json.dumps(header).encode()
        new += b" " * ((8 - len(new) % 8) % 8)
        path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    return edit


def _set_entry(name, **fields):
    def change(header):
        header[name].update(fields)
        return header

    return change


def _drop_from_index(name):
    def edit(root):
        index = json.loads((root / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (root / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _duplicate_into_second_shard(root):
    second = {n: t for n, t in make_tensors().items() if ".layers.0." not in n and ".layers.1." not in n}
    second["backbone.layers.0.norm.weight"] = _bf16(H, seed=0)
    save_file(second, str(root / SHARDS[1]), metadata={"format": "pt"})


def _fp8_byte(name, value):
    def edit(tensors):
        raw = tensors[name].view(torch.uint8).clone()
        raw[0, 1] = value
        tensors[name] = raw.view(torch.float8_e4m3fn)

    return edit


def _no_kv_cache_flat(config):
    for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
        config["quantization_config"].pop(key)


def _declare(name, algo):
    entry = {"quant_algo": algo, **({"group_size": 16} if "NVFP4" in algo else {})}
    return _both(lambda s: s["quantized_layers"].__setitem__(name, dict(entry)))


def _attention_in(make):
    """q/k/v of the attention layer quantized by `make(n, k, seed)`, declared with `algo`."""

    def edit(tensors):
        for i, (proj, n) in enumerate((("q_proj", H), ("k_proj", H // 2), ("v_proj", H // 2))):
            del tensors[f"{ATTN}.{proj}.weight"]
            tensors.update({f"{ATTN}.{proj}.{leaf}": v for leaf, v in make(n, H, 20 + i).items()})

    return edit


def _declare_attention(algo):
    def edit(section):
        for proj in ("q_proj", "k_proj", "v_proj"):
            section["quantized_layers"][f"{ATTN}.{proj}"] = {"quant_algo": algo, **({"group_size": 16} if "NVFP4" in algo else {})}

    return _both(edit)


def _nvfp4_w4a4(n, k, seed):
    return {**_nvfp4(n, k, seed), "input_scale": torch.tensor(0.1 + seed * 1e-3)}


def _fp8_same_input(n, k, seed):
    return {**_fp8(n, k, seed), "weight_scale": torch.tensor(0.02 + seed * 1e-3)}


def _gated_experts(tensors):
    for e in range(E):
        tensors.update({f"{MOE}.experts.{e}.gate_proj.{leaf}": v for leaf, v in _nvfp4(I, H, seed=100 + e).items()})


def _declare_gated_experts(section):
    for e in range(E):
        section["quantized_layers"][f"{MOE}.experts.{e}.gate_proj"] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}


def _unreadable_second_shard(monkeypatch):
    from fp4kit.export import conformance

    real = conformance.read_safetensors_header

    def read(path):
        if path.name == SHARDS[1]:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(conformance, "read_safetensors_header", read)


def _config_without_quantization(producer):
    def edit(config):
        del config["quantization_config"]

    def hf_edit(hf_quant):
        hf_quant["producer"] = {"name": producer, "version": "0.47.0"}

    return edit, hf_edit


ATTN = "backbone.layers.0.mixer"
MOE = "backbone.layers.1.mixer"
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
    "declared_algo_differs_from_tensors": dict(
        config_pair=_declare("backbone.layers.2.mixer.in_proj", "NVFP4"),
        expect=("algo_mismatch", "backbone.layers.2.mixer.in_proj"),
    ),
    "config_json_not_json": dict(
        files=lambda root: (root / "config.json").write_text("{"), expect=("bad_json", "config.json")
    ),
    "tensor_in_two_shards": dict(
        files=_duplicate_into_second_shard, expect=("duplicate_tensor", "backbone.layers.0.norm.weight")
    ),
    "expert_count_differs_from_config": dict(
        config=lambda c: c.__setitem__("n_routed_experts", 8),
        expect=("expert_count", "backbone.layers.1.mixer.experts"),
    ),
    "one_expert_wider_than_its_siblings": dict(
        tensors=lambda t: t.update({f"{MOE}.experts.2.up_proj.{leaf}": v for leaf, v in _nvfp4(I + 16, H, 23).items()}),
        expect=("expert_shape_mismatch", "backbone.layers.1.mixer.experts.2.up_proj"),
    ),
    "kv_cache_fp8_without_scales": dict(
        tensors=lambda t: (t.pop(f"{ATTN}.k_proj.k_scale"), t.pop(f"{ATTN}.v_proj.v_scale")),
        expect=("kv_scales_absent", ATTN, "warning"),
    ),
    "kv_scales_without_fp8_kv_cache": dict(
        config_pair=(_no_kv_cache_flat, lambda h: h["quantization"].__setitem__("kv_cache_quant_algo", None)),
        expect=("kv_scales_unused", f"{ATTN}.k_proj.k_scale", "warning"),
    ),
    "only_k_scale": dict(
        tensors=lambda t: t.pop(f"{ATTN}.v_proj.v_scale"),
        expect=("missing_tensor", f"{ATTN}.v_proj.v_scale"),
    ),
    "hf_quant_config_missing": dict(
        files=lambda root: (root / "hf_quant_config.json").unlink(), expect=("missing_file", "hf_quant_config.json")
    ),
    "nan_fp8_weight_byte": dict(
        tensors=_fp8_byte("backbone.layers.2.mixer.in_proj.weight", 0x7F),
        expect=("nan_weight", "backbone.layers.2.mixer.in_proj.weight"),
    ),
    "negative_block_scale": dict(
        tensors=lambda t: t[EXPERT0_SCALE].view(torch.uint8)[0].__setitem__(0, 0xB8),
        expect=("nonpositive_scale", EXPERT0_SCALE),
    ),
    "negative_input_scale": dict(
        tensors=lambda t: _set(t, "backbone.layers.2.mixer.out_proj.input_scale", torch.tensor(-0.05)),
        expect=("nonpositive_scale", "backbone.layers.2.mixer.out_proj.input_scale"),
    ),
    "bf16_module_declared_quantized": dict(
        config_pair=_declare(f"{ATTN}.o_proj", "FP8"),
        expect=("not_excluded", f"{ATTN}.o_proj"),
    ),
    "tensor_missing_from_index": dict(
        files=_drop_from_index("backbone.norm_f.weight"), expect=("not_in_index", "backbone.norm_f.weight", "warning")
    ),
    "one_of_fused_qkv_excluded": dict(
        config_pair=_ignore(f"{ATTN}.q_proj"), expect=("partial_fused_exclusion", f"{ATTN}.k_proj")
    ),
    "unknown_leaf_next_to_fp8_weight": dict(
        tensors=lambda t: _set(t, "backbone.layers.2.mixer.in_proj.weight_zero_point", torch.tensor(0.0)),
        expect=("unexpected_tensor", "backbone.layers.2.mixer.in_proj.weight_zero_point", "warning"),
    ),
    "w4a16_expert_with_input_scale": dict(
        tensors=lambda t: t.update({f"{MOE}.experts.{e}.down_proj.input_scale": torch.tensor(0.1) for e in range(E)}),
        expect=("ignored_tensor", "backbone.layers.1.mixer.experts.0.down_proj.input_scale", "warning"),
    ),
    "one_of_fused_gate_up_excluded": dict(
        tensors=lambda t: _set(t, f"{MOE}.shared_experts.gate_proj.weight", _bf16(2 * I, H, seed=5)),
        config_pair=_ignore(f"{MOE}.shared_experts.gate_proj"),
        expect=("partial_fused_exclusion", f"{MOE}.shared_experts.gate_proj"),
    ),
    "shard_unreadable": dict(patch=_unreadable_second_shard, expect=("unreadable_file", SHARDS[1])),
    "header_not_json": dict(
        files=_rewrite_header(SHARDS[0], lambda h: b"{" * 64), expect=("bad_header", SHARDS[0])
    ),
    "header_shape_needs_more_bytes": dict(
        files=_rewrite_header(SHARDS[1], _set_entry("backbone.norm_f.weight", shape=[H + 1])),
        expect=("byte_count_mismatch", "backbone.norm_f.weight"),
    ),
    "header_dtype_unknown": dict(
        files=_rewrite_header(SHARDS[1], _set_entry("backbone.norm_f.weight", dtype="Q4")),
        expect=("unknown_dtype", "backbone.norm_f.weight"),
    ),
    "quant_algo_vllm_only": dict(
        config_pair=_both(lambda s: s.__setitem__("quant_algo", "FP8_PB_WO")),
        expect=("unsupported_quant_algo", "config.json:quantization_config.quant_algo"),
    ),
    "hf_quant_config_alone_from_another_producer": dict(
        config_pair=_config_without_quantization("fp4kit"),
        expect=("producer_not_modelopt", "hf_quant_config.json:producer.name"),
    ),
    "fused_nvfp4_global_scales_differ": dict(
        tensors=_attention_in(_nvfp4),
        config_pair=_declare_attention("W4A16_NVFP4"),
        expect=("fused_scale_mismatch", "backbone.layers.0.mixer.qkv_proj"),
    ),
    "fused_fp8_weight_scales_differ": dict(
        tensors=_attention_in(_fp8_same_input),
        config_pair=_declare_attention("FP8"),
        expect=("fused_scale_mismatch", "backbone.layers.0.mixer.qkv_proj", "warning"),
    ),
    "gated_expert_global_scales_differ": dict(
        tensors=_gated_experts,
        config_pair=_both(_declare_gated_experts),
        expect=("fused_scale_mismatch", "backbone.layers.1.mixer.experts.0.gate_up_proj"),
    ),
}


# Every finding each defect gives, in report order: (level, code, tensor or key).
FINDINGS = {
    "bf16_module_declared_quantized": [("error", "not_excluded", "backbone.layers.0.mixer.o_proj")],
    "config_json_not_json": [
        ("error", "bad_json", "config.json"),
        ("warning", "kv_scales_unused", "backbone.layers.0.mixer.k_proj.k_scale"),
        ("warning", "kv_scales_unused", "backbone.layers.0.mixer.v_proj.v_scale"),
    ],
    "config_json_vs_hf_quant_config": [("error", "config_mismatch", "quant_algo")],
    "declared_algo_differs_from_tensors": [
        ("error", "wrong_dtype", "backbone.layers.2.mixer.in_proj.weight"),
        ("error", "algo_mismatch", "backbone.layers.2.mixer.in_proj"),
    ],
    "expert_count_differs_from_config": [("error", "expert_count", "backbone.layers.1.mixer.experts")],
    "fp8_without_input_scale": [("error", "missing_tensor", "backbone.layers.2.mixer.out_proj.input_scale")],
    "fused_fp8_weight_scales_differ": [("warning", "fused_scale_mismatch", "backbone.layers.0.mixer.qkv_proj")],
    "fused_nvfp4_global_scales_differ": [("error", "fused_scale_mismatch", "backbone.layers.0.mixer.qkv_proj")],
    "gated_expert_global_scales_differ": [
        ("error", "fused_scale_mismatch", "backbone.layers.1.mixer.experts.0.gate_up_proj"),
        ("error", "fused_scale_mismatch", "backbone.layers.1.mixer.experts.1.gate_up_proj"),
        ("error", "fused_scale_mismatch", "backbone.layers.1.mixer.experts.2.gate_up_proj"),
        ("error", "fused_scale_mismatch", "backbone.layers.1.mixer.experts.3.gate_up_proj"),
    ],
    "header_claiming_huge_size": [("error", "header_too_large", "model-00001-of-00002.safetensors")],
    "header_dtype_unknown": [("error", "unknown_dtype", "backbone.norm_f.weight")],
    "header_not_json": [("error", "bad_header", "model-00001-of-00002.safetensors")],
    "header_shape_needs_more_bytes": [("error", "byte_count_mismatch", "backbone.norm_f.weight")],
    "hf_quant_config_alone_from_another_producer": [("error", "producer_not_modelopt", "hf_quant_config.json:producer.name")],
    "hf_quant_config_missing": [
        ("error", "missing_file", "hf_quant_config.json"),
        ("warning", "kv_scales_unused", "backbone.layers.0.mixer.k_proj.k_scale"),
        ("warning", "kv_scales_unused", "backbone.layers.0.mixer.v_proj.v_scale"),
    ],
    "ignore_matching_nothing": [("error", "pattern_matches_nothing", "ignore['backbone.layers.7.mixer.in_proj']")],
    "junk_ignore_name": [("error", "junk_module_name", "ignore['backbone.layers.2.mixer.in_proj.\\x00backbone.pt_name_sentinel']")],
    "kv_cache_fp8_without_scales": [("warning", "kv_scales_absent", "backbone.layers.0.mixer")],
    "kv_declared_in_one_file_only": [("error", "config_mismatch", "kv_cache_scheme")],
    "kv_scale_under_dropped_name": [
        ("error", "kv_scale_dropped", "backbone.layers.0.mixer.qkv_proj.k_scale"),
        ("error", "missing_tensor", "backbone.layers.0.mixer.k_proj.k_scale"),
    ],
    "kv_scales_without_fp8_kv_cache": [
        ("warning", "kv_scales_unused", "backbone.layers.0.mixer.k_proj.k_scale"),
        ("warning", "kv_scales_unused", "backbone.layers.0.mixer.v_proj.v_scale"),
    ],
    "layers_block_type_disagrees_with_pattern": [("error", "config_mismatch", "config.json:layers_block_type")],
    "layers_block_type_in_transformers_names": [("error", "bad_value", "config.json:layers_block_type")],
    "mamba_n_groups_differs": [("error", "config_mismatch", "config.json:mamba_n_groups")],
    "mamba_n_groups_missing": [("error", "missing_key", "config.json:mamba_n_groups")],
    "missing_hybrid_override_pattern": [("error", "missing_key", "config.json:hybrid_override_pattern")],
    "missing_shard": [("error", "missing_shard", "model-00002-of-00002.safetensors")],
    "moe_layer_with_mixed_declarations": [
        ("error", "missing_tensor", "backbone.layers.1.mixer.experts.3.up_proj.input_scale"),
        ("error", "mixed_moe_layer", "backbone.layers.1.mixer.experts"),
    ],
    "nan_fp8_weight_byte": [("error", "nan_weight", "backbone.layers.2.mixer.in_proj.weight")],
    "nan_scale_byte": [("error", "nan_scale", "backbone.layers.1.mixer.experts.0.up_proj.weight_scale")],
    "negative_block_scale": [("error", "nonpositive_scale", "backbone.layers.1.mixer.experts.0.up_proj.weight_scale")],
    "negative_input_scale": [("error", "nonpositive_scale", "backbone.layers.2.mixer.out_proj.input_scale")],
    "one_expert_wider_than_its_siblings": [("error", "expert_shape_mismatch", "backbone.layers.1.mixer.experts.2.up_proj")],
    "one_of_fused_gate_up_excluded": [("error", "partial_fused_exclusion", "backbone.layers.1.mixer.shared_experts.gate_proj")],
    "one_of_fused_qkv_excluded": [("error", "partial_fused_exclusion", "backbone.layers.0.mixer.k_proj")],
    "only_k_scale": [("error", "missing_tensor", "backbone.layers.0.mixer.v_proj.v_scale")],
    "partially_excluded_moe": [
        ("error", "not_declared", "backbone.layers.1.mixer.experts.0.down_proj"),
        ("error", "partial_moe_exclusion", "ignore['backbone.layers.1.mixer.experts.2.*']"),
    ],
    "pattern_disagrees_with_tensors": [
        ("error", "layer_type_mismatch", "backbone.layers.1"),
        ("error", "layer_type_mismatch", "backbone.layers.2"),
    ],
    "quant_algo_vllm_only": [("error", "unsupported_quant_algo", "config.json:quantization_config.quant_algo")],
    "quantized_module_not_declared": [("error", "not_declared", "backbone.layers.2.mixer.out_proj")],
    "shard_unreadable": [("error", "unreadable_file", "model-00002-of-00002.safetensors")],
    "tensor_in_index_not_in_shard": [("error", "index_tensor_missing", "backbone.layers.2.mixer.ghost")],
    "tensor_in_two_shards": [("error", "duplicate_tensor", "backbone.layers.0.norm.weight")],
    "tensor_missing_from_index": [("warning", "not_in_index", "backbone.norm_f.weight")],
    "truncated_safetensors_data": [("error", "offset_past_eof", "backbone.layers.2.mixer.out_proj.weight")],
    "truncated_safetensors_header": [("error", "truncated_file", "model-00002-of-00002.safetensors")],
    "unknown_leaf_next_to_fp8_weight": [("warning", "unexpected_tensor", "backbone.layers.2.mixer.in_proj.weight_zero_point")],
    "unknown_quant_algo": [("error", "unknown_quant_algo", "config.json:quantization_config.quant_algo")],
    "w4a16_expert_with_input_scale": [
        ("warning", "ignored_tensor", "backbone.layers.1.mixer.experts.0.down_proj.input_scale"),
        ("warning", "ignored_tensor", "backbone.layers.1.mixer.experts.1.down_proj.input_scale"),
        ("warning", "ignored_tensor", "backbone.layers.1.mixer.experts.2.down_proj.input_scale"),
        ("warning", "ignored_tensor", "backbone.layers.1.mixer.experts.3.down_proj.input_scale"),
    ],
    "wrong_dtype": [
        ("error", "wrong_dtype", "backbone.layers.1.mixer.experts.0.up_proj.weight_scale"),
        ("error", "expert_shape_mismatch", "backbone.layers.1.mixer.experts.0.up_proj"),
    ],
    "wrong_shape": [
        ("error", "wrong_shape", "backbone.layers.1.mixer.experts.2.down_proj.weight_scale"),
        ("error", "expert_shape_mismatch", "backbone.layers.1.mixer.experts.2.down_proj"),
    ],
    "zero_fp8_input_scale": [("error", "nonpositive_scale", "backbone.layers.2.mixer.in_proj.input_scale")],
    "zero_global_scale": [("error", "nonpositive_scale", "backbone.layers.1.mixer.experts.3.down_proj.weight_scale_2")],
}


def build_defect(tmp_path, monkeypatch, name: str):
    """DEFECTS[name]'s checkpoint under tmp_path/ckpt."""
    d = DEFECTS[name]
    if "patch" in d:
        d["patch"](monkeypatch)
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
    return root


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_defect_is_an_error_naming_the_tensor_or_key(tmp_path, monkeypatch, name):
    d = DEFECTS[name]
    root = build_defect(tmp_path, monkeypatch, name)
    report = check_checkpoint(root)

    code, key, level = (*d["expect"], "error")[:3]
    assert report.ok is (level == "warning" and not report.errors)
    hits = [f for f in report.findings if f.code == code and f.level == level and f.tensor_or_key is not None and key in f.tensor_or_key]
    assert hits, [(f.code, f.tensor_or_key, f.message) for f in report.findings]
    assert [(f.level, f.code, f.tensor_or_key) for f in report.findings] == FINDINGS[name]


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


# --- every code the checker emits has a DEFECTS case ---


def _emitted_codes() -> set[str]:
    """The finding codes conformance.py can emit: the code argument of its error / warn / add
    calls and of _HeaderError, and the first item of the header parser's `problems` tuples."""
    import ast
    import inspect

    from fp4kit.export import conformance

    def strings(node) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return strings(node.body) | strings(node.orelse)
        return set()

    codes: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(conformance))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in ("error", "warn", "_HeaderError"):
            codes |= strings(node.args[0])
        elif name == "add" and len(node.args) >= 2:
            codes |= strings(node.args[1])
        elif name == "append" and getattr(node.func.value, "id", None) == "problems":
            codes |= strings(node.args[0].elts[0])
    return codes


def test_every_emitted_code_has_a_defect_case():
    emitted = _emitted_codes()
    tested = {d["expect"][0] for d in DEFECTS.values()}
    assert {"nan_weight", "fused_scale_mismatch", "producer_not_modelopt", "bad_header"} <= emitted
    assert sorted(emitted - tested) == [], "codes no DEFECTS case names"
    assert sorted(tested - emitted) == [], "DEFECTS cases for codes the checker no longer emits"
    assert sorted(FINDINGS) == sorted(DEFECTS)


# --- where the engines read the quantization config from ---


def _single_algo_parts() -> tuple[dict, dict, dict]:
    """test_conformant_single_algo_checkpoint_passes' checkpoint: tensors, config, hf_quant."""
    tensors = make_tensors()
    for proj, (n, k) in (("in_proj", (IN_PROJ, H)), ("out_proj", (H, INNER))):
        for leaf in ("weight", "weight_scale", "input_scale"):
            del tensors[f"backbone.layers.2.mixer.{proj}.{leaf}"]
        tensors[f"backbone.layers.2.mixer.{proj}.weight"] = _bf16(n, k)
    ignore = [f"{ATTN}.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    ignore += ["lm_head", f"{MOE}.shared_experts*"] + [f"backbone.layers.2.mixer.{p}" for p in ("in_proj", "out_proj", "conv1d")]
    config, _ = make_configs()
    q = config["quantization_config"]
    del q["quantized_layers"]
    q.update(quant_algo="W4A16_NVFP4", group_size=16, ignore=ignore)
    hf_quant = {
        "producer": q["producer"],
        "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": list(ignore)},
    }
    return tensors, config, hf_quant


def test_hf_quant_config_alone_from_modelopt_passes(tmp_path):
    """Neither engine needs config.json's quantization_config when ModelOpt wrote hf_quant_config.json."""
    config, hf_quant = make_configs()
    del config["quantization_config"]
    hf_quant["producer"] = {"name": "modelopt", "version": "0.47.0"}
    report = check_checkpoint(write_checkpoint(tmp_path / "c", make_tensors(), config, hf_quant))
    assert report.findings == []


def test_hf_quant_config_alone_cannot_say_w4a16_to_vllm(tmp_path):
    tensors, config, hf_quant = _single_algo_parts()
    del config["quantization_config"]
    hf_quant["producer"] = {"name": "modelopt", "version": "0.47.0"}
    report = check_checkpoint(write_checkpoint(tmp_path / "c", tensors, config, hf_quant))
    assert [(f.level, f.code, f.tensor_or_key) for f in report.findings] == [
        ("error", "unsupported_quant_algo", "hf_quant_config.json:quantization.quant_algo")
    ]
    assert "Unknown ModelOpt quant algo" in report.findings[0].message


@pytest.mark.parametrize("producer", ["fp4kit", "modelopt"])
def test_mixed_without_quantized_layers_in_config_json(tmp_path, producer):
    """vLLM then reads hf_quant_config.json (ModelOpt's only); SGLang serves it as w4afp8 either way."""
    config, hf_quant = make_configs()
    del config["quantization_config"]["quantized_layers"]
    hf_quant["producer"] = {"name": producer, "version": "1"}
    report = check_checkpoint(write_checkpoint(tmp_path / "c", make_tensors(), config, hf_quant))
    expected = [("error", "missing_key", "config.json:quantization_config.quantized_layers")]
    if producer != "modelopt":
        expected.append(("error", "producer_not_modelopt", "hf_quant_config.json:producer.name"))
    assert [(f.level, f.code, f.tensor_or_key) for f in report.errors] == expected


def test_config_json_quantization_config_wins_whatever_the_producer(checkpoint):
    """fp4kit's own exports: producer fp4kit in both files, config.json read first: no finding."""
    hf_quant = json.loads((checkpoint / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "fp4kit"
    assert check_checkpoint(checkpoint).findings == []


# --- fused siblings ---


def test_w4a4_input_scales_of_fused_siblings_differ_is_a_warning(tmp_path):
    tensors, config, hf_quant = make_tensors(), *make_configs()

    def shard(n, seed):
        return {**_nvfp4(n, H, seed), "weight_scale_2": torch.tensor(0.01), "input_scale": torch.tensor(0.1 + seed * 1e-3)}

    for i, (proj, n) in enumerate((("q_proj", H), ("k_proj", H // 2), ("v_proj", H // 2))):
        del tensors[f"{ATTN}.{proj}.weight"]
        tensors.update({f"{ATTN}.{proj}.{leaf}": v for leaf, v in shard(n, i).items()})
    _declare_attention("NVFP4")[0](config)
    _declare_attention("NVFP4")[1](hf_quant)
    report = check_checkpoint(write_checkpoint(tmp_path / "c", tensors, config, hf_quant))
    assert [(f.level, f.code, f.tensor_or_key) for f in report.findings] == [("warning", "fused_scale_mismatch", f"{ATTN}.qkv_proj")]
    assert report.findings[0].message.startswith("input_scale differs across the fused shards (q_proj=0.100000001, k_proj=0.101000004, v_proj=0.101999998)")


def test_equal_scales_of_fused_siblings_pass(tmp_path):
    tensors, config, hf_quant = make_tensors(), *make_configs()
    _attention_in(lambda n, k, seed: {**_nvfp4(n, k, seed), "weight_scale_2": torch.tensor(0.01)})(tensors)
    _declare_attention("W4A16_NVFP4")[0](config)
    _declare_attention("W4A16_NVFP4")[1](hf_quant)
    assert check_checkpoint(write_checkpoint(tmp_path / "c", tensors, config, hf_quant)).findings == []


def test_fused_groups_are_the_adapters_fuse_groups():
    """conformance's name-based groups are the siblings fp4kit's adapters give one fuse_group."""
    import sys
    from collections import defaultdict

    from fp4kit.export.conformance import FUSED_LINEARS
    from fp4kit.models import adapter_for

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
    from tiny_models import build_llama, build_nemotron_h

    seen = set()
    for model in (build_llama(), build_nemotron_h()):
        groups = defaultdict(list)
        for t in adapter_for(model).targets(model):
            if t.fuse_group:
                groups[t.fuse_group].append(t.disk_names[0].rpartition(".")[2])
        seen |= {tuple(g) for g in groups.values()}
    assert seen == set(FUSED_LINEARS.values())


# --- routed experts kept in BF16 ---


def test_bf16_routed_experts_excluded_by_expert_0_only_fail(tmp_path):
    """vLLM excludes the whole MoE layer for one expert entry; SGLang excludes nothing and loads
    the BF16 experts into NVFP4 parameters."""
    tensors, config, hf_quant = _single_algo_parts()
    for e in range(E):
        for proj, (n, k) in (("up_proj", (I, H)), ("down_proj", (H, I))):
            m = f"{MOE}.experts.{e}.{proj}"
            for leaf in ("weight", "weight_scale", "weight_scale_2"):
                del tensors[f"{m}.{leaf}"]
            tensors[f"{m}.weight"] = _bf16(n, k, seed=e)
    for proj, (n, k) in (("up_proj", (2 * I, H)), ("down_proj", (H, 2 * I))):
        tensors.update({f"{MOE}.shared_experts.{proj}.{leaf}": v for leaf, v in _nvfp4(n, k, seed=7).items()})
    ignore = [e for e in config["quantization_config"]["ignore"] if "shared_experts" not in e]
    ignore += [f"{MOE}.experts.0.up_proj", f"{MOE}.experts.0.down_proj"]
    config["quantization_config"]["ignore"] = ignore
    hf_quant["quantization"]["exclude_modules"] = list(ignore)
    report = check_checkpoint(write_checkpoint(tmp_path / "c", tensors, config, hf_quant))
    assert [(f.level, f.code, f.tensor_or_key) for f in report.findings] == [
        ("error", "not_excluded", f"{MOE}.experts.0.down_proj"),
        ("error", "partial_moe_exclusion", f"ignore['{MOE}.experts.0.up_proj']"),
        ("error", "partial_moe_exclusion", f"ignore['{MOE}.experts.0.down_proj']"),
    ]
    assert report.findings[0].message.startswith("SGLang loads model.layers.1.mixer.experts as W4A16_NVFP4")
