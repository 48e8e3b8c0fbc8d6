"""What the GEMM-family sweeps share: timing a launch shape only once it is right, register caps,
and a picked table merged into the current one."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fp4kit.kernels import launch


def time_if_right(fn, ref: torch.Tensor) -> dict:
    """{"ms": CUDA-graph median time of fn()} if fn() is within 1e-2 relative of ref (a launch
    shape must be right before it is fast), else {"ms": None, "error": why}."""
    from triton.testing import do_bench_cudagraph

    try:
        err = float((fn().float() - ref).norm() / ref.norm())
        if not err < 1e-2:
            raise ArithmeticError(f"relative error {err:.3g}")
        return {"ms": do_bench_cudagraph(fn, rep=30, return_mode="median")}
    except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory or registers
        return {"ms": None, "error": f"{type(exc).__name__}: {exc}"[:160]}


def with_maxnreg(cfg: dict, maxnreg) -> dict:
    """cfg with Triton's register cap per thread (more programs per multiprocessor, at the cost
    of spills) when maxnreg is set; unchanged for None (the compiler's choice)."""
    return dict(cfg, maxnreg=maxnreg) if maxnreg else cfg


def updated(table: Mapping, picked: Mapping) -> dict:
    """A table entry with a pick's keys replaced (the keys a sweep does not pick kept)."""
    return {**launch.thaw(table), **launch.thaw(picked)}


def merged(kernel: str, table: str, pick):
    """A Sweep's pick: `pick(rows)` merged into the live table entry `kernel`.`table` (`updated`)."""
    return lambda rows: updated(launch.table(kernel)[table], pick(rows))
