"""Architecture adapters (which module plays which role) and the bundled tiny model."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from . import generic, nemotron_h
from .roles import ROLE_NAMES, AttentionKV, Role, Target


def adapter_for(model: nn.Module) -> ModuleType:
    """The adapter module for a loaded model: Nemotron-H first class, dense decoders generic."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return nemotron_h if model_type == nemotron_h.MODEL_TYPE else generic


__all__ = ["ROLE_NAMES", "AttentionKV", "Role", "Target", "adapter_for", "generic", "nemotron_h"]
