"""Launch-shape sweeps of the grouped MoE (fp4kit.kernels.moe_gemm) on a GPU, on Nemotron-3-Nano's
experts (128 experts, top-6, H = 2688, I = 1856).

Each sweep times candidate launch shapes or paths with CUDA graphs, each checked against the
torch backend first; its pick turns the rows into one entry of the "moe" launch table. Candidate
tables are built and passed in (`launch.override`); the live tables are never changed.
"""

from __future__ import annotations

import itertools

import torch

from fp4kit.kernels import launch, moe_gemm as mg
from fp4kit.kernels.quantize import quantize

from . import Sweep
from .common import merged, nvfp4_bytes, time_if_right, weight_copies, weight_copy, with_maxnreg


def _nano_experts(n_exp, hid, inter):
    """Random bf16 expert stacks of the given widths quantized on the GPU: (up, down)."""
    up = quantize(torch.randn((n_exp, inter, hid), dtype=torch.bfloat16, device="cuda") * 0.02)
    down = quantize(torch.randn((n_exp, hid, inter), dtype=torch.bfloat16, device="cuda") * 0.02)
    return up, down


def _routed_tokens(t, n_exp, top_k, hid, up, down):
    """t random tokens routed top_k of n_exp, and the torch backend's output as the fp32
    reference a swept launch shape must match: (hidden, ids, weights, reference)."""
    h = torch.randn((t, hid), dtype=torch.bfloat16, device="cuda")
    ids = torch.rand((t, n_exp), device="cuda").topk(top_k, dim=-1).indices
    w = torch.rand((t, top_k), device="cuda")
    return h, ids, w, mg.moe_experts(h, ids, w, up, down, backend="torch").float()


def sweep(tokens=(1, 8, 64), n_exp=128, top_k=6, hid=2688, inter=1856,
          shapes=((64, 128, 4), (32, 128, 4), (32, 256, 4), (64, 256, 4)), maxnreg=(None,)):
    """CUDA-graph times of decode launch shapes (BLOCK_N, BLOCK_K, warps) x register cap on
    Nano's experts, each checked first."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    for t in tokens:
        h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
        for (bn, bk, nw), mr in itertools.product(shapes, maxnreg):
            cfg = with_maxnreg(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3), mr)
            row = {"tokens": t, "maxnreg": mr, **cfg}
            row.update(time_if_right(lambda: mg.moe_experts(h, ids, w, up, down, cfg=cfg), ref))
            out.append(row)
    return out


def _cold_copies(t, top_k, n_exp, up, down):
    """(up, down) copies for `time_if_right`'s others: enough that a graph over them reads the
    routed experts from memory (t tokens touch up to t * top_k experts of each stack)."""
    touched = min(n_exp, t * top_k) * (nvfp4_bytes(up) + nvfp4_bytes(down)) // n_exp
    return [(u, weight_copy(down)) for u in weight_copies(up, touched)[1:]]


def _cold_timer(t, n_exp, top_k, hid, up, down):
    """t routed tokens (`_routed_tokens`) and what times a `moe_experts` launch shape on them cold
    (`time_if_right` over `_cold_copies` of the stacks, each launch checked first): (hidden
    states, stack copies in the graph, timer)."""
    h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
    copies = _cold_copies(t, top_k, n_exp, up, down)

    def timed(cfg):
        def run(u, d):
            return mg.moe_experts(h, ids, w, u, d, cfg=dict(cfg))
        return time_if_right(lambda: run(up, down), ref, [lambda u=u, d=d: run(u, d) for u, d in copies])

    return h, 1 + len(copies), timed


def sweep_small(tokens=(1, 2, 4, 8, 64), n_exp=128, top_k=6, hid=2688, inter=1856, programs_per_sm=(2, 4, 8),
                max_parts=(4, 8), tables=None):
    """Times of the in-kernel-routing path (`_moe_small`) per split-K target and split cap, and
    of the sort-based path, on Nano's experts, each checked first; timed cold (`time_if_right`
    over copies of the stacks)."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    tables = tables or launch.table("moe")
    for t in tokens:
        h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
        copies = _cold_copies(t, top_k, n_exp, up, down)
        cfg = mg.matrix_unit_config(t * top_k, n_exp, h.device, tables)

        def timed(run):
            return time_if_right(lambda: run(up, down), ref, [lambda u=u, d=d: run(u, d) for u, d in copies])

        row = {"tokens": t, "path": "sorted", "weight_copies": 1 + len(copies)}
        row.update(timed(lambda u, d: mg.moe_experts(h, ids, w, u, d, cfg=dict(cfg, small=False))))
        out.append(row)
        for pps, parts in itertools.product(programs_per_sm, max_parts):
            small = launch.override(tables, SMALL={"programs_per_sm": pps, "max_parts": parts})
            row = {"tokens": t, "path": "small", "programs_per_sm": pps, "max_parts": parts,
                   "weight_copies": 1 + len(copies)}
            row.update(timed(lambda u, d: mg.moe_experts(h, ids, w, u, d, cfg=dict(cfg, small=True), tables=small)))
            out.append(row)
    return out


def sweep_gemv(tokens=(1, 2, 4, 8, 16), n_exp=128, top_k=6, hid=2688, inter=1856,
               tiles=((1, 4, 512, 1), (1, 8, 512, 1), (1, 8, 256, 1), (1, 4, 1024, 2), (2, 8, 512, 1)),
               programs_per_sm=(2,), max_parts=4, ahead=(1, 2, 3), pdl=(False, True), tables=None):
    """Times of the CUDA-core tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps[, register cap]) per split-K
    target (programs per multiprocessor), K tiles in flight (AHEAD) and the down launch as a
    programmatic dependent of the up launch or not (pdl) on the in-kernel-routing
    path, and of the default beyond them (`beyond_gemv_config`: the register-fed or the wgmma
    matrix units) at the same token count, side by side, on Nano's experts; each checked first,
    timed cold (`time_if_right` over copies of the stacks). At one token the up projection's 2784
    one-warp programs of 4 rows share the 132 multiprocessors about 21 each: each thread's loads
    in flight, not the programs' count, set how much of the memory's bandwidth they draw, and
    splitting K for more programs costs more than it gives (65.9 against 24.1 us at 2 against 64
    programs per multiprocessor, kernels-sweeps-moe-gemv-before-ahead-h200.json)."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    for t in tokens:
        h, n_copies, timed = _cold_timer(t, n_exp, top_k, hid, up, down)
        base = mg.beyond_gemv_config(t * top_k, n_exp, h.device, h.dtype, tables)
        row = {"tokens": t, "path": "matrix-unit", "weight_copies": n_copies}
        row.update(timed(base))
        out.append(row)
        for (bm, bn, bk, nw, *cap), pps, a, p in itertools.product(tiles, programs_per_sm, ahead, pdl):
            mr = cap[0] if cap else None
            cfg = with_maxnreg(dict(gemv=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=1,
                                    programs_per_sm=pps, max_parts=max_parts, AHEAD=a, pdl=p), mr)
            row = {"tokens": t, "path": "gemv", "tile": [bm, bn, bk, nw], "maxnreg": mr, "programs_per_sm": pps,
                   "max_parts": max_parts, "ahead": a, "pdl": p, "weight_copies": n_copies}
            row.update(timed(cfg))
            out.append(row)
    return out


def _ms(r) -> float:
    """A sweep row's time, infinite where the launch failed."""
    return r["ms"] if r["ms"] is not None else float("inf")


def _wins_up_to(times: dict, base: dict) -> int:
    """The largest token count up to which `times` beats `base` at every count of base's (0 if
    not at the first)."""
    up_to = 0
    for t in sorted(base):
        if not times.get(t, float("inf")) < base[t]:
            break
        up_to = t
    return up_to


def _relative_pick(candidates, launch_of, base, most_tokens=None) -> tuple:
    """(launch, the token count up to which it beats base at every count): of the candidate rows'
    launches, the one with the smallest sum of its time relative to each token count's fastest
    over the counts the path will serve, those up to which the fastest launch at each beats base
    at every count (at most `most_tokens`; at least the first count), each count alike."""
    fastest = {}
    for r in candidates:
        fastest[r["tokens"]] = min(fastest.get(r["tokens"], float("inf")), _ms(r))
    served = _wins_up_to(fastest, base)
    served = max(served if most_tokens is None else min(served, most_tokens), min(fastest))
    totals = {}
    for r in candidates:
        if r["tokens"] <= served:
            totals[launch_of(r)] = totals.get(launch_of(r), 0.0) + _ms(r) / fastest[r["tokens"]]
    best = min(totals, key=totals.get)
    return best, _wins_up_to({r["tokens"]: _ms(r) for r in candidates if launch_of(r) == best}, base)


def sweep_mma(tokens=(32, 64, 128, 256), n_exp=128, top_k=6, hid=2688, inter=1856,
              launches=((1, 2, 2), (2, 1, 2), (2, 2, 2), (2, 4, 2), (2, 2, 0), (2, 2, 4)), tables=None):
    """CUDA-graph times of the sorted path on the register-fed matrix units for launch shapes
    (weight tiles per warp, warps, L2 prefetch distance), and of the sorted path on wgmma at the
    same token count, side by side, on Nano's experts; each checked first."""
    up, down = _nano_experts(n_exp, hid, inter)
    out = []
    for t in tokens:
        h, ids, w, ref = _routed_tokens(t, n_exp, top_k, hid, up, down)
        base = mg.matrix_unit_config(t * top_k, n_exp, h.device, tables)
        row = {"tokens": t, "path": "sorted"}
        row.update(time_if_right(lambda: mg.moe_experts(h, ids, w, up, down, cfg=dict(base, small=False)), ref))
        out.append(row)
        for shape in launches:
            cfg = dict(mg.moe_mma_config(*shape, tables=tables), small=False)
            row = {"tokens": t, "path": "sorted-mma", "launch": list(shape)}
            row.update(time_if_right(lambda: mg.moe_experts(h, ids, w, up, down, cfg=dict(cfg)), ref))
            out.append(row)
    return out


def pick_mma(rows, n_exp=128, top_k=6) -> dict:
    """MOE_MMA: the launch shape with the smallest time summed over the token counts where the
    register-fed path is used, and max_per_expert: the mean assignments per expert at the
    largest token count up to which that shape beats the sorted wgmma path at every swept
    count (0 if not at the first)."""
    base = {r["tokens"]: _ms(r) for r in rows if r["path"] == "sorted"}
    mma = [r for r in rows if r["path"] == "sorted-mma"]

    def reach(launch):
        return _wins_up_to({r["tokens"]: _ms(r) for r in mma if tuple(r["launch"]) == launch}, base)

    launches = {tuple(r["launch"]) for r in mma}
    # The shape that wins furthest, then the fastest summed over the counts it is used for.
    up_to = max(reach(launch) for launch in launches)
    totals = {launch: sum(_ms(r) for r in mma if tuple(r["launch"]) == launch and r["tokens"] <= up_to)
              for launch in launches if reach(launch) == up_to}
    rows_per_warp, warps, prefetch = min(totals, key=lambda launch: (totals[launch], launch))
    return {"max_per_expert": top_k * up_to / n_exp, "rows": rows_per_warp, "num_warps": warps,
            "prefetch": prefetch}


def pick_gemv(rows, top_k=6, decode_tokens=8) -> dict:
    """MOE_GEMV: the launch (tile, register cap if any, split-K target and cap, K tiles in flight)
    with the smallest sum of its time relative to the token count's best over the counts the tiles
    will serve: those up to `decode_tokens` up to which the fastest tile at each beats the
    matrix-unit default beyond them (`beyond_gemv_config`) at every swept count, each count alike
    (a sum of times would let 8 tokens' 127 us outweigh one token's 24, and a count the matrix
    units take anyway would choose the tile); and max_assignments: top_k times the largest token
    count up to which that launch beats the matrix units at every swept count (0 if not at the
    first; where none wins at one token the launch is chosen at one token; `_relative_pick`)."""
    def launch_of(r):  # rows from before the split was swept ran SMALL's: 2 programs per SM, 4 parts
        return (*r["tile"], r.get("maxnreg"), r.get("programs_per_sm", 2), r.get("max_parts", 4), r.get("ahead", 1),
                r.get("pdl", False))

    base = {r["tokens"]: _ms(r) for r in rows if r["path"] == "matrix-unit"}
    best, up_to = _relative_pick([r for r in rows if r["path"] == "gemv"], launch_of, base, decode_tokens)
    bm, bn, bk, nw, mr, pps, parts, a, p = best
    return with_maxnreg({"max_assignments": top_k * up_to, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                         "num_warps": nw, "num_stages": 1, "programs_per_sm": pps, "max_parts": parts, "AHEAD": a,
                         "pdl": p}, mr)


def pick_small(rows, top_k=6) -> dict:
    """SMALL's split-K target and cap with the smallest summed time, and max_assignments: 512 if
    the path beats the sorted one at every swept token count, else top_k times the largest
    count up to which it beats it (0 if not at the first)."""
    totals = {}
    for r in rows:
        if r["path"] == "small":
            key = (r["programs_per_sm"], r["max_parts"])
            totals[key] = totals.get(key, 0.0) + (r["ms"] if r["ms"] is not None else float("inf"))
    pps, parts = min(totals, key=totals.get)
    best = {r["tokens"]: r["ms"] for r in rows if r["path"] == "small" and
            (r["programs_per_sm"], r["max_parts"]) == (pps, parts) and r["ms"] is not None}
    sorted_ms = {r["tokens"]: r["ms"] for r in rows if r["path"] == "sorted" and r["ms"] is not None}
    up_to = 0
    for t in sorted(sorted_ms):
        if not best.get(t, float("inf")) < sorted_ms[t]:
            break
        up_to = t
    max_a = 512 if up_to == max(sorted_ms) else top_k * up_to
    return {"max_assignments": max_a, "programs_per_sm": pps, "max_parts": parts}


def pick(rows) -> dict:
    """The MOE_DECODE entry with the smallest summed sweep time."""
    totals = {}
    for r in rows:
        key = (r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r.get("maxnreg"))
        totals[key] = totals.get(key, 0.0) + (r["ms"] if r["ms"] is not None else float("inf"))
    bn, bk, nw, mr = min(totals, key=totals.get)
    return with_maxnreg({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 3}, mr)


SWEEPS = {
    "decode": Sweep("moe", "MOE_DECODE",
                    lambda: sweep(shapes=((64, 128, 4), (32, 128, 4)), maxnreg=(None, 128, 96, 80)),
                    merged("moe", "MOE_DECODE", pick, owned=("maxnreg",)),
                    "the wgmma tiles' launch shape at decode sizes"),
    "small": Sweep("moe", "SMALL", sweep_small, merged("moe", "SMALL", pick_small),
                   "the in-kernel-routing path's split-K and the assignments up to which it beats the sorted path"),
    "gemv": Sweep("moe", "MOE_GEMV", sweep_gemv, merged("moe", "MOE_GEMV", pick_gemv, owned=("maxnreg",)),
                  "the CUDA-core tiles and the assignments up to which they beat the matrix units"),
    "mma": Sweep("moe", "MOE_MMA", sweep_mma, merged("moe", "MOE_MMA", pick_mma),
                 "the register-fed matrix units' launch shape and their reach in rows per expert"),
}
