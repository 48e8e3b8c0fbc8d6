"""Architecture adapters (which module plays which role) and the bundled tiny model."""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

from torch import nn

from . import generic, nemotron_h
from .roles import ROLE_NAMES, AttentionKV, Role, Target


def adapter_for(model: nn.Module) -> ModuleType:
    """The adapter module for a loaded model: Nemotron-H first class, dense decoders generic."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return nemotron_h if model_type == nemotron_h.MODEL_TYPE else generic


def cache_argument(model: nn.Module) -> str:
    """The name under which the model's forward takes its cache: `cache` (transformers 5.2x) or
    `past_key_values` (5.18 and before). A cache passed under the other name would land in
    **kwargs and be ignored, and every step would run without its past. Read once per model class."""
    return _cache_argument(type(model))


@functools.cache
def _cache_argument(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


__all__ = ["ROLE_NAMES", "AttentionKV", "Role", "Target", "adapter_for", "cache_argument", "generic", "nemotron_h"]
