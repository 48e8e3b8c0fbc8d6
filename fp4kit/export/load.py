"""Load a ModelOpt-format checkpoint back into transformers, every quantized layer run as stored.

`load_quantized(path)` builds the model from its config.json (transformers' own classes, never
code from the checkpoint), loads every BF16 tensor by name, and replaces each quantized module
with an fp4kit runtime module (`fp4kit.modules`: NVFP4Linear, FP8Linear, NVFP4Experts,
FP8KVProjection) that holds the checkpoint's tensors unchanged and computes with them.

A checkpoint the loader cannot run completely is refused with an error naming the problem: a
quant_algo it does not implement, a quantized tensor it cannot place, a module listed as
quantized without its tensors, a weight that is missing. Only safetensors are read.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..formats import nvfp4
from ..formats.constants import NVFP4_BLOCK_SIZE
from ..models import adapter_for
from ..modules import FP4KIT_MODULES, LAYOUTS, FP8KVProjection, FP8Linear, NVFP4Experts, NVFP4Linear, resolve_backend
from .checkpoint import (
    FP8_ALGO,
    KV_SUFFIXES,
    NVFP4_ALGOS,
    SCALE_SUFFIXES,
    CheckpointError,
    CheckpointReader,
    read_quant_scheme,
)

# The dtype transformers builds the model in, and so the activations the packed layout serves.
MODEL_DTYPE = torch.bfloat16


def _scalar(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.numel() != 1:
        raise CheckpointError(f"{name}: expected one float32 value, got {t.dtype} of shape {tuple(t.shape)}")
    return t.reshape(())


class _Builder:
    """Reads each quantized module's tensors by checkpoint name and checks their form."""

    def __init__(self, tensors: CheckpointReader) -> None:
        self.tensors = tensors

    def need(self, module: str, suffix: str, algo: str) -> torch.Tensor:
        name = f"{module}.{suffix}"
        if name not in self.tensors:
            raise CheckpointError(f"{module} is listed as {algo} but its tensor {name} is not in the checkpoint")
        return self.tensors.take(name)

    def nvfp4(self, module: str, algo: str, shape: tuple[int, int]) -> tuple[nvfp4.NVFP4Tensor, torch.Tensor | None]:
        n, k = shape
        packed = self.need(module, "weight", algo)
        scale = self.need(module, "weight_scale", algo)
        scale2 = _scalar(self.need(module, "weight_scale_2", algo), f"{module}.weight_scale_2")
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
            raise CheckpointError(f"{module}.weight: {algo} expects uint8 {(n, k // 2)} for a [{n}, {k}] layer, got {packed.dtype} {tuple(packed.shape)}")
        if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // NVFP4_BLOCK_SIZE):
            raise CheckpointError(f"{module}.weight_scale: expected float8_e4m3fn {(n, k // NVFP4_BLOCK_SIZE)}, got {scale.dtype} {tuple(scale.shape)}")
        input_scale = None
        if algo == "NVFP4":
            input_scale = _scalar(self.need(module, "input_scale", algo), f"{module}.input_scale")
        elif f"{module}.input_scale" in self.tensors:
            raise CheckpointError(f"{module}.input_scale: {module} is listed as {algo} (weight-only), which has no input scale")
        return nvfp4.NVFP4Tensor(packed, scale, scale2), input_scale

    def fp8(self, module: str, shape: tuple[int, int]):
        w = self.need(module, "weight", FP8_ALGO)
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != tuple(shape):
            raise CheckpointError(f"{module}.weight: FP8 expects float8_e4m3fn {tuple(shape)}, got {w.dtype} {tuple(w.shape)}")
        ws = _scalar(self.need(module, "weight_scale", FP8_ALGO), f"{module}.weight_scale")
        xs = _scalar(self.need(module, "input_scale", FP8_ALGO), f"{module}.input_scale")
        return w, ws, xs

    def bias(self, module: str, like: torch.Tensor | None) -> torch.Tensor | None:
        if like is None:
            return None
        name = f"{module}.bias"
        if name not in self.tensors:
            raise CheckpointError(f"{name} is not in the checkpoint")
        return self.tensors.take(name).to(like.dtype)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def load_quantized(path: str | Path, device: str | torch.device = "cpu", *, backend: str | None = None,
                   act_quant: bool = True, layout: str = "checkpoint") -> nn.Module:
    """A ModelOpt-format checkpoint folder -> a transformers model (eval mode) that runs it.

    backend: "torch" (exact emulation, the default on CPU) or "triton" (the default on CUDA).
    act_quant: for NVFP4 (W4A4) checkpoints, quantize activations as the engines do on
    Blackwell (True) or keep them in BF16 as the engines do on Hopper (False). W4A16 and FP8
    layers are not affected.
    layout: how NVFP4 linear weights are held: "checkpoint" (as stored) or "packed" (each
    re-laid out once here for the model's BF16 activations and run by
    `kernels.packed_linear.packed_linear`: `packed_gemm`'s kernel, on an sm_90 GPU `packed_ws`'s
    at 16-64 rows; W4A16 only, so an NVFP4
    layer that quantizes its activations is refused). Routed experts keep the checkpoint layout
    either way; a Nemotron-H shared expert runs beside them in either layout.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    device = torch.device(device)
    backend = resolve_backend(backend, device)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    scheme = read_quant_scheme(path)
    tensors = CheckpointReader(path, device)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=MODEL_DTYPE, trust_remote_code=False)
    adapter = adapter_for(model)
    build = _Builder(tensors)
    placed: set[str] = set()  # checkpoint module names that became fp4kit modules

    # Look everything up before any module is replaced (the adapters find roles by module type).
    stacks: dict[str, dict[str, list[str]]] = {}
    for t in adapter.targets(model):
        if t.is_stack:
            stacks.setdefault(t.name, {})[t.param] = t.disk_names
    kv_layers = adapter.attention_kv(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    for name, projs in stacks.items():
        module = model.get_submodule(name)
        disk = adapter.disk_name(name)
        algos = {a for names in projs.values() for a in map(scheme.algo_for, names)}
        if algos == {None}:
            for proj, names in projs.items():
                _load_stack(module, proj, names, tensors)
            continue
        if len(algos) > 1 or set(projs) != {"up_proj", "down_proj"}:
            raise CheckpointError(f"{disk}: the experts of one MoE layer are stored in different formats {sorted(map(str, algos))}")
        algo = algos.pop()
        if algo not in NVFP4_ALGOS:
            raise CheckpointError(f"{disk}: routed experts stored as {algo} are not implemented by the loader (NVFP4 and W4A16_NVFP4 are)")
        stacked, scales = {}, {}
        for proj, names in projs.items():
            shape = tuple(getattr(module, proj).shape[1:])
            parts = [build.nvfp4(d, algo, shape) for d in names]
            stacked[proj] = nvfp4.NVFP4Tensor(
                torch.stack([q.packed for q, _ in parts]), torch.stack([q.block_scale for q, _ in parts]),
                torch.stack([q.global_scale for q, _ in parts]),
            )
            scales[proj] = torch.stack([s for _, s in parts]) if algo == "NVFP4" else None
            placed.update(names)
        quant_act = act_quant and algo == "NVFP4"
        new = NVFP4Experts(stacked["up_proj"], stacked["down_proj"], module.act_fn, up_input_scale=scales["up_proj"],
                           down_input_scale=scales["down_proj"], act_quant=quant_act, backend=backend, name=name, algo=algo)
        _set_module(model, name, new)

    # An output head tied to the input embeddings is the embedding table, which no engine
    # quantizes; exporters need not list it as excluded.
    tied_head = model.get_output_embeddings() if getattr(config.get_text_config(), "tie_word_embeddings", False) else None
    for name, module in linears:
        disk = adapter.disk_name(name)
        algo = scheme.algo_for(disk)
        if algo is None or (module is tied_head and scheme.layers is None):
            continue
        shape = tuple(module.weight.shape)
        bias = build.bias(disk, module.bias)
        if algo == FP8_ALGO:
            w, ws, xs = build.fp8(disk, shape)
            new = FP8Linear(w, ws, xs, bias, backend=backend, name=name)
        else:
            qt, xs = build.nvfp4(disk, algo, shape)
            new = NVFP4Linear(qt, bias, input_scale=xs, act_quant=act_quant and algo == "NVFP4", backend=backend, name=name, algo=algo,
                              layout=layout, act_dtype=MODEL_DTYPE)
        _set_module(model, name, new)
        placed.add(disk)

    if scheme.layers is not None:
        unknown = sorted(set(scheme.layers) - placed)
        if unknown:
            raise CheckpointError(f"{scheme.source}: quantized_layers names modules this model does not have or cannot quantize: {unknown[:8]}")

    _load_plain_tensors(model, adapter, tensors, tied_head)
    if tied_head is not None and type(tied_head) is nn.Linear:
        tied_head.weight = model.get_input_embeddings().weight

    for kv in kv_layers:
        attn = model.get_submodule(kv.name)
        for kind in ("k", "v"):
            key = f"{kv.disk_name}.{kind}_proj.{kind}_scale"
            if scheme.kv_cache_algo is None:
                continue  # a stray scale is reported below as a tensor that cannot be placed
            if key not in tensors:
                raise CheckpointError(f"kv_cache_quant_algo is {scheme.kv_cache_algo} but {key} is not in the checkpoint")
            scale = _scalar(tensors.take(key), key)
            proj = f"{kind}_proj"
            setattr(attn, proj, FP8KVProjection(getattr(attn, proj), scale, kind, name=f"{kv.name}.{proj}"))

    # Subtrees the model class itself skips on load (Nemotron-H: the `mtp.*` layers it has no
    # module for), whatever their format, as from_pretrained does.
    skip = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    left = [k for k in tensors.left() if not any(p.search(k) for p in skip)]
    if left:
        quantized = [k for k in left if k.rsplit(".", 1)[-1] in SCALE_SUFFIXES + KV_SUFFIXES]
        hint = " (quantization scales of modules the config does not list as quantized)" if quantized else ""
        raise CheckpointError(f"{path}: {len(left)} tensor(s) the loader cannot place{hint}: {left[:8]}")
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if on_meta:
        raise CheckpointError(f"{path}: no tensor in the checkpoint for {on_meta[:8]}")

    model.to(device).eval()
    if backend == "triton" and hasattr(adapter, "overlap_shared_experts"):
        adapter.overlap_shared_experts(model)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _load_stack(module: nn.Module, proj: str, names: list[str], tensors: CheckpointReader) -> None:
    """A BF16 expert stack: one checkpoint tensor per expert -> the fused [E, N, K] parameter."""
    param = getattr(module, proj)
    parts = []
    for d in names:
        key = f"{d}.weight"
        if key not in tensors:
            raise CheckpointError(f"weight {key} is not in the checkpoint")
        parts.append(_plain(tensors.take(key), key, tuple(param.shape[1:])))
    module._parameters[proj] = nn.Parameter(torch.stack(parts).to(param.dtype), requires_grad=False)


def _plain(t: torch.Tensor, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"{key} is stored as {t.dtype}, but the config does not list its module as quantized")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{key}: shape {tuple(t.shape)} does not match the model's {shape}")
    return t


def _load_plain_tensors(model: nn.Module, adapter, tensors: CheckpointReader, tied_head: nn.Module | None) -> None:
    """Every parameter and persistent buffer still unloaded, by name; tied parameters once."""
    loaded: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            key = f"{mod_name}.{pname}" if mod_name else pname
            disk = adapter.disk_name(key)
            if id(param) in loaded:  # tied to a parameter already loaded
                module._parameters[pname] = loaded[id(param)]
                if disk in tensors:
                    tensors.take(disk)
                continue
            if disk not in tensors:
                if module is tied_head and pname == "weight":
                    continue  # the input embeddings' table, tied after loading
                raise CheckpointError(f"weight {disk} ({key}) is not in the checkpoint")
            t = _plain(tensors.take(disk), disk, tuple(param.shape))
            new = nn.Parameter(t.to(param.dtype), requires_grad=False)
            loaded[id(param)] = new
            module._parameters[pname] = new
        for bname, buf in list(module._buffers.items()):
            if buf is None or bname in module._non_persistent_buffers_set or isinstance(module, FP4KIT_MODULES):
                continue
            key = f"{mod_name}.{bname}" if mod_name else bname
            disk = adapter.disk_name(key)
            if disk in tensors:
                module._buffers[bname] = _plain(tensors.take(disk), disk, tuple(buf.shape)).to(buf.dtype)
