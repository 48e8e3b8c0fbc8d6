"""The W4A16 linear on a pre-packed NVFP4 weight, as fp4kit's modules run it: `packed_gemm`'s
Triton kernel, or on an sm_90 GPU, at the rows the launch table's WS entry names (16 to 64 on a
weight below LARGE_WEIGHTS, except where packed_ws would leave multiprocessors idle and
`packed_gemm` runs 16-row blocks: `ws_rows`), `packed_ws.packed_matmul_ws`, and before it, for bf16
activations at the rows of its CLUSTER entry where a cluster launch fills the GPU
(`cluster_rows`), `packed_cluster.packed_matmul_cluster`; each sums over K in its own order. The
choice is measured in benchmarks/README.md (`bench_packed.py --rows`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from . import backend, launch
from .backend import interpreted
from .packed_gemm import PackedNVFP4, _packed_kernel, packed_matmul, row_class


def uses_ws(m: int, n: int, k: int, device: torch.device, tables: Mapping | None = None) -> bool:
    """Whether `packed_linear` hands an [m, k] @ [n, k]^T problem to `packed_ws.packed_matmul_ws`
    (K split across each program's warpgroups, launch shape by `packed_ws.config`'s rule): on an
    sm_90 GPU, where `ws_rows` says so for its multiprocessor count. tables: the "packed" launch
    table (default: the device's)."""
    t = launch.table("packed", device) if tables is None else tables
    return _sm90(device) and ws_rows(m, n, k, backend.sm_count(device), t)


def _entry(tables: Mapping, key: str, m: int, n: int, k: int) -> Mapping | None:
    """The table's `key` entry where it takes an [m, k] @ [n, k]^T problem (a weight below
    LARGE_WEIGHTS, m from its min_rows to its max_rows), else None."""
    e = tables.get(key)
    if e is None or n * k >= tables["LARGE_WEIGHTS"] or not e["min_rows"] <= m <= e["max_rows"]:
        return None
    return e


def _sm90(device: torch.device) -> bool:
    return bool(device.type == "cuda" and not interpreted(_packed_kernel) and backend.capability(device) == (9, 0))


def uses_cluster(m: int, n: int, k: int, device: torch.device, tables: Mapping | None = None) -> bool:
    """Whether `packed_linear` hands an [m, k] @ [n, k]^T problem of bf16 activations to
    `packed_cluster.packed_matmul_cluster` (its default launch shape): on an sm_90 GPU, where
    `cluster_rows` says so for its multiprocessor count. tables: the "packed" launch table
    (default: the device's)."""
    t = launch.table("packed", device) if tables is None else tables
    return _sm90(device) and cluster_rows(m, n, k, backend.sm_count(device), t)


def cluster_rows(m: int, n: int, k: int, sms: int, tables: Mapping) -> bool:
    """`uses_cluster`'s rule on a GPU of `sms` multiprocessors, under the "packed" launch table
    `tables`: for weights below its LARGE_WEIGHTS, at the rows of its CLUSTER entry (min_rows to
    max_rows; no entry: never), where the default launch's blocks (one wave: one block of four
    warpgroups a multiprocessor) are at least the entry's min_fill times `sms`."""
    c = _entry(tables, "CLUSTER", m, n, k)
    if c is None:
        return False
    from .packed_cluster import _default_config, launch_grid

    return math.prod(launch_grid(m, n, _default_config(m, n, k, sms))) >= c["min_fill"] * sms


def ws_rows(m: int, n: int, k: int, sms: int, tables: Mapping) -> bool:
    """`uses_ws`'s rule on a GPU of `sms` multiprocessors, under the "packed" launch table `tables`:
    for weights below its LARGE_WEIGHTS, at the rows of its WS entry (min_rows to max_rows; no
    entry: never), except where `packed_matmul` runs blocks of 16 rows (its PACKED entry for m)
    and packed_ws's one-wave launch has fewer programs than WS's min_fill times `sms` (no
    min_fill: no exception). There `packed_matmul`'s split of K over programs keeps every
    multiprocessor busy, while packed_ws's unsplit programs would leave some idle."""
    ws = _entry(tables, "WS", m, n, k)
    if ws is None:
        return False
    fill = ws.get("min_fill")
    if fill is None or tables["PACKED"][str(row_class(m))]["small"]["BLOCK_M"] > 16:
        return True
    from .packed_ws import _default_config, launch_grid

    return math.prod(launch_grid(m, n, _default_config(m, n, k, sms))) >= fill * sms


@functools.lru_cache(maxsize=4096)
def _default_ws(m: int, n: int, k: int, device: torch.device) -> bool:
    """`uses_ws` under the device's own launch table, kept per shape."""
    return uses_ws(m, n, k, device)


@functools.lru_cache(maxsize=4096)
def _default_cluster(m: int, n: int, k: int, device: torch.device) -> bool:
    """`uses_cluster` under the device's own launch table, kept per shape."""
    return uses_cluster(m, n, k, device)


def packed_linear(x: torch.Tensor, w: PackedNVFP4, *, backend: str = "triton") -> torch.Tensor:
    """y = x @ W.unpack().dequantize(x.dtype)^T (x: [..., K] in the dtype `w` was packed for):
    `packed_gemm.packed_matmul` (backend "triton" or "torch"), on the Triton backend
    `packed_cluster.packed_matmul_cluster` where `uses_cluster` says so (bf16), else
    `packed_ws.packed_matmul_ws` where `uses_ws` does."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if backend == "triton" and isinstance(w, PackedNVFP4) and rows:
        if (x.dtype == torch.bfloat16 and w.scales.dtype == torch.bfloat16
                and _default_cluster(rows, *w.shape, x.device)):
            from .packed_cluster import packed_matmul_cluster

            return packed_matmul_cluster(x, w)
        if _default_ws(rows, *w.shape, x.device):
            from .packed_ws import packed_matmul_ws

            return packed_matmul_ws(x, w)
    return packed_matmul(x, w, backend=backend)
