"""Roles: what each weight of a model does, named the same way for every architecture.

Recipes speak in roles ("routed_experts -> NVFP4 4/6"), so a recipe is written once per family
of models, not once per checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn


class Role(str, Enum):
    ROUTED_EXPERTS = "routed_experts"
    SHARED_EXPERTS = "shared_experts"
    MAMBA_IN_PROJ = "mamba_in_proj"
    MAMBA_OUT_PROJ = "mamba_out_proj"
    ATTENTION_QKV = "attention_qkv"
    ATTENTION_O = "attention_o"
    DENSE_MLP = "dense_mlp"
    ROUTER = "router"
    CONV1D = "conv1d"
    LM_HEAD = "lm_head"
    EMBEDDINGS = "embeddings"
    MTP = "mtp"


ROLE_NAMES = tuple(r.value for r in Role)


@dataclass
class Target:
    """One quantizable weight: a Linear's `weight`, or a 3-D expert stack [E, N, K].

    name:        in-memory module path of the weight's owner (e.g. `model.layers.1.mixer.experts`)
    param:       parameter name on that module (`weight`, `up_proj`, `down_proj`)
    disk_names:  checkpoint module names this weight is stored under: one per expert for stacks
                 (e.g. `backbone.layers.1.mixer.experts.0.up_proj`), else one
    fuse_group:  targets sharing a group key read the same input and share one global amax
    """

    name: str
    module: nn.Module
    param: str
    role: Role
    layer: int | None
    disk_names: list[str]
    fuse_group: str | None = None
    stacked: bool = False  # a fused [E, N, K] expert stack (one disk module per expert)

    @property
    def weight(self) -> torch.Tensor:
        """The weight's values: the parameter itself, or where accelerate offloaded the module
        (its parameter left on the meta device), the host tensor its hook holds."""
        return parameter_value(self.module, self.param)

    @property
    def is_stack(self) -> bool:
        return self.stacked

    @property
    def key(self) -> str:
        """The weight's state_dict name, e.g. `model.layers.1.mixer.experts.up_proj`."""
        return f"{self.name}.{self.param}"

    def disk_tensor_names(self, suffix: str = "weight") -> list[str]:
        return [f"{d}.{suffix}" for d in self.disk_names]


def _hooks(module: nn.Module) -> list:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])  # a SequentialHook holds several


def parameter_value(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>`, or, for a module that accelerate offloads (`device_map` entries "cpu" or
    "disk" beside a GPU, `cpu_offload`: the parameter sits on the meta device and the module's
    hook loads it for each forward), the tensor that hook holds."""
    t = getattr(module, name)
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return t
    for hook in _hooks(module):
        weights = getattr(hook, "weights_map", None)
        if getattr(hook, "offload", False) and weights is not None:
            try:
                return weights[name]
            except KeyError:
                pass
    raise ValueError(f"{type(module).__name__}.{name} is on the meta device and no accelerate hook holds its values")


def input_device(model: nn.Module) -> torch.device:
    """The device the model's inputs go to: its input embedding's, or for an embedding that
    accelerate offloads (parameters on the meta device), the device its hook runs it on."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in ([emb] if emb is not None else []) + [model]:
        for hook in _hooks(module):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    params = list(emb.parameters()) if emb is not None else []
    params += list(model.parameters())
    return next((p.device for p in params if p.device.type != "meta"), torch.device("cpu"))


def state_value(model: nn.Module, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A `model.state_dict()` entry's values (see `parameter_value`)."""
    if tensor.device.type != "meta":
        return tensor
    owner, _, name = key.rpartition(".")
    try:
        return parameter_value(model.get_submodule(owner) if owner else model, name)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


@dataclass
class AttentionKV:
    """An attention layer whose K/V cache can be quantized: where the k/v projections live."""

    name: str
    k_proj: nn.Module
    v_proj: nn.Module
    disk_name: str  # checkpoint name of the attention module (owner of k_proj/v_proj)
    module: nn.Module | None = None  # the attention module (its rotary embedding applies to keys)
