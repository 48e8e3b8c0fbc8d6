"""A ModelOpt-format checkpoint folder: its vocabulary, and the one way to read it.

Vocabulary: the file names, the quant_algo names, the tensor-name suffixes of a quantized module.
Reading: `CheckpointReader` (tensors by name across shards, safetensors only) and
`read_quant_scheme` (the quantization config.json and hf_quant_config.json declare, checked to
agree). The exporter writes this vocabulary, the loader, the conformance check and verify read it.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from ..formats.constants import NVFP4_BLOCK_SIZE

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
METADATA_FILE = "fp4kit.json"  # fp4kit's own record: recipe, calibration, arith, source
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
FP8_ALGO = "FP8"
MIXED_PRECISION = "MIXED_PRECISION"
LAYER_ALGOS = NVFP4_ALGOS + (FP8_ALGO,)  # the per-module algos fp4kit writes and runs
KV_ALGOS = (FP8_ALGO,)
QUANT_METHOD = "modelopt"

# Tensors a quantized module stores next to its weight, and the FP8 KV cache's scales.
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
KV_SUFFIXES = ("k_scale", "v_scale")


def weight_suffixes(algo: str) -> tuple[str, ...]:
    """The tensors a module stored in `algo` has: weight, its scales, and an input scale for
    the formats that quantize activations."""
    if algo in NVFP4_ALGOS:
        return ("weight", "weight_scale", "weight_scale_2") + (("input_scale",) if algo == "NVFP4" else ())
    return ("weight", "weight_scale", "input_scale")


class CheckpointError(ValueError):
    """A checkpoint fp4kit refuses: unknown format, unreadable files, unplaceable or missing tensors."""


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------
class CheckpointReader:
    """The folder's safetensors, read by name across shards; remembers what was taken.

    Files: those the index names, else every *.safetensors in the folder. A folder with only
    pickles, a missing shard, an unreadable file or a tensor stored twice is refused.
    """

    def __init__(self, folder: str | Path, device: str = "cpu") -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if self.folder.is_dir() else []
            if pickles:
                raise CheckpointError(f"{self.folder}: only pickle files ({', '.join(pickles)}); fp4kit reads safetensors only, never pickles")
            raise CheckpointError(f"{self.folder}: no .safetensors files")
        self._handles = {}
        self.where: dict[str, str] = {}
        for f in files:
            if not (self.folder / f).is_file():
                raise CheckpointError(f"{self.folder}: shard {f} named in the index is missing")
            try:
                h = safe_open(str(self.folder / f), framework="pt", device=str(device))
            except Exception as exc:  # safetensors' own error type is not a ValueError
                raise CheckpointError(f"{self.folder / f}: not a readable safetensors file: {exc}") from None
            self._handles[f] = h
            for k in h.keys():
                if k in self.where:
                    raise CheckpointError(f"{self.folder}: tensor {k} is stored twice ({self.where[k]} and {f})")
                self.where[k] = f
        self.taken: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str):
        return self._handles[self.where[name]].get_tensor(name)

    def take(self, name: str):
        """`get`, remembering the name (see `left`)."""
        self.taken.add(name)
        return self.get(name)

    def left(self) -> list[str]:
        """Names never taken."""
        return sorted(set(self.where) - self.taken)


def read_metadata(folder: str | Path) -> dict | None:
    """fp4kit's record of how the checkpoint was made, or None for a checkpoint from elsewhere."""
    path = Path(folder) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else None


# --------------------------------------------------------------------------------------------
# What the checkpoint says it is
# --------------------------------------------------------------------------------------------
def read_quant_configs(folder: str | Path) -> tuple[dict | None, dict | None]:
    """(config.json's flat `quantization_config`, hf_quant_config.json's nested `quantization`),
    each None where absent; unparsed."""
    folder = Path(folder)
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}")
    flat = json.loads(cfg_file.read_text()).get("quantization_config")
    nested_file = folder / HF_QUANT_CONFIG_FILE
    nested = json.loads(nested_file.read_text()).get("quantization") if nested_file.is_file() else None
    return flat, nested


@dataclass(frozen=True)
class QuantScheme:
    """The quantization a checkpoint declares, from config.json (flat) or hf_quant_config.json.

    quant_algo: one algo for every quantized module, or MIXED_PRECISION with `layers` naming
    each quantized module (checkpoint names) and its algo. `ignore`: the exclusion list of the
    single-algo form.
    """

    quant_algo: str
    kv_cache_algo: str | None
    layers: dict[str, str] | None
    ignore: tuple[str, ...]
    source: str

    def algo_for(self, disk_module: str) -> str | None:
        """The algo a checkpoint module is stored in, or None (unquantized)."""
        if self.layers is not None:
            return self.layers.get(disk_module)
        return None if excluded(disk_module, self.ignore) else self.quant_algo


def excluded(disk_module: str, patterns) -> bool:
    """True if an exclusion entry names the module, a module above it, or matches it as a glob."""
    return any(disk_module == p or disk_module.startswith(p + ".") or fnmatch.fnmatchcase(disk_module, p) for p in patterns)


def parse_quant_scheme(q: dict, where: str, exclusion_key: str) -> QuantScheme:
    """One quantization section (flat: exclusion_key "ignore"; nested: "exclude_modules")."""
    method = q.get("quant_method", QUANT_METHOD)
    if method != QUANT_METHOD:
        raise CheckpointError(f"{where}: quant_method {method!r} is not ModelOpt's; fp4kit loads quant_method 'modelopt' only")
    algo = q.get("quant_algo")
    group = q.get("group_size", NVFP4_BLOCK_SIZE)
    layers = None
    if algo == MIXED_PRECISION:
        raw = q.get("quantized_layers")
        if not isinstance(raw, dict) or not raw:
            raise CheckpointError(f"{where}: MIXED_PRECISION without a `quantized_layers` mapping")
        layers = {}
        for name, entry in raw.items():
            a = entry.get("quant_algo") if isinstance(entry, dict) else None
            if a not in LAYER_ALGOS:
                raise CheckpointError(f"{where}: layer {name!r} has quant_algo {a!r}, which fp4kit's loader does not implement (it runs {list(LAYER_ALGOS)})")
            if a in NVFP4_ALGOS and entry.get("group_size", NVFP4_BLOCK_SIZE) != NVFP4_BLOCK_SIZE:
                raise CheckpointError(f"{where}: layer {name!r} has group_size {entry.get('group_size')}; NVFP4 uses {NVFP4_BLOCK_SIZE}")
            layers[name] = a
    elif algo not in LAYER_ALGOS:
        raise CheckpointError(
            f"{where}: quant_algo {algo!r} is not implemented by fp4kit's loader (it runs {list(LAYER_ALGOS)} and MIXED_PRECISION of these)"
        )
    elif algo in NVFP4_ALGOS and group != NVFP4_BLOCK_SIZE:
        raise CheckpointError(f"{where}: group_size {group}; NVFP4 uses {NVFP4_BLOCK_SIZE}")
    kv = q.get("kv_cache_quant_algo")
    if kv is None and isinstance(q.get("kv_cache_scheme"), dict):
        s = q["kv_cache_scheme"]
        if s.get("type") == "float" and s.get("num_bits") == 8 and not s.get("dynamic", False):
            kv = FP8_ALGO
        else:
            raise CheckpointError(f"{where}: kv_cache_scheme {s} is not implemented (static FP8 is)")
    if kv is not None and kv not in KV_ALGOS:
        raise CheckpointError(f"{where}: kv_cache_quant_algo {kv!r} is not implemented by fp4kit's loader (it runs {list(KV_ALGOS)})")
    ignore = q.get(exclusion_key) or ()
    return QuantScheme(algo, kv, layers, tuple(ignore), where)


def read_quant_scheme(path: str | Path) -> QuantScheme:
    """config.json's flat `quantization_config` first, else hf_quant_config.json; both must agree."""
    path = Path(path)
    flat, nested = read_quant_configs(path)
    if flat is None and nested is None:
        raise CheckpointError(
            f"{path}: not a quantized checkpoint ({CONFIG_FILE} has no quantization_config and there is no {HF_QUANT_CONFIG_FILE})"
        )
    schemes = []
    if flat is not None:
        schemes.append(parse_quant_scheme(flat, f"{path / CONFIG_FILE} quantization_config", "ignore"))
    if nested is not None:
        schemes.append(parse_quant_scheme(nested, str(path / HF_QUANT_CONFIG_FILE), "exclude_modules"))
    first = schemes[0]
    for other in schemes[1:]:
        a = (first.quant_algo, first.kv_cache_algo, first.layers, sorted(first.ignore))
        b = (other.quant_algo, other.kv_cache_algo, other.layers, sorted(other.ignore))
        if a != b:
            raise CheckpointError(
                f"{path}: config.json's quantization_config and hf_quant_config.json disagree "
                f"(quant_algo {first.quant_algo} vs {other.quant_algo}, kv {first.kv_cache_algo} vs {other.kv_cache_algo}, "
                "or their layer / exclusion lists); engines read one or the other"
            )
    return first
