"""Launch tables: each kernel's launch shapes and routing limits, as frozen data.

The tables are read once from `tuning/<gpu>.json`, which `scripts/tune_kernels.py` writes from
its sweeps (each table carries the command and date that chose it), or from the file named by the
environment variable FP4KIT_TUNING where it is set (read at the first launch). Nothing in the
library changes a table at run time: a launcher takes its table as an argument (default: the one
for the device) and a test or a sweep that wants other launch shapes passes its own.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

# The GPU whose picks are used where a device has none of its own (every CUDA device today, and
# the CPU, where the interpreter runs the same routing on small grids).
DEFAULT_GPU = "h200"
TUNING_ENV = "FP4KIT_TUNING"  # a tuning file to use instead of the package's (same format)


def freeze(value):
    """A JSON value as read-only data: dicts -> mappingproxy, lists -> tuples, recursively."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value):
    """The inverse of `freeze`: plain dicts and lists, for writing a table back out or editing a copy."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def tuning_path(gpu: str = DEFAULT_GPU):
    return importlib.resources.files("fp4kit.kernels").joinpath("tuning", f"{gpu}.json")


@functools.cache
def tables(gpu: str = DEFAULT_GPU) -> Mapping[str, Mapping]:
    """Every kernel's launch table for `gpu` ({kernel: {table name: table}}), frozen."""
    chosen = os.environ.get(TUNING_ENV)
    doc = json.loads(Path(chosen).read_text() if chosen else tuning_path(gpu).read_text())
    return freeze({kernel: entry["tables"] for kernel, entry in doc["kernels"].items()})


def gpu_of(device: torch.device | None) -> str:
    """The tuning file for a device: the H200's picks for every device until another is tuned."""
    return DEFAULT_GPU


def table(kernel: str, device: torch.device | None = None) -> Mapping:
    """`kernel`'s tables ("quantize", "w4a16", "moe", "packed", "fp8", "router", "mamba") for `device`."""
    return tables(gpu_of(device))[kernel]


def override(base: Mapping, **changes) -> Mapping:
    """A copy of a frozen table with some entries replaced (nested mappings merged one level)."""
    out = thaw(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **thaw(value)}
        else:
            out[key] = thaw(value)
    return freeze(out)
