"""Launch-shape sweep of the one-launch MoE router (fp4kit.kernels.router.route) on a GPU.

`sweep_route` times the router's experts per program and warps, each launched plainly and as a
programmatic dependent of the launch before it ("pdl"), on Nemotron-3-Nano's router (128 experts
over 2688 columns, top 6) at 1, 16 and 64 tokens, each launch's pick checked against
`topk_gather` on its own logits first; `pick_route` turns the rows into the "router" table's
ROUTE entry.
"""

from __future__ import annotations

import itertools
import math

import torch

from fp4kit.kernels import router

from . import Sweep
from .common import tensor_copies, time_calls

# (experts per program, warps, pdl)
SHAPES = tuple(itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (False, True)))


def sweep_route(e=128, kdim=2688, k=6, tokens=(1, 16, 64), shapes=SHAPES) -> list:
    """Rows {T, experts, num_warps, pdl, ms}: the CUDA-graph median time of one `route` call (its
    weight read from memory: the graph runs it over copies of the router's weight that together
    exceed four times the L2 cache, as a model's step reads its layers' routers; with pdl each call
    a programmatic dependent of the one before), where its picks equal the reference's on the
    same logits; ms None with an error otherwise."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn((e, kdim), device=dev, generator=g) * 0.02
    copies = tensor_copies(w, w.numel() * 4, most=256)
    bias = torch.randn(e, device=dev, generator=g) * 0.01
    rows = []
    for t in tokens:
        x = torch.randn((t, kdim), device=dev, generator=g).to(torch.bfloat16)
        for per, warps, pdl in shapes:
            table = {"ROUTE": {"experts": per, "num_warps": warps, "pdl": pdl}}
            row = {"T": t, "experts": per, "num_warps": warps, "pdl": pdl, "weight_copies": len(copies)}
            try:
                logits, weights, chosen = router.route(x, w, bias, k, tables=table)
                want, _ = router.topk_gather(logits.sigmoid(), bias, k)
                if not torch.equal(chosen, want):
                    raise ArithmeticError("picks differ from topk_gather's on the kernel's logits")
                calls = [lambda c=c: router.route(x, c, bias, k, tables=table) for c in copies]
                row["ms"] = time_calls(calls)
            except Exception as exc:  # noqa: BLE001 -- e.g. out of registers
                row.update(ms=None, error=f"{type(exc).__name__}: {exc}"[:160])
            rows.append(row)
    return rows


def pick_route(rows) -> dict:
    """The ROUTE entry: the shape with the smallest sum over the swept token counts of its time
    relative to the best time at that count (each count weighs alike)."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else math.inf

    best = {}
    for r in rows:
        best[r["T"]] = min(best.get(r["T"], math.inf), ms(r))
    totals = {}
    for r in rows:
        key = (r["experts"], r["num_warps"], r.get("pdl", False))
        totals[key] = totals.get(key, 0.0) + ms(r) / best[r["T"]]
    per, warps, pdl = min(totals, key=totals.get)
    return {"experts": per, "num_warps": warps, "pdl": pdl}


SWEEPS = {
    "route": Sweep("router", "ROUTE", sweep_route, pick_route,
                   "the one-launch router's experts per program, warps and dependent launch"),
}
