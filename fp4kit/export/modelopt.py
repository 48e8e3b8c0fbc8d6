"""ModelOpt-format checkpoint export: tensors, hf_quant_config.json, config.json, model card.

Tensor names follow the checkpoint layout (`backbone.` for Nemotron-H, one module per routed
expert); each quantized module gets the tensors its format needs (see the reference table in
the README). When every quantized module uses one format the config says so with an exclusion
list; otherwise it is MIXED_PRECISION with one `quantized_layers` entry per module.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import __version__
from ..formats.constants import NVFP4_BLOCK_SIZE
from ..models import Role
from ..models.roles import state_value
from ..plan import QuantizedModel
from .card import model_card
from .checkpoint import (
    CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    METADATA_FILE,
    MIXED_PRECISION,
    NVFP4_ALGOS,
    QUANT_METHOD,
    CheckpointReader,
)
from .writer import DEFAULT_MAX_SHARD_BYTES, AtomicFolder, ShardWriter, write_json

PRODUCER = {"name": "fp4kit", "version": __version__}
# Roles that are never Linear layers in the engines; they are not listed as excluded modules.
_NOT_LINEAR = (Role.EMBEDDINGS, Role.ROUTER)


def _excluded_module_names(qm: QuantizedModel) -> list[str]:
    names = []
    for p in qm.plan:
        if p.rule is not None or p.target.role in _NOT_LINEAR:
            continue
        # A BF16 MoE layer is excluded as a whole: `...mixer.experts` matches every expert.
        names.append(qm.adapter.disk_name(p.target.name) if p.target.is_stack else p.target.disk_names[0])
    return sorted(set(names))


def quant_configs(qm: QuantizedModel, carried: list[str] = ()) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json's flat `quantization_config`).

    `carried`: source tensors copied unchanged (BF16); their modules are listed as excluded."""
    algos = sorted({q.algo for q in qm.quantized.values()})
    kv = "FP8" if qm.kv_scales or qm.recipe.kv_cache == "fp8" else None
    nested: dict = {"producer": PRODUCER, "quantization": {}}
    flat: dict = {"quant_method": QUANT_METHOD, "producer": PRODUCER}
    if len(algos) == 1:
        algo = algos[0]
        nested["quantization"]["quant_algo"] = algo
        flat["quant_algo"] = algo
        if algo in NVFP4_ALGOS:
            nested["quantization"]["group_size"] = NVFP4_BLOCK_SIZE
            flat["group_size"] = NVFP4_BLOCK_SIZE
        excluded = sorted(set(_excluded_module_names(qm)) | {n.rsplit(".", 1)[0] for n in carried if n.endswith(".weight")})
        nested["quantization"]["exclude_modules"] = excluded
        flat["ignore"] = excluded
    elif algos:
        layers = {}
        for q in qm.quantized.values():
            entry = {"quant_algo": q.algo}
            if q.algo in NVFP4_ALGOS:
                entry["group_size"] = NVFP4_BLOCK_SIZE
            for name in q.target.disk_names:
                layers[name] = dict(entry)
        layers = dict(sorted(layers.items()))
        nested["quantization"]["quant_algo"] = MIXED_PRECISION
        nested["quantization"]["quantized_layers"] = layers
        flat["quant_algo"] = MIXED_PRECISION
        flat["quantized_layers"] = layers
    else:
        raise ValueError(f"recipe {qm.recipe.name!r} quantized no weight of this model")
    # Always present (null: a BF16 KV cache): vLLM's parser of the nested file requires the key.
    nested["quantization"]["kv_cache_quant_algo"] = kv
    if kv:
        flat["kv_cache_quant_algo"] = kv
        flat["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return nested, flat


def _source_config(qm: QuantizedModel, source_dir: Path | None) -> dict:
    cfg_path = source_dir / CONFIG_FILE if source_dir else None
    if cfg_path and cfg_path.is_file():
        config = json.loads(cfg_path.read_text())
    else:
        config = qm.model.config.to_dict()
    config.pop("quantization_config", None)
    if getattr(qm.model.config, "model_type", None) == "nemotron_h":
        # Serving engines read the pattern strings; SGLang refuses transformers' newer
        # `layers_block_type` names (linear_attention, full_attention), so only patterns are written.
        for key, attr in (("layers_block_type", "hybrid_override_pattern"), ("mtp_layers_block_type", "mtp_hybrid_override_pattern")):
            pattern = getattr(qm.model.config, attr, None)
            if key in config and pattern is None:
                continue
            config.pop(key, None)
            if pattern is not None:
                config[attr] = pattern
        # SGLang builds the Mamba mixer from `mamba_n_groups` (its default 8) but sizes the state
        # cache from `n_groups`; transformers reads the two as one.
        n_groups = config.get("n_groups", getattr(qm.model.config, "n_groups", None))
        if n_groups is not None:
            config["mamba_n_groups"] = n_groups
    if not config.get("architectures"):
        config["architectures"] = [type(qm.model).__name__]
    return config


def unloaded_source_tensors(model, source_dir: Path | None) -> list[str]:
    """Source tensors the model class drops on load (its `_keys_to_ignore_on_load_unexpected`,
    e.g. Nemotron-H's `mtp.*` subtree): the export copies them unchanged so nothing is lost."""
    import re

    patterns = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    if source_dir is None or not patterns or not any(Path(source_dir).glob("*.safetensors")):
        return []
    return sorted(n for n in CheckpointReader(Path(source_dir)).names() if any(p.search(n) for p in patterns))


def _write_tensors(qm: QuantizedModel, writer: ShardWriter, progress_cb=None, source_dir: Path | None = None) -> None:
    by_key = {p.target.key: p for p in qm.plan}
    seen_storage: set[int] = set()
    for key, tensor in qm.model.state_dict().items():
        tensor = state_value(qm.model, key, tensor)
        planned = by_key.get(key)
        quantized = qm.quantized.get(key)
        if quantized is not None:
            for suffix, parts in quantized.tensors.items():
                for name, part in zip(quantized.target.disk_tensor_names(suffix), parts):
                    writer.add(name, part)
        elif planned is not None and planned.target.is_stack:
            for name, part in zip(planned.target.disk_tensor_names("weight"), tensor.unbind(0)):
                writer.add(name, part)
        else:
            ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
            tied = ptr is not None and ptr in seen_storage and getattr(qm.model.config, "tie_word_embeddings", False)
            if ptr is not None:
                seen_storage.add(ptr)
            if not tied:  # a tied weight is stored once
                writer.add(qm.adapter.disk_name(key), tensor)
        if progress_cb:
            progress_cb()
    for attn, (k_scale, v_scale) in qm.kv_scales.items():
        writer.add(f"{attn}.k_proj.k_scale", k_scale.reshape(()))
        writer.add(f"{attn}.v_proj.v_scale", v_scale.reshape(()))
    extra = unloaded_source_tensors(qm.model, source_dir)
    if extra:
        source = CheckpointReader(source_dir)
        for name in extra:
            writer.add(name, source.get(name))


def export_checkpoint(
    qm: QuantizedModel,
    output: str | Path,
    *,
    tokenizer=None,
    source_dir: str | Path | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    card_extra: dict | None = None,
) -> Path:
    """Write the checkpoint folder atomically; returns its path."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    source_dir = Path(source_dir) if source_dir else None
    nested, flat = quant_configs(qm, unloaded_source_tensors(qm.model, source_dir))
    with AtomicFolder(Path(output), overwrite=overwrite) as folder:
        writer = ShardWriter(folder.tmp, max_shard_bytes)
        n = len(qm.model.state_dict())
        bar = tqdm(total=n, desc="export", unit="tensor", disable=not progress)
        try:
            _write_tensors(qm, writer, bar.update, source_dir)
        except BaseException:
            try:
                writer.wait()  # no background write may outlive the folder's removal
            except Exception:
                pass
            raise
        bar.close()
        writer.close()
        config = _source_config(qm, source_dir)
        config["quantization_config"] = flat
        write_json(folder.tmp / CONFIG_FILE, config)
        write_json(folder.tmp / HF_QUANT_CONFIG_FILE, nested)
        write_json(folder.tmp / METADATA_FILE, {
            "producer": PRODUCER,
            "recipe": qm.recipe.to_dict(),
            "calibration": qm.calibration,
            "arith": qm.arith,
            "source": (card_extra or {}).get("source"),
        })
        if getattr(qm.model, "generation_config", None) is not None:
            qm.model.generation_config.save_pretrained(folder.tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder.tmp)
        qm.timings["export"] = time.perf_counter() - t0
        (folder.tmp / "README.md").write_text(model_card(qm, nested, writer.total_bytes, card_extra or {}))
        return folder.commit()
