"""The words of every conformance finding, down to the lines a mutation run showed no other test
pinning: what the report tells a user (the engine, the tensor, the numbers) is part of the check;
then edge cases of the rules that the defect table does not reach, each pinning the exact findings
(level, code, key, message) of one small checkpoint or one helper call."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from fp4kit.export import conformance as cf
from fp4kit.export.conformance import check_checkpoint, read_safetensors_header, sglang_excluded
from test_conformance import (
    DEFECTS,
    E,
    EXPERT0_SCALE,
    SHARDS,
    H,
    I,
    IN_PROJ,
    _attention_in,
    _bf16,
    _declare_attention,
    _declare_gated_experts,
    _fp8,
    _gated_experts,
    _nvfp4,
    _single_algo_parts,
    build_defect,
    make_configs,
    make_tensors,
    write_checkpoint,
)

# The message of every finding each DEFECTS case gives, in report order (test_conformance.FINDINGS
# has their levels, codes and keys); <root> stands for the checkpoint folder.
MESSAGES = {'bf16_module_declared_quantized': ['vLLM loads model.layers.0.mixer.o_proj as FP8 but its weight is BF16; exclude '
                                    'it'],
 'config_json_not_json': ['config.json is not valid JSON: Expecting property name enclosed in double quotes: line 1 '
                          'column 2 (char 1)',
                          'KV cache is not declared FP8; the engines ignore this scale',
                          'KV cache is not declared FP8; the engines ignore this scale'],
 'config_json_vs_hf_quant_config': ["config.json says 'MIXED_PRECISION', hf_quant_config.json says 'NVFP4'"],
 'declared_algo_differs_from_tensors': ['F8_E4M3, NVFP4 stores U8',
                                        'vLLM loads model.layers.2.mixer.in_proj as NVFP4 but its tensors are FP8'],
 'expert_count_differs_from_config': ['4 experts on disk, n_routed_experts is 8'],
 'fp8_without_input_scale': ['FP8 is static per-tensor in both engines; without input_scale they quantize '
                             'activations with the float32-min placeholder (silent garbage)'],
 'fused_fp8_weight_scales_differ': ['weight_scale differs across the fused shards (q_proj=0.0399999991, '
                                    'k_proj=0.0410000011, v_proj=0.0419999994): the engines requantize every shard '
                                    'to the largest scale (one more rounding)'],
 'fused_nvfp4_global_scales_differ': ['weight_scale_2 differs across the fused shards (q_proj=0.0120000001, '
                                      'k_proj=0.0120999999, v_proj=0.0121999998): the engines use the largest value '
                                      'for every shard without requantizing, so the other shards dequantize scaled '
                                      'by the ratio'],
 'gated_expert_global_scales_differ': ['weight_scale_2 differs across the fused shards (gate_proj=0.0199999996, '
                                       "up_proj=0.0107000005): the engines use the gate's (w1) value for every shard "
                                       'without requantizing, so the other shards dequantize scaled by the ratio',
                                       'weight_scale_2 differs across the fused shards (gate_proj=0.0200999994, '
                                       "up_proj=0.0116999997): the engines use the gate's (w1) value for every shard "
                                       'without requantizing, so the other shards dequantize scaled by the ratio',
                                       'weight_scale_2 differs across the fused shards (gate_proj=0.0201999992, '
                                       "up_proj=0.0126999998): the engines use the gate's (w1) value for every shard "
                                       'without requantizing, so the other shards dequantize scaled by the ratio',
                                       'weight_scale_2 differs across the fused shards (gate_proj=0.0203000009, '
                                       "up_proj=0.0137): the engines use the gate's (w1) value for every shard "
                                       'without requantizing, so the other shards dequantize scaled by the ratio'],
 'header_claiming_huge_size': ['header claims 1099511627776 bytes (limit 100000000)'],
 'header_dtype_unknown': ["model-00002-of-00002.safetensors: dtype 'Q4' is not a safetensors dtype"],
 'header_not_json': ['header is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 '
                     '(char 1)'],
 'header_shape_needs_more_bytes': ['model-00002-of-00002.safetensors: BF16 [33] needs 66 bytes, data_offsets span '
                                   '64'],
 'hf_quant_config_alone_from_another_producer': ["'fp4kit': config.json has no quantization_config, so vLLM reads "
                                                 'hf_quant_config.json, and it accepts that file only from producer '
                                                 "'modelopt' (otherwise it builds the model unquantized or raises "
                                                 "'Unsupported quantization config')"],
 'hf_quant_config_missing': ['hf_quant_config.json is missing',
                             'KV cache is not declared FP8; the engines ignore this scale',
                             'KV cache is not declared FP8; the engines ignore this scale'],
 'ignore_matching_nothing': ['matches no module of the checkpoint'],
 'junk_ignore_name': ['contains control characters, whitespace or a ModelOpt sentinel'],
 'kv_cache_fp8_without_scales': ['KV cache is FP8 but no k/v scales: the engines use 1.0'],
 'kv_declared_in_one_file_only': ["config.json kv_cache_scheme={'dynamic': False, 'num_bits': 8, 'type': 'float'} "
                                  'but hf_quant_config.json kv_cache_quant_algo=None'],
 'kv_scale_under_dropped_name': ['the engines drop (or fail on) this name; attention KV scales load as '
                                 '<attn>.k_proj.k_scale / <attn>.v_proj.v_scale',
                                 'only one of k_scale / v_scale present'],
 'kv_scales_without_fp8_kv_cache': ['KV cache is not declared FP8; the engines ignore this scale',
                                    'KV cache is not declared FP8; the engines ignore this scale'],
 'layers_block_type_disagrees_with_pattern': ["does not spell hybrid_override_pattern '*EM'; the engines use "
                                              'layers_block_type'],
 'layers_block_type_in_transformers_names': ["['full_attention', 'linear_attention']: SGLang's NemotronHConfig "
                                             "accepts only ['mamba', 'attention', 'mlp', 'moe'] and refuses the "
                                             'config'],
 'mamba_n_groups_differs': ['8 but n_groups is 1'],
 'mamba_n_groups_missing': ['SGLang builds the Mamba mixer with mamba_n_groups (default 8), not n_groups (1); its '
                            'conv1d weights then do not fit'],
 'missing_hybrid_override_pattern': ["nemotron_h needs hybrid_override_pattern; without it the engines' config class "
                                     'falls back to a built-in layer layout'],
 'missing_shard': ['shard named by the index is missing (16 tensors)'],
 'moe_layer_with_mixed_declarations': ['expected F32 []',
                                       "experts declare ['NVFP4', 'W4A16_NVFP4']; the engines give every expert of a "
                                       'layer the algo of its first entry'],
 'nan_fp8_weight_byte': ['1 NaN bytes (0x7F/0xFF)'],
 'nan_scale_byte': ['1 NaN bytes (0x7F/0xFF)'],
 'negative_block_scale': ['1 negative block scales'],
 'negative_input_scale': ['1 value(s) not finite and > 0, e.g. -0.05000000074505806'],
 'one_expert_wider_than_its_siblings': ["differs from most experts of backbone.layers.1.mixer.experts in [('weight', "
                                        "'U8', (32, 16)), ('weight', 'U8', (48, 16)), ('weight_scale', 'F8_E4M3', "
                                        "(32, 2)), ('weight_scale', 'F8_E4M3', (48, 2))]"],
 'one_of_fused_gate_up_excluded': ['the engines refuse model.layers.1.mixer.shared_experts.gate_up_proj: some but '
                                   'not all shards of model.layers.1.mixer.shared_experts.gate_up_proj are excluded'],
 'one_of_fused_qkv_excluded': ['the engines refuse model.layers.0.mixer.qkv_proj: some but not all shards of '
                               'model.layers.0.mixer.qkv_proj are excluded'],
 'only_k_scale': ['only one of k_scale / v_scale present'],
 'partially_excluded_moe': ['vLLM loads model.layers.1.mixer.experts unquantized but its tensors are W4A16_NVFP4',
                            'excludes 2 of 8 expert modules of backbone.layers.1.mixer.experts; the engines exclude '
                            'whole MoE layers only'],
 'pattern_disagrees_with_tensors': ["pattern says 'M' but no tensor has '.mixer.in_proj'",
                                    "pattern says 'E' but no tensor has '.mixer.experts.'"],
 'quant_algo_vllm_only': ["'FP8_PB_WO' is served by vLLM only; SGLang's ModelOpt configs reject it"],
 'quantized_module_not_declared': ['vLLM loads model.layers.2.mixer.out_proj unquantized but its tensors are FP8'],
 'shard_unreadable': ["[Errno 13] Permission denied: '<root>/model-00002-of-00002.safetensors'"],
 'tensor_in_index_not_in_shard': ['the index places it in model-00002-of-00002.safetensors, which lacks it'],
 'tensor_in_two_shards': ['present in both model-00001-of-00002.safetensors and model-00002-of-00002.safetensors'],
 'tensor_missing_from_index': ['in model-00002-of-00002.safetensors but the index does not place it there'],
 'truncated_safetensors_data': ['model-00002-of-00002.safetensors: data ends at byte 18288, the file has 18285'],
 'truncated_safetensors_header': ['5 bytes, shorter than the 8-byte header length'],
 'unknown_leaf_next_to_fp8_weight': ['not part of the FP8 layout'],
 'unknown_quant_algo': ["'NVFP5' is not a ModelOpt algo the engines accept (FP8, NVFP4, W4A16_NVFP4, "
                        'MIXED_PRECISION)'],
 'w4a16_expert_with_input_scale': ['W4A16_NVFP4 quantizes no activations; the engines drop it',
                                   'W4A16_NVFP4 quantizes no activations; the engines drop it',
                                   'W4A16_NVFP4 quantizes no activations; the engines drop it',
                                   'W4A16_NVFP4 quantizes no activations; the engines drop it'],
 'wrong_dtype': ['F32, expected F8_E4M3',
                 "differs from most experts of backbone.layers.1.mixer.experts in [('weight_scale', 'F32', (32, 2)), "
                 "('weight_scale', 'F8_E4M3', (32, 2))]"],
 'wrong_shape': ['[32, 3], expected [32, 2]',
                 "differs from most experts of backbone.layers.1.mixer.experts in [('weight_scale', 'F8_E4M3', (32, "
                 "2)), ('weight_scale', 'F8_E4M3', (32, 3))]"],
 'zero_fp8_input_scale': ['1 value(s) not finite and > 0, e.g. 0.0'],
 'zero_global_scale': ['1 value(s) not finite and > 0, e.g. 0.0']}


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_every_finding_says_what_is_wrong_in_words(tmp_path, monkeypatch, name):
    root = build_defect(tmp_path, monkeypatch, name)
    report = check_checkpoint(root)
    assert [f.message.replace(str(root), "<root>") for f in report.findings] == MESSAGES[name]


def test_messages_cover_every_defect():
    assert sorted(MESSAGES) == sorted(DEFECTS)


# --- more checkpoints, each with every finding it gives: (level, code, key, message) ---

ATTN, MOE, SSM = "backbone.layers.0.mixer", "backbone.layers.1.mixer", "backbone.layers.2.mixer"


def _q(section):
    """Edit config.json's quantization_config: `_q(lambda q: ...)` as a config edit."""
    return lambda c: section(c["quantization_config"])


def _n(section):
    """Edit hf_quant_config.json's nested section."""
    return lambda h: section(h["quantization"])


def _single(tensors, config, hf_quant):
    """The W4A16_NVFP4 single-algo layout of test_conformance._single_algo_parts."""
    from test_conformance import _single_algo_parts

    t, c, h = _single_algo_parts()
    tensors.clear(), tensors.update(t), config.clear(), config.update(c), hf_quant.clear(), hf_quant.update(h)


def _raw_header(shard, header: bytes, size: int | None = None):
    def edit(root):
        (root / shard).write_bytes(struct.pack("<Q", len(header) if size is None else size) + header)

    return edit


def _extra_shard(header: bytes, names=("a",)):
    """One more shard, `model-extra.safetensors`, with this raw header and no data; the index
    places `names` in it."""

    def edit(root):
        (root / "model-extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
        index = json.loads((root / "model.safetensors.index.json").read_text())
        index["weight_map"].update({n: "model-extra.safetensors" for n in names})
        (root / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _index(value):
    def edit(root):
        (root / "model.safetensors.index.json").write_text(value if isinstance(value, str) else json.dumps(value))

    return edit


def _weight_map(change):
    def edit(root):
        index = json.loads((root / "model.safetensors.index.json").read_text())
        change(index["weight_map"])
        (root / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _drop_layer(section, name):
    section["quantized_layers"].pop(name)


SHARD0, SHARD1 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
def _merge_shards(root):
    from safetensors.torch import load_file

    tensors = {}
    for shard in (SHARD0, SHARD1):
        tensors.update(load_file(str(root / shard)))
        (root / shard).unlink()
    (root / "model.safetensors.index.json").unlink()
    save_file(tensors, str(root / "model.safetensors"))


def _experts_to_bf16(t):
    for e in range(E):
        for proj, (n, k) in (("up_proj", (I, H)), ("down_proj", (H, I))):
            for leaf in ("weight", "weight_scale", "weight_scale_2"):
                t.pop(f"{MOE}.experts.{e}.{proj}.{leaf}")
            t[f"{MOE}.experts.{e}.{proj}.weight"] = _bf16(n, k, seed=e)


def _only_fp8_layers(section):
    section["quantized_layers"] = {k: v for k, v in section["quantized_layers"].items() if v["quant_algo"] == "FP8"}
    section["exclude_modules" if "quant_method" not in section else "ignore"] = [f"{MOE}.experts"]


def _renumber_expert(t):
    for leaf in ("weight", "weight_scale", "weight_scale_2"):
        for proj in ("up_proj", "down_proj"):
            t[f"{MOE}.experts.7.{proj}.{leaf}"] = t.pop(f"{MOE}.experts.3.{proj}.{leaf}")


def _expert_to_fp8(t):
    for proj, (n, k) in (("up_proj", (I, H)), ("down_proj", (H, I))):
        for leaf in ("weight", "weight_scale", "weight_scale_2"):
            t.pop(f"{MOE}.experts.3.{proj}.{leaf}")
        t.update({f"{MOE}.experts.3.{proj}.{leaf}": v for leaf, v in _fp8(n, k, seed=9).items()})


def _declare_expert_fp8(section):
    for proj in ("up_proj", "down_proj"):
        section["quantized_layers"][f"{MOE}.experts.3.{proj}"] = {"quant_algo": "FP8"}


def _qkv_mixed(t):
    for i, (proj, n) in enumerate((("q_proj", H), ("k_proj", H // 2), ("v_proj", H // 2))):
        del t[f"{ATTN}.{proj}.weight"]
        t.update({f"{ATTN}.{proj}.{leaf}": v for leaf, v in (_fp8(n, H, 30 + i) if proj == "q_proj" else _nvfp4(n, H, 30 + i)).items()})


def _declare_qkv_mixed(section):
    for proj in ("q_proj", "k_proj", "v_proj"):
        section["quantized_layers"][f"{ATTN}.{proj}"] = (
            {"quant_algo": "FP8"} if proj == "q_proj" else {"quant_algo": "W4A16_NVFP4", "group_size": 16})


def _qkv_fp8_scale_bf16(t):
    for i, (proj, n) in enumerate((("q_proj", H), ("k_proj", H // 2), ("v_proj", H // 2))):
        del t[f"{ATTN}.{proj}.weight"]
        t.update({f"{ATTN}.{proj}.{leaf}": v for leaf, v in _fp8(n, H, 30 + i).items()})
        t[f"{ATTN}.{proj}.weight_scale"] = torch.tensor(0.01 * (i + 1)).to(torch.bfloat16)


def _declare_qkv_fp8(section):
    for proj in ("q_proj", "k_proj", "v_proj"):
        section["quantized_layers"][f"{ATTN}.{proj}"] = {"quant_algo": "FP8"}



SCENARIOS = {
    "header_shorter_than_it_claims": dict(files=_raw_header(SHARD1, b"{}", size=100)),
    "header_entry_not_an_object": dict(files=_extra_shard(b'{"a": 5, "__metadata__": {"x": "y"}}')),
    "header_negative_shape": dict(
        files=_extra_shard(b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}')),
    "header_offsets_reversed": dict(
        files=_extra_shard(b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}')),
    "header_shape_not_a_list": dict(
        files=_extra_shard(b'{"a": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}', ("a", "b"))),
    "header_offsets_malformed": dict(files=_extra_shard(
        b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0]}, "b": {"dtype": "F32", "shape": [0], "data_offsets": [0.0, 0]},'
        b' "c": {"dtype": "F32", "shape": [0], "data_offsets": [-1, 0]}, "d": {"dtype": "F32", "shape": [0], "data_offsets": null},'
        b' "e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}', ("a", "b", "c", "d", "e"))),
    "header_data_past_the_end": dict(files=_extra_shard(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')),
    "header_duplicate_keys": dict(files=_raw_header(SHARD1, b'{"a": 1, "a": 2, "b": 3, "b": 4}')),
    "header_not_utf8": dict(files=_raw_header(SHARD1, b'{"\xff": 1}')),
    "index_without_weight_map": dict(files=_index({"metadata": {}})),
    "index_not_json": dict(files=_index("{")),
    "index_names_a_path": dict(files=_weight_map(lambda m: m.update({"x.weight": "../other.safetensors", "y.weight": 3}))),
    "no_weights_at_all": dict(files=lambda root: [p.unlink() for p in root.glob("model*")]),
    "single_file_checkpoint": dict(files=lambda root: _merge_shards(root)),
    "n_groups_missing": dict(config=lambda c: c.pop("n_groups")),
    "pattern_not_a_pattern": dict(config=lambda c: c.__setitem__("hybrid_override_pattern", "*EX")),
    "pattern_empty": dict(config=lambda c: c.__setitem__("hybrid_override_pattern", "")),
    "layers_block_type_not_strings": dict(config=lambda c: c.__setitem__("layers_block_type", ["attention", 1, "mamba"])),
    "layers_block_type_not_a_list": dict(config=lambda c: c.__setitem__("layers_block_type", "attention")),
    "pattern_without_mamba_needs_no_groups": dict(
        config=lambda c: (c.pop("n_groups"), c.__setitem__("hybrid_override_pattern", "*E-"))),
    "num_hidden_layers_differs": dict(config=lambda c: c.__setitem__("num_hidden_layers", 4)),
    "hf_quant_without_section": dict(hf_quant=lambda h: h.pop("quantization")),
    "no_quantization_anywhere": dict(config=lambda c: c.pop("quantization_config"), hf_quant=lambda h: h.pop("quantization")),
    "hf_quant_alone_with_a_producer_string": dict(config=lambda c: c.pop("quantization_config"),
                                                  hf_quant=lambda h: h.__setitem__("producer", "modelopt")),
    "single_with_quantized_layers_in_config_json": dict(tensors=_single, config=_q(lambda q: q.__setitem__("quantized_layers", {}))),
    "quant_method_not_modelopt": dict(config=_q(lambda q: q.__setitem__("quant_method", "fp8"))),
    "no_producer": dict(config=_q(lambda q: q.pop("producer")), hf_quant=lambda h: h.pop("producer")),
    "algo_lower_case": dict(config=_q(lambda q: q.__setitem__("quant_algo", "mixed_precision")),
                            hf_quant=_n(lambda q: q.__setitem__("quant_algo", "mixed_precision"))),
    "algo_not_a_string": dict(config=_q(lambda q: q.__setitem__("quant_algo", 4)), hf_quant=_n(lambda q: q.__setitem__("quant_algo", 4))),
    "kv_algo_int8": dict(hf_quant=_n(lambda q: q.__setitem__("kv_cache_quant_algo", "INT8"))),
    "kv_scheme_dynamic": dict(config=_q(lambda q: q["kv_cache_scheme"].__setitem__("dynamic", True))),
    "kv_scheme_int8": dict(config=_q(lambda q: q["kv_cache_scheme"].__setitem__("num_bits", 4))),
    "kv_scheme_int_type": dict(config=_q(lambda q: q["kv_cache_scheme"].__setitem__("type", "int"))),
    "kv_scheme_not_a_dict": dict(config=_q(lambda q: q.__setitem__("kv_cache_scheme", "fp8"))),
    "single_conformant": dict(tensors=_single),
    "single_nested_without_keys": dict(tensors=_single, hf_quant=_n(lambda q: [q.pop(k) for k in ("group_size", "kv_cache_quant_algo", "exclude_modules")])),
    "single_group_size_32": dict(tensors=_single, config=_q(lambda q: q.__setitem__("group_size", 32)),
                                 hf_quant=_n(lambda q: q.__setitem__("group_size", 32))),
    "single_ignore_not_a_list": dict(tensors=_single, config=_q(lambda q: q.__setitem__("ignore", "lm_head"))),
    "single_exclude_not_strings": dict(tensors=_single, hf_quant=_n(lambda q: q.__setitem__("exclude_modules", [1]))),
    "single_no_ignore": dict(tensors=_single, config=_q(lambda q: q.pop("ignore"))),
    "single_ignore_differs": dict(tensors=_single, config=_q(lambda q: q["ignore"].pop())),
    "single_with_quantized_layers": dict(tensors=_single, hf_quant=_n(lambda q: q.__setitem__("quantized_layers", {}))),
    "single_fp8_algo": dict(tensors=_single, config=_q(lambda q: q.__setitem__("quant_algo", "FP8")),
                            hf_quant=_n(lambda q: q.__setitem__("quant_algo", "FP8"))),
    "single_nvfp4_algo": dict(tensors=_single, config=_q(lambda q: q.__setitem__("quant_algo", "NVFP4")),
                              hf_quant=_n(lambda q: q.__setitem__("quant_algo", "NVFP4"))),
    "mixed_nested_layers_missing": dict(hf_quant=_n(lambda q: q.pop("quantized_layers"))),
    "mixed_layers_missing_everywhere": dict(config=_q(lambda q: q.pop("quantized_layers")), hf_quant=_n(lambda q: q.pop("quantized_layers"))),
    "mixed_layer_only_in_config": dict(hf_quant=_n(lambda q: _drop_layer(q, f"{SSM}.in_proj"))),
    "mixed_layer_algo_differs": dict(hf_quant=_n(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.in_proj", {"quant_algo": "NVFP4"}))),
    "mixed_layer_unknown_algo": dict(config=_q(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.in_proj", {"quant_algo": "INT4"})),
                                     hf_quant=_n(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.in_proj", {"quant_algo": "INT4"}))),
    "mixed_layer_not_a_dict": dict(config=_q(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.in_proj", "FP8")),
                                   hf_quant=_n(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.in_proj", "FP8"))),
    "mixed_layer_group_size_32": dict(
        config=_q(lambda q: q["quantized_layers"][f"{MOE}.experts.0.up_proj"].__setitem__("group_size", 32)),
        hf_quant=_n(lambda q: q["quantized_layers"][f"{MOE}.experts.0.up_proj"].__setitem__("group_size", 32))),
    "mixed_without_nvfp4": dict(
        tensors=lambda t: _experts_to_bf16(t),
        config=_q(_only_fp8_layers), hf_quant=_n(_only_fp8_layers)),
    "mixed_ignore_differs": dict(config=_q(lambda q: q.__setitem__("ignore", ["lm_head"]))),
    "mixed_ignore_in_both": dict(config=_q(lambda q: q.__setitem__("ignore", ["lm_head"])),
                                 hf_quant=_n(lambda q: q.__setitem__("exclude_modules", ["lm_head", 3]))),
    "ignore_unchecked_when_a_shard_is_missing": dict(
        config=_q(lambda q: q.__setitem__("ignore", ["nothing.here"])),
        hf_quant=_n(lambda q: q.__setitem__("exclude_modules", ["nothing.here"])),
        files=lambda root: (root / SHARD1).unlink()),
    "ignore_glob_matches": dict(config=_q(lambda q: q.__setitem__("ignore", ["lm_he*"])),
                                hf_quant=_n(lambda q: q.__setitem__("exclude_modules", ["lm_he*"]))),
    "ignore_parent_module": dict(config=_q(lambda q: q.__setitem__("ignore", ["backbone.layers.0"])),
                                 hf_quant=_n(lambda q: q.__setitem__("exclude_modules", ["backbone.layers.0"]))),
    "junk_layer_name": dict(config=_q(lambda q: q["quantized_layers"].__setitem__("a b", {"quant_algo": "FP8"})),
                            hf_quant=_n(lambda q: q["quantized_layers"].__setitem__("a b", {"quant_algo": "FP8"}))),
    "layer_name_without_weight": dict(config=_q(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.conv9", {"quant_algo": "FP8"})),
                                      hf_quant=_n(lambda q: q["quantized_layers"].__setitem__(f"{SSM}.conv9", {"quant_algo": "FP8"}))),
    "quantized_weight_3d": dict(tensors=lambda t: t.__setitem__(f"{SSM}.in_proj.weight", t[f"{SSM}.in_proj.weight"].reshape(1, IN_PROJ, H))),
    "nvfp4_k_not_whole_blocks": dict(tensors=lambda t: t.update({f"{MOE}.experts.{e}.up_proj.weight": torch.zeros(I, 4, dtype=torch.uint8) for e in range(E)})),
    "nvfp4_weight_as_fp8": dict(tensors=lambda t: t.__setitem__(f"{MOE}.experts.1.up_proj.weight", torch.zeros(I, H // 2).to(torch.float8_e4m3fn))),
    "scales_without_weight": dict(tensors=lambda t: t.pop(f"{SSM}.out_proj.weight")),
    "fp8_scale_as_vector": dict(tensors=lambda t: t.__setitem__(f"{SSM}.out_proj.weight_scale", torch.ones(2))),
    "fp8_input_scale_bf16": dict(tensors=lambda t: t.__setitem__(f"{SSM}.out_proj.input_scale", torch.tensor(0.05).to(torch.bfloat16))),
    "nvfp4_global_scale_missing": dict(tensors=lambda t: t.pop(f"{MOE}.experts.1.down_proj.weight_scale_2")),
    "kv_scale_leaf_next_to_fp8_weight": dict(tensors=lambda t: t.__setitem__(f"{SSM}.in_proj.k_scale", torch.tensor(1.0))),
    "bias_next_to_fp8_weight": dict(tensors=lambda t: t.__setitem__(f"{SSM}.in_proj.bias", torch.zeros(IN_PROJ))),
    "experts_not_numbered_from_0": dict(tensors=_renumber_expert, config=lambda c: c.__setitem__("n_routed_experts", "4")),
    "expert_in_another_format": dict(tensors=_expert_to_fp8, config=_q(_declare_expert_fp8), hf_quant=_n(_declare_expert_fp8)),
    "expert_without_down_proj": dict(tensors=lambda t: [t.pop(f"{MOE}.experts.2.down_proj.{leaf}") for leaf in ("weight", "weight_scale", "weight_scale_2")],
                                     config=_q(lambda q: _drop_layer(q, f"{MOE}.experts.2.down_proj")),
                                     hf_quant=_n(lambda q: _drop_layer(q, f"{MOE}.experts.2.down_proj"))),
    "fused_shards_in_two_formats": dict(tensors=_qkv_mixed, config=_q(_declare_qkv_mixed), hf_quant=_n(_declare_qkv_mixed)),
    "fused_shard_scale_not_f32": dict(tensors=_qkv_fp8_scale_bf16, config=_q(_declare_qkv_fp8), hf_quant=_n(_declare_qkv_fp8)),
    "deprecated_kv_scale": dict(tensors=lambda t: t.__setitem__(f"{ATTN}.k_proj.kv_scale", torch.tensor(0.1))),
    "kv_scale_not_f32": dict(tensors=lambda t: t.__setitem__(f"{ATTN}.v_proj.v_scale", torch.tensor(0.2).to(torch.bfloat16))),
    "kv_scale_vector": dict(tensors=lambda t: t.__setitem__(f"{ATTN}.v_proj.v_scale", torch.tensor([0.2, 0.3]))),
    "kv_scales_under_attn": dict(tensors=lambda t: (t.__setitem__(f"{ATTN}.attn.k_scale", t.pop(f"{ATTN}.k_proj.k_scale")),
                                                   t.__setitem__(f"{ATTN}.v_scale", t.pop(f"{ATTN}.v_proj.v_scale")))),
    "q_scale_on_q_proj": dict(tensors=lambda t: t.__setitem__(f"{ATTN}.q_proj.q_scale", torch.tensor(0.3))),
    "zero_block_scale": dict(tensors=lambda t: t[EXPERT0_SCALE].view(torch.uint8)[1].__setitem__(slice(0, 2), 0x80)),
    "nan_scale_with_sign": dict(tensors=lambda t: t[EXPERT0_SCALE].view(torch.uint8)[1].__setitem__(0, 0xFF)),
    "fp8_weight_negative_and_zero_bytes": dict(tensors=lambda t: t[f"{SSM}.in_proj.weight"].view(torch.uint8)[0].__setitem__(slice(0, 3), torch.tensor([0x80, 0x00, 0xB8], dtype=torch.uint8))),
    "large_f32_scale_not_scanned": dict(tensors=lambda t: t.__setitem__(f"{SSM}.in_proj.input_scale", torch.zeros(1 << 16 | 1))),
    "f32_scale_at_the_limit_is_scanned": dict(tensors=lambda t: t.__setitem__(f"{SSM}.in_proj.input_scale", torch.zeros(1 << 16))),
    "infinite_and_nan_scales": dict(tensors=lambda t: (t.__setitem__(f"{SSM}.in_proj.weight_scale", torch.tensor(float("inf"))),
                                                      t.__setitem__(f"{SSM}.out_proj.weight_scale", torch.tensor(float("nan"))))),
}



def build_scenario(tmp_path, name: str):
    d = SCENARIOS[name]
    tensors = make_tensors()
    config, hf_quant = make_configs()
    for key, target in (("tensors", tensors), ("config", config), ("hf_quant", hf_quant)):
        if key in d:
            if d[key] is _single:
                _single(tensors, config, hf_quant)
            else:
                d[key](target)
    root = write_checkpoint(tmp_path / "ckpt", tensors, config, hf_quant)
    if "files" in d:
        d["files"](root)
    return root


def findings_of(root) -> list[tuple]:
    return [(f.level, f.code, f.tensor_or_key, f.message.replace(str(root), "<root>")) for f in check_checkpoint(root).findings]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_checkpoint_gives_exactly_its_findings(tmp_path, name):
    assert findings_of(build_scenario(tmp_path, name)) == SCENARIO_FINDINGS[name]


def test_scenarios_all_have_findings_listed():
    assert sorted(SCENARIO_FINDINGS) == sorted(SCENARIOS)


# Each list is what the engines make of that checkpoint, finding by finding.
SCENARIO_FINDINGS = {'algo_lower_case': [('error',
                      'bad_value',
                      'config.json:quantization_config.quant_algo',
                      "'mixed_precision': SGLang compares quant_algo case-sensitively; write 'MIXED_PRECISION'")],
 'algo_not_a_string': [('error',
                        'unknown_quant_algo',
                        'config.json:quantization_config.quant_algo',
                        '4 is not a ModelOpt algo the engines accept (FP8, NVFP4, W4A16_NVFP4, MIXED_PRECISION)')],
 'bias_next_to_fp8_weight': [],
 'deprecated_kv_scale': [('error',
                          'kv_scale_dropped',
                          'backbone.layers.0.mixer.k_proj.kv_scale',
                          'deprecated fused kv_scale; write k_scale and v_scale')],
 'expert_in_another_format': [('error',
                               'algo_mismatch',
                               'backbone.layers.1.mixer.experts.3.down_proj',
                               'vLLM loads model.layers.1.mixer.experts as W4A16_NVFP4 but its tensors are FP8'),
                              ('error',
                               'mixed_moe_layer',
                               'backbone.layers.1.mixer.experts',
                               "experts declare ['FP8', 'W4A16_NVFP4']; the engines give every expert of a layer the "
                               'algo of its first entry'),
                              ('error',
                               'mixed_moe_layer',
                               'backbone.layers.1.mixer.experts',
                               "expert tensors mix formats ['FP8', 'NVFP4']"),
                              ('error',
                               'expert_shape_mismatch',
                               'backbone.layers.1.mixer.experts.3.down_proj',
                               "differs from most experts of backbone.layers.1.mixer.experts in [('input_scale', "
                               "'F32', ()), ('weight', 'F8_E4M3', (32, 32)), ('weight', 'U8', (32, 16)), "
                               "('weight_scale', 'F32', ()), ('weight_scale', 'F8_E4M3', (32, 2)), "
                               "('weight_scale_2', 'F32', ())]"),
                              ('error',
                               'expert_shape_mismatch',
                               'backbone.layers.1.mixer.experts.3.up_proj',
                               "differs from most experts of backbone.layers.1.mixer.experts in [('input_scale', "
                               "'F32', ()), ('weight', 'F8_E4M3', (32, 32)), ('weight', 'U8', (32, 16)), "
                               "('weight_scale', 'F32', ()), ('weight_scale', 'F8_E4M3', (32, 2)), "
                               "('weight_scale_2', 'F32', ())]")],
 'expert_without_down_proj': [('error',
                               'missing_tensor',
                               'backbone.layers.1.mixer.experts.2.down_proj.weight',
                               'expert lacks a projection its siblings have')],
 'experts_not_numbered_from_0': [('error',
                                  'pattern_matches_nothing',
                                  "quantized_layers['backbone.layers.1.mixer.experts.3.up_proj']",
                                  'names no module with a weight in the checkpoint'),
                                 ('error',
                                  'pattern_matches_nothing',
                                  "quantized_layers['backbone.layers.1.mixer.experts.3.down_proj']",
                                  'names no module with a weight in the checkpoint'),
                                 ('warning',
                                  'expert_count',
                                  'backbone.layers.1.mixer.experts',
                                  'expert indices are not 0..E-1'),
                                 ('error',
                                  'mixed_moe_layer',
                                  'backbone.layers.1.mixer.experts',
                                  "experts declare ['None', 'W4A16_NVFP4']; the engines give every expert of a layer "
                                  'the algo of its first entry')],
 'f32_scale_at_the_limit_is_scanned': [('error',
                                        'wrong_shape',
                                        'backbone.layers.2.mixer.in_proj.input_scale',
                                        '[65536], expected []'),
                                       ('error',
                                        'nonpositive_scale',
                                        'backbone.layers.2.mixer.in_proj.input_scale',
                                        '65536 value(s) not finite and > 0, e.g. 0.0')],
 'fp8_input_scale_bf16': [('error',
                           'wrong_dtype',
                           'backbone.layers.2.mixer.out_proj.input_scale',
                           'BF16, expected F32')],
 'fp8_scale_as_vector': [('error',
                          'wrong_shape',
                          'backbone.layers.2.mixer.out_proj.weight_scale',
                          '[2], expected []')],
 'fp8_weight_negative_and_zero_bytes': [],
 'fused_shard_scale_not_f32': [('error',
                                'wrong_dtype',
                                'backbone.layers.0.mixer.k_proj.weight_scale',
                                'BF16, expected F32'),
                               ('error',
                                'wrong_dtype',
                                'backbone.layers.0.mixer.q_proj.weight_scale',
                                'BF16, expected F32'),
                               ('error',
                                'wrong_dtype',
                                'backbone.layers.0.mixer.v_proj.weight_scale',
                                'BF16, expected F32')],
 'fused_shards_in_two_formats': [('error',
                                  'partial_fused_exclusion',
                                  'backbone.layers.0.mixer.k_proj',
                                  'the engines refuse model.layers.0.mixer.qkv_proj: shards of '
                                  "model.layers.0.mixer.qkv_proj declare different algos ['FP8', 'W4A16_NVFP4']")],
 'header_data_past_the_end': [('error',
                               'offset_past_eof',
                               'a',
                               'model-extra.safetensors: data ends at byte 73, the file has 69')],
 'header_duplicate_keys': [('error',
                            'bad_header',
                            'model-00002-of-00002.safetensors',
                            "header is not valid JSON: duplicate keys ['a', 'b']")],
 'header_entry_not_an_object': [('error', 'bad_header', 'a', 'model-extra.safetensors: entry is not an object')],
 'header_negative_shape': [('error',
                            'bad_header',
                            'a',
                            'model-extra.safetensors: shape [-1] is not a list of non-negative ints')],
 'header_not_utf8': [('error',
                      'bad_header',
                      'model-00002-of-00002.safetensors',
                      "header is not valid JSON: 'utf-8' codec can't decode byte 0xff in position 2: invalid start "
                      'byte')],
 'header_offsets_malformed': [('error',
                               'bad_header',
                               'a',
                               'model-extra.safetensors: data_offsets [0] are not [begin, end]'),
                              ('error',
                               'bad_header',
                               'b',
                               'model-extra.safetensors: data_offsets [0.0, 0] are not [begin, end]'),
                              ('error',
                               'bad_header',
                               'c',
                               'model-extra.safetensors: data_offsets [-1, 0] are not [begin, end]'),
                              ('error',
                               'bad_header',
                               'd',
                               'model-extra.safetensors: data_offsets None are not [begin, end]')],
 'header_offsets_reversed': [('error',
                              'bad_header',
                              'a',
                              'model-extra.safetensors: data_offsets [4, 0] are not [begin, end]')],
 'header_shape_not_a_list': [('error',
                              'bad_header',
                              'a',
                              'model-extra.safetensors: shape 4 is not a list of non-negative ints'),
                             ('error',
                              'bad_header',
                              'b',
                              'model-extra.safetensors: shape [1.0] is not a list of non-negative ints')],
 'header_shorter_than_it_claims': [('error',
                                    'truncated_file',
                                    'model-00002-of-00002.safetensors',
                                    'header claims 100 bytes, the file has 2 after the length')],
 'hf_quant_alone_with_a_producer_string': [('error',
                                            'producer_not_modelopt',
                                            'hf_quant_config.json:producer.name',
                                            'None: config.json has no quantization_config, so vLLM reads '
                                            'hf_quant_config.json, and it accepts that file only from producer '
                                            "'modelopt' (otherwise it builds the model unquantized or raises "
                                            "'Unsupported quantization config')")],
 'hf_quant_without_section': [('error',
                               'missing_key',
                               'hf_quant_config.json:quantization',
                               'no nested quantization section'),
                              ('warning',
                               'kv_scales_unused',
                               'backbone.layers.0.mixer.k_proj.k_scale',
                               'KV cache is not declared FP8; the engines ignore this scale'),
                              ('warning',
                               'kv_scales_unused',
                               'backbone.layers.0.mixer.v_proj.v_scale',
                               'KV cache is not declared FP8; the engines ignore this scale')],
 'ignore_glob_matches': [],
 'ignore_parent_module': [],
 'ignore_unchecked_when_a_shard_is_missing': [('error',
                                               'missing_shard',
                                               'model-00002-of-00002.safetensors',
                                               'shard named by the index is missing (16 tensors)')],
 'index_names_a_path': [('error',
                         'bad_json',
                         'x.weight',
                         "index names '../other.safetensors', not a file of this folder"),
                        ('error', 'bad_json', 'y.weight', 'index names 3, not a file of this folder')],
 'index_not_json': [('error',
                     'bad_json',
                     'model.safetensors.index.json',
                     'index has no weight_map: Expecting property name enclosed in double quotes: line 1 column 2 '
                     '(char 1)'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.0.up_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.0.down_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.1.up_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.1.down_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.2.up_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.2.down_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.3.up_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.1.mixer.experts.3.down_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.2.mixer.in_proj']",
                     'names no module with a weight in the checkpoint'),
                    ('error',
                     'pattern_matches_nothing',
                     "quantized_layers['backbone.layers.2.mixer.out_proj']",
                     'names no module with a weight in the checkpoint')],
 'index_without_weight_map': [('error',
                               'bad_json',
                               'model.safetensors.index.json',
                               'index has no weight_map: missing key'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.0.up_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.0.down_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.1.up_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.1.down_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.2.up_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.2.down_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.3.up_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.1.mixer.experts.3.down_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.2.mixer.in_proj']",
                               'names no module with a weight in the checkpoint'),
                              ('error',
                               'pattern_matches_nothing',
                               "quantized_layers['backbone.layers.2.mixer.out_proj']",
                               'names no module with a weight in the checkpoint')],
 'infinite_and_nan_scales': [('error',
                              'nonpositive_scale',
                              'backbone.layers.2.mixer.in_proj.weight_scale',
                              '1 value(s) not finite and > 0, e.g. inf'),
                             ('error',
                              'nonpositive_scale',
                              'backbone.layers.2.mixer.out_proj.weight_scale',
                              '1 value(s) not finite and > 0, e.g. nan')],
 'junk_layer_name': [('error',
                      'junk_module_name',
                      "quantized_layers['a b']",
                      'contains control characters, whitespace or a ModelOpt sentinel')],
 'kv_algo_int8': [('error',
                   'bad_value',
                   'hf_quant_config.json:kv_cache_quant_algo',
                   "'INT8'; fp4kit writes FP8 or null"),
                  ('error',
                   'config_mismatch',
                   'kv_cache_scheme',
                   "config.json kv_cache_scheme={'dynamic': False, 'num_bits': 8, 'type': 'float'} but "
                   "hf_quant_config.json kv_cache_quant_algo='INT8'")],
 'kv_scale_leaf_next_to_fp8_weight': [('error',
                                       'kv_scale_dropped',
                                       'backbone.layers.2.mixer.in_proj.k_scale',
                                       'the engines drop (or fail on) this name; attention KV scales load as '
                                       '<attn>.k_proj.k_scale / <attn>.v_proj.v_scale')],
 'kv_scale_not_f32': [('error', 'wrong_dtype', 'backbone.layers.0.mixer.v_proj.v_scale', 'BF16 [], expected F32 []')],
 'kv_scale_vector': [('error', 'wrong_dtype', 'backbone.layers.0.mixer.v_proj.v_scale', 'F32 [2], expected F32 []')],
 'kv_scales_under_attn': [],
 'kv_scheme_dynamic': [('warning',
                        'bad_value',
                        'config.json:quantization_config.kv_cache_scheme.dynamic',
                        'static per-tensor KV scales expect dynamic: false')],
 'kv_scheme_int8': [('error',
                     'config_mismatch',
                     'kv_cache_scheme',
                     "config.json kv_cache_scheme={'dynamic': False, 'num_bits': 4, 'type': 'float'} but "
                     "hf_quant_config.json kv_cache_quant_algo='FP8'"),
                    ('warning',
                     'kv_scales_unused',
                     'backbone.layers.0.mixer.k_proj.k_scale',
                     'KV cache is not declared FP8; the engines ignore this scale'),
                    ('warning',
                     'kv_scales_unused',
                     'backbone.layers.0.mixer.v_proj.v_scale',
                     'KV cache is not declared FP8; the engines ignore this scale')],
 'kv_scheme_int_type': [('error',
                         'config_mismatch',
                         'kv_cache_scheme',
                         "config.json kv_cache_scheme={'dynamic': False, 'num_bits': 8, 'type': 'int'} but "
                         "hf_quant_config.json kv_cache_quant_algo='FP8'"),
                        ('warning',
                         'kv_scales_unused',
                         'backbone.layers.0.mixer.k_proj.k_scale',
                         'KV cache is not declared FP8; the engines ignore this scale'),
                        ('warning',
                         'kv_scales_unused',
                         'backbone.layers.0.mixer.v_proj.v_scale',
                         'KV cache is not declared FP8; the engines ignore this scale')],
 'kv_scheme_not_a_dict': [('error',
                           'config_mismatch',
                           'kv_cache_scheme',
                           "config.json kv_cache_scheme='fp8' but hf_quant_config.json kv_cache_quant_algo='FP8'"),
                          ('warning',
                           'kv_scales_unused',
                           'backbone.layers.0.mixer.k_proj.k_scale',
                           'KV cache is not declared FP8; the engines ignore this scale'),
                          ('warning',
                           'kv_scales_unused',
                           'backbone.layers.0.mixer.v_proj.v_scale',
                           'KV cache is not declared FP8; the engines ignore this scale')],
 'large_f32_scale_not_scanned': [('error',
                                  'wrong_shape',
                                  'backbone.layers.2.mixer.in_proj.input_scale',
                                  '[65537], expected []')],
 'layer_name_without_weight': [('error',
                                'pattern_matches_nothing',
                                "quantized_layers['backbone.layers.2.mixer.conv9']",
                                'names no module with a weight in the checkpoint')],
 'layers_block_type_not_a_list': [('error',
                                   'bad_value',
                                   'config.json:layers_block_type',
                                   'must be a list of strings')],
 'layers_block_type_not_strings': [('error',
                                    'bad_value',
                                    'config.json:layers_block_type',
                                    'must be a list of strings'),
                                   ('error',
                                    'config_mismatch',
                                    'config.json:layers_block_type',
                                    "does not spell hybrid_override_pattern '*EM'; the engines use "
                                    'layers_block_type')],
 'mixed_ignore_differs': [('error',
                           'config_mismatch',
                           'ignore',
                           'config.json ignore and hf_quant_config.json exclude_modules differ')],
 'mixed_ignore_in_both': [('error',
                           'config_mismatch',
                           'ignore',
                           'config.json ignore and hf_quant_config.json exclude_modules differ')],
 'mixed_layer_algo_differs': [('error',
                               'config_mismatch',
                               'quantized_layers',
                               'config.json and hf_quant_config.json differ, first at '
                               "'backbone.layers.2.mixer.in_proj'")],
 'mixed_layer_group_size_32': [('error',
                                'bad_value',
                                'quantized_layers.backbone.layers.1.mixer.experts.0.up_proj.group_size',
                                '32, NVFP4 uses 16')],
 'mixed_layer_not_a_dict': [('error',
                             'unknown_quant_algo',
                             'quantized_layers.backbone.layers.2.mixer.in_proj',
                             "None is not one of ('FP8', 'NVFP4', 'W4A16_NVFP4')"),
                            ('error',
                             'not_declared',
                             'backbone.layers.2.mixer.in_proj',
                             'vLLM loads model.layers.2.mixer.in_proj unquantized but its tensors are FP8')],
 'mixed_layer_only_in_config': [('error',
                                 'config_mismatch',
                                 'quantized_layers',
                                 'config.json and hf_quant_config.json differ, first at '
                                 "'backbone.layers.2.mixer.in_proj'")],
 'mixed_layer_unknown_algo': [('error',
                               'unknown_quant_algo',
                               'quantized_layers.backbone.layers.2.mixer.in_proj',
                               "'INT4' is not one of ('FP8', 'NVFP4', 'W4A16_NVFP4')"),
                              ('error',
                               'not_declared',
                               'backbone.layers.2.mixer.in_proj',
                               'vLLM loads model.layers.2.mixer.in_proj unquantized but its tensors are FP8')],
 'mixed_layers_missing_everywhere': [('error',
                                      'missing_key',
                                      'config.json:quantization_config.quantized_layers',
                                      'MIXED_PRECISION needs quantized_layers in config.json (SGLang reads no other '
                                      'file once config.json has a quantization_config)'),
                                     ('error',
                                      'producer_not_modelopt',
                                      'hf_quant_config.json:producer.name',
                                      "'fp4kit': config.json's MIXED_PRECISION quantization_config has no "
                                      'quantized_layers, so vLLM reads hf_quant_config.json, and it accepts that '
                                      "file only from producer 'modelopt' (otherwise it builds the model unquantized "
                                      "or raises 'Unsupported quantization config')"),
                                     ('error',
                                      'missing_key',
                                      'hf_quant_config.json:quantized_layers',
                                      'MIXED_PRECISION needs a non-empty quantized_layers'),
                                     ('error',
                                      'not_declared',
                                      'backbone.layers.1.mixer.experts.0.down_proj',
                                      'vLLM loads model.layers.1.mixer.experts unquantized but its tensors are '
                                      'W4A16_NVFP4'),
                                     ('error',
                                      'not_declared',
                                      'backbone.layers.2.mixer.in_proj',
                                      'vLLM loads model.layers.2.mixer.in_proj unquantized but its tensors are FP8'),
                                     ('error',
                                      'not_declared',
                                      'backbone.layers.2.mixer.out_proj',
                                      'vLLM loads model.layers.2.mixer.out_proj unquantized but its tensors are '
                                      'FP8')],
 'mixed_nested_layers_missing': [('error',
                                  'missing_key',
                                  'hf_quant_config.json:quantized_layers',
                                  'MIXED_PRECISION needs a non-empty quantized_layers')],
 'mixed_without_nvfp4': [('error',
                          'unsupported_quant_algo',
                          'quantized_layers',
                          'SGLang serves MIXED_PRECISION without an NVFP4 layer as w4afp8')],
 'n_groups_missing': [('error', 'missing_key', 'config.json:n_groups', "nemotron_h's Mamba layers need n_groups")],
 'nan_scale_with_sign': [('error',
                          'nan_scale',
                          'backbone.layers.1.mixer.experts.0.up_proj.weight_scale',
                          '1 NaN bytes (0x7F/0xFF)')],
 'no_producer': [('warning', 'missing_key', 'config.json:quantization_config.producer', 'no producer recorded'),
                 ('warning', 'missing_key', 'hf_quant_config.json.producer', 'no producer recorded')],
 'no_quantization_anywhere': [('error',
                               'missing_key',
                               'hf_quant_config.json:quantization',
                               'no nested quantization section'),
                              ('error',
                               'missing_key',
                               'config.json:quantization_config',
                               'no quantization_config, and no hf_quant_config.json section for the engines to fall '
                               'back to'),
                              ('warning',
                               'kv_scales_unused',
                               'backbone.layers.0.mixer.k_proj.k_scale',
                               'KV cache is not declared FP8; the engines ignore this scale'),
                              ('warning',
                               'kv_scales_unused',
                               'backbone.layers.0.mixer.v_proj.v_scale',
                               'KV cache is not declared FP8; the engines ignore this scale')],
 'no_weights_at_all': [('error',
                        'missing_file',
                        'model.safetensors',
                        'neither model.safetensors nor its index is present'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.0.up_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.0.down_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.1.up_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.1.down_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.2.up_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.2.down_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.3.up_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.1.mixer.experts.3.down_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.2.mixer.in_proj']",
                        'names no module with a weight in the checkpoint'),
                       ('error',
                        'pattern_matches_nothing',
                        "quantized_layers['backbone.layers.2.mixer.out_proj']",
                        'names no module with a weight in the checkpoint')],
 'num_hidden_layers_differs': [('error',
                                'config_mismatch',
                                'config.json:hybrid_override_pattern',
                                '3 layers, num_hidden_layers says 4')],
 'nvfp4_global_scale_missing': [('error',
                                 'missing_tensor',
                                 'backbone.layers.1.mixer.experts.1.down_proj.weight_scale_2',
                                 'expected F32 []'),
                                ('error',
                                 'expert_shape_mismatch',
                                 'backbone.layers.1.mixer.experts.1.down_proj',
                                 'differs from most experts of backbone.layers.1.mixer.experts in '
                                 "[('weight_scale_2', 'F32', ())]")],
 'nvfp4_k_not_whole_blocks': [('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.0.up_proj.weight',
                               'K = 8 is not a multiple of 16'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.0.up_proj.weight_scale',
                               '[32, 2], expected [32, 0]'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.1.up_proj.weight',
                               'K = 8 is not a multiple of 16'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.1.up_proj.weight_scale',
                               '[32, 2], expected [32, 0]'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.2.up_proj.weight',
                               'K = 8 is not a multiple of 16'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.2.up_proj.weight_scale',
                               '[32, 2], expected [32, 0]'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.3.up_proj.weight',
                               'K = 8 is not a multiple of 16'),
                              ('error',
                               'wrong_shape',
                               'backbone.layers.1.mixer.experts.3.up_proj.weight_scale',
                               '[32, 2], expected [32, 0]')],
 'nvfp4_weight_as_fp8': [('error',
                          'wrong_dtype',
                          'backbone.layers.1.mixer.experts.1.up_proj.weight',
                          'F8_E4M3, W4A16_NVFP4 stores U8'),
                         ('error',
                          'algo_mismatch',
                          'backbone.layers.1.mixer.experts.1.up_proj',
                          'vLLM loads model.layers.1.mixer.experts as W4A16_NVFP4 but its tensors are FP8'),
                         ('error',
                          'mixed_moe_layer',
                          'backbone.layers.1.mixer.experts',
                          "expert tensors mix formats ['FP8', 'NVFP4']"),
                         ('error',
                          'expert_shape_mismatch',
                          'backbone.layers.1.mixer.experts.1.up_proj',
                          "differs from most experts of backbone.layers.1.mixer.experts in [('weight', 'F8_E4M3', "
                          "(32, 16)), ('weight', 'U8', (32, 16))]")],
 'pattern_empty': [('error', 'bad_value', 'config.json:hybrid_override_pattern', "'' is not a string over 'M*-E'")],
 'pattern_not_a_pattern': [('error',
                            'bad_value',
                            'config.json:hybrid_override_pattern',
                            "'*EX' is not a string over 'M*-E'")],
 'pattern_without_mamba_needs_no_groups': [('error',
                                            'layer_type_mismatch',
                                            'backbone.layers.2',
                                            "pattern says '-' but no tensor has '.mixer.up_proj'")],
 'q_scale_on_q_proj': [('error',
                        'kv_scale_dropped',
                        'backbone.layers.0.mixer.q_proj.q_scale',
                        'the engines drop (or fail on) this name; attention KV scales load as <attn>.k_proj.k_scale '
                        '/ <attn>.v_proj.v_scale')],
 'quant_method_not_modelopt': [('error',
                                'bad_value',
                                'config.json:quantization_config.quant_method',
                                "'fp8', expected 'modelopt'")],
 'quantized_weight_3d': [('error',
                          'wrong_shape',
                          'backbone.layers.2.mixer.in_proj.weight',
                          '[1, 164, 32], expected 2-D')],
 'scales_without_weight': [('error',
                            'pattern_matches_nothing',
                            "quantized_layers['backbone.layers.2.mixer.out_proj']",
                            'names no module with a weight in the checkpoint'),
                           ('error',
                            'missing_tensor',
                            'backbone.layers.2.mixer.out_proj.weight',
                            'FP8 module has no weight')],
 'single_conformant': [],
 'single_exclude_not_strings': [('error',
                                 'bad_value',
                                 'hf_quant_config.json:exclude_modules',
                                 'must be a list of module names'),
                                ('error',
                                 'not_excluded',
                                 'backbone.layers.0.mixer.k_proj',
                                 'vLLM loads model.layers.0.mixer.qkv_proj as W4A16_NVFP4 but its weight is BF16; '
                                 'exclude it'),
                                ('error',
                                 'not_excluded',
                                 'backbone.layers.0.mixer.o_proj',
                                 'vLLM loads model.layers.0.mixer.o_proj as W4A16_NVFP4 but its weight is BF16; '
                                 'exclude it'),
                                ('error',
                                 'not_excluded',
                                 'backbone.layers.1.mixer.shared_experts.down_proj',
                                 'vLLM loads model.layers.1.mixer.shared_experts.down_proj as W4A16_NVFP4 but its '
                                 'weight is BF16; exclude it'),
                                ('error',
                                 'not_excluded',
                                 'backbone.layers.1.mixer.shared_experts.up_proj',
                                 'vLLM loads model.layers.1.mixer.shared_experts.up_proj as W4A16_NVFP4 but its '
                                 'weight is BF16; exclude it'),
                                ('error',
                                 'not_excluded',
                                 'backbone.layers.2.mixer.in_proj',
                                 'vLLM loads model.layers.2.mixer.in_proj as W4A16_NVFP4 but its weight is BF16; '
                                 'exclude it'),
                                ('error',
                                 'not_excluded',
                                 'backbone.layers.2.mixer.out_proj',
                                 'vLLM loads model.layers.2.mixer.out_proj as W4A16_NVFP4 but its weight is BF16; '
                                 'exclude it'),
                                ('error',
                                 'not_excluded',
                                 'lm_head',
                                 'vLLM loads lm_head as W4A16_NVFP4 but its weight is BF16; exclude it')],
 'single_file_checkpoint': [],
 'single_fp8_algo': [('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.0.down_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'algo_mismatch',
                      'backbone.layers.1.mixer.experts.0.down_proj',
                      'vLLM loads model.layers.1.mixer.experts as FP8 but its tensors are W4A16_NVFP4'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.0.up_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.1.down_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.1.up_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.2.down_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.2.up_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.3.down_proj.weight',
                      'U8, FP8 stores F8_E4M3'),
                     ('error',
                      'wrong_dtype',
                      'backbone.layers.1.mixer.experts.3.up_proj.weight',
                      'U8, FP8 stores F8_E4M3')],
 'single_group_size_32': [('error', 'bad_value', 'config.json:quantization_config.group_size', '32, NVFP4 uses 16'),
                          ('error',
                           'bad_value',
                           'hf_quant_config.json:quantization.group_size',
                           '32, NVFP4 uses 16')],
 'single_ignore_differs': [('error',
                            'config_mismatch',
                            'ignore',
                            'config.json ignore and hf_quant_config.json exclude_modules differ')],
 'single_ignore_not_a_list': [('error',
                               'bad_value',
                               'config.json:quantization_config.ignore',
                               'must be a list of module names'),
                              ('error',
                               'not_excluded',
                               'backbone.layers.0.mixer.k_proj',
                               'vLLM loads model.layers.0.mixer.qkv_proj as W4A16_NVFP4 but its weight is BF16; '
                               'exclude it'),
                              ('error',
                               'not_excluded',
                               'backbone.layers.0.mixer.o_proj',
                               'vLLM loads model.layers.0.mixer.o_proj as W4A16_NVFP4 but its weight is BF16; '
                               'exclude it'),
                              ('error',
                               'not_excluded',
                               'backbone.layers.1.mixer.shared_experts.down_proj',
                               'vLLM loads model.layers.1.mixer.shared_experts.down_proj as W4A16_NVFP4 but its '
                               'weight is BF16; exclude it'),
                              ('error',
                               'not_excluded',
                               'backbone.layers.1.mixer.shared_experts.up_proj',
                               'vLLM loads model.layers.1.mixer.shared_experts.up_proj as W4A16_NVFP4 but its weight '
                               'is BF16; exclude it'),
                              ('error',
                               'not_excluded',
                               'backbone.layers.2.mixer.in_proj',
                               'vLLM loads model.layers.2.mixer.in_proj as W4A16_NVFP4 but its weight is BF16; '
                               'exclude it'),
                              ('error',
                               'not_excluded',
                               'backbone.layers.2.mixer.out_proj',
                               'vLLM loads model.layers.2.mixer.out_proj as W4A16_NVFP4 but its weight is BF16; '
                               'exclude it'),
                              ('error',
                               'not_excluded',
                               'lm_head',
                               'vLLM loads lm_head as W4A16_NVFP4 but its weight is BF16; exclude it')],
 'single_nested_without_keys': [('error',
                                 'config_mismatch',
                                 'kv_cache_scheme',
                                 "config.json kv_cache_scheme={'dynamic': False, 'num_bits': 8, 'type': 'float'} but "
                                 'hf_quant_config.json kv_cache_quant_algo=None'),
                                ('error',
                                 'missing_key',
                                 'hf_quant_config.json:quantization.group_size',
                                 'vLLM requires it for NVFP4 (value may be null)'),
                                ('error',
                                 'missing_key',
                                 'hf_quant_config.json:quantization.kv_cache_quant_algo',
                                 'vLLM requires it for NVFP4 (value may be null)'),
                                ('error',
                                 'missing_key',
                                 'hf_quant_config.json:quantization.exclude_modules',
                                 'vLLM requires it for NVFP4 (value may be null)'),
                                ('error',
                                 'config_mismatch',
                                 'ignore',
                                 'config.json ignore and hf_quant_config.json exclude_modules differ')],
 'single_no_ignore': [('error',
                       'missing_key',
                       'config.json:quantization_config.ignore',
                       'hf_quant_config.json excludes modules but config.json has no ignore list'),
                      ('error',
                       'config_mismatch',
                       'ignore',
                       'config.json ignore and hf_quant_config.json exclude_modules differ')],
 'single_nvfp4_algo': [('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.0.down_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.0.up_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.1.down_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.1.up_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.2.down_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.2.up_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.3.down_proj.input_scale',
                        'expected F32 []'),
                       ('error',
                        'missing_tensor',
                        'backbone.layers.1.mixer.experts.3.up_proj.input_scale',
                        'expected F32 []')],
 'single_with_quantized_layers': [('warning',
                                   'bad_value',
                                   'quantized_layers',
                                   'quantized_layers is ignored unless quant_algo is MIXED_PRECISION (it is '
                                   'W4A16_NVFP4)')],
 'single_with_quantized_layers_in_config_json': [('warning',
                                                  'bad_value',
                                                  'quantized_layers',
                                                  'quantized_layers is ignored unless quant_algo is MIXED_PRECISION '
                                                  '(it is W4A16_NVFP4)')],
 'zero_block_scale': [('error',
                       'nonpositive_scale',
                       'backbone.layers.1.mixer.experts.0.up_proj.weight_scale',
                       '2 zero block scales')]}


# --- the engines' name rules, one branch at a time ---

QKV = ("q_proj", "k_proj", "v_proj")
UNIT = "model.layers.0.mixer.qkv_proj"
SHARDS_OF = [f"model.layers.0.mixer.{s}" for s in QKV]


def test_engine_names():
    assert cf._engine_name("backbone") == "model"
    assert cf._engine_name("backbone.layers.0.mixer") == "model.layers.0.mixer"
    assert cf._engine_name("backbone.embeddings") == "model.embed_tokens"
    assert cf._engine_name("backbones.layers.0") == "backbones.layers.0"
    assert cf._engine_name("x.backbone.y") == "x.backbone.y"
    assert cf._split("a.b.weight") == ("a.b", "weight") and cf._split("weight") == ("", "weight")


def test_expand_trailing_star():
    assert cf._expand_trailing_star(["a.b*", "a.b.*", "*", "c"]) == ["a.b", "a.b.*", "a.b.*", "*", "c"]
    assert cf._expand_trailing_star(["x*"]) == ["x", "x.*"]


def test_vllm_exclusion_branches():
    assert not cf.vllm_excluded(UNIT, [])
    assert cf.vllm_excluded(UNIT, [UNIT], QKV)  # the fused name itself
    assert not cf.vllm_excluded(UNIT, ["model.layers.0.mixer.o_proj"], QKV)
    assert cf.vllm_excluded(UNIT, ["model.layers.0"], QKV)  # a parent, by substring
    assert cf.vllm_excluded(UNIT, ["model.layers.0.mixer.*"], QKV)  # a glob
    with pytest.raises(ValueError) as e:
        cf.vllm_excluded(UNIT, SHARDS_OF[:2], QKV)
    assert str(e.value) == f"some but not all shards of {UNIT} are excluded"
    experts = "model.layers.1.mixer.experts"
    assert cf.vllm_excluded(experts, [experts + ".0.up_proj"])
    assert not cf.vllm_excluded(experts, ["model.layers.1.mixer.shared_experts.up_proj", "model.layers.10.mixer.experts"])
    assert cf.vllm_excluded("a.b", ["a.b"]) and not cf.vllm_excluded("a.b", ["a.bc"])
    assert cf.vllm_excluded("a.bc", ["a.b"])  # a substring
    assert cf.vllm_excluded("a.b", ["a.?"])  # fnmatch: ? is one character
    assert not cf.vllm_excluded("A.B", ["a.b"])  # case-sensitive
    assert not cf.vllm_excluded("a.b", ["c", "d*"])


def test_sglang_exclusion_branches():
    assert not cf.sglang_excluded(UNIT, [])
    assert cf.sglang_excluded(UNIT, ["model.layers.0.mixer.*"], QKV)  # a glob over the whole name
    assert cf.sglang_excluded(UNIT, ["mixer"], QKV)  # a glob over one part
    assert not cf.sglang_excluded(UNIT, ["mix*r.q*"], QKV)
    assert cf.sglang_excluded(UNIT, SHARDS_OF, QKV)
    assert not cf.sglang_excluded(UNIT, ["model.layers.0.mixer.o_proj"], QKV)
    assert cf.sglang_excluded(UNIT, ["model.layers.0"], QKV)  # a dotted parent of every shard
    with pytest.raises(ValueError) as e:
        cf.sglang_excluded(UNIT, SHARDS_OF[1:], QKV)
    assert str(e.value) == f"some but not all shards of {UNIT} are excluded"
    experts = "model.layers.1.mixer.experts"
    assert not cf.sglang_excluded(experts, ["model.layers.1.mixer"])  # is_layer_excluded: exact or glob only
    assert cf.sglang_excluded(experts, ["model.layers.1.mixer.exp*"])
    assert cf.sglang_excluded("model.layers.1.mixer.experts.0.up_proj", ["model.layers.1.mixer.experts"])
    assert cf.sglang_excluded("model.layers.1.mixer.experts.0.up", ["xx.model.layers.1.mixer.experts.0.up.yy"])
    assert not cf.sglang_excluded("model.layers.1.mixer.shared.up", ["xx.model.layers.1.mixer.shared.up.yy"])
    assert cf.sglang_excluded("a.b.c", ["b.c."]) and cf.sglang_excluded("a.b.c", ["a.b"])
    assert not cf.sglang_excluded("a.bc", ["a.b"]) and not cf.sglang_excluded("a.b", ["a.b.c"])


def test_path_and_glob_matching():
    assert cf._path_match("a.b", "a.b") and cf._path_match("a.b.", "a.b") and cf._path_match("a.b", "a.b.")
    assert cf._path_match("a", "a.b") and cf._path_match("b", "a.b.c") and not cf._path_match("a.b", "a.bc")
    assert not cf._path_match("b.c", "a.b") and not cf._path_match("a.b", "xa.b")
    assert cf._glob_fullmatch("a.*", "a.b.c") and not cf._glob_fullmatch("a.*", "xa.b")
    assert cf._glob_fullmatch("a.b", "a.b") and not cf._glob_fullmatch("a.b", "axb") and not cf._glob_fullmatch("a", "a.b")


def test_mixed_algo_lookups():
    layers = {f"{SHARDS_OF[0]}": "NVFP4", f"{SHARDS_OF[1]}": "NVFP4", "model.layers.0.mixer.o_proj": "FP8"}
    assert cf.sglang_mixed_algo(UNIT, {UNIT: "FP8", **layers}, QKV) == "FP8"  # the exact name first
    assert cf.sglang_mixed_algo(UNIT, layers, QKV) == "NVFP4"  # then the shards, which agree
    assert cf.sglang_mixed_algo(UNIT, {"model.layers.0.mixer.o_proj": "FP8"}, QKV) is None
    with pytest.raises(ValueError) as e:
        cf.sglang_mixed_algo(UNIT, {**layers, SHARDS_OF[2]: "FP8"}, QKV)
    assert str(e.value) == f"shards of {UNIT} declare different algos ['FP8', 'NVFP4']"
    assert cf.sglang_mixed_algo("a.b", {"a.bc.d": "FP8", "a.b.c": "NVFP4", "a.b.d": "FP8"}) == "NVFP4"  # first key under it
    assert cf.sglang_mixed_algo("a.b", {"a.b": "FP8"}, ("c",)) == "FP8"
    assert cf.sglang_mixed_algo("a.b", {"a.c": "FP8"}) is None
    experts = "model.layers.1.mixer.experts"
    assert cf.vllm_mixed_algo(experts, {"model.layers.1.mixer.gate": "FP8"}) == "FP8"  # any key under the parent
    assert cf.vllm_mixed_algo(experts, {"model.layers.10.mixer.gate": "FP8"}) is None
    assert cf.vllm_mixed_algo("model.layers.1.mixer.up_proj", {"model.layers.1.mixer.gate": "FP8"}) is None
    assert cf.vllm_mixed_algo(experts, {experts + ".0.up_proj": "NVFP4", "model.layers.1.mixer.gate": "FP8"}) == "NVFP4"


def test_flat_view_of_hf_quant_config():
    nested = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"], "kv_cache_quant_algo": "FP8",
              "quantized_layers": {"a": 1}, "other": 3}
    assert cf._flat_view(nested, {"producer": {"name": "modelopt"}}) == {
        "quant_method": "modelopt", "producer": {"name": "modelopt"}, "quant_algo": "NVFP4", "group_size": 16,
        "quantized_layers": {"a": 1}, "ignore": ["lm_head"], "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    assert cf._flat_view({"kv_cache_quant_algo": "INT8"}, {}) == {"quant_method": "modelopt"}


def test_fused_scale_rules_and_families():
    assert cf._fused_scale_rules("NVFP4", False) == [
        ("weight_scale_2", "error", "the engines use the largest value for every shard without requantizing, so the other "
                                    "shards dequantize scaled by the ratio"),
        ("input_scale", "warning", "the engines quantize the shared input with the largest value (vLLM warns)")]
    assert cf._fused_scale_rules("W4A16_NVFP4", True) == [
        ("weight_scale_2", "error", "the engines use the gate's (w1) value for every shard without requantizing, so the "
                                    "other shards dequantize scaled by the ratio")]
    assert cf._fused_scale_rules("FP8", False) == [
        ("weight_scale", "warning", "the engines requantize every shard to the largest scale (one more rounding)"),
        ("input_scale", "warning", "the engines quantize the shared input with the largest value (vLLM warns)")]
    assert cf._fused_scale_rules(None, False) == [] and cf._fused_scale_rules("UNKNOWN", True) == []
    assert [cf._family(a) for a in ("NVFP4", "W4A16_NVFP4", "FP8", None)] == ["NVFP4", "NVFP4", "FP8", None]


def test_report_lists_and_dict():
    r = cf.ConformanceReport("p", [cf.Finding("warning", "w", None, "m1"), cf.Finding("error", "e", "k", "m2")], tensors=3)
    assert r.warnings == [r.findings[0]] and r.errors == [r.findings[1]] and not r.ok
    assert r.to_dict() == {"path": "p", "ok": False, "tensors": 3, "errors": 1, "warnings": 1, "findings": [
        {"level": "warning", "code": "w", "tensor_or_key": None, "message": "m1"},
        {"level": "error", "code": "e", "tensor_or_key": "k", "message": "m2"}]}
    assert cf.ConformanceReport("q", [cf.Finding("warning", "w", None, "m")]).ok


def test_header_reader_returns_offsets_from_the_file_start(tmp_path):
    header = b'{"a": {"dtype": "BF16", "shape": [2, 1], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [], "data_offsets": [4, 5]}}'
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03\x04\x05")
    tensors, problems = cf.read_safetensors_header(path)
    assert problems == []
    assert tensors == {"a": cf.TensorInfo(path, "BF16", (2, 1), 8 + len(header), 4),
                       "b": cf.TensorInfo(path, "U8", (), 8 + len(header) + 4, 1)}
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03\x04")  # one byte short
    tensors, problems = cf.read_safetensors_header(path)
    assert list(tensors) == ["a"]
    assert problems == [("offset_past_eof", "b", f"data ends at byte {8 + len(header) + 5}, the file has {8 + len(header) + 4}")]
    path.write_bytes(struct.pack("<Q", cf.MAX_HEADER_BYTES) + b"{}")
    with pytest.raises(cf._HeaderError) as e:
        cf.read_safetensors_header(path)
    assert (e.value.code, str(e.value)) == ("truncated_file", f"header claims {cf.MAX_HEADER_BYTES} bytes, the file has 2 after the length")
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(cf._HeaderError) as e:
        cf.read_safetensors_header(path)
    assert (e.value.code, str(e.value)) == ("truncated_file", "7 bytes, shorter than the 8-byte header length")
    path.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert cf.read_safetensors_header(path) == ({}, [])


def test_a_folder_that_does_not_exist(tmp_path):
    report = check_checkpoint(tmp_path / "nothing")
    assert [(f.level, f.code, f.tensor_or_key, f.message) for f in report.findings] == [
        ("error", "missing_file", str(tmp_path / "nothing"), "checkpoint folder does not exist")]
    assert report.tensors == 0


# --- edge cases of the rules ---------------------------------------------------------------------

ATTN, MOE, SSM = "backbone.layers.0.mixer", "backbone.layers.1.mixer", "backbone.layers.2.mixer"
JUNK = "backbone.layers.2.mixer.in_proj.\u0000backbone.pt_name_sentinel"


def _findings(root):
    return [(f.level, f.code, f.tensor_or_key, f.message.replace(str(root), "<root>")) for f in check_checkpoint(root).findings]


def _build(tmp_path, tensors=None, config=None, hf_quant=None, index_extra=None):
    t = make_tensors() if tensors is None else tensors
    c, h = make_configs()
    return write_checkpoint(tmp_path / "ckpt", t, config or c, hf_quant or h, index_extra=index_extra)


def _both_sections(config, hf_quant, edit):
    edit(config["quantization_config"])
    edit(hf_quant["quantization"])


# --- checkpoints; each test below pins every finding one of them gives ---


def _case_scale_without_weight_format(tmp_path, monkeypatch):
    """An undeclared BF16 o_proj carrying a weight_scale: scales without a quantized weight."""
    t = make_tensors()
    t[f"{ATTN}.o_proj.weight_scale"] = torch.tensor(0.5)
    return _build(tmp_path, t)


def _case_unreadable_fused_shard(tmp_path, monkeypatch):
    """q/k/v NVFP4 with differing global scales, q_proj losing a tensor the index names; gated
    experts whose gate/up global scales differ come after it."""
    t = make_tensors()
    _attention_in(_nvfp4)(t)
    _gated_experts(t)
    c, h = make_configs()
    for edit, section in zip(_declare_attention("W4A16_NVFP4"), (c, h)):
        edit(section)
    _declare_gated_experts(c["quantization_config"])
    _declare_gated_experts(h["quantization"])
    return write_checkpoint(tmp_path / "ckpt", t, c, h, index_extra={f"{ATTN}.q_proj.bias": SHARDS[0]})


def _case_fused_shards_of_two_formats(tmp_path, monkeypatch):
    """q_proj W4A4 NVFP4 (with input_scale), k/v W4A16: the fused group mixes formats."""
    t = make_tensors()
    _attention_in(_nvfp4)(t)
    t[f"{ATTN}.q_proj.input_scale"] = torch.tensor(0.1)
    c, h = make_configs()
    for edit, section in zip(_declare_attention("W4A16_NVFP4"), (c, h)):
        edit(section)
    for s in (c["quantization_config"], h["quantization"]):
        s["quantized_layers"][f"{ATTN}.q_proj"] = {"quant_algo": "NVFP4", "group_size": 16}
    return write_checkpoint(tmp_path / "ckpt", t, c, h)


def _case_exclude_modules_only_in_hf_quant(tmp_path, monkeypatch):
    c, h = make_configs()
    h["quantization"]["exclude_modules"] = ["backbone.layers.9.nothing"]
    return _build(tmp_path, config=c, hf_quant=h)


def _case_empty_nested_quantized_layers(tmp_path, monkeypatch):
    c, h = make_configs()
    h["quantization"]["quantized_layers"] = {}
    return _build(tmp_path, config=c, hf_quant=h)


def _case_empty_flat_quantized_layers(tmp_path, monkeypatch):
    c, h = make_configs()
    c["quantization_config"]["quantized_layers"] = {}
    return _build(tmp_path, config=c, hf_quant=h)


def _case_layer_missing_from_config_json_only(tmp_path, monkeypatch):
    c, h = make_configs()
    del c["quantization_config"]["quantized_layers"][f"{SSM}.out_proj"]
    return _build(tmp_path, config=c, hf_quant=h)


def _case_nvfp4_layers_without_group_size(tmp_path, monkeypatch):
    c, h = make_configs()
    for s in (c["quantization_config"], h["quantization"]):
        for entry in s["quantized_layers"].values():
            entry.pop("group_size", None)
    return _build(tmp_path, config=c, hf_quant=h)


def _case_partial_fused_exclusion_then_undeclared_module(tmp_path, monkeypatch):
    c, h = make_configs()
    for s in (c["quantization_config"], h["quantization"]):
        s["ignore" if "quant_method" in s else "exclude_modules"] = [f"{ATTN}.q_proj"]
        del s["quantized_layers"][f"{SSM}.out_proj"]
    return _build(tmp_path, config=c, hf_quant=h)


def _ignore_case(entries):
    def case(tmp_path, monkeypatch):
        c, h = make_configs()
        c["quantization_config"]["ignore"] = list(entries)
        h["quantization"]["exclude_modules"] = list(entries)
        return _build(tmp_path, config=c, hf_quant=h)

    return case


def _case_expert_prefix_excluded(tmp_path, monkeypatch):
    return _ignore_case([f"{MOE}.experts.0"])(tmp_path, monkeypatch)


def _case_junk_then_unmatched_ignore(tmp_path, monkeypatch):
    return _ignore_case([JUNK, "backbone.layers.9.nothing"])(tmp_path, monkeypatch)


def _case_empty_ignore_entry(tmp_path, monkeypatch):
    return _ignore_case([""])(tmp_path, monkeypatch)


def _case_top_level_prefix_ignored(tmp_path, monkeypatch):
    return _ignore_case(["backbone"])(tmp_path, monkeypatch)


def _case_incomplete_then_junk_ignore(tmp_path, monkeypatch):
    """The second shard is missing; the ignore list names a module, then junk."""
    c, h = make_configs()
    for s, key in ((c["quantization_config"], "ignore"), (h["quantization"], "exclude_modules")):
        s[key] = ["backbone.layers.9.nothing", JUNK]
    root = _build(tmp_path, config=c, hf_quant=h)
    (root / SHARDS[1]).unlink()
    return root


def _case_two_experts_lack_a_projection(tmp_path, monkeypatch):
    t = make_tensors()
    for e in (1, 2):
        for leaf in ("weight", "weight_scale", "weight_scale_2"):
            del t[f"{MOE}.experts.{e}.down_proj.{leaf}"]
    return _build(tmp_path, t)


def _case_empty_f32_input_scale(tmp_path, monkeypatch):
    t = make_tensors()
    t[f"{SSM}.in_proj.input_scale"] = torch.zeros(0)
    return _build(tmp_path, t)


def _case_index_names_no_file_of_the_folder(tmp_path, monkeypatch):
    extra = {"a.weight": "sub\\x.safetensors", "b.weight": "", "c.weight": ".", "d.weight": ".."}
    return _build(tmp_path, index_extra=extra)


def _case_missing_shard_sorted_first(tmp_path, monkeypatch):
    return _build(tmp_path, index_extra={"extra.weight": "model-00000-of-00002.safetensors"})


def _case_unreadable_shard_sorted_first(tmp_path, monkeypatch):
    root = _build(tmp_path, index_extra={"extra.weight": "model-00000-of-00002.safetensors"})
    (root / "model-00000-of-00002.safetensors").write_bytes(b"\x01\x02\x03")
    return root


def _case_duplicate_then_unindexed_tensor(tmp_path, monkeypatch):
    root = _build(tmp_path)
    second = {n: v for n, v in make_tensors().items() if ".layers.0." not in n and ".layers.1." not in n}
    second["backbone.layers.0.norm.weight"] = make_tensors()["backbone.layers.0.norm.weight"]
    second["zz.extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(second, str(root / SHARDS[1]), metadata={"format": "pt"})
    return root


def _single_file(tmp_path):
    """The default checkpoint as one model.safetensors (no index)."""
    root = _build(tmp_path)
    tensors = make_tensors()
    for shard in SHARDS:
        (root / shard).unlink()
    (root / "model.safetensors.index.json").unlink()
    save_file({n: v.contiguous() for n, v in tensors.items()}, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def _case_single_file_bad_header(tmp_path, monkeypatch):
    root = _single_file(tmp_path)
    (root / "model.safetensors").write_bytes(b"\x01\x02\x03")
    return root


def _case_single_file_unreadable(tmp_path, monkeypatch):
    root = _single_file(tmp_path)

    def read(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cf, "read_safetensors_header", read)
    return root


def _case_fp8_scale_bytes_in_first_chunk(tmp_path, monkeypatch):
    """NaN, zero and negative block scales in the first of several read chunks."""
    monkeypatch.setattr(cf, "_CHUNK_BYTES", 8)
    t = make_tensors()
    name = f"{MOE}.experts.0.up_proj.weight_scale"
    raw = t[name].view(torch.uint8).clone()
    raw[0, 0], raw[0, 1], raw[1, 0] = 0x7F, 0x00, 0xB8
    t[name] = raw.view(torch.float8_e4m3fn)
    return _build(tmp_path, t)


def _case_shard_shrinks_after_header_read(tmp_path, monkeypatch):
    """The second shard loses its data bytes after its header was read."""
    root = _build(tmp_path)
    real = cf.read_safetensors_header

    def read(path):
        out = real(path)
        if path.name == SHARDS[1]:
            raw = path.read_bytes()
            n = struct.unpack("<Q", raw[:8])[0]
            path.write_bytes(raw[: 8 + n])
        return out

    monkeypatch.setattr(cf, "read_safetensors_header", read)
    return root


def _case_config_json_missing(tmp_path, monkeypatch):
    root = _build(tmp_path)
    (root / "config.json").unlink()
    return root


def _case_norm_modules_in_single_algo(tmp_path, monkeypatch):
    """W4A16 single-algo checkpoint with a 2-D BF16 `q_norm` (a norm: never quantized) and a 2-D
    BF16 linear under a module whose parent name has `norm` in it (a linear, not excluded)."""
    t, c, h = _single_algo_parts()
    t[f"{ATTN}.q_norm.weight"] = torch.ones(4, 8, dtype=torch.bfloat16)
    t[f"{ATTN}.norm_gate.proj.weight"] = torch.ones(32, 32, dtype=torch.bfloat16)
    return write_checkpoint(tmp_path / "ckpt", t, c, h)


def _case_top_level_norm_module(tmp_path, monkeypatch):
    t, c, h = _single_algo_parts()
    t["final_norm.weight"] = torch.ones(4, 8, dtype=torch.bfloat16)
    return write_checkpoint(tmp_path / "ckpt", t, c, h)


def _case_non_ascii_config_in_latin1_locale(tmp_path, monkeypatch):
    """config.json and hf_quant_config.json hold a non-ASCII algo; the locale is Latin-1."""
    c, h = make_configs()
    c["quantization_config"]["quant_algo"] = "NVFP4\u00e9"
    h["quantization"]["quant_algo"] = "NVFP4\u00e9"
    root = tmp_path / "ckpt"
    write_checkpoint(root, make_tensors(), c, h)
    for name, data in (("config.json", c), ("hf_quant_config.json", h)):
        (root / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    real = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: "latin-1" if encoding is None else real(encoding))
    return root


CASES = {k[len("_case_"):]: v for k, v in dict(globals()).items() if k.startswith("_case_")}


EXPECTED = {'config_json_missing': [('error', 'missing_file', 'config.json', 'config.json is missing'),
                         ('warning',
                          'kv_scales_unused',
                          'backbone.layers.0.mixer.k_proj.k_scale',
                          'KV cache is not declared FP8; the engines ignore this scale'),
                         ('warning',
                          'kv_scales_unused',
                          'backbone.layers.0.mixer.v_proj.v_scale',
                          'KV cache is not declared FP8; the engines ignore this scale')],
 'duplicate_then_unindexed_tensor': [('error',
                                      'duplicate_tensor',
                                      'backbone.layers.0.norm.weight',
                                      'present in both model-00001-of-00002.safetensors and '
                                      'model-00002-of-00002.safetensors'),
                                     ('warning',
                                      'not_in_index',
                                      'zz.extra.weight',
                                      'in model-00002-of-00002.safetensors but the index does not place it there')],
 'empty_f32_input_scale': [('error', 'wrong_shape', 'backbone.layers.2.mixer.in_proj.input_scale', '[0], expected []')],
 'empty_flat_quantized_layers': [('error',
                                  'missing_key',
                                  'config.json:quantization_config.quantized_layers',
                                  'MIXED_PRECISION needs quantized_layers in config.json (SGLang reads no other file '
                                  'once config.json has a quantization_config)'),
                                 ('error',
                                  'producer_not_modelopt',
                                  'hf_quant_config.json:producer.name',
                                  "'fp4kit': config.json's MIXED_PRECISION quantization_config has no "
                                  'quantized_layers, so vLLM reads hf_quant_config.json, and it accepts that file only '
                                  "from producer 'modelopt' (otherwise it builds the model unquantized or raises "
                                  "'Unsupported quantization config')"),
                                 ('error',
                                  'config_mismatch',
                                  'quantized_layers',
                                  'config.json and hf_quant_config.json differ, first at '
                                  "'backbone.layers.1.mixer.experts.0.down_proj'")],
 'empty_ignore_entry': [('error', 'pattern_matches_nothing', "ignore['']", 'matches no module of the checkpoint'),
                        ('error',
                         'not_declared',
                         'backbone.layers.1.mixer.experts.0.down_proj',
                         'vLLM loads model.layers.1.mixer.experts unquantized but its tensors are W4A16_NVFP4'),
                        ('error',
                         'not_declared',
                         'backbone.layers.2.mixer.in_proj',
                         'vLLM loads model.layers.2.mixer.in_proj unquantized but its tensors are FP8'),
                        ('error',
                         'not_declared',
                         'backbone.layers.2.mixer.out_proj',
                         'vLLM loads model.layers.2.mixer.out_proj unquantized but its tensors are FP8')],
 'empty_nested_quantized_layers': [('error',
                                    'missing_key',
                                    'hf_quant_config.json:quantized_layers',
                                    'MIXED_PRECISION needs a non-empty quantized_layers'),
                                   ('error',
                                    'config_mismatch',
                                    'quantized_layers',
                                    'config.json and hf_quant_config.json differ, first at '
                                    "'backbone.layers.1.mixer.experts.0.down_proj'")],
 'exclude_modules_only_in_hf_quant': [('error',
                                       'config_mismatch',
                                       'ignore',
                                       'config.json ignore and hf_quant_config.json exclude_modules differ'),
                                      ('error',
                                       'pattern_matches_nothing',
                                       "ignore['backbone.layers.9.nothing']",
                                       'matches no module of the checkpoint')],
 'expert_prefix_excluded': [('error',
                             'not_declared',
                             'backbone.layers.1.mixer.experts.0.down_proj',
                             'vLLM loads model.layers.1.mixer.experts unquantized but its tensors are W4A16_NVFP4'),
                            ('error',
                             'partial_moe_exclusion',
                             "ignore['backbone.layers.1.mixer.experts.0']",
                             'excludes 2 of 8 expert modules of backbone.layers.1.mixer.experts; the engines exclude '
                             'whole MoE layers only')],
 'fp8_scale_bytes_in_first_chunk': [('error',
                                     'nan_scale',
                                     'backbone.layers.1.mixer.experts.0.up_proj.weight_scale',
                                     '1 NaN bytes (0x7F/0xFF)'),
                                    ('error',
                                     'nonpositive_scale',
                                     'backbone.layers.1.mixer.experts.0.up_proj.weight_scale',
                                     '1 zero block scales'),
                                    ('error',
                                     'nonpositive_scale',
                                     'backbone.layers.1.mixer.experts.0.up_proj.weight_scale',
                                     '1 negative block scales')],
 'fused_shards_of_two_formats': [('error',
                                  'partial_fused_exclusion',
                                  'backbone.layers.0.mixer.k_proj',
                                  'the engines refuse model.layers.0.mixer.qkv_proj: shards of '
                                  "model.layers.0.mixer.qkv_proj declare different algos ['NVFP4', 'W4A16_NVFP4']")],
 'incomplete_then_junk_ignore': [('error',
                                  'missing_shard',
                                  'model-00002-of-00002.safetensors',
                                  'shard named by the index is missing (16 tensors)'),
                                 ('error',
                                  'junk_module_name',
                                  "ignore['backbone.layers.2.mixer.in_proj.\\x00backbone.pt_name_sentinel']",
                                  'contains control characters, whitespace or a ModelOpt sentinel')],
 'index_names_no_file_of_the_folder': [('error',
                                        'bad_json',
                                        'a.weight',
                                        "index names 'sub\\\\x.safetensors', not a file of this folder"),
                                       ('error', 'bad_json', 'b.weight', "index names '', not a file of this folder"),
                                       ('error', 'bad_json', 'c.weight', "index names '.', not a file of this folder"),
                                       ('error',
                                        'bad_json',
                                        'd.weight',
                                        "index names '..', not a file of this folder")],
 'junk_then_unmatched_ignore': [('error',
                                 'junk_module_name',
                                 "ignore['backbone.layers.2.mixer.in_proj.\\x00backbone.pt_name_sentinel']",
                                 'contains control characters, whitespace or a ModelOpt sentinel'),
                                ('error',
                                 'pattern_matches_nothing',
                                 "ignore['backbone.layers.9.nothing']",
                                 'matches no module of the checkpoint')],
 'layer_missing_from_config_json_only': [('error',
                                          'config_mismatch',
                                          'quantized_layers',
                                          'config.json and hf_quant_config.json differ, first at '
                                          "'backbone.layers.2.mixer.out_proj'"),
                                         ('error',
                                          'not_declared',
                                          'backbone.layers.2.mixer.out_proj',
                                          'vLLM loads model.layers.2.mixer.out_proj unquantized but its tensors are '
                                          'FP8')],
 'missing_shard_sorted_first': [('error',
                                 'missing_shard',
                                 'model-00000-of-00002.safetensors',
                                 'shard named by the index is missing (1 tensors)')],
 'non_ascii_config_in_latin1_locale': [('error',
                                        'unknown_quant_algo',
                                        'config.json:quantization_config.quant_algo',
                                        "'NVFP4é' is not a ModelOpt algo the engines accept (FP8, NVFP4, W4A16_NVFP4, "
                                        'MIXED_PRECISION)')],
 'norm_modules_in_single_algo': [('error',
                                  'not_excluded',
                                  'backbone.layers.0.mixer.norm_gate.proj',
                                  'vLLM loads model.layers.0.mixer.norm_gate.proj as W4A16_NVFP4 but its weight is '
                                  'BF16; exclude it')],
 'nvfp4_layers_without_group_size': [],
 'partial_fused_exclusion_then_undeclared_module': [('error',
                                                     'partial_fused_exclusion',
                                                     'backbone.layers.0.mixer.k_proj',
                                                     'the engines refuse model.layers.0.mixer.qkv_proj: some but not '
                                                     'all shards of model.layers.0.mixer.qkv_proj are excluded'),
                                                    ('error',
                                                     'not_declared',
                                                     'backbone.layers.2.mixer.out_proj',
                                                     'vLLM loads model.layers.2.mixer.out_proj unquantized but its '
                                                     'tensors are FP8')],
 'scale_without_weight_format': [('error',
                                  'missing_tensor',
                                  'backbone.layers.0.mixer.o_proj.weight',
                                  'scale tensors without a uint8 or float8_e4m3fn weight')],
 'shard_shrinks_after_header_read': [('error',
                                      'unreadable_file',
                                      'backbone.layers.2.mixer.in_proj.input_scale',
                                      'model-00002-of-00002.safetensors ended early'),
                                     ('error',
                                      'unreadable_file',
                                      'backbone.layers.2.mixer.in_proj.weight',
                                      'model-00002-of-00002.safetensors ended early'),
                                     ('error',
                                      'unreadable_file',
                                      'backbone.layers.2.mixer.in_proj.weight_scale',
                                      'model-00002-of-00002.safetensors ended early'),
                                     ('error',
                                      'unreadable_file',
                                      'backbone.layers.2.mixer.out_proj.input_scale',
                                      'model-00002-of-00002.safetensors ended early'),
                                     ('error',
                                      'unreadable_file',
                                      'backbone.layers.2.mixer.out_proj.weight',
                                      'model-00002-of-00002.safetensors ended early'),
                                     ('error',
                                      'unreadable_file',
                                      'backbone.layers.2.mixer.out_proj.weight_scale',
                                      'model-00002-of-00002.safetensors ended early')],
 'single_file_bad_header': [('error',
                             'truncated_file',
                             'model.safetensors',
                             '3 bytes, shorter than the 8-byte header length')],
 'single_file_unreadable': [('error',
                             'unreadable_file',
                             'model.safetensors',
                             "[Errno 13] Permission denied: '<root>/model.safetensors'")],
 'top_level_norm_module': [],
 'top_level_prefix_ignored': [('error',
                               'not_declared',
                               'backbone.layers.1.mixer.experts.0.down_proj',
                               'vLLM loads model.layers.1.mixer.experts unquantized but its tensors are W4A16_NVFP4'),
                              ('error',
                               'not_declared',
                               'backbone.layers.2.mixer.in_proj',
                               'vLLM loads model.layers.2.mixer.in_proj unquantized but its tensors are FP8'),
                              ('error',
                               'not_declared',
                               'backbone.layers.2.mixer.out_proj',
                               'vLLM loads model.layers.2.mixer.out_proj unquantized but its tensors are FP8')],
 'two_experts_lack_a_projection': [('error',
                                    'pattern_matches_nothing',
                                    "quantized_layers['backbone.layers.1.mixer.experts.1.down_proj']",
                                    'names no module with a weight in the checkpoint'),
                                   ('error',
                                    'pattern_matches_nothing',
                                    "quantized_layers['backbone.layers.1.mixer.experts.2.down_proj']",
                                    'names no module with a weight in the checkpoint'),
                                   ('error',
                                    'missing_tensor',
                                    'backbone.layers.1.mixer.experts.1.down_proj.weight',
                                    'expert lacks a projection its siblings have'),
                                   ('error',
                                    'missing_tensor',
                                    'backbone.layers.1.mixer.experts.2.down_proj.weight',
                                    'expert lacks a projection its siblings have')],
 'unreadable_fused_shard': [('error',
                             'index_tensor_missing',
                             'backbone.layers.0.mixer.q_proj.bias',
                             'the index places it in model-00001-of-00002.safetensors, which lacks it'),
                            ('error',
                             'fused_scale_mismatch',
                             'backbone.layers.1.mixer.experts.0.gate_up_proj',
                             'weight_scale_2 differs across the fused shards (gate_proj=0.0199999996, '
                             "up_proj=0.0107000005): the engines use the gate's (w1) value for every shard without "
                             'requantizing, so the other shards dequantize scaled by the ratio'),
                            ('error',
                             'fused_scale_mismatch',
                             'backbone.layers.1.mixer.experts.1.gate_up_proj',
                             'weight_scale_2 differs across the fused shards (gate_proj=0.0200999994, '
                             "up_proj=0.0116999997): the engines use the gate's (w1) value for every shard without "
                             'requantizing, so the other shards dequantize scaled by the ratio'),
                            ('error',
                             'fused_scale_mismatch',
                             'backbone.layers.1.mixer.experts.2.gate_up_proj',
                             'weight_scale_2 differs across the fused shards (gate_proj=0.0201999992, '
                             "up_proj=0.0126999998): the engines use the gate's (w1) value for every shard without "
                             'requantizing, so the other shards dequantize scaled by the ratio'),
                            ('error',
                             'fused_scale_mismatch',
                             'backbone.layers.1.mixer.experts.3.gate_up_proj',
                             'weight_scale_2 differs across the fused shards (gate_proj=0.0203000009, up_proj=0.0137): '
                             "the engines use the gate's (w1) value for every shard without requantizing, so the other "
                             'shards dequantize scaled by the ratio')],
 'unreadable_shard_sorted_first': [('error',
                                    'truncated_file',
                                    'model-00000-of-00002.safetensors',
                                    '3 bytes, shorter than the 8-byte header length')]}



@pytest.mark.parametrize("name", sorted(CASES))
def test_edge_checkpoint_gives_exactly_these_findings(tmp_path, monkeypatch, name):
    root = CASES[name](tmp_path, monkeypatch)
    assert _findings(root) == EXPECTED[name]


def test_edge_cases_all_have_expectations():
    assert sorted(CASES) == sorted(EXPECTED)


@pytest.mark.parametrize("name", ["missing_shard_sorted_first", "unreadable_shard_sorted_first"])
def test_a_lost_shard_does_not_stop_the_other_shards_loading(tmp_path, monkeypatch, name):
    root = CASES[name](tmp_path, monkeypatch)
    assert check_checkpoint(root).tensors == len(make_tensors())


def test_report_path_is_the_checked_folder(tmp_path):
    root = _build(tmp_path)
    report = check_checkpoint(root)
    assert report.path == str(root)
    assert report.to_dict()["path"] == str(root)


def test_duplicate_header_keys_are_named_alone(tmp_path):
    header = b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "b": 1, "a": 2}'
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(cf._HeaderError) as e:
        read_safetensors_header(path)
    assert (e.value.code, str(e.value)) == ("bad_header", "header is not valid JSON: duplicate keys ['a']")


def test_header_that_is_not_an_object(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(cf._HeaderError) as e:
        read_safetensors_header(path)
    assert (e.value.code, str(e.value)) == ("bad_header", "header is not a JSON object")


def test_header_length_is_read_unsigned(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(cf._HeaderError) as e:
        read_safetensors_header(path)
    assert (e.value.code, str(e.value)) == ("header_too_large", f"header claims {2**64 - 1} bytes (limit {cf.MAX_HEADER_BYTES})")


@pytest.mark.parametrize(
    "bad, problem",
    [
        (7, ("bad_header", "bad", "entry is not an object")),
        (
            {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            ("offset_past_eof", "bad", "data ends at byte 140, the file has 138"),
        ),
    ],
)
def test_header_entries_after_a_bad_one_are_still_read(tmp_path, bad, problem):
    good = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}
    header = json.dumps({"bad": bad, "good": good}).encode()
    header += b" " * (128 - len(header))
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02")
    tensors, problems = read_safetensors_header(path)
    assert list(tensors) == ["good"] and tensors["good"].nbytes == 2 and tensors["good"].shape == (2,)
    assert problems == [problem]


def test_sglang_glob_entry_matches_one_dotted_component():
    # SGLang's is_layer_skipped fullmatches each dot-separated part of the name against the entry.
    assert sglang_excluded("model.layers.0.mixer.o_proj", ["o_*"]) is True
    assert sglang_excluded("model.layers.0.mixer.o_proj", ["x_*"]) is False
