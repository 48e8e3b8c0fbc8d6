"""What the GEMM-family sweeps share: timing a launch shape only once it is right, register caps,
and a picked table merged into the current one."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fp4kit.kernels import launch


def time_calls(calls) -> float:
    """CUDA-graph median ms per call of `calls` run in turn (each on a weight of its own, where
    they are a `weight_copies` set: every call then reads its weight from memory, as a model's
    step does, not from the L2 cache of the call before)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(lambda: [f() for f in calls], rep=30, return_mode="median") / len(calls)


def time_if_right(fn, ref: torch.Tensor, others=()) -> dict:
    """{"ms": CUDA-graph median time of fn()} if fn() is within 1e-2 relative of ref (a launch
    shape must be right before it is fast), else {"ms": None, "error": why}. others: the same
    call on copies of its weights (`weight_copies`); the graph then runs fn and each of them in
    turn and "ms" is the time per call, with the weights coming from memory as in a model's step
    rather than from the L2 cache of the call before."""
    try:
        err = float((fn().float() - ref).norm() / ref.norm())
        if not err < 1e-2:
            raise ArithmeticError(f"relative error {err:.3g}")
        return {"ms": time_calls((fn, *others))}
    except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory or registers
        return {"ms": None, "error": f"{type(exc).__name__}: {exc}"[:160]}


def weight_copies(w, touched_bytes: int, l2_multiple: int = 4, most: int = 64) -> list:
    """Copies of NVFP4 weight w in memory of their own (w itself first), as many as make one call
    on each touch `l2_multiple` times the GPU's L2 cache (`touched_bytes`: what one call reads of
    a weight), at least 2: a graph running the calls in turn reads each weight cold, as a
    model's step reads its layers' weights."""
    return [w] + [weight_copy(w) for _ in range(copy_count(w.packed.device, touched_bytes, l2_multiple, most) - 1)]


def tensor_copies(t: torch.Tensor, touched_bytes: int, most: int = 64) -> list:
    """`t` and clones of it, as many as `copy_count` gives: `weight_copies` for a plain tensor."""
    return [t] + [t.clone() for _ in range(copy_count(t.device, touched_bytes, most=most) - 1)]


def copy_count(device, touched_bytes: int, l2_multiple: int = 4, most: int = 64) -> int:
    """How many weights of `touched_bytes` each make `l2_multiple` times the device's L2 cache
    (at least 2, at most `most`): `weight_copies`' count, for any kind of weight."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, min(most, -(-l2_multiple * l2 // max(1, touched_bytes))))


def weight_copy(w):
    """NVFP4 weight w in memory of its own."""
    from fp4kit.formats.nvfp4 import NVFP4Tensor

    return NVFP4Tensor(w.packed.clone(), w.block_scale.clone(), w.global_scale.clone())


def nvfp4_bytes(w) -> int:
    """Bytes of an NVFP4 weight's packed values and block scales."""
    return w.packed.numel() * w.packed.element_size() + w.block_scale.numel() * w.block_scale.element_size()


def with_maxnreg(cfg: dict, maxnreg) -> dict:
    """cfg with Triton's register cap per thread (more programs per multiprocessor, at the cost
    of spills) when maxnreg is set; unchanged for None (the compiler's choice)."""
    return dict(cfg, maxnreg=maxnreg) if maxnreg else cfg


def updated(table: Mapping, picked: Mapping) -> dict:
    """A table entry with a pick's keys replaced (the keys a sweep does not pick kept)."""
    return {**launch.thaw(table), **launch.thaw(picked)}


def merged(kernel: str, table: str, pick, owned: tuple = ()):
    """A Sweep's pick: `pick(rows)` merged into the live table entry `kernel`.`table` (`updated`).
    owned: optional keys the pick decides, left out of the entry where the pick leaves them out
    (a register cap the new pick does not carry is not kept from the old entry)."""
    def run(rows):
        picked = pick(rows)
        out = updated(launch.table(kernel)[table], picked)
        return {k: v for k, v in out.items() if k not in owned or k in picked}
    return run
