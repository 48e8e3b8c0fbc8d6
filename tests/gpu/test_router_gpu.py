"""fp4kit.kernels.router on a CUDA GPU: the one-launch pick gives torch.topk's experts in torch's
order, and their scores, bit for bit; the short router forward with it gives transformers' full
router forward bit for bit, so every Nemotron-3 router takes it.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

from fp4kit.kernels import router  # noqa: E402

from .helpers import eager_and_replayed, write_late  # noqa: E402

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parents[1] / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

pytestmark = pytest.mark.gpu


def _torch_pick(scores, bias, k):
    chosen = torch.topk(scores + bias, k=k, dim=-1, sorted=False)[1]
    return chosen, scores.gather(1, chosen)


@pytest.mark.parametrize("levels", [None, 64, 5, 1])
@pytest.mark.parametrize("t,e,k", [(1, 128, 6), (7, 128, 6), (4096, 128, 6), (33, 128, 22), (16, 60, 4), (8, 512, 8)])
def test_the_pick_is_torch_topks_on_the_gpu(t, e, k, levels):
    g = torch.Generator(device="cuda").manual_seed(t * e + k)
    scores = torch.sigmoid(torch.randn((t, e), device="cuda", generator=g) * 3)
    if levels:  # few distinct values: ties across the k-th place, as equal sums give
        scores = torch.floor(scores * levels) / levels
    for bias in (torch.zeros(e, device="cuda"), torch.randn(e, device="cuda", generator=g) * 0.01,
                 (torch.randn(e, device="cuda", generator=g) * 0.01).to(torch.bfloat16)):
        if levels and bias.any():
            bias = torch.floor(bias * 1024) / 1024
        got = router.topk_gather(scores, bias, k)
        want = _torch_pick(scores, bias, k)
        assert torch.equal(got[0], want[0]), (t, e, k, levels)
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
        ref = router.topk_gather_reference(scores, bias, k)
        assert torch.equal(ref[0], want[0]) and torch.equal(ref[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_short_router_on_the_gpu_is_the_full_one_and_every_router_takes_it(dtype):
    from fp4kit.models.nemotron_h import _one_group_route, _takes_short_forward, single_group_routing

    model = models.build_nemotron_h(n_routed_experts=64, num_experts_per_tok=6).to(device="cuda", dtype=dtype)
    routers = [m for m in model.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    g = torch.Generator(device="cuda").manual_seed(3)
    for r in routers:
        with torch.no_grad():
            r.e_score_correction_bias.normal_(0, 0.01, generator=g)
        for rows in (1, 6, 512):
            x = torch.randn((rows, r.hidden_dim), device="cuda", generator=g).to(dtype)
            full, short = r(x), _one_group_route(r, x)
            for a, b in zip(full, short):
                assert a.dtype == b.dtype and torch.equal(a, b)
        assert _takes_short_forward(r)
    with single_group_routing(model) as n:
        assert n == len(routers) > 0
        compiled = torch.compile(_one_group_route, fullgraph=True)
        x = torch.randn((5, routers[0].hidden_dim), device="cuda", generator=g).to(dtype)
        got, want = compiled(routers[0], x), _one_group_route(routers[0], x)
        assert torch.equal(got[2], want[2])  # the same experts under the compiler


@pytest.mark.parametrize("t", [1, 7])
def test_the_programmatic_dependent_router_reads_its_rows_only_after_the_launch_before(t):
    # "pdl": the router's first weight tile is requested before it waits for the launch before it.
    # Here that launch lets it start at once and writes the router's rows late: the logits, picks
    # and weights are those of the new rows, bit for bit the plain launch's, eagerly and over
    # replays of a CUDA graph (a program that read x before its wait would see the old rows).
    assert router.dependent_launch(True, torch.device("cuda"), router._route_kernel)
    e, kdim, k = 128, 2688, 6
    g = torch.Generator(device="cuda").manual_seed(t)
    w = torch.randn((e, kdim), device="cuda", generator=g) * 0.05
    bias = torch.randn(e, device="cuda", generator=g) * 0.01
    old, new = (torch.randn((t, kdim), device="cuda", generator=g) for _ in range(2))
    plain, dependent = ({"ROUTE": {"experts": 4, "num_warps": 4, "pdl": pdl}} for pdl in (False, True))
    assert router._route_plan(e, kdim, k, True, dependent, torch.device("cuda"))[1]["launch_pdl"]
    want = router.route(new, w, bias, k, norm=True, scale=2.5, tables=plain)
    assert not torch.equal(want[2], router.route(old, w, bias, k, norm=True, scale=2.5, tables=plain)[2])
    x = old.clone()

    def step():
        x.copy_(old)
        write_late(new, x)
        return router.route(x, w, bias, k, norm=True, scale=2.5, tables=dependent)

    def check(got):
        assert all(torch.equal(a, b) for a, b in zip(got, want))

    eager_and_replayed(step, check)
