"""Launch-shape sweeps of the checkpoint-layout W4A16 GEMM (fp4kit.kernels.w4a16_gemm) on a GPU.

Each sweep times candidate launch shapes with CUDA graphs, each checked against an fp32
reference first; its pick turns the rows into one entry of the "w4a16" launch table. Candidate
tables are built and passed in (`launch.override`); the live tables are never changed.
"""

from __future__ import annotations

import itertools
import math

import torch

from fp4kit.kernels import launch, w4a16_gemm as wg
from fp4kit.kernels.quantize import quantize
from fp4kit.kernels.tiles import gemv_k_tile

from . import Sweep
from .common import merged, nvfp4_bytes, time_if_right, weight_copies, with_maxnreg


def sweep(shapes=((8192, 8192), (3712, 2688)), ms=(1, 16),
          tiles=((32, 256), (64, 128), (64, 256), (128, 256)), warps=(4, 8), stages=(3,),
          programs_per_sm=(4, 8), block_m=16, maxnreg=(None,)):
    """CUDA-graph times of decode launch shapes: tile (BLOCK_N, BLOCK_K) x warps x stages x the
    split-K target (programs per multiprocessor) x register cap; each checked against an fp32
    reference first."""
    out = []
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            ref = torch.nn.functional.linear(x.float(), wq.dequantize(torch.bfloat16).float())
            for (bn, bk), nw, st, pps, mr in itertools.product(tiles, warps, stages, programs_per_sm, maxnreg):
                cfg = with_maxnreg(dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st), mr)
                cfg.update(wg.split_k(m, n, k, cfg, x.device, pps))
                row = {"N": n, "K": k, "M": m, "maxnreg": mr, **cfg, "programs_per_sm": pps}
                row.update(time_if_right(lambda: wg.w4a16_matmul(x, wq, cfg=cfg), ref))
                out.append(row)
    return out


def sweep_mid(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)), ms=(64,)):
    """`sweep` of the 17-64-row launch shapes (BLOCK_M = 64) on the five bench shapes."""
    return sweep(shapes, ms, tiles=((64, 128), (64, 256), (128, 128)), warps=(4, 8), stages=(3,),
                 programs_per_sm=(2, 4), block_m=64)


def pick_decode(rows) -> dict:
    """The launch shape (a DECODE or MID entry) with the smallest summed sweep time over its
    shapes and M."""
    totals = {}
    for r in rows:
        key = (r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["num_stages"], r["programs_per_sm"], r.get("maxnreg"))
        t = r["ms"] if r["ms"] is not None else float("inf")
        totals[key] = totals.get(key, 0.0) + t
    bn, bk, nw, st, pps, mr = min(totals, key=totals.get)
    return with_maxnreg({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st, "programs_per_sm": pps}, mr)


def _sweep_problems(shapes, ms):
    """(N, K, M, NVFP4 weight, bf16 activations, fp32 reference) for each swept problem on the GPU:
    a random weight per shape, quantized by fp4kit, and its product with W.dequantize()."""
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        wdq = wq.dequantize(torch.float32)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            yield n, k, m, wq, x, torch.nn.functional.linear(x.float(), wdq)


def sweep_gemv(shapes=((3712, 2688), (2688, 3712), (131072, 2688)), ms=(1, 2, 4),
               tiles=((1, 4, 2048, 4), (1, 8, 2048, 4), (1, 8, 1024, 2), (1, 16, 1024, 4), (1, 4, 512, 1),
                      (1, 8, 512, 1), (1, 4, 1024, 2), (1, 16, 1024, 2), (1, 8, 256, 1), (1, 16, 128, 1),
                      (2, 8, 2048, 4), (2, 8, 512, 1), (2, 8, 1024, 2), (4, 8, 2048, 4), (4, 8, 1024, 2)),
               programs_per_sm=(4, 8, 16), stages=(1,), maxnreg=(None,), tables=None):
    """Times of the CUDA-core kernel's launch shapes (BLOCK_M, BLOCK_N, BLOCK_K, warps) x split-K
    target x stages on Nemotron-3-Nano's decode GEMVs (shared-expert up and down, lm_head), and
    of the matrix-unit kernel's launch shape at the same M, side by side; tiles with BLOCK_M < M
    run several row tiles. The one-warp 8 x 256 and 16 x 128 tiles step through K = 2688 and 3712
    in 256 or 128 (4.8 % and 3.4 % padding at 256, against 14 % and 10 % at 1024). Each launch shape is checked against an fp32 reference first (a wrong
    one is not timed), and timed cold (`time_if_right` over copies of the weight)."""
    out = []
    # config() at GEMV and MMA max_m 0 gives the wgmma kernel's launch shape at every M
    wgmma = launch.override(tables or launch.table("w4a16"), GEMV={"max_m": 0}, MMA={"max_m": 0})
    copied, others = None, []
    for n, k, m, wq, x, ref in _sweep_problems(shapes, ms):
        if copied is not wq:  # one set of copies per shape, for its M values
            copied, others = wq, weight_copies(wq, nvfp4_bytes(wq))[1:]

        def timed(cfg):
            return time_if_right(lambda: wg.w4a16_matmul(x, wq, cfg=cfg), ref,
                                 [lambda c=c: wg.w4a16_matmul(x, c, cfg=cfg) for c in others])

        base = wg.config(m, n, k, x.device, tables=wgmma)
        row = {"N": n, "K": k, "M": m, "kernel": "matrix-unit", "weight_copies": 1 + len(others), **base}
        row.update(timed(base))
        out.append(row)
        for (bm, bn, bk, nw), pps, st, mr in itertools.product(tiles, programs_per_sm, stages, maxnreg):
            if bm != wg.gemv_block_m(m):
                continue
            cfg = gemv_k_tile(k, dict(BLOCK_M=bm, gemv=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st))
            cfg = with_maxnreg(cfg, mr)
            cfg.update(wg.split_k(m, n, k, cfg, x.device, pps))
            row = {"N": n, "K": k, "M": m, "kernel": "gemv", "tile": [bm, bn, bk, nw], "maxnreg": mr, **cfg,
                   "programs_per_sm": pps, "weight_copies": 1 + len(others)}
            row.update(timed(cfg))
            out.append(row)
    return out


def pick_gemv(rows) -> dict:
    """GEMV's launch shape for each BLOCK_M (1, 2, 4): the swept (tile, split-K target, register
    cap) with the smallest sum over the swept shapes at M = BLOCK_M of its time relative to the
    shape's best (each shape counts alike: a 200 MB lm_head would outweigh the shared experts'
    5 MB in a sum of times); and max_m: the largest swept M up to which the CUDA-core kernel
    (with its BLOCK_M's pick) beats the matrix-unit kernel in the geometric mean over the swept
    shapes of its time relative to it (0 if not at M = 1). One tile serves every shape, so a
    pick that loses a little on one shape and wins much on the others still runs."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else float("inf")

    def key(r):
        return (*r["tile"], r["programs_per_sm"], r.get("maxnreg"))

    shape_best: dict = {}
    for r in rows:
        if r["kernel"] == "gemv":
            shape_best[r["N"], r.get("K"), r["M"]] = min(shape_best.get((r["N"], r.get("K"), r["M"]), float("inf")), ms(r))
    out = {}
    best_time = {}
    for bm in (1, 2, 4):
        totals = {}
        for r in rows:
            if r["kernel"] == "gemv" and r["tile"][0] == bm:
                rel = ms(r) / shape_best[r["N"], r.get("K"), r["M"]] if r["M"] == bm else 0.0
                totals[key(r)] = totals.get(key(r), 0.0) + rel
        if not totals:
            continue
        best = min(totals, key=totals.get)
        _, bn, bk, nw, pps, mr = best
        out[str(bm)] = with_maxnreg({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "programs_per_sm": pps}, mr)
        best_time.update({(r["N"], r["M"]): ms(r) for r in rows if r["kernel"] == "gemv" and key(r) == best})
    base = {(r["N"], r["M"]): ms(r) for r in rows if r["kernel"] == "matrix-unit"}
    max_m = 0
    for m in sorted({mm for _, mm in base}):
        ratios = [best_time.get(k, float("inf")) / base[k] for k in base if k[1] == m]
        if not math.prod(ratios) < 1:  # the geometric mean of its time over the matrix unit's
            break
        max_m = m
    out["max_m"] = max_m
    return out


def sweep_mma(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)), ms=(2, 4, 8),
              launches=((2, 4, 2, 2), (4, 4, 2, 2), (8, 2, 2, 2), (2, 8, 2, 2), (4, 8, 1, 2), (4, 2, 1, 2),
                      (2, 4, 2, 0), (1, 1, 2, 2, 4), (2, 1, 2, 2, 4), (1, 2, 2, 2, 4), (1, 1, 2, 2, 8),
                      (1, 2, 2, 2, 2)), tables=None):
    """CUDA-graph times of `_mma_kernel`'s launch shapes (warps, split-K target, weight-row tiles
    per warp, prefetch distance[, K groups of warps]), each checked against an fp32 reference
    first."""
    out = []
    for n, k, m, wq, x, ref in _sweep_problems(shapes, ms):
        out += _mma_launch_rows(n, k, m, wq, x, ref, launches, tables)
    return out


def _mma_launch_rows(n, k, m, wq, x, ref, launches, tables=None, **tag) -> list:
    """One sweep row per `_mma_kernel` launch shape (warps, split-K target, weight-row tiles per
    warp, prefetch distance, optionally the K groups of warps: 1 if not given) on one problem, with
    `tag`'s items, each timed if right."""
    out = []
    for nw, pps, rows, pf, *groups in launches:
        kw = groups[0] if groups else 1
        cfg = wg.mma_config(m, n, k, x.device, nw, pps, rows, pf, kw, tables=tables)
        row = {"N": n, "K": k, "M": m, **tag, "num_warps": nw, "programs_per_sm": pps, "rows": rows, "prefetch": pf,
               "kwarps": kw}
        row.update(time_if_right(lambda: wg.w4a16_matmul(x, wq, cfg=cfg), ref))
        out.append(row)
    return out


def sweep_mma_wide(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)), ms=(12, 16),
                   launches=((1, 8, 2, 2), (2, 4, 2, 2), (1, 8, 1, 2), (2, 8, 2, 2), (1, 1, 2, 2, 4), (1, 2, 2, 2, 4),
                           (1, 2, 1, 2, 4), (1, 2, 1, 2, 8)), tables=None):
    """CUDA-graph times of `_mma_kernel`'s launch shapes with two activation tiles (warps, split-K
    target, weight-row tiles per warp, prefetch distance[, K groups of warps]) and of the wgmma
    kernel's launch shape at the same M, side by side; each checked against an fp32 reference
    first."""
    out = []
    tables = tables or launch.table("w4a16")
    wgmma = launch.override(tables, MMA_WIDE={"min_weights": None})  # config() then gives the wgmma kernel's
    for n, k, m, wq, x, ref in _sweep_problems(shapes, ms):
        base = wg.config(m, n, k, x.device, tables=wgmma)
        row = {"N": n, "K": k, "M": m, "kernel": "matrix-unit"}
        row.update(time_if_right(lambda: wg.w4a16_matmul(x, wq, cfg=base), ref))
        out.append(row)
        out += _mma_launch_rows(n, k, m, wq, x, ref, launches, tables, kernel="mma")
    return out


def sweep_row_mma(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688), (10304, 2688),
                          (16384, 2688), (32768, 2688), (65536, 2688), (32768, 1856), (65536, 1856), (32768, 3712),
                          (65536, 3712), (65536, 4096), (24576, 8192), (16384, 1856)), tables=None):
    """CUDA-graph times at one activation row of the GEMV and of `_mma_kernel` at MMA's launch shape,
    side by side per shape, each checked against an fp32 reference first; "ragged": the GEMV's K
    step does not divide K."""
    out = []
    tables = tables or launch.table("w4a16")
    gemv_only = launch.override(tables, ROW_MMA={"min_weights": None})  # config() then gives the GEMV
    for n, k, m, wq, x, ref in _sweep_problems(shapes, (1,)):
        gemv = wg.config(m, n, k, x.device, tables=gemv_only)
        for kernel, cfg in (("gemv", gemv), ("mma", wg.mma_config(m, n, k, x.device, tables=tables))):
            row = {"N": n, "K": k, "M": m, "kernel": kernel, "ragged": wg.gemv_pads_k(k, tables)}
            row.update(time_if_right(lambda: wg.w4a16_matmul(x, wq, cfg=dict(cfg)), ref))
            out.append(row)
    return out


def pick_row_mma(rows) -> dict:
    """ROW_MMA from `sweep_row_mma`'s rows: min_weights, the smallest swept N * K from which the mma
    kernel beats the GEMV on every swept shape with a ragged GEMV step at least as large (shapes
    of one size summed together; None if it does not on the largest)."""
    sums = {}  # size -> [gemv, mma] summed over the ragged shapes of that size
    for r in rows:
        if r["ragged"]:
            t = r["ms"] if r["ms"] is not None else float("inf")
            pair = sums.setdefault(r["N"] * r["K"], [0.0, 0.0])
            pair[r["kernel"] == "mma"] += t
    least = None
    for size in sorted(sums, reverse=True):
        gemv, mma = sums[size]
        if not mma < gemv:
            break
        least = size
    return {"min_weights": least}


def pick_mma_wide(rows) -> dict:
    """MMA_WIDE from `sweep_mma_wide`'s rows. Each swept launch shape gets its reach, min_weights:
    the smallest swept N * K from which it beats the wgmma kernel in time summed over the swept
    M, on every swept size at least as large (shapes of one size summed together; None if it
    does not on the largest). The launch shape taken is the one whose routing (it from its reach
    up, the wgmma kernel below) is nearest each problem's best swept time: the smallest sum over
    the problems of the routed time over the problem's best, ties to `pick_mma`'s order. Routed
    times, so that a launch shape is judged only where it would run; relative ones, so that the
    largest weights do not outvote the others."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else float("inf")

    best, base, base_size = {}, {}, {}
    for r in rows:
        p, size = (r["N"], r["K"], r["M"]), r["N"] * r["K"]
        best[p] = min(best.get(p, float("inf")), ms(r))
        if r["kernel"] == "matrix-unit":
            base[p] = ms(r)
            base_size[size] = base_size.get(size, 0.0) + ms(r)
    mma_rows = [r for r in rows if r["kernel"] == "mma"]
    times, size_sums = {}, {}  # per launch shape: its time per problem, and summed per weight size
    for r in mma_rows:
        key, size = _mma_launch_key(r), r["N"] * r["K"]
        times.setdefault(key, {})[r["N"], r["K"], r["M"]] = ms(r)
        sums = size_sums.setdefault(key, {})
        sums[size] = sums.get(size, 0.0) + ms(r)

    def reach(key):
        out = None
        for size in sorted(size_sums[key], reverse=True):
            if not size_sums[key][size] < base_size[size]:
                break
            out = size
        return out

    def routed(key):
        start = reach(key)
        return sum((times[key][p] if start is not None and p[0] * p[1] >= start else base[p]) / best[p]
                   for p in base if best[p] < float("inf"))  # a problem nothing ran on counts for none

    first = _mma_launch_key(pick_mma(mma_rows))  # ties: the launch shape nearest the best over all problems
    key = min(times, key=lambda k: (routed(k), k != first))
    nw, pps, rows_, pf, kw = key
    return {"min_weights": reach(key), "num_warps": nw, "programs_per_sm": pps, "rows": rows_, "prefetch": pf,
            "kwarps": kw}


def _mma_launch_key(r: dict) -> tuple:
    """(warps, split-K target, rows, prefetch, K groups) of a sweep row or launch shape; rows of
    sweeps without K groups have 1."""
    return r["num_warps"], r["programs_per_sm"], r["rows"], r["prefetch"], r.get("kwarps", 1)


def pick_mma(rows) -> dict:
    """The MMA launch shape closest to each problem's fastest: the smallest sum over the swept
    problems (N, K, M) of its time over the problem's best time (a launch shape that failed on
    a problem never wins). Relative times, so that the largest weights do not outvote the
    others."""
    best = {}
    for r in rows:
        if r["ms"] is not None:
            p = (r["N"], r["K"], r["M"])
            best[p] = min(best.get(p, float("inf")), r["ms"])
    totals = {}
    for r in rows:
        key = _mma_launch_key(r)
        t = r["ms"] / best[r["N"], r["K"], r["M"]] if r["ms"] is not None else float("inf")
        totals[key] = totals.get(key, 0.0) + t
    nw, pps, rows_, pf, kw = min(totals, key=totals.get)
    return {"num_warps": nw, "programs_per_sm": pps, "rows": rows_, "prefetch": pf, "kwarps": kw}


SWEEPS = {
    "decode": Sweep("w4a16", "DECODE",
                    lambda: sweep(tiles=((64, 128),), warps=(4,), programs_per_sm=(4, 8), maxnreg=(None, 128, 96, 80)),
                    merged("w4a16", "DECODE", pick_decode, owned=("maxnreg",)),
                    "the wgmma kernel's launch shape up to 16 rows"),
    "mid": Sweep("w4a16", "MID", sweep_mid, merged("w4a16", "MID", pick_decode, owned=("maxnreg",)),
                 "the wgmma kernel's launch shape for 17-64 rows"),
    "gemv": Sweep("w4a16", "GEMV", sweep_gemv, merged("w4a16", "GEMV", pick_gemv),
                  "the CUDA-core GEMV's tiles and the rows up to which it beats the matrix units"),
    "mma": Sweep("w4a16", "MMA", sweep_mma, merged("w4a16", "MMA", pick_mma),
                 "the register-fed matrix-unit kernel's launch shape (2-8 rows)"),
    "mma_wide": Sweep("w4a16", "MMA_WIDE", sweep_mma_wide, merged("w4a16", "MMA_WIDE", pick_mma_wide),
                      "its two-tile launch shape (9-16 rows) and the weights from which it beats wgmma"),
    "row_mma": Sweep("w4a16", "ROW_MMA", sweep_row_mma, merged("w4a16", "ROW_MMA", pick_row_mma),
                     "the weight size from which one row runs on the mma kernel where the GEMV pads K"),
}
