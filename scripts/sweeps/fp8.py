"""Launch-shape sweep of the FP8 GEMV (fp4kit.kernels.fp8_gemm) on a GPU, beside torch._scaled_mm.

`sweep_gemv` times the GEMV's launch shapes on Nemotron-3-Nano's Mamba projections (in_proj
10304 x 2688, out_proj 2688 x 4096) at 1-8 activation rows, and `torch._scaled_mm` (the launch
FP8Linear makes past the GEMV's rows) on the same problems; `pick_gemv` turns the rows into the
"fp8" table's GEMV entry. `sweep_mma` times the matrix-unit kernel's launch shapes on the same
problems at 1-16 rows beside `torch._scaled_mm`, and `pick_mma` turns them into the MMA entry.
"""

from __future__ import annotations

import itertools
import math

import torch

from fp4kit.kernels import fp8_gemm as fg

from . import Sweep
from .common import tensor_copies, time_if_right

SHAPES = ((10304, 2688), (2688, 4096))
# (BLOCK_N, BLOCK_K, warps): every lane holding 16 columns of its rows (BLOCK_K = 512 x warps), and
# tiles with more rows or warps than that, whose activation tile passes through shared memory
TILES = (tuple((bn, 512 * nw, nw) for bn, nw in itertools.product((1, 2, 4, 8), (1, 2, 4)))
         + ((8, 512, 4), (16, 512, 4), (8, 256, 2), (16, 256, 4)))


def _scaled_mm(xq, w, xs, ws):
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)


def _timed(fn, ref, copies) -> dict:
    """`time_if_right` of fn on the weight's first copy, the others run in turn in the same graph."""
    return time_if_right(lambda: fn(copies[0]), ref, [lambda c=c: fn(c) for c in copies[1:]])


def _problems(shapes, ms, rows: list):
    """Per shape and row count: (xq, xs, ws, the weight's copies, the fp64 reference, the row's base
    fields), after appending `torch._scaled_mm`'s row on the problem to `rows`. The copies of the
    weight together exceed four times the L2 cache (each call reads its weight from memory, as a
    model's step does)."""
    dev = torch.device("cuda")
    for n, k in shapes:
        w = (torch.randn((n, k), device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        copies = tensor_copies(w, w.numel())
        ws = torch.tensor(0.0123, device=dev)
        for m in ms:
            xq = (torch.randn((m, k), device=dev) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
            xs = torch.tensor(0.0317, device=dev)
            ref = fg.fp8_matmul_reference(xq, w, xs, ws, torch.float32).float()
            base = {"N": n, "K": k, "M": m, "weight_copies": len(copies)}
            rows.append({**base, "kernel": "_scaled_mm", **_timed(lambda c: _scaled_mm(xq, c, xs, ws), ref, copies)})
            yield xq, xs, ws, copies, ref, base
        del w, copies


def sweep_gemv(shapes=SHAPES, ms=(1, 2, 4, 8), tiles=TILES, max_acc=64, pdl_ms=(1,)) -> list:
    """Rows {N, K, M, kernel ("gemv" with tile [BLOCK_N, BLOCK_K, num_warps] and pdl, or
    "_scaled_mm"), weight_copies, ms}: each launch checked against the fp64 reference first (bf16
    output within 1e-2 relative), then timed from a CUDA graph over copies of the weight
    (`_problems`). Tiles with more than max_acc fp32 partial sums per thread at a row class are
    skipped (they spill). At the row counts pdl_ms each tile is also timed as a programmatic
    dependent launch (pdl: each call's first weight tile requested while the call before it
    finishes, as after a predecessor that lets it start early), where the GPU has it."""
    rows = []
    pdl_here = fg.backend.pdl(torch.device("cuda"), fg._fp8_gemv_kernel)
    for xq, xs, ws, copies, ref, base in _problems(shapes, ms, rows):
        bm = fg.row_class(base["M"])
        for bn, bk, nw in tiles:
            if bm * bn * bk > max_acc * 32 * nw or bk > base["K"]:
                continue
            for pdl in (False, True) if pdl_here and base["M"] in pdl_ms else (False,):
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "pdl": pdl}
                rows.append({**base, "kernel": "gemv", "tile": [bn, bk, nw], "pdl": pdl,
                             **_timed(lambda c, cfg=cfg: fg.fp8_matmul(xq, c, xs, ws, cfg=cfg), ref, copies)})
    return rows


def _ms(r) -> float:
    return r["ms"] if r["ms"] is not None else math.inf


def _best(rows) -> dict:
    """{(N, K, M): the fastest of these rows' times on that problem}."""
    best = {}
    for r in rows:
        p = (r["N"], r["K"], r["M"])
        best[p] = min(best.get(p, math.inf), _ms(r))
    return best


def _reach(picked: dict, rows, shape: tuple | None = None) -> int:
    """The largest swept M up to which the picked launches' times ({(N, K, M): ms}) beat
    `torch._scaled_mm`'s on every swept shape, or on `shape` (N, K) alone (0 if not at the first M)."""
    library = {(r["N"], r["K"], r["M"]): _ms(r) for r in rows
               if r["kernel"] == "_scaled_mm" and (shape is None or (r["N"], r["K"]) == shape)}
    max_m = 0
    for m in sorted({p[2] for p in library}):
        if not all(picked.get(p, math.inf) < t for p, t in library.items() if p[2] == m):
            break
        max_m = m
    return max_m


def _gemv_tile(r) -> tuple:
    """A GEMV row's launch: (BLOCK_N, BLOCK_K, num_warps, pdl)."""
    return (*r["tile"][:3], bool(r.get("pdl", False)))


def pick_gemv(rows) -> dict:
    """The GEMV entry: per row class c (1, 2, 4: the activation rows of one program), the launch
    (tile, and pdl where it was timed) with the smallest sum over the swept shapes of its time
    relative to the shape's best GEMV time, at the swept M of class c nearest to c (each shape
    counts alike); "shapes": per swept shape ("NxK"), the largest swept M up to which the GEMV
    with its class's launch beats `torch._scaled_mm` on that shape; max_m: the largest up to
    which it beats it on every swept shape, for other shapes (0 if not at M = 1: FP8Linear then
    calls the library)."""
    gemv = [r for r in rows if r["kernel"] == "gemv"]
    best = _best(gemv)
    out, launches = {}, {}
    for c in sorted({fg.row_class(r["M"]) for r in gemv}):
        m = min((r["M"] for r in gemv if fg.row_class(r["M"]) == c), key=lambda v: abs(v - c))
        totals = {}
        for r in gemv:
            if r["M"] == m:
                totals[_gemv_tile(r)] = totals.get(_gemv_tile(r), 0.0) + _ms(r) / best[r["N"], r["K"], m]
        launches[c] = tile = min(totals, key=totals.get)
        out[str(c)] = {"BLOCK_N": tile[0], "BLOCK_K": tile[1], "num_warps": tile[2], **({"pdl": True} if tile[3] else {})}
    picked = {(r["N"], r["K"], r["M"]): _ms(r) for r in gemv if _gemv_tile(r) == launches[fg.row_class(r["M"])]}
    out["max_m"] = _reach(picked, rows)
    out["shapes"] = {fg.shape_key(n, k): _reach(picked, rows, (n, k))
                     for n, k in sorted({(r["N"], r["K"]) for r in rows if r["kernel"] == "_scaled_mm"})}
    return out


# (BLOCK_N, BLOCK_K, num_warps, num_stages, programs_per_sm) of the matrix-unit kernel
MMA_TILES = tuple((bn, bk, 4 if bn == 64 else 8, st, pps) for bn, bk, st, pps in
                  itertools.product((64, 128), (128, 256), (3, 5), (1, 2)))


def sweep_mma(shapes=SHAPES, ms=(1, 4, 16), tiles=MMA_TILES) -> list:
    """Rows {N, K, M, kernel ("mma" with tile [BLOCK_N, BLOCK_K, num_warps, num_stages,
    programs_per_sm], or "_scaled_mm"), weight_copies, ms}, checked and timed as `sweep_gemv`'s."""
    rows = []
    for xq, xs, ws, copies, ref, base in _problems(shapes, ms, rows):
        for bn, bk, nw, st, pps in tiles:
            table = {"GEMV": {"max_m": 0}, "MMA": {"max_m": fg.MMA_ROWS, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw,
                                                   "num_stages": st, "programs_per_sm": pps, "max_parts": 4}}
            rows.append({**base, "kernel": "mma", "tile": [bn, bk, nw, st, pps],
                         **_timed(lambda c, t=table: fg.fp8_matmul(xq, c, xs, ws, tables=t), ref, copies)})
    return rows


def pick_mma(rows) -> dict:
    """The MMA entry: the tile with the smallest sum over the swept (shape, M) of its time relative
    to that problem's best matrix-unit time; max_m: the largest swept M up to which that tile beats
    `torch._scaled_mm` on every swept shape (0 if not at M = 1: then the kernel is not used)."""
    mma = [r for r in rows if r["kernel"] == "mma"]
    best = _best(mma)
    totals = {}
    for r in mma:
        totals[tuple(r["tile"])] = totals.get(tuple(r["tile"]), 0.0) + _ms(r) / best[r["N"], r["K"], r["M"]]
    tile = min(totals, key=totals.get)
    max_m = _reach({(r["N"], r["K"], r["M"]): _ms(r) for r in mma if tuple(r["tile"]) == tile}, rows)
    return {"max_m": max_m, "BLOCK_N": tile[0], "BLOCK_K": tile[1], "num_warps": tile[2], "num_stages": tile[3],
            "programs_per_sm": tile[4], "max_parts": 4}


SWEEPS = {
    "mma": Sweep("fp8", "MMA", sweep_mma, pick_mma,
                 "the FP8 matrix-unit kernel's launch shape and the rows up to which it beats torch._scaled_mm"),
    "gemv": Sweep("fp8", "GEMV", sweep_gemv, pick_gemv,
                  "the FP8 GEMV's tiles per row class and the rows up to which it beats torch._scaled_mm, per shape"),
}
