"""Launch-shape sweeps of the quantize kernel (fp4kit.kernels.quantize) on a GPU.

    python scripts/tune_kernels.py quantize.tuning quantize.stack

Each candidate runs as a table of its own (`launch.override` of the device's "quantize" table),
passed to the launcher; the live tables are never changed. Every stack schedule's bytes are
checked against the two launches' before it is timed.
"""

from __future__ import annotations

import torch

from fp4kit.kernels import launch, quantize as kquant

from . import Sweep
from .common import updated

NANO_STACKS = ((128, 1856, 2688), (128, 2688, 1856))  # Nemotron-3-Nano's expert stacks (up, down)
RULES = ("6", "4o6")
# (blocks per program, warps per program) per swept TUNING entry.
TUNING_SWEEP = ((64, 2), (128, 4), (128, 2), (256, 8), (256, 4))
SCHEDULE = ("lag", "max_tiles", "quant_tiles", "prefetch", "programs_per_sm")
# One tuple per swept schedule, in SCHEDULE's order.
STACK_SWEEP = ((8, 32, 8, True, 8), (6, 32, 8, True, 8), (4, 16, 8, True, 8), (2, 16, 8, True, 8),
               (1, 4, 1, True, 8), (1, 4, 2, True, 8), (1, 8, 2, True, 8), (1, 4, 1, True, 4),
               (1, 4, 2, True, 4), (1, 8, 4, True, 4), (2, 4, 2, True, 8), (2, 8, 2, True, 8),
               (2, 4, 2, True, 4), (2, 8, 4, True, 4), (3, 8, 2, True, 8), (3, 8, 4, True, 4),
               (1, 4, 1, False, 16), (2, 4, 2, True, 16))


def _table():
    return launch.table("quantize", torch.device("cuda"))


def _same_bytes(a, b) -> bool:
    return (torch.equal(a.packed, b.packed) and torch.equal(a.global_scale, b.global_scale)
            and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)))


def sweep(shape=NANO_STACKS[0], configs=TUNING_SWEEP) -> list:
    """Times of `launch` (CUDA graph, median) per (blocks per program, warps) launch shape, both rules."""
    from triton.testing import do_bench_cudagraph

    w = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    out = []
    for blocks, warps in configs:
        table = launch.override(_table(), TUNING={"blocks": blocks, "num_warps": warps})
        for rule in RULES:
            ms = do_bench_cudagraph(lambda: kquant.launch(w, rule, tables=table), rep=60, return_mode="median")
            out.append({"blocks": blocks, "num_warps": warps, "rule": rule, "ms": ms})
    return out


def pick(rows) -> dict:
    """The TUNING entry with the smallest plain + 4/6 sweep time."""
    totals = {}
    for r in rows:
        key = (r["blocks"], r["num_warps"])
        totals[key] = totals.get(key, 0.0) + r["ms"]
    blocks, warps = min(totals, key=totals.get)
    return {"blocks": blocks, "num_warps": warps}


def sweep_stack(shapes=NANO_STACKS, configs=STACK_SWEEP) -> list:
    """Times of the one-launch stack kernel per schedule (SCHEDULE) on the Nano expert stacks, both
    rules, beside the two launches; every schedule's bytes are checked against the two launches'."""
    from triton.testing import do_bench_cudagraph

    base = _table()
    two = launch.override(base, STACK={"max_member_bytes": None})  # a max pass, then the quantize launch
    out = []
    for shape in shapes:
        w = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        ref = {rule: kquant.launch(w, rule, tables=two)[0] for rule in RULES}
        for rule in RULES:
            ms = do_bench_cudagraph(lambda: kquant.launch(w, rule, tables=two), rep=60, return_mode="median")
            out.append({"shape": list(shape), "config": "two launches", "rule": rule, "ms": ms})
        for config in configs:
            schedule = dict(zip(SCHEDULE, config))
            table = launch.override(base, STACK=schedule)
            for rule in RULES:
                if not _same_bytes(kquant.launch(w, rule, tables=table)[0], ref[rule]):
                    raise AssertionError(f"stack kernel bytes differ at {schedule} ({rule}, {shape})")
                ms = do_bench_cudagraph(lambda: kquant.launch(w, rule, tables=table), rep=60, return_mode="median")
                out.append({"shape": list(shape), **schedule, "rule": rule, "ms": ms})
    return out


def pick_stack(rows) -> dict:
    """The STACK entry (the device's, with the schedule that has the smallest plain + 4/6 time
    summed over the swept stacks)."""
    totals = {}
    for r in rows:
        if "lag" in r:
            key = tuple(r[k] for k in SCHEDULE)
            totals[key] = totals.get(key, 0.0) + r["ms"]
    return updated(_table()["STACK"], dict(zip(SCHEDULE, min(totals, key=totals.get))))


SWEEPS = {
    "tuning": Sweep(kernel="quantize", table="TUNING", run=sweep, pick=pick,
                    doc="blocks and warps per program of the quantize launches, on one Nano expert stack"),
    "stack": Sweep(kernel="quantize", table="STACK", run=sweep_stack, pick=pick_stack,
                   doc="the one-launch stack kernel's schedule, on both Nano expert stacks"),
}
