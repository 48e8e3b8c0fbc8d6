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
        return getattr(self.module, self.param)

    @property
    def is_stack(self) -> bool:
        return self.stacked

    @property
    def key(self) -> str:
        """The weight's state_dict name, e.g. `model.layers.1.mixer.experts.up_proj`."""
        return f"{self.name}.{self.param}"

    def disk_tensor_names(self, suffix: str = "weight") -> list[str]:
        return [f"{d}.{suffix}" for d in self.disk_names]


@dataclass
class AttentionKV:
    """An attention layer whose K/V cache can be quantized: where the k/v projections live."""

    name: str
    k_proj: nn.Module
    v_proj: nn.Module
    disk_name: str  # checkpoint name of the attention module (owner of k_proj/v_proj)
    module: nn.Module | None = None  # the attention module (its rotary embedding applies to keys)
