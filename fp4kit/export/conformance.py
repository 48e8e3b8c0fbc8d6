"""Checks a ModelOpt-format checkpoint folder against what vLLM and SGLang load.

The rules come from the engines' source; docs/engine-rules.md lists each with the file and
function it was read from. The checker never imports or runs anything from the checkpoint: the
JSON files are parsed as data and the safetensors headers are parsed here, byte by byte, so a
damaged file gives a finding instead of an exception. Tensor bytes are read only for the
numeric checks (scales, FP8 weights), a bounded chunk at a time.

    report = check_checkpoint("out/nemotron-nvfp4")
    if not report.ok:
        for f in report.errors:
            print(f.code, f.tensor_or_key, f.message)
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import struct
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ..formats.constants import E4M3_NAN_CODE, NVFP4_BLOCK_SIZE
from .checkpoint import CONFIG_FILE, HF_QUANT_CONFIG_FILE, INDEX_FILE, NVFP4_ALGOS, QUANT_METHOD, SCALE_SUFFIXES, SINGLE_FILE

Level = Literal["error", "warning"]

# safetensors refuses headers above this size; so do we.
MAX_HEADER_BYTES = 100_000_000
# Bytes read per step when scanning tensor data.
_CHUNK_BYTES = 1 << 22
# A per-tensor scale is a 0-d tensor; anything this large is not one.
_MAX_SCALAR_ELEMENTS = 1 << 16

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

# Top-level algos both engines serve (vLLM upper-cases, SGLang compares as written).
COMMON_ALGOS = ("FP8", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION")
# Accepted by vLLM 0.33 only (SGLang's modelopt_fp8/modelopt_fp4 reject them).
VLLM_ONLY_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8")
# Per-layer algos under MIXED_PRECISION that both engines serve.
MIXED_LAYER_ALGOS = ("FP8", "NVFP4", "W4A16_NVFP4")

# Tensor leaves that belong to a quantized module.
_QUANT_LEAVES = SCALE_SUFFIXES
# Leaves each format writes; anything else next to a quantized weight is reported.
_ALGO_LEAVES = {
    "NVFP4": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
    "W4A16_NVFP4": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
    "FP8": {"weight", "weight_scale", "input_scale"},
}
# Modules the engines build without a quant config: they are never quantized and need no
# exclusion entry (router `gate`, depthwise `conv1d`, embeddings, norms).
_NEVER_QUANTIZED_LEAF_MODULES = ("gate", "conv1d", "embeddings", "embed_tokens", "wte")

_KV_SCALE_LEAF = re.compile(r"^(?:k|v|q|kv)_scale$")
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)$")
_JUNK = re.compile(r"[\x00-\x1f\x7f\s]|pt_name_sentinel")
_HYBRID_CHARS = set("M*-E")
# `layers_block_type` values SGLang's NemotronHConfig accepts (it raises on any other); the
# transformers 5.x names `linear_attention` / `full_attention` are not among them.
SGLANG_BLOCK_TYPES = ("mamba", "attention", "mlp", "moe")
_BLOCK_LETTER = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "moe": "E", "mlp": "-"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Sibling linears the engines fuse into one layer (their `packed_modules_mapping`): the engine-side
# name and the shards, in load order. These are the groups fp4kit's model adapters give one
# `fuse_group` (q/k/v, gate/up); routed experts fuse gate/up per expert the same way (w13).
FUSED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The only producer whose hf_quant_config.json vLLM accepts when config.json has no
# quantization_config (`weight_utils.get_quant_config`, `ModelArchConfigConvertor._normalize_quantization_config`).
MODELOPT_PRODUCER = "modelopt"
# Top-level algos vLLM maps to a method when it reads hf_quant_config.json itself (any other raises
# "Unknown ModelOpt quant algo"); W4A16_NVFP4 is served only from config.json's quantization_config.
VLLM_NESTED_ALGOS = ("FP8", "NVFP4", "MIXED_PRECISION")


@dataclass(frozen=True)
class Finding:
    level: Level
    code: str
    tensor_or_key: str | None
    message: str


@dataclass
class ConformanceReport:
    path: str
    findings: list[Finding] = field(default_factory=list)
    tensors: int = 0  # tensors read from the safetensors headers

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "ok": self.ok,
            "tensors": self.tensors,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [asdict(f) for f in self.findings],
        }


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


class _HeaderError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], list[tuple[str, str, str]]]:
    """Parse one safetensors header without trusting it.

    Returns the well-formed tensors and a list of (code, tensor, message) for the entries that
    are not; raises _HeaderError when the file as a whole cannot be read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _HeaderError("truncated_file", f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise _HeaderError("header_too_large", f"header claims {n} bytes (limit {MAX_HEADER_BYTES})")
        if 8 + n > size:
            raise _HeaderError("truncated_file", f"header claims {n} bytes, the file has {size - 8} after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise _HeaderError("bad_header", f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise _HeaderError("bad_header", "header is not a JSON object")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    problems: list[tuple[str, str, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            problems.append(("bad_header", name, "entry is not an object"))
            continue
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            problems.append(("unknown_dtype", name, f"dtype {dtype!r} is not a safetensors dtype"))
            continue
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            problems.append(("bad_header", name, f"shape {shape!r} is not a list of non-negative ints"))
            continue
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            problems.append(("bad_header", name, f"data_offsets {offsets!r} are not [begin, end]"))
            continue
        nbytes = offsets[1] - offsets[0]
        expected = math.prod(shape) * _DTYPE_BYTES[dtype]
        if nbytes != expected:
            problems.append(
                ("byte_count_mismatch", name, f"{dtype} {shape} needs {expected} bytes, data_offsets span {nbytes}")
            )
            continue
        if data_start + offsets[1] > size:
            problems.append(
                ("offset_past_eof", name, f"data ends at byte {data_start + offsets[1]}, the file has {size}")
            )
            continue
        tensors[name] = TensorInfo(path, dtype, tuple(shape), data_start + offsets[0], nbytes)
    return tensors, problems


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"duplicate keys {dup}")
    return dict(pairs)


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _engine_name(name: str) -> str:
    """The name both engines look modules up by (Nemotron-H: `backbone.` -> `model.`)."""
    if name == "backbone" or name.startswith("backbone."):
        name = "model" + name[len("backbone") :]
    return name.replace("embeddings", "embed_tokens")


def _expand_trailing_star(entries: list[str]) -> list[str]:
    # vLLM rewrites a ModelOpt `name*` (no dot before the star) into `name` and `name.*`.
    out = []
    for e in entries:
        if len(e) >= 2 and e.endswith("*") and e[-2] != ".":
            out += [e[:-1], e[:-1] + ".*"]
        else:
            out.append(e)
    return out


def vllm_excluded(unit: str, entries: list[str], fused_shards: tuple[str, ...] = ()) -> bool:
    """vLLM 0.33 `ModelOptQuantConfigBase.is_layer_excluded` for an engine-side module name.

    `fused_shards` are the shard names of a fused linear (q/k/v for `qkv_proj`). Raises
    ValueError like vLLM when some shards are excluded and some are not.
    """
    if not entries:
        return False
    if fused_shards:
        base = unit.rpartition(".")[0]
        if unit in entries:
            return True
        hits = {f"{base}.{s}" in entries for s in fused_shards}
        if len(hits) > 1:
            raise ValueError(f"some but not all shards of {unit} are excluded")
        if hits.pop():
            return True
    elif "experts" in unit:
        if any(unit in e for e in entries if "experts" in e):
            return True
    elif unit in entries:
        return True
    if any(e != unit and e in unit for e in entries):
        return True
    return any(fnmatch.fnmatchcase(unit, e) for e in entries)


def _path_match(entry: str, name: str) -> bool:
    entry, name = entry.rstrip("."), name.rstrip(".")
    return entry == name or name.startswith(entry + ".") or f".{entry}." in f".{name}."


def _glob_fullmatch(entry: str, name: str) -> bool:
    return re.fullmatch(re.escape(entry).replace(r"\*", ".*"), name) is not None


def sglang_excluded(unit: str, entries: list[str], fused_shards: tuple[str, ...] = ()) -> bool:
    """SGLang 0.5.23 `is_layer_skipped` or `ModelOptQuantConfig.is_layer_excluded`.

    A MoE layer (`...experts`) is tested with `is_layer_excluded` alone, as SGLang does.
    """
    if not entries:
        return False
    parts = unit.split(".")
    if any(_glob_fullmatch(e, unit) or any(_glob_fullmatch(e, p) for p in parts) for e in entries):
        return True
    if unit.endswith(".experts"):
        return False
    if fused_shards:
        base = unit.rpartition(".")[0]
        hits = {any(_path_match(e, f"{base}.{s}") for e in entries) for s in fused_shards}
        if len(hits) > 1:
            raise ValueError(f"some but not all shards of {unit} are excluded")
        skipped = hits.pop()
    else:
        skipped = any(_path_match(e, unit) for e in entries)
        if "experts" in unit:
            skipped = skipped or any(unit in e for e in entries if "experts" in e)
    return skipped


def sglang_mixed_algo(unit: str, layers: dict[str, str], fused_shards: tuple[str, ...] = ()) -> str | None:
    """SGLang 0.5.23 `ModelOptMixedPrecisionConfig._resolve_quant_algo` (engine-side names):
    the exact name, then the fused shards (which must agree), then the first key under `unit.`."""
    if unit in layers:
        return layers[unit]
    base = unit.rpartition(".")[0]
    if fused_shards:
        algos = {layers[f"{base}.{s}"] for s in fused_shards if f"{base}.{s}" in layers}
        if len(algos) > 1:
            raise ValueError(f"shards of {unit} declare different algos {sorted(algos)}")
        if algos:
            return algos.pop()
    for key, algo in layers.items():
        if key.startswith(unit + "."):
            return algo
    return None


def vllm_mixed_algo(unit: str, layers: dict[str, str], fused_shards: tuple[str, ...] = ()) -> str | None:
    """vLLM 0.33 `ModelOptMixedPrecisionConfig._resolve_quant_algo` (engine-side names): SGLang's
    lookup, then, for a MoE layer, any key under its parent module."""
    algo = sglang_mixed_algo(unit, layers, fused_shards)
    if algo is None and unit.endswith(".experts"):
        parent = unit[: -len("experts")]
        for key, layer_algo in layers.items():
            if key.startswith(parent):
                return layer_algo
    return algo


def _flat_view(nested: dict, hf_quant: dict) -> dict:
    """The flat `quantization_config` the engines take from hf_quant_config.json when config.json
    has none (vLLM reads the nested keys, SGLang unwraps them), for the checks that follow."""
    flat: dict = {"quant_method": QUANT_METHOD}
    if "producer" in hf_quant:
        flat["producer"] = hf_quant["producer"]
    for key in ("quant_algo", "group_size", "quantized_layers"):
        if key in nested:
            flat[key] = nested[key]
    if "exclude_modules" in nested:
        flat["ignore"] = nested["exclude_modules"]
    if nested.get("kv_cache_quant_algo") == "FP8":
        flat["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return flat


def _fused_scale_rules(algo: str | None, expert: bool) -> list[tuple[str, Level, str]]:
    """(leaf, level, what the engines do) for each per-tensor scale a fused layer holds once.

    NVFP4 `weight_scale_2` is taken as is (no requantization): a shard stored with another
    global scale dequantizes off by the ratio, an error. Input scales quantize one shared input
    with the largest value, and FP8 weights are requantized to the largest weight scale: the
    engines serve these, with one more rounding, so they are warnings.
    """
    if algo in NVFP4_ALGOS:
        pick = "the gate's (w1) value" if expert else "the largest value"
        rules = [("weight_scale_2", "error", f"the engines use {pick} for every shard without requantizing, "
                  "so the other shards dequantize scaled by the ratio")]
        if algo == "NVFP4":
            rules.append(("input_scale", "warning", "the engines quantize the shared input with the largest value (vLLM warns)"))
        return rules
    if algo == "FP8":
        return [
            ("weight_scale", "warning", "the engines requantize every shard to the largest scale (one more rounding)"),
            ("input_scale", "warning", "the engines quantize the shared input with the largest value (vLLM warns)"),
        ]
    return []


def _family(algo: str | None) -> str | None:
    return "NVFP4" if algo in NVFP4_ALGOS else algo


def _read_json(path: Path) -> tuple[object | None, str | None]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, str(e)


class _Checker:
    def __init__(self, root: Path, model_type: str | None):
        self.root = root
        self.report = ConformanceReport(str(root))
        self.model_type = model_type
        self.tensors: dict[str, TensorInfo] = {}
        self.modules: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
        self.algo: str | None = None
        self.exclusions: list[str] = []
        self.layers: dict[str, str] = {}  # checkpoint module name -> per-layer algo (MIXED)
        self.kv_fp8 = False
        self.hf_quant: dict = {}
        # Tensors named somewhere (index, header) that could not be read: checks that need the
        # full set of modules skip what depends on them instead of reporting follow-on errors.
        self.unreadable: set[str] = set()
        self.unreadable_reported: set[str] = set()
        self.incomplete = False
        self._unit_cache: dict[tuple[str, tuple[str, ...]], dict[str, str | None]] = {}

    def add(self, level: Level, code: str, key: str | None, message: str) -> None:
        self.report.findings.append(Finding(level, code, key, message))

    def error(self, code: str, key: str | None, message: str) -> None:
        self.add("error", code, key, message)

    def warn(self, code: str, key: str | None, message: str) -> None:
        self.add("warning", code, key, message)

    # --- files ---

    def run(self) -> ConformanceReport:
        if not self.root.is_dir():
            self.error("missing_file", str(self.root), "checkpoint folder does not exist")
            return self.report
        config = self._json(CONFIG_FILE, required=True)
        hf_quant = self._json(HF_QUANT_CONFIG_FILE, required=True)
        if not (self.root / "generation_config.json").is_file():
            self.warn(
                "missing_file",
                "generation_config.json",
                "no generation_config.json (engines fall back to defaults)",
            )
        if not any((self.root / n).is_file() for n in _TOKENIZER_FILES):
            self.warn("missing_file", "tokenizer", f"none of {list(_TOKENIZER_FILES)} present")
        self._load_weights()
        if isinstance(config, dict):
            self.model_type = self.model_type or config.get("model_type")
            if self.model_type == "nemotron_h":
                self._check_hybrid_pattern(config)
        self._check_quant_config(config, hf_quant)
        if self.algo is not None:
            self._check_names()
            self._check_modules()
            self._check_experts(config if isinstance(config, dict) else {})
            self._check_fused_scales()
        self._check_kv()
        self._check_numerics()
        self.report.tensors = len(self.tensors)
        return self.report

    def _json(self, name: str, *, required: bool) -> object | None:
        path = self.root / name
        if not path.is_file():
            if required:
                self.error("missing_file", name, f"{name} is missing")
            return None
        data, err = _read_json(path)
        if err is not None:
            self.error("bad_json", name, f"{name} is not valid JSON: {err}")
        return data

    def _load_weights(self) -> None:
        index_path = self.root / INDEX_FILE
        single = self.root / SINGLE_FILE
        if index_path.is_file():
            index, err = _read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if err is not None or not isinstance(weight_map, dict):
                self.error("bad_json", index_path.name, f"index has no weight_map: {err or 'missing key'}")
                return
            shards: dict[str, list[str]] = defaultdict(list)
            for tensor, shard in weight_map.items():
                if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
                    self.error("bad_json", tensor, f"index names {shard!r}, not a file of this folder")
                    continue
                shards[shard].append(tensor)
            seen: dict[str, str] = {}
            for shard, listed in sorted(shards.items()):
                path = self.root / shard
                if not path.is_file():
                    self.error("missing_shard", shard, f"shard named by the index is missing ({len(listed)} tensors)")
                    self._lost(listed)
                    continue
                found = self._read_shard(path)
                if found is None:
                    self._lost(listed)
                    continue
                for t in listed:
                    if t not in found:
                        self._lost([t])
                        if t not in self.unreadable_reported:
                            self.error("index_tensor_missing", t, f"the index places it in {shard}, which lacks it")
                for t in found:
                    if t in seen:
                        self.error("duplicate_tensor", t, f"present in both {seen[t]} and {shard}")
                        continue
                    seen[t] = shard
                    if weight_map.get(t) != shard:
                        self.warn("not_in_index", t, f"in {shard} but the index does not place it there")
        elif single.is_file():
            self._read_shard(single)
        else:
            self.error("missing_file", "model.safetensors", "neither model.safetensors nor its index is present")

    def _lost(self, names) -> None:
        self.unreadable.update(names)
        self.incomplete = True

    def _read_shard(self, path: Path) -> dict[str, TensorInfo] | None:
        try:
            found, problems = read_safetensors_header(path)
        except _HeaderError as e:
            self.error(e.code, path.name, str(e))
            self.incomplete = True
            return None
        except OSError as e:
            self.error("unreadable_file", path.name, str(e))
            self.incomplete = True
            return None
        for code, tensor, message in problems:
            self.error(code, tensor, f"{path.name}: {message}")
            self.unreadable_reported.add(tensor)
            self._lost([tensor])
        for name, info in found.items():
            if name not in self.tensors:
                self.tensors[name] = info
                module, leaf = _split(name)
                self.modules[module][leaf] = info
        return found

    # --- config ---

    def _check_mamba_groups(self, config: dict) -> None:
        # SGLang 0.5.23 builds the mixer from `mamba_n_groups` (default 8) and sizes its state
        # cache from `n_groups`; vLLM and transformers read `n_groups`.
        groups, sglang = config.get("n_groups"), config.get("mamba_n_groups")
        if groups is None:
            self.error("missing_key", "config.json:n_groups", "nemotron_h's Mamba layers need n_groups")
        elif sglang is None:
            self.error(
                "missing_key",
                "config.json:mamba_n_groups",
                f"SGLang builds the Mamba mixer with mamba_n_groups (default 8), not n_groups ({groups}); "
                "its conv1d weights then do not fit",
            )
        elif sglang != groups:
            self.error("config_mismatch", "config.json:mamba_n_groups", f"{sglang!r} but n_groups is {groups!r}")

    def _check_hybrid_pattern(self, config: dict) -> None:
        pattern = config.get("hybrid_override_pattern")
        if pattern is None:
            self.error(
                "missing_key",
                "config.json:hybrid_override_pattern",
                "nemotron_h needs hybrid_override_pattern; without it the engines' config class "
                "falls back to a built-in layer layout",
            )
            return
        if not isinstance(pattern, str) or not pattern or set(pattern) - _HYBRID_CHARS:
            self.error("bad_value", "config.json:hybrid_override_pattern", f"{pattern!r} is not a string over 'M*-E'")
            return
        blocks = config.get("layers_block_type")
        if blocks is not None:
            if not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
                self.error("bad_value", "config.json:layers_block_type", "must be a list of strings")
            elif set(blocks) - set(SGLANG_BLOCK_TYPES):
                self.error(
                    "bad_value",
                    "config.json:layers_block_type",
                    f"{sorted(set(blocks) - set(SGLANG_BLOCK_TYPES))}: SGLang's NemotronHConfig accepts only "
                    f"{list(SGLANG_BLOCK_TYPES)} and refuses the config",
                )
            if isinstance(blocks, list) and "".join(_BLOCK_LETTER.get(b, "?") for b in blocks) != pattern:
                self.error(
                    "config_mismatch",
                    "config.json:layers_block_type",
                    f"does not spell hybrid_override_pattern {pattern!r}; the engines use layers_block_type",
                )
        if "M" in pattern:
            self._check_mamba_groups(config)
        n = config.get("num_hidden_layers")
        if isinstance(n, int) and n != len(pattern):
            self.error(
                "config_mismatch",
                "config.json:hybrid_override_pattern",
                f"{len(pattern)} layers, num_hidden_layers says {n}",
            )
        # Each layer's tensors must fit its letter.
        expect = {"M": ".mixer.in_proj", "*": ".mixer.q_proj", "E": ".mixer.experts.", "-": ".mixer.up_proj"}
        for i, kind in enumerate(pattern):
            prefix = f"backbone.layers.{i}"
            names = [t for t in self.tensors if t.startswith(prefix + ".")]
            if names and not any(expect[kind] in t for t in names):
                self.error("layer_type_mismatch", prefix, f"pattern says {kind!r} but no tensor has {expect[kind]!r}")

    def _check_quant_config(self, config: object, hf_quant: object) -> None:
        flat = config.get("quantization_config") if isinstance(config, dict) else None
        nested = hf_quant.get("quantization") if isinstance(hf_quant, dict) else None
        self.hf_quant = hf_quant if isinstance(hf_quant, dict) else {}
        if isinstance(hf_quant, dict) and not isinstance(nested, dict):
            self.error("missing_key", "hf_quant_config.json:quantization", "no nested quantization section")
        if isinstance(config, dict) and not isinstance(flat, dict):
            if not isinstance(nested, dict):
                self.error(
                    "missing_key",
                    "config.json:quantization_config",
                    "no quantization_config, and no hf_quant_config.json section for the engines to fall back to",
                )
                return
            # Both engines then read hf_quant_config.json; vLLM only from ModelOpt.
            self._check_producer("config.json has no quantization_config")
            algo = nested.get("quant_algo")
            if algo in COMMON_ALGOS and algo not in VLLM_NESTED_ALGOS:
                self.error(
                    "unsupported_quant_algo",
                    "hf_quant_config.json:quantization.quant_algo",
                    f"{algo!r}: config.json has no quantization_config, and from hf_quant_config.json vLLM "
                    f"maps only {list(VLLM_NESTED_ALGOS)} (it raises 'Unknown ModelOpt quant algo')",
                )
            flat = _flat_view(nested, self.hf_quant)
        if not (isinstance(flat, dict) and isinstance(nested, dict)):
            return
        if flat.get("quant_method") != "modelopt":
            self.error(
                "bad_value",
                "config.json:quantization_config.quant_method",
                f"{flat.get('quant_method')!r}, expected 'modelopt'",
            )
        for where, d in (("config.json:quantization_config", flat), ("hf_quant_config.json", hf_quant)):
            if "producer" not in d:
                self.warn("missing_key", f"{where}.producer", "no producer recorded")
        algo, nested_algo = flat.get("quant_algo"), nested.get("quant_algo")
        if algo != nested_algo:
            self.error(
                "config_mismatch",
                "quant_algo",
                f"config.json says {algo!r}, hf_quant_config.json says {nested_algo!r}",
            )
        self._check_kv_config(flat, nested)
        if not self._algo_ok(algo, "config.json:quantization_config.quant_algo"):
            return
        self.algo = algo
        if algo == "MIXED_PRECISION":
            self._check_mixed_config(flat, nested)
        else:
            self._check_single_config(algo, flat, nested)

    def _check_producer(self, why: str) -> None:
        producer = self.hf_quant.get("producer")
        name = producer.get("name") if isinstance(producer, dict) else None
        if name != MODELOPT_PRODUCER:
            self.error(
                "producer_not_modelopt",
                "hf_quant_config.json:producer.name",
                f"{name!r}: {why}, so vLLM reads hf_quant_config.json, and it accepts that file only "
                f"from producer {MODELOPT_PRODUCER!r} (otherwise it builds the model unquantized or "
                "raises 'Unsupported quantization config')",
            )

    def _algo_ok(self, algo: object, key: str) -> bool:
        if algo in COMMON_ALGOS:
            return True
        if isinstance(algo, str) and algo.upper() in COMMON_ALGOS:
            self.error(
                "bad_value",
                key,
                f"{algo!r}: SGLang compares quant_algo case-sensitively; write {algo.upper()!r}",
            )
        elif algo in VLLM_ONLY_ALGOS:
            self.error(
                "unsupported_quant_algo",
                key,
                f"{algo!r} is served by vLLM only; SGLang's ModelOpt configs reject it",
            )
        else:
            self.error(
                "unknown_quant_algo",
                key,
                f"{algo!r} is not a ModelOpt algo the engines accept ({', '.join(COMMON_ALGOS)})",
            )
        return False

    def _check_kv_config(self, flat: dict, nested: dict) -> None:
        scheme = flat.get("kv_cache_scheme")
        flat_fp8 = isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
        nested_kv = nested.get("kv_cache_quant_algo")
        if nested_kv not in (None, "FP8"):
            self.error(
                "bad_value",
                "hf_quant_config.json:kv_cache_quant_algo",
                f"{nested_kv!r}; fp4kit writes FP8 or null",
            )
        if flat_fp8 != (nested_kv == "FP8"):
            self.error(
                "config_mismatch",
                "kv_cache_scheme",
                f"config.json kv_cache_scheme={scheme!r} but hf_quant_config.json kv_cache_quant_algo={nested_kv!r}",
            )
        if isinstance(scheme, dict) and flat_fp8 and scheme.get("dynamic") is not False:
            self.warn(
                "bad_value",
                "config.json:quantization_config.kv_cache_scheme.dynamic",
                "static per-tensor KV scales expect dynamic: false",
            )
        self.kv_fp8 = flat_fp8

    def _check_single_config(self, algo: str, flat: dict, nested: dict) -> None:
        if algo in NVFP4_ALGOS:
            for key in ("group_size", "kv_cache_quant_algo", "exclude_modules"):
                if key not in nested:
                    self.error(
                        "missing_key",
                        f"hf_quant_config.json:quantization.{key}",
                        "vLLM requires it for NVFP4 (value may be null)",
                    )
            for where, d in (("config.json:quantization_config", flat), ("hf_quant_config.json:quantization", nested)):
                if d.get("group_size", NVFP4_BLOCK_SIZE) != NVFP4_BLOCK_SIZE:
                    self.error(
                        "bad_value",
                        f"{where}.group_size",
                        f"{d.get('group_size')!r}, NVFP4 uses {NVFP4_BLOCK_SIZE}",
                    )
        ignore, exclude = flat.get("ignore"), nested.get("exclude_modules")
        lists = (("config.json:quantization_config.ignore", ignore), ("hf_quant_config.json:exclude_modules", exclude))
        for key, value in lists:
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                self.error("bad_value", key, "must be a list of module names")
                return
        if ignore is None and exclude:
            self.error(
                "missing_key",
                "config.json:quantization_config.ignore",
                "hf_quant_config.json excludes modules but config.json has no ignore list",
            )
        if sorted(ignore or []) != sorted(exclude or []):
            self.error(
                "config_mismatch",
                "ignore",
                "config.json ignore and hf_quant_config.json exclude_modules differ",
            )
        if "quantized_layers" in flat or "quantized_layers" in nested:
            self.warn(
                "bad_value",
                "quantized_layers",
                f"quantized_layers is ignored unless quant_algo is MIXED_PRECISION (it is {algo})",
            )
        self.exclusions = list(ignore if ignore is not None else exclude or [])

    def _check_mixed_config(self, flat: dict, nested: dict) -> None:
        flat_layers, nested_layers = flat.get("quantized_layers"), nested.get("quantized_layers")
        if not isinstance(flat_layers, dict) or not flat_layers:
            self.error(
                "missing_key",
                "config.json:quantization_config.quantized_layers",
                "MIXED_PRECISION needs quantized_layers in config.json (SGLang reads no other file "
                "once config.json has a quantization_config)",
            )
            self._check_producer("config.json's MIXED_PRECISION quantization_config has no quantized_layers")
        if not isinstance(nested_layers, dict) or not nested_layers:
            self.error(
                "missing_key",
                "hf_quant_config.json:quantized_layers",
                "MIXED_PRECISION needs a non-empty quantized_layers",
            )
        if isinstance(flat_layers, dict) and isinstance(nested_layers, dict) and flat_layers != nested_layers:
            keys = sorted(set(flat_layers) ^ set(nested_layers))
            keys = keys or sorted(k for k in flat_layers if flat_layers[k] != nested_layers.get(k))
            self.error(
                "config_mismatch",
                "quantized_layers",
                f"config.json and hf_quant_config.json differ, first at {keys[0]!r}",
            )
        layers = flat_layers if isinstance(flat_layers, dict) and flat_layers else nested_layers
        if not isinstance(layers, dict):
            return
        for name, entry in layers.items():
            algo = entry.get("quant_algo") if isinstance(entry, dict) else None
            if algo not in MIXED_LAYER_ALGOS:
                self.error(
                    "unknown_quant_algo",
                    f"quantized_layers.{name}",
                    f"{algo!r} is not one of {MIXED_LAYER_ALGOS}",
                )
                continue
            if algo in NVFP4_ALGOS and entry.get("group_size", NVFP4_BLOCK_SIZE) != NVFP4_BLOCK_SIZE:
                self.error(
                    "bad_value",
                    f"quantized_layers.{name}.group_size",
                    f"{entry.get('group_size')!r}, NVFP4 uses {NVFP4_BLOCK_SIZE}",
                )
            self.layers[name] = algo
        if self.layers and not any(a in NVFP4_ALGOS for a in self.layers.values()):
            self.error(
                "unsupported_quant_algo",
                "quantized_layers",
                "SGLang serves MIXED_PRECISION without an NVFP4 layer as w4afp8",
            )
        ignore, exclude = flat.get("ignore") or [], nested.get("exclude_modules") or []
        if sorted(map(str, ignore)) != sorted(map(str, exclude)):
            self.error("config_mismatch", "ignore", "config.json ignore and hf_quant_config.json exclude_modules differ")
        self.exclusions = [e for e in ignore or exclude if isinstance(e, str)]

    # --- module names in the config ---

    def _check_names(self) -> None:
        module_names = set(self.modules)
        for m in list(self.modules):
            parts = m.split(".")
            module_names.update(".".join(parts[:i]) for i in range(1, len(parts)))
        weights = {m for m, leaves in self.modules.items() if "weight" in leaves}
        for entry in self.exclusions:
            key = f"ignore[{entry!r}]"
            if _JUNK.search(entry):
                self.error("junk_module_name", key, "contains control characters, whitespace or a ModelOpt sentinel")
                continue
            if self.incomplete:
                continue
            if entry not in module_names and not any(fnmatch.fnmatchcase(m, entry) for m in module_names):
                self.error("pattern_matches_nothing", key, "matches no module of the checkpoint")
        for name in self.layers:
            key = f"quantized_layers[{name!r}]"
            if _JUNK.search(name):
                self.error("junk_module_name", key, "contains control characters, whitespace or a ModelOpt sentinel")
            elif name not in weights and not self.incomplete:
                self.error("pattern_matches_nothing", key, "names no module with a weight in the checkpoint")

    # --- per-module tensors and how each engine classifies the module ---

    def _tensor_algo(self, leaves: dict[str, TensorInfo]) -> str | None:
        """The format the tensors themselves show, or None for an unquantized module."""
        w = leaves.get("weight")
        if w is not None and w.dtype == "U8":
            return "NVFP4" if "input_scale" in leaves else "W4A16_NVFP4"
        if w is not None and w.dtype == "F8_E4M3":
            return "FP8"
        if any(leaf in leaves for leaf in _QUANT_LEAVES):
            return "UNKNOWN"
        return None

    def _linear_like(self, module: str, leaves: dict[str, TensorInfo]) -> bool:
        w = leaves.get("weight")
        if w is None or len(w.shape) != 2 or module.rpartition(".")[2] in _NEVER_QUANTIZED_LEAF_MODULES:
            return False
        return "norm" not in module.rpartition(".")[2]

    def _fused(self, module: str) -> tuple[str, tuple[str, ...]] | None:
        """(fused name, shards) when `module` is one shard of a fused linear whose shards are all here."""
        parent, _, leaf = module.rpartition(".")
        for fused, shards in FUSED_LINEARS.items():
            if leaf in shards and all(f"{parent}.{s}" in self.modules for s in shards):
                return fused, shards
        return None

    def _unit(self, module: str) -> tuple[str, tuple[str, ...]]:
        """The engine-side module that owns `module`: a fused linear, a MoE layer, or itself."""
        name = _engine_name(module)
        m = _EXPERT.match(name)
        if m:
            return m["layer"], ()
        fused = self._fused(module)
        if fused is not None:
            return f"{name.rpartition('.')[0]}.{fused[0]}", fused[1]
        return name, ()

    def _engine_algos(self, module: str) -> dict[str, str | None]:
        key = self._unit(module)
        if key not in self._unit_cache:
            self._unit_cache[key] = self._engine_algos_uncached(*key)
        return self._unit_cache[key]

    def _engine_algos_uncached(self, unit: str, shards: tuple[str, ...]) -> dict[str, str | None]:
        entries = _expand_trailing_star([_engine_name(e) for e in self.exclusions])
        layers = {_engine_name(k): v for k, v in self.layers.items()}
        out: dict[str, str | None] = {}
        for engine, excluded, mixed in (
            ("vLLM", vllm_excluded, vllm_mixed_algo),
            ("SGLang", sglang_excluded, sglang_mixed_algo),
        ):
            if excluded(unit, entries, shards):
                out[engine] = None
            elif self.algo == "MIXED_PRECISION":
                out[engine] = mixed(unit, layers, shards)
            else:
                out[engine] = self.algo
        return out

    def _check_modules(self) -> None:
        reported: set[str] = set()
        broken = {_split(t)[0] for t in self.unreadable}
        for module, leaves in sorted(self.modules.items()):
            shown = self._tensor_algo(leaves)
            if module in broken or (shown is None and not self._linear_like(module, leaves)):
                continue
            unit = self._unit(module)[0]
            try:
                engines = self._engine_algos(module)
            except ValueError as e:
                if unit not in reported:
                    reported.add(unit)
                    self.error("partial_fused_exclusion", module, f"the engines refuse {unit}: {e}")
                continue
            if shown is not None:
                declared = self.layers.get(module) if self.algo == "MIXED_PRECISION" else engines["vLLM"]
                self._check_tensors(module, leaves, declared or shown)
            if shown == "UNKNOWN" or unit in reported:
                continue
            for engine, got in engines.items():
                if _family(got) == _family(shown):
                    continue
                reported.add(unit)
                if got is None:
                    self.error("not_declared", module, f"{engine} loads {unit} unquantized but its tensors are {shown}")
                elif shown is None:
                    dtype = leaves["weight"].dtype
                    message = f"{engine} loads {unit} as {got} but its weight is {dtype}; exclude it"
                    self.error("not_excluded", module, message)
                else:
                    self.error("algo_mismatch", module, f"{engine} loads {unit} as {got} but its tensors are {shown}")
                break

    def _check_tensors(self, module: str, leaves: dict[str, TensorInfo], algo: str) -> None:
        if algo == "UNKNOWN":
            self.error("missing_tensor", f"{module}.weight", "scale tensors without a uint8 or float8_e4m3fn weight")
            return
        w = leaves.get("weight")
        if w is None:
            self.error("missing_tensor", f"{module}.weight", f"{algo} module has no weight")
            return
        expect_weight = "U8" if algo in NVFP4_ALGOS else "F8_E4M3"
        if w.dtype != expect_weight:
            self.error("wrong_dtype", f"{module}.weight", f"{w.dtype}, {algo} stores {expect_weight}")
            return
        if len(w.shape) != 2:
            self.error("wrong_shape", f"{module}.weight", f"{list(w.shape)}, expected 2-D")
            return
        n = w.shape[0]
        k = w.shape[1] * 2 if algo in NVFP4_ALGOS else w.shape[1]
        if k % NVFP4_BLOCK_SIZE and algo in NVFP4_ALGOS:
            self.error("wrong_shape", f"{module}.weight", f"K = {k} is not a multiple of {NVFP4_BLOCK_SIZE}")
        if algo in NVFP4_ALGOS:
            self._expect(module, leaves, "weight_scale", "F8_E4M3", (n, k // NVFP4_BLOCK_SIZE))
            self._expect(module, leaves, "weight_scale_2", "F32", ())
            if algo == "NVFP4":
                self._expect(module, leaves, "input_scale", "F32", ())
            elif "input_scale" in leaves:
                self.warn(
                    "ignored_tensor",
                    f"{module}.input_scale",
                    "W4A16_NVFP4 quantizes no activations; the engines drop it",
                )
        else:
            self._expect(module, leaves, "weight_scale", "F32", ())
            if "input_scale" not in leaves:
                self.error(
                    "missing_tensor",
                    f"{module}.input_scale",
                    "FP8 is static per-tensor in both engines; without input_scale they quantize "
                    "activations with the float32-min placeholder (silent garbage)",
                )
            else:
                self._expect(module, leaves, "input_scale", "F32", ())
        for leaf in sorted(set(leaves) - _ALGO_LEAVES[algo] - {"bias"}):
            if not _KV_SCALE_LEAF.match(leaf):
                self.warn("unexpected_tensor", f"{module}.{leaf}", f"not part of the {algo} layout")

    def _expect(self, module: str, leaves: dict, leaf: str, dtype: str, shape: tuple[int, ...]) -> None:
        name = f"{module}.{leaf}"
        t = leaves.get(leaf)
        if t is None:
            self.error("missing_tensor", name, f"expected {dtype} {list(shape)}")
        elif t.dtype != dtype:
            self.error("wrong_dtype", name, f"{t.dtype}, expected {dtype}")
        elif t.shape != shape:
            self.error("wrong_shape", name, f"{list(t.shape)}, expected {list(shape)}")

    # --- MoE layers ---

    def _check_experts(self, config: dict) -> None:
        layers: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        for module in self.modules:
            m = _EXPERT.match(module)
            if m and "weight" in self.modules[module]:
                layers[m["layer"]][int(m["index"])][m["proj"]] = module
        n_routed = config.get("n_routed_experts")
        entries = self.exclusions
        for layer, experts in sorted(layers.items()):
            modules = [mod for projs in experts.values() for mod in projs.values()]
            if isinstance(n_routed, int) and len(experts) != n_routed:
                self.error("expert_count", layer, f"{len(experts)} experts on disk, n_routed_experts is {n_routed}")
            if sorted(experts) != list(range(len(experts))):
                self.warn("expert_count", layer, "expert indices are not 0..E-1")
            for entry in entries:
                hit = [m for m in modules if m == entry or m.startswith(entry + ".") or fnmatch.fnmatchcase(m, entry)]
                if hit and len(hit) < len(modules):
                    self.error(
                        "partial_moe_exclusion",
                        f"ignore[{entry!r}]",
                        f"excludes {len(hit)} of {len(modules)} expert modules of {layer}; "
                        "the engines exclude whole MoE layers only",
                    )
            if self.algo == "MIXED_PRECISION":
                declared = {self.layers.get(mod) for mod in modules}
                if len(declared) > 1:
                    self.error(
                        "mixed_moe_layer",
                        layer,
                        f"experts declare {sorted(map(str, declared))}; the engines give every expert "
                        "of a layer the algo of its first entry",
                    )
            # families: an ignored input_scale next to a W4A16 expert does not change its format
            shown = {_family(self._tensor_algo(self.modules[mod])) for mod in modules}
            if len(shown) > 1:
                self.error("mixed_moe_layer", layer, f"expert tensors mix formats {sorted(map(str, shown))}")
            for proj in sorted({p for projs in experts.values() for p in projs}):
                sigs = {}
                for e in sorted(experts):
                    mod = experts[e].get(proj)
                    if mod is None:
                        self.error(
                            "missing_tensor",
                            f"{layer}.{e}.{proj}.weight",
                            "expert lacks a projection its siblings have",
                        )
                        continue
                    sigs[mod] = tuple(sorted((leaf, t.dtype, t.shape) for leaf, t in self.modules[mod].items()))
                if not sigs:
                    continue
                common = Counter(sigs.values()).most_common(1)[0][0]
                for mod, sig in sigs.items():
                    if sig != common:
                        diff = sorted(set(sig) ^ set(common))
                        self.error("expert_shape_mismatch", mod, f"differs from most experts of {layer} in {diff}")

    # --- scales of fused siblings ---

    def _check_fused_scales(self) -> None:
        """One value per fused layer: the engines keep one weight_scale_2 / input_scale / FP8
        weight_scale for all shards of a fused linear (and for an expert's gate/up, w13)."""
        groups: dict[str, list[str]] = {}
        for module in self.modules:
            fused = self._fused(module)
            if fused is not None and module.rpartition(".")[2] == fused[1][0]:
                parent = module.rpartition(".")[0]
                groups[f"{parent}.{fused[0]}"] = [f"{parent}.{s}" for s in fused[1]]
        broken = {_split(t)[0] for t in self.unreadable}
        for group, members in sorted(groups.items()):
            algos = {self._tensor_algo(self.modules[m]) for m in members}
            if len(algos) != 1 or broken & set(members):
                continue  # mixed or unreadable shards are reported by the module checks
            algo = algos.pop()
            expert = _EXPERT.match(members[0]) is not None
            for leaf, level, effect in _fused_scale_rules(algo, expert):
                values = [self._scalar(f"{m}.{leaf}") for m in members]
                if None in values or len({v.tobytes() for v in values}) == 1:
                    continue
                shown = ", ".join(f"{m.rpartition('.')[2]}={float(v):.9g}" for m, v in zip(members, values))
                self.add(level, "fused_scale_mismatch", group, f"{leaf} differs across the fused shards ({shown}): {effect}")

    def _scalar(self, name: str) -> np.ndarray | None:
        """A one-element F32 tensor's value (as a 0-d array), or None."""
        t = self.tensors.get(name)
        if t is None or t.dtype != "F32" or math.prod(t.shape) != 1:
            return None
        try:
            return np.concatenate(list(self._chunks(t))).view("<f4").reshape(())
        except OSError:
            return None

    # --- KV cache scales ---

    def _check_kv(self) -> None:
        attention = sorted(
            m.rpartition(".")[0]
            for m in self.modules
            if m.endswith(".q_proj") and all(f"{m[:-len('q_proj')]}{s}" in self.modules for s in ("k_proj", "v_proj"))
        )
        loadable: dict[str, str] = {}
        for attn in attention:
            for kv in ("k", "v"):
                for name in (f"{attn}.{kv}_proj.{kv}_scale", f"{attn}.attn.{kv}_scale", f"{attn}.{kv}_scale"):
                    loadable[name] = f"{attn}:{kv}"
        for name, info in sorted(self.tensors.items()):
            if not _KV_SCALE_LEAF.match(name.rpartition(".")[2]):
                continue
            if name.endswith(".kv_scale"):
                self.error("kv_scale_dropped", name, "deprecated fused kv_scale; write k_scale and v_scale")
            elif name not in loadable:
                self.error(
                    "kv_scale_dropped",
                    name,
                    "the engines drop (or fail on) this name; attention KV scales load as "
                    "<attn>.k_proj.k_scale / <attn>.v_proj.v_scale",
                )
            elif info.dtype != "F32" or math.prod(info.shape) != 1:
                self.error("wrong_dtype", name, f"{info.dtype} {list(info.shape)}, expected F32 []")
            elif not self.kv_fp8:
                self.warn("kv_scales_unused", name, "KV cache is not declared FP8; the engines ignore this scale")
        if not self.kv_fp8:
            return
        for attn in attention:
            present = {loadable[t] for t in self.tensors if t in loadable and t.startswith(attn + ".")}
            have = {kv for kv in ("k", "v") if f"{attn}:{kv}" in present}
            if not have:
                self.warn("kv_scales_absent", attn, "KV cache is FP8 but no k/v scales: the engines use 1.0")
            elif len(have) == 1:
                missing = ({"k", "v"} - have).pop()
                self.error(
                    "missing_tensor",
                    f"{attn}.{missing}_proj.{missing}_scale",
                    "only one of k_scale / v_scale present",
                )

    # --- numerics ---

    def _check_numerics(self) -> None:
        for name, t in sorted(self.tensors.items()):
            leaf = name.rpartition(".")[2]
            try:
                if leaf == "weight_scale" and t.dtype == "F8_E4M3":
                    self._scan_e4m3(name, t, positive=True)
                elif leaf == "weight" and t.dtype == "F8_E4M3":
                    self._scan_e4m3(name, t, positive=False)
                elif (leaf in _QUANT_LEAVES or _KV_SCALE_LEAF.match(leaf)) and t.dtype == "F32":
                    self._check_f32_scale(name, t)
            except OSError as e:
                self.error("unreadable_file", name, str(e))

    def _chunks(self, t: TensorInfo):
        with open(t.file, "rb") as f:
            f.seek(t.start)
            left = t.nbytes
            while left:
                data = f.read(min(left, _CHUNK_BYTES))
                if not data:
                    raise OSError(f"{t.file.name} ended early")
                left -= len(data)
                yield np.frombuffer(data, dtype=np.uint8)

    def _scan_e4m3(self, name: str, t: TensorInfo, *, positive: bool) -> None:
        nan = zero = negative = 0
        for b in self._chunks(t):
            mag = b & 0x7F
            nan += int(np.count_nonzero(mag == E4M3_NAN_CODE))
            if positive:
                zero += int(np.count_nonzero(mag == 0))
                negative += int(np.count_nonzero(((b & 0x80) != 0) & (mag != 0) & (mag != E4M3_NAN_CODE)))
        if nan:
            self.error("nan_scale" if positive else "nan_weight", name, f"{nan} NaN bytes (0x7F/0xFF)")
        if zero:
            self.error("nonpositive_scale", name, f"{zero} zero block scales")
        if negative:
            self.error("nonpositive_scale", name, f"{negative} negative block scales")

    def _check_f32_scale(self, name: str, t: TensorInfo) -> None:
        if math.prod(t.shape) > _MAX_SCALAR_ELEMENTS:
            return
        values = np.concatenate(list(self._chunks(t)) or [np.zeros(0, np.uint8)]).view("<f4")
        bad = values[~(np.isfinite(values) & (values > 0))]
        if bad.size:
            self.error("nonpositive_scale", name, f"{bad.size} value(s) not finite and > 0, e.g. {float(bad[0])!r}")


def check_checkpoint(path: str | Path, *, model_type: str | None = None) -> ConformanceReport:
    """Check the checkpoint folder `path`; `model_type` overrides config.json's."""
    return _Checker(Path(path), model_type).run()


__all__ = [
    "ConformanceReport",
    "Finding",
    "MAX_HEADER_BYTES",
    "TensorInfo",
    "check_checkpoint",
    "read_safetensors_header",
    "sglang_excluded",
    "sglang_mixed_algo",
    "vllm_excluded",
    "vllm_mixed_algo",
]
