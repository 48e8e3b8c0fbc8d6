"""Benchmark of the pre-packed W4A16 GEMM (fp4kit.kernels.packed_gemm) on a GPU, for
scripts/bench_packed.py: side by side with torch.matmul and the checkpoint layout's GEMM."""

from __future__ import annotations

import json

import torch

from fp4kit.kernels.backend import sm_count
from fp4kit.kernels.packed_gemm import config, pack, packed_matmul
from fp4kit.kernels.packed_linear import packed_linear, uses_cluster, uses_ws
from fp4kit.kernels.quantize import quantize
from fp4kit.kernels.w4a16_gemm import path, w4a16_matmul
from sweeps.common import nvfp4_bytes, tensor_copies, time_calls, weight_copies
from sweeps.packed import NANO, SHAPES, time_graph


def bench(shapes=SHAPES, ms=(1, 4, 16, 64, 256, 1024), tables=None) -> list:
    """CUDA-graph times side by side: torch.matmul on the bf16 weight, `w4a16_matmul` on the
    checkpoint layout, and `packed_matmul` (with the launch table `tables`, default the
    device's) on the packed weight."""
    rows = []
    for n, k in shapes:
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        wq = quantize(wb)
        wp = pack(wq)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            row = {"N": n, "K": k, "M": m, "ms_bf16": time_graph(lambda: torch.matmul(x, wb.T)),
                   "ms_w4a16": time_graph(lambda: w4a16_matmul(x, wq)), "path_w4a16": path(m, n, k, x.device),
                   "ms_packed": time_graph(lambda: packed_matmul(x, wp, tables=tables)),
                   "packed_launch": config(m, n, k, x.device, tables=tables)}
            row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_w4a16"]
            row["speedup_vs_bf16_packed"] = row["ms_bf16"] / row["ms_packed"]
            row["speedup_vs_bf16_best"] = row["ms_bf16"] / min(row["ms_w4a16"], row["ms_packed"])
            rows.append(row)
        del wb, wq, wp
    return rows


def bench_cold(shapes=NANO, ms=(1, 4, 16, 32, 64), tables=None, picked=None) -> list:
    """torch.matmul on the bf16 weight, `w4a16_matmul` and `packed_matmul` (with the launch table
    `tables`, default the device's, and where `picked` is given also with that table), each timed
    warm (one weight, replayed: it stays in L2 where it fits) and cold (`time_calls` over
    copies of the weight, 4 L2s of bytes in all: every call reads its weight from device memory,
    as a decode step's layers do). "picked_equal": the two tables' outputs byte for byte (equal
    where their split of K is the same; another split sums in another order)."""
    rows = []
    for n, k in shapes:
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        wq = quantize(wb)
        q_copies = weight_copies(wq, nvfp4_bytes(wq))
        bf16_copies = tensor_copies(wb, 2 * n * k)
        p_copies = [pack(q) for q in q_copies]
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            fns = {"bf16": [lambda w=w: torch.matmul(x, w.T) for w in bf16_copies],
                   "w4a16": [lambda w=w: w4a16_matmul(x, w) for w in q_copies],
                   "packed": [lambda w=w: packed_matmul(x, w, tables=tables) for w in p_copies]}
            row = {"N": n, "K": k, "M": m, "copies": {name: len(f) for name, f in fns.items()},
                   "packed_launch": config(m, n, k, x.device, tables=tables)}
            if picked is not None:
                fns["packed_picked"] = [lambda w=w: packed_matmul(x, w, tables=picked) for w in p_copies]
                row["packed_picked_launch"] = config(m, n, k, x.device, tables=picked)
                row["picked_equal"] = bool(torch.equal(fns["packed"][0](), fns["packed_picked"][0]()))
            for name, f in fns.items():
                row[f"ms_{name}_warm"] = time_graph(f[0])
                row[f"ms_{name}_cold"] = time_calls(f)
            for state in ("warm", "cold"):
                best = min(row[f"ms_{name}_{state}"] for name in fns if name != "bf16")
                row[f"speedup_vs_bf16_best_{state}"] = row[f"ms_bf16_{state}"] / best
            rows.append(row)
        del wb, wq, bf16_copies, q_copies, p_copies
    return rows


def line_fit(xs, ys) -> dict:
    """Least-squares line ys = intercept + slope * xs, and the largest residual (same units as ys)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2 or len(ys) != n:
        raise ValueError(f"a line needs at least two distinct x values with one y each, got {list(xs)}, {list(ys)}")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return {"intercept": intercept, "slope": slope,
            "max_residual": max(abs(y - intercept - slope * x) for x, y in zip(xs, ys))}


def chain_fits(rows) -> list:
    """Per (M, launch variant, SPLIT, warm/cold): the line fit of `bench_chain`'s times (us) against
    K tiles per program: the intercept is what a launch costs whatever its K (launch, the first
    loads' wait, the split-K epilogue), the slope what each further K tile adds."""
    groups: dict = {}
    for r in rows:
        for state in ("warm", "cold"):
            key = (r["M"], r["variant"], r["SPLIT"], state)
            groups.setdefault(key, []).append((r["tiles"], r[f"ms_{state}"] * 1e3))
    fits = []
    for (m, variant, split, state), pts in sorted(groups.items()):
        pts.sort()
        fit = line_fit([p[0] for p in pts], [p[1] for p in pts])
        fits.append({"M": m, "variant": variant, "SPLIT": split, "state": state,
                     "intercept_us": fit["intercept"], "us_per_tile": fit["slope"], "max_residual_us": fit["max_residual"]})
    return fits


def bench_chain(n=3712, ms=(1, 16, 64), splits=(1, 4), tiles=(1, 2, 3, 4, 6, 8), k_ref=2688) -> list:
    """`packed_matmul`'s time against the K tiles each program runs: N weight rows, M activation
    rows, the launch table's shape for (M, n, k_ref) with SPLIT forced, K = tiles * SPLIT * 128, so
    that every program runs `tiles` K tiles and the grid stays the same. At 64 rows also with
    BLOCK_M 64 (each weight tile decoded once). Warm (one weight, replayed) and cold (copies, four
    L2s in all). bf16 torch.matmul on the same (n, K) for scale."""
    rows = []
    for split in splits:
        for t in tiles:
            k = t * split * 128
            wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
            wq = quantize(wb)
            copies = [pack(q) for q in weight_copies(wq, nvfp4_bytes(wq))]
            bf16_copies = tensor_copies(wb, 2 * n * k)
            for m in ms:
                x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
                base = config(m, n, k_ref, x.device)
                variants = {"table": {"BLOCK_M": base["BLOCK_M"], "num_warps": base["num_warps"]}}
                if m > 32:
                    variants["BLOCK_M 64"] = {"BLOCK_M": 64, "num_warps": base["num_warps"]}
                for name, v in variants.items():
                    cfg = dict(v, SPLIT=split, UNROLL=1, PREFETCH=0)
                    got = config(m, n, k, x.device, cfg)
                    if got["kt_per_split"] != t or got["SPLIT"] != split:
                        raise AssertionError(f"launch {got} does not run {t} K tiles per program in {split} splits")
                    fns = [lambda w=w: packed_matmul(x, w, cfg=cfg) for w in copies]
                    rows.append({"N": n, "K": k, "M": m, "tiles": t, "SPLIT": split, "variant": name, "launch": got,
                                 "ms_warm": time_graph(fns[0]), "ms_cold": time_calls(fns),
                                 "ms_bf16_warm": time_graph(lambda: torch.matmul(x, wb.T)),
                                 "ms_bf16_cold": time_calls([lambda w=w: torch.matmul(x, w.T) for w in bf16_copies])})
            del wb, wq, copies, bf16_copies
    return rows


def _cold_sets(n: int, k: int) -> tuple:
    """A random bf16 weight [n, k] quantized (the NVFP4 weight), and the copies a cold timing runs
    in turn: of the NVFP4 weight, of it packed, and of the bf16 weight (`weight_copies`)."""
    wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
    wq = quantize(wb)
    q_copies = weight_copies(wq, nvfp4_bytes(wq))
    return wq, q_copies, [pack(q) for q in q_copies], tensor_copies(wb, 2 * n * k)


WS_LAUNCHES = ({"BLOCK_M": 32, "P": 4}, {"BLOCK_M": 32, "P": 4, "XS": 3}, {"BLOCK_M": 32, "P": 2},
               {"BLOCK_M": 64, "P": 4}, {"BLOCK_M": 64, "P": 2, "SPLIT": 2}, {"BLOCK_M": 16, "P": 4},
               {"BLOCK_M": 16, "P": 4, "SPLIT": 2})


def bench_ws(shapes=NANO, ms=(16, 32, 64), launches=WS_LAUNCHES) -> list:
    """`packed_ws.packed_matmul_ws` (K split across each program's warpgroups) beside torch.matmul
    and `packed_matmul` (the launch table's shape), warm and cold (`bench_cold`'s copies), per launch
    shape: its relative error against the fp32 product of the dequantized weight (and
    `packed_matmul`'s), and whether two calls give the same bytes."""
    from fp4kit.kernels.packed_cluster import config as cluster_config, packed_matmul_cluster
    from fp4kit.kernels.packed_ws import config as ws_config, packed_matmul_ws

    sms = sm_count(torch.device("cuda", torch.cuda.current_device()))  # the launch packed_matmul_ws runs
    rows = []
    for n, k in shapes:
        wq, q_copies, p_copies, bf16_copies = _cold_sets(n, k)
        wd = wq.dequantize()
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            ref = x.float() @ wd.T

            def err(y):
                return float((y.float() - ref).norm() / ref.norm())

            base = {"N": n, "K": k, "M": m}
            rows.append({**base, "kernel": "bf16", "ms_warm": time_graph(lambda: torch.matmul(x, bf16_copies[0].T)),
                         "ms_cold": time_calls([lambda w=w: torch.matmul(x, w.T) for w in bf16_copies])})
            rows.append({**base, "kernel": "packed", "launch": config(m, n, k, x.device),
                         "rel_err": err(packed_matmul(x, p_copies[0])),
                         "ms_warm": time_graph(lambda: packed_matmul(x, p_copies[0])),
                         "ms_cold": time_calls([lambda w=w: packed_matmul(x, w) for w in p_copies])})
            for cfg in launches:
                if cfg.get("BLOCK_M", 0) > max(16, m):
                    continue
                y = packed_matmul_ws(x, p_copies[0], cfg=cfg)
                row = {**base, "kernel": "ws", "cfg": cfg, "launch": ws_config(m, n, k, cfg, sms), "rel_err": err(y),
                       "same_bytes_twice": bool(torch.equal(y, packed_matmul_ws(x, p_copies[0], cfg=cfg)))}
                row["ms_warm"] = time_graph(lambda cfg=cfg: packed_matmul_ws(x, p_copies[0], cfg=cfg))
                row["ms_cold"] = time_calls([lambda w=w, cfg=cfg: packed_matmul_ws(x, w, cfg=cfg) for w in p_copies])
                rows.append(row)
                print(row, flush=True)
        del wq, q_copies, p_copies, bf16_copies, wd
    return rows


ROW_WS_LAUNCHES = ({"BLOCK_M": 16, "P": 4}, {"BLOCK_M": 32, "P": 4}, {"BLOCK_M": 32, "P": 2},
                   {"BLOCK_M": 16, "P": 4, "SPLIT": 2}, {"BLOCK_M": 64, "P": 4}, {"BLOCK_M": 64, "P": 2, "SPLIT": 2})
EVERY_M = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64)


def bench_rows(shapes=NANO, ms=EVERY_M, launches=ROW_WS_LAUNCHES) -> list:
    """Per activation-row count, every W4A16 kernel a decode step could run on the weight, warm and
    cold (`bench_cold`'s copies), beside torch.matmul on the bf16 weight: `w4a16_matmul` on the
    checkpoint layout, `packed_matmul` with its launch table ("packed"), `packed_linear` as the
    modules call it ("dispatch": at the rows `uses_cluster` names, `packed_cluster`, else at those
    `uses_ws` names, `packed_ws`; its "launch" says which), `packed_cluster` at its
    default launch shape ("cluster") and, from 16 rows,
    `packed_ws.packed_matmul_ws` at each launch shape of `launches` whose BLOCK_M is at most
    max(16, M) rounded up to a power of two. One row per (shape, M, kernel)."""
    from fp4kit.kernels.packed_cluster import config as cluster_config, packed_matmul_cluster
    from fp4kit.kernels.packed_ws import config as ws_config, packed_matmul_ws

    sms = sm_count(torch.device("cuda", torch.cuda.current_device()))  # the launch packed_matmul_ws runs
    rows = []
    for n, k, m, x, base, (wq, q_copies, p_copies, bf16_copies) in _problems(shapes, ms):
        cands = [("bf16", None, [lambda w=w: torch.matmul(x, w.T) for w in bf16_copies]),
                 ("w4a16", {"path": path(m, n, k, x.device)}, [lambda w=w: w4a16_matmul(x, w) for w in q_copies]),
                 ("packed", config(m, n, k, x.device), [lambda w=w: packed_matmul(x, w) for w in p_copies]),
                 ("dispatch", _dispatch(m, n, k, x.device), [lambda w=w: packed_linear(x, w) for w in p_copies]),
                 ("cluster", cluster_config(m, n, k, None, sms), [lambda w=w: packed_matmul_cluster(x, w) for w in p_copies])]
        if m >= 16:
            for cfg in launches:
                if cfg["BLOCK_M"] <= max(16, 1 << (m - 1).bit_length()):
                    cands.append(("ws", {**cfg, **ws_config(m, n, k, cfg, sms)},
                                  [lambda w=w, cfg=cfg: packed_matmul_ws(x, w, cfg=cfg) for w in p_copies]))
        for kernel, launch_shape, fns in cands:
            rows.append({**base, "kernel": kernel, "launch": launch_shape, "ms_warm": time_graph(fns[0]),
                         "ms_cold": time_calls(fns)})
        print(f"{n}x{k} M={m}: " + "  ".join(f"{r['kernel']}{'' if r['kernel'] != 'ws' else json.dumps(r['launch'])[:40]} "
                                             f"{r['ms_warm'] * 1e3:.2f}/{r['ms_cold'] * 1e3:.2f}"
                                             for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m)), flush=True)
    return rows


def _dispatch(m: int, n: int, k: int, device: torch.device) -> dict:
    """What `packed_linear` runs for bf16 activations: packed_cluster where `uses_cluster` says so,
    else packed_ws where `uses_ws` does, else packed_matmul."""
    return {"uses_cluster": uses_cluster(m, n, k, device), "uses_ws": uses_ws(m, n, k, device)}


def _problems(shapes, ms):
    """Per shape (its `_cold_sets`, made once and dropped before the next shape's) and row count:
    (N, K, M, random bf16 activations [M, K], the row's {"N", "K", "M"}, the shape's sets)."""
    for n, k in shapes:
        sets = _cold_sets(n, k)
        for m in ms:
            yield n, k, m, torch.randn((m, k), dtype=torch.bfloat16, device="cuda"), {"N": n, "K": k, "M": m}, sets
        del sets


CLUSTER_LAUNCHES = ({"WG": 4, "WN": 1, "CL": 1, "DB": 0}, {"WG": 4, "WN": 1, "CL": 2, "DB": 0},
                    {"WG": 2, "WN": 2, "CL": 2, "DB": 0}, {"WG": 2, "WN": 2, "CL": 4, "DB": 0},
                    {"WG": 2, "WN": 2, "CL": 6, "DB": 0}, {"WG": 1, "WN": 4, "CL": 8, "DB": 0},
                    {"WG": 1, "WN": 3, "CL": 8, "DB": 0}, {"WG": 4, "WN": 1, "CL": 1, "DB": 1},
                    {"WG": 4, "WN": 1, "CL": 2, "DB": 1}, {"WG": 2, "WN": 2, "CL": 4, "DB": 1},
                    {"WG": 1, "WN": 4, "CL": 8, "DB": 1}, {"WG": 4, "WN": 1, "CL": 2, "DB": 1, "STAGES": 4},
                    {"WG": 4, "WN": 1, "CL": 2, "DB": 1, "STAGES": 5}, {"WG": 4, "WN": 1, "CL": 2, "DB": 0, "STAGES": 4})
# the default launch with the activation tiles in plain core matrices, or a stage left out
CLUSTER_VARIANTS = (("plain", False, ()), ("no-x", True, ("x",)), ("no-mma", True, ("mma",)),
                    ("no-x-no-mma", True, ("x", "mma")))


# a launch's "BN" that stands for the row count rounded up to a multiple of 8 (the wgmma's N), or of 16
ROWS8, ROWS16 = "M rounded up to 8", "M rounded up to 16"
# packed_cluster at 16-64 rows: the wgmma's N at the rows rounded up to 8 or 16, four or two
# warpgroups per block (two: no register spills at 49-64 rows), two blocks of 32 rows, as a
# programmatic dependent launch or not
ROW_CLUSTER_LAUNCHES = ({"WG": 4, "CL": 2, "BN": ROWS8, "PDL": 0}, {"WG": 4, "CL": 2, "BN": ROWS8, "DB": 0, "PDL": 0},
                        {"WG": 2, "CL": 2, "BN": ROWS16, "PDL": 0}, {"WG": 2, "CL": 2, "BN": ROWS8, "PDL": 0},
                        {"WG": 2, "CL": 2, "BN": ROWS8, "STAGES": 4, "PDL": 0}, {"WG": 4, "CL": 1, "BN": 32, "PDL": 0},
                        {"WG": 4, "CL": 2, "BN": ROWS16, "PDL": 1}, {"WG": 4, "CL": 2, "BN": ROWS8, "PDL": 1},
                        {"WG": 2, "CL": 2, "BN": ROWS8, "PDL": 1})
ROW_CLUSTER_MS = (16, 20, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64)


def at_rows(cfg: dict, m: int) -> dict:
    """cfg with a "BN" of ROWS8 or ROWS16 made m rounded up to a multiple of 8 or 16."""
    step = {ROWS8: 8, ROWS16: 16}.get(cfg.get("BN"))
    return {**cfg, "BN": -(-m // step) * step} if step else cfg


def fitting_launches(launches, m: int, n: int, k: int, sms: int) -> list:
    """(cfg, launch shape) for each of packed_cluster's `launches` (`at_rows`) that an [m, k] @ [n,
    k]^T problem can take on `sms` multiprocessors; those whose buffers need more shared memory than
    a block has at m rows are left out."""
    from fp4kit.kernels.packed_cluster import SMEM_BYTES, config as cluster_config, default_shares, mma_rows, smem_bytes

    out = []
    for cfg in launches:
        c = at_rows(cfg, m)
        bn = c.get("BN", mma_rows(m))
        if smem_bytes(bn, c.get("STAGES", 3), c.get("WG", default_shares(m)), c.get("WN", 1)) > SMEM_BYTES:
            continue
        out.append((c, cluster_config(m, n, k, c, sms)))
    return out


def bench_cluster(shapes=NANO, ms=(16, 20, 24, 32, 40, 48, 56, 64), launches=CLUSTER_LAUNCHES,
                  variants=CLUSTER_VARIANTS) -> list:
    """`packed_cluster.packed_matmul_cluster` at each launch shape of `launches` that fits the row
    count's shared memory and, at its default
    launch, each variant of `variants` (name, swizzle, stages skipped: those give wrong products,
    timed to place the time of the stages they leave out), beside torch.matmul on the bf16 weight
    and `packed_linear` ("dispatch"), warm and cold (`bench_cold`'s copies). One row per (shape, M,
    kernel); "launch": the launch shape, "variant": the variant's name, "same_bytes_as_default": a
    launch's output equal to the default launch's, byte for byte."""
    from fp4kit.kernels.packed_cluster import config as cluster_config, packed_matmul_cluster

    sms = sm_count(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for n, k, m, x, base, (_, _, p_copies, bf16_copies) in _problems(shapes, ms):
        cands = [("bf16", None, None, [lambda w=w: torch.matmul(x, w.T) for w in bf16_copies]),
                 ("dispatch", _dispatch(m, n, k, x.device), None, [lambda w=w: packed_linear(x, w) for w in p_copies])]
        default = packed_matmul_cluster(x, p_copies[0])
        same = {}
        for cfg, shape in fitting_launches(launches, m, n, k, sms):
            same[json.dumps(shape, sort_keys=True)] = bool(torch.equal(packed_matmul_cluster(x, p_copies[0], cfg=cfg), default))
            cands.append(("cluster", shape, None, [lambda w=w, cfg=cfg: packed_matmul_cluster(x, w, cfg=cfg) for w in p_copies]))
        for name, swizzle, skip in variants:
            cands.append(("cluster", cluster_config(m, n, k, None, sms), name,
                          [lambda w=w, sw=swizzle, sk=skip: packed_matmul_cluster(x, w, swizzle=sw, skip=sk)
                           for w in p_copies]))
        for kernel, launch_shape, variant, fns in cands:
            row = {**base, "kernel": kernel, "launch": launch_shape, "variant": variant,
                   "ms_warm": time_graph(fns[0]), "ms_cold": time_calls(fns)}
            if kernel == "cluster" and variant is None:
                row["same_bytes_as_default"] = same[json.dumps(launch_shape, sort_keys=True)]
            rows.append(row)
        print(f"{n}x{k} M={m}: " + "  ".join(
            f"{r['kernel']}{'' if r['kernel'] != 'cluster' else ' ' + (r['variant'] or 'BN%d WG%d WN%d CL%d S%d DB%d P%d' % tuple(r['launch'][q] for q in ('BN', 'WG', 'WN', 'CL', 'STAGES', 'DB', 'PDL')))} "
            f"{r['ms_warm'] * 1e3:.2f}/{r['ms_cold'] * 1e3:.2f}"
            for r in rows if (r["N"], r["K"], r["M"]) == (n, k, m)), flush=True)
    return rows

