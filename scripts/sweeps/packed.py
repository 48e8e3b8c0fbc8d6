"""Launch-shape sweeps of the pre-packed W4A16 GEMM (fp4kit.kernels.packed_gemm) on a GPU.

`sweep` times launch shapes per row class with CUDA graphs and `pick` turns the rows into the
"packed" table's PACKED entry; `sweep_pipeline` times the software-pipelined and TMA variants
against the plain loop (a study: no table follows from it; scripts/bench_packed.py --pipeline).
"""

from __future__ import annotations

import itertools
import json

import torch

from fp4kit.kernels import launch, packed_gemm as pg
from fp4kit.kernels.quantize import quantize

from . import Sweep
from .common import nvfp4_bytes, time_calls, weight_copies


def time_graph(fn) -> float:
    """Median ms of `fn` replayed from a CUDA graph."""
    return time_calls((fn,))


SHAPES = ((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688))
NANO = ((3712, 2688), (2688, 3712))  # the shared experts' up and down projections
PREFETCH = (0, 4)


def _sweep_problems(shapes, classes, cold: bool = False):
    """(N, K, M, BLOCK_M, packed weights, activations) for each shape (a random weight, quantized
    and packed once; cold: with packed copies, `weight_copies`), each row class M and BLOCK_M the
    class or half of it (two row programs)."""
    for n, k in shapes:
        q = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        ws = [pg.pack(c) for c in (weight_copies(q, nvfp4_bytes(q)) if cold else [q])]
        for m in classes:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            for bm in sorted({m, max(16, m // 2)}):
                yield n, k, m, bm, ws, x
        del q, ws


def _timed(n, k, m, x, ws, cfg, **extra) -> dict:
    """A sweep row: the problem, the launch keys, the split they give, `extra`, the time: replayed
    on one weight (`time_graph`), or in turn on its copies where there are several (`time_calls`)."""
    split = pg.config(m, n, k, x.device, cfg)["SPLIT"]
    if len(ws) > 1:
        ms = time_calls([lambda w=w: pg.packed_matmul(x, w, cfg=cfg) for w in ws])
    else:
        ms = time_graph(lambda: pg.packed_matmul(x, ws[0], cfg=cfg))
    return {"N": n, "K": k, "M": m, **cfg, "SPLIT": split, **extra, "ms": ms}


def sweep(shapes=SHAPES, classes=(16, 32, 64), warps=(4, 8), programs_per_sm=(1, 2, 4, 8), unroll=(1, 2),
          prefetch=PREFETCH, cold: bool = False) -> list:
    """CUDA-graph times of the launch shapes for each row class (M = the class) on each shape:
    BLOCK_M the class or half of it (two row programs), every warp count, split-K target, number
    of K tiles per loop step and L2 prefetch distance. cold: each launch reads its weight from
    device memory (`time_calls` over `weight_copies`), as in a decode step."""
    rows = []
    for n, k, m, bm, ws, x in _sweep_problems(shapes, classes, cold):
        for nw, pps, u, ahead in itertools.product(warps, programs_per_sm, unroll, prefetch):
            cfg = {"BLOCK_M": bm, "num_warps": nw, "programs_per_sm": pps, "UNROLL": u, "PREFETCH": ahead}
            rows.append(_timed(n, k, m, x, ws, cfg))
    return rows


PIPELINE_SHAPES = ((3712, 2688), (2688, 3712), (8192, 8192))


def sweep_pipeline(shapes=PIPELINE_SHAPES, classes=(16, 64), programs_per_sm=(1, 2, 4), stages=(1, 2, 3),
                   tma=(False, True)) -> list:
    """CUDA-graph times of the software-pipelined loop (num_stages > 1: the next K tile's weights
    copied to shared memory while this one is decoded and multiplied) and of the activations read
    by the tensor-memory accelerator (TMA), against the unpipelined loop, 4 warps, one K tile per
    step, for each row class on each shape (BLOCK_M the class or half of it). Each row records
    whether its output equals the unpipelined pointer-load launch's byte for byte."""
    rows = []
    for n, k, m, bm, (w,), x in _sweep_problems(shapes, classes):
        for pps in programs_per_sm:
            base = {"BLOCK_M": bm, "num_warps": 4, "programs_per_sm": pps, "UNROLL": 1}
            want = pg.packed_matmul(x, w, cfg=base)
            for st, t in itertools.product(stages, tma):
                cfg = {**base, "num_stages": st, "TMA": t}
                rows.append(_timed(n, k, m, x, [w], cfg, equal=bool(torch.equal(pg.packed_matmul(x, w, cfg=cfg), want))))
                print(json.dumps(rows[-1]), flush=True)
    return rows


OVERLAP_PROBLEMS = ((3712, 2688, 16), (3712, 2688, 64), (2688, 3712, 16), (2688, 3712, 64), (8192, 8192, 64))


def sweep_overlap(problems=OVERLAP_PROBLEMS, stages=(2, 3), programs_per_sm=(1, 2, 4), ahead=(2, 3),
                  prefetch=(0, 4)) -> list:
    """CUDA-graph times of `packed_overlap.packed_matmul_overlapped` (Gluon: K tiles overlapped)
    against torch.matmul on the bf16 weight and `packed_matmul` with its launch table, for each
    problem (N, K, M) and launch shape (activation stages, split-K target, tiles of codes loaded
    ahead, L2 prefetch distance). Each overlapped row records whether its output equals
    `packed_matmul`'s with the same BLOCK_M and split, 4 warps, byte for byte."""
    from fp4kit.kernels import packed_overlap as po

    rows = []
    for n, k in dict.fromkeys((n, k) for n, k, _ in problems):
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        w = pg.pack(quantize(wb))
        for m in [m for n2, k2, m in problems if (n2, k2) == (n, k)]:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            base = {"N": n, "K": k, "M": m}
            rows.append({**base, "kernel": "bf16", "ms": time_graph(lambda: torch.matmul(x, wb.T))})
            rows.append({**base, "kernel": "packed", **pg.config(m, n, k, x.device),
                         "ms": time_graph(lambda: pg.packed_matmul(x, w))})
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
            for st, pps, a, pf in itertools.product(stages, programs_per_sm, ahead, prefetch):
                cfg = {"STAGES": st, "programs_per_sm": pps, "AHEAD": a, "PREFETCH": pf}
                c = po.config(m, n, k, x.device, cfg)
                want = pg.packed_matmul(x, w, cfg={"BLOCK_M": c["BLOCK_M"], "num_warps": 4, "SPLIT": c["SPLIT"]})
                got = po.packed_matmul_overlapped(x, w, cfg=cfg)
                rows.append({**base, "kernel": "overlap", **c, "programs_per_sm": pps,
                             "equal": bool(torch.equal(got, want)),
                             "ms": time_graph(lambda: po.packed_matmul_overlapped(x, w, cfg=cfg))})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def pick(rows, tables=None) -> dict:
    """PACKED: per row class and weight size, the launch shape with the smallest sum over the
    swept problems of its time over the problem's best (relative, so that large weights do not
    outvote the others). Classes and sizes the sweep did not cover keep their entry in `tables`
    (default: the current "packed" table)."""
    tables = tables or launch.table("packed")
    best = {}
    for r in rows:
        p = (r["N"], r["K"], r["M"])
        best[p] = min(best.get(p, float("inf")), r["ms"])
    totals: dict = {}
    for r in rows:
        size = "large" if r["N"] * r["K"] >= tables["LARGE_WEIGHTS"] else "small"
        key = (str(pg.row_class(r["M"])), size, r["BLOCK_M"], r["num_warps"], r["programs_per_sm"], r.get("UNROLL", 1),
               r.get("PREFETCH", 0))
        totals[key] = totals.get(key, 0.0) + r["ms"] / best[r["N"], r["K"], r["M"]]
    table = {cls: launch.thaw(entry) for cls, entry in tables["PACKED"].items()}
    for cls, size in {key[:2] for key in totals}:
        keys = [key for key in totals if key[:2] == (cls, size)]
        _, _, bm, nw, pps, u, ahead = min(keys, key=totals.get)
        table[cls] = dict(table[cls], **{size: {"BLOCK_M": bm, "num_warps": nw, "programs_per_sm": pps, "UNROLL": u,
                                                "PREFETCH": ahead}})
    return table


SWEEPS = {
    "launch": Sweep("packed", "PACKED", sweep, pick,
                    "the launch shape per row class (16-128 rows) and weight size"),
}
