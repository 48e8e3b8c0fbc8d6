"""fp4kit.kernels.router: the router's expert pick (torch's CUDA top-k order) and the gather, in
Triton's interpreter against the reference, and the reference against the rule written out
expert by expert. tests/gpu/test_router_gpu.py compares the kernel with torch.topk on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.kernels import launch, router  # noqa: E402


def _rule(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[list, list]:
    """The pick written out per token: values compared as torch's radix select compares fp32
    (their bit patterns made order-preserving: -0.0 below +0.0, NaN above all); the k-th largest
    value v (k-th in that order, lower experts first among equals); the experts above v in
    increasing order, then those equal to v in increasing order until k are taken."""
    def key(v: float) -> tuple:
        if math.isnan(v):
            return (2, 0)
        bits = int(torch.tensor(v, dtype=torch.float32).view(torch.int32))
        return (1, bits if bits >= 0 else -(bits & 0x7FFFFFFF) - 1)

    ids, vals = [], []
    c = (scores.float() + bias.float()).tolist()
    for t, row in enumerate(c):
        keys = [key(v) for v in row]
        ranked = sorted(range(len(row)), key=lambda e: (keys[e], -e), reverse=True)[:k]
        kth = keys[ranked[-1]]
        above = sorted(e for e in ranked if keys[e] > kth)
        equal = sorted(e for e in ranked if keys[e] == kth)
        chosen = (above + equal)[:k]
        ids.append(chosen)
        vals.append([scores[t, e].item() for e in chosen])
    return ids, vals


def _scores(t: int, e: int, seed: int, levels: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.rand((t, e), generator=g)
    if levels:  # few distinct values: ties across the k-th place
        s = torch.floor(s * levels) / levels
    return s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


CASES = [  # tokens, experts, k, distinct levels (None: continuous)
    (5, 128, 6, None), (9, 128, 6, 7), (4, 128, 6, 2), (3, 20, 1, None), (3, 20, 20, 3), (6, 37, 5, 4),
    (3, 256, 8, 3), (3, 300, 8, None), (4, 300, 6, 5),
]


@pytest.mark.parametrize("t,e,k,levels", CASES)
def test_the_reference_is_the_rule(t, e, k, levels):
    s = _scores(t, e, seed=t * e + k, levels=levels)
    bias = (torch.rand(e, generator=torch.Generator().manual_seed(1)) - 0.5) * (0 if levels else 0.1)
    ids, vals = router.topk_gather_reference(s, bias, k)
    want_ids, want_vals = _rule(s, bias, k)
    assert ids.tolist() == want_ids
    assert torch.equal(_bits(vals), _bits(torch.tensor(want_vals, dtype=torch.float32)))


def test_the_rule_orders_signed_zeros_and_nans_as_torch_does():
    s = torch.tensor([[0.0, -0.0, float("nan"), -1.0, 2.0, -float("inf")]])
    zero = torch.full((6,), -0.0)  # adds nothing, keeps -0.0 (+0.0 would make it +0.0)
    ids, _ = router.topk_gather_reference(s, zero, 4)
    # NaN above everything, +0.0 above -0.0; the ones above the 4th value first, by expert
    assert ids.tolist() == [[0, 2, 4, 1]]
    assert _rule(s, zero, 4)[0] == [[0, 2, 4, 1]]
    assert router.topk_gather_reference(s, zero, 6)[0].tolist() == [[0, 1, 2, 3, 4, 5]]
    # with +0.0 added the two zeros are equal: both after the experts above them
    assert router.topk_gather_reference(s, torch.zeros(6), 4)[0].tolist() == [[2, 4, 0, 1]]


@pytest.mark.parametrize("t,e,k,levels", CASES)
def test_the_kernel_equals_the_reference(t, e, k, levels):
    s = _scores(t, e, seed=100 + t * e + k, levels=levels)
    bias = torch.linspace(-0.01, 0.01, e) if levels is None else torch.zeros(e)
    got = router.topk_gather(s, bias, k)
    want = router.topk_gather_reference(s, bias, k)
    assert torch.equal(got[0], want[0]) and got[0].dtype == torch.int64
    assert torch.equal(_bits(got[1]), _bits(want[1]))


def test_the_kernel_takes_special_values_strided_rows_and_a_bf16_bias():
    s = torch.tensor([[0.0, -0.0, float("nan"), -1.0, 2.0, -float("inf"), 0.5, 0.5]])
    got = router.topk_gather(s, torch.full((8,), -0.0), 5)
    want = router.topk_gather_reference(s, torch.full((8,), -0.0), 5)
    assert got[0].tolist() == want[0].tolist() == [[2, 4, 6, 7, 0]]  # the 5th value +0.0: last
    got = router.topk_gather(s, torch.full((8,), -0.0), 6)
    assert got[0].tolist() == [[0, 2, 4, 6, 7, 1]]
    wide = _scores(4, 64, seed=7)
    rows = wide[:, :48]  # rows 64 apart
    bias = (torch.rand(48, generator=torch.Generator().manual_seed(8)) * 0.1).to(torch.bfloat16)
    got = router.topk_gather(rows, bias, 6)
    want = router.topk_gather_reference(rows, bias, 6)
    assert torch.equal(got[0], want[0]) and torch.equal(_bits(got[1]), _bits(want[1]))


def test_bad_inputs_are_named():
    s = _scores(2, 16, seed=1)
    with pytest.raises(ValueError, match="scores must be an fp32"):
        router.topk_gather(s.double(), torch.zeros(16), 2)
    with pytest.raises(ValueError, match=r"bias must be a float \[16\]"):
        router.topk_gather(s, torch.zeros(15), 2)
    with pytest.raises(ValueError, match=r"k must be in \[1, 16\]"):
        router.topk_gather(s, torch.zeros(16), 17)
    with pytest.raises(ValueError, match="backend must be one of"):
        router.topk_gather(s, torch.zeros(16), 2, backend="cuda")


def test_the_operator_gives_the_launchers_pick_and_the_gathers_gradient():
    from fp4kit.kernels import ops

    s = _scores(3, 16, seed=9).requires_grad_()
    bias = torch.linspace(-0.01, 0.01, 16)
    chosen, gathered = ops.topk_gather(s, bias, 4)
    want = router.topk_gather(s.detach(), bias, 4)
    assert torch.equal(chosen, want[0]) and torch.equal(gathered.detach(), want[1])
    assert not chosen.requires_grad and gathered.requires_grad
    g = torch.arange(12.0).view(3, 4)
    (gathered * g).sum().backward()
    # as torch's gather: each pick's gradient at the score it came from, zero elsewhere
    ref = s.detach().clone().requires_grad_()
    (ref.gather(1, chosen) * g).sum().backward()
    assert torch.equal(s.grad, ref.grad)


class _OnSecondGPU(torch.Tensor):
    """CPU scores that say they are on GPU 1."""

    def get_device(self):
        return 1


def test_scores_on_another_gpu_than_the_current_one_launch_on_theirs(monkeypatch):
    import contextlib

    entered, launched_in = [], []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield
        entered.pop()

    real = router.launch_cached
    monkeypatch.setattr(router.torch.cuda, "device", device)
    monkeypatch.setattr(router, "current_device", lambda: 0)
    monkeypatch.setattr(router, "launch_cached", lambda *a, **k: launched_in.append(list(entered)) or real(*a, **k))
    s = _scores(2, 16, seed=3)
    got = router.topk_gather(s.as_subclass(_OnSecondGPU), torch.zeros(16), 3)
    assert launched_in == [[1]]
    assert torch.equal(got[0], router.topk_gather_reference(s, torch.zeros(16), 3)[0])
    router.topk_gather(s, torch.zeros(16), 3)  # on the CPU (the interpreter): no device to make current
    assert launched_in == [[1], []]


# The one-launch router: logits, sigmoid scores, the pick and the normalised weights

def _router_inputs(t: int, e: int, kdim: int, seed: int, twins: int = 0):
    """bf16 rows, an fp32 weight ([E, K]) whose first `twins` pairs of rows are equal (equal
    logits: ties across the k-th place), an fp32 correction bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, kdim), generator=g).to(torch.bfloat16)
    w = torch.randn((e, kdim), generator=g) * 0.05
    for i in range(twins):
        w[2 * i + 1] = w[2 * i]
    return x, w, torch.zeros(e) if twins else torch.randn(e, generator=g) * 0.01


@pytest.mark.parametrize("norm,scale", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("t,e,kdim,k,twins", [(1, 128, 1100, 6, 0), (3, 60, 200, 4, 0), (5, 16, 64, 3, 8),
                                               (2, 37, 96, 5, 18), (2, 300, 64, 6, 0)])
def test_the_one_launch_router_picks_by_the_rule_from_its_own_logits(t, e, kdim, k, twins, norm, scale):
    x, w, bias = _router_inputs(t, e, kdim, seed=t * e + k, twins=twins)
    logits, weights, chosen = router.route(x, w, bias, k, norm=norm, scale=scale)
    want_logits, want_weights, want_chosen = router.route_reference(x, w, bias, k, norm=norm, scale=scale)
    # fp32 sums of K products in another order: within a few fp32 ulps of the sum's magnitude
    assert torch.allclose(logits, want_logits, rtol=0, atol=kdim * 2**-24 * (x.float().abs() @ w.abs().T).max().item())
    # given its own logits, the experts, their order and the weights are the rule's
    own = router.topk_gather_reference(logits.sigmoid(), bias, k)
    assert torch.equal(chosen, own[0])
    picked = own[1] / (own[1].sum(-1, keepdim=True) + 1e-20) if norm else own[1]
    assert torch.allclose(weights, picked * scale, rtol=4 * 2**-24, atol=0)
    if not twins:  # no sums within 1e-7 of each other here: the reference's experts
        assert torch.equal(chosen, want_chosen) and torch.allclose(weights, want_weights, rtol=1e-6, atol=0)
    else:  # equal logits across the k-th place: of two equal experts at the cut, the lower one
        cut = [(i, i ^ 1) for row in chosen.tolist() for i in row if i < 2 * twins and i ^ 1 not in row]
        assert cut and all(i < twin for i, twin in cut)


def test_the_one_launch_router_leaves_its_counters_at_zero_and_repeats_itself():
    from fp4kit.kernels.tiles import split_counters

    x, w, bias = _router_inputs(4, 32, 128, seed=5)
    first = router.route(x, w, bias, 3)
    assert not split_counters(x.device, 4)[:4].any()
    second = router.route(x, w, bias, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("block_k", [router.ROUTE_BLOCK_K, 32])
def test_the_launch_tables_experts_per_program_warps_and_dependent_launch_change_no_result(block_k, monkeypatch):
    # The grid (experts per program), the warps and "pdl" come from the ROUTE table; every shape
    # gives the same logits, picks and weights (each logit is one program's sum, whatever the
    # grid), and so does the dependent launch's early first weight tile (here in the interpreter,
    # its load order alone), with one K tile (Nano's 2688 columns) or several.
    monkeypatch.setattr(router, "ROUTE_BLOCK_K", block_k)
    x, w, bias = _router_inputs(3, 20, 64, seed=8)
    want = router.route(x, w, bias, 4, tables={"ROUTE": {"experts": 4, "num_warps": 2}})
    assert dict(launch.table("router")["ROUTE"]).keys() == {"experts", "num_warps", "pdl"}
    for per, warps, pdl in ((1, 1, False), (2, 4, True), (8, 2, False), (32, 1, True), (4, 4, True)):
        table = {"ROUTE": {"experts": per, "num_warps": warps, "pdl": pdl}}
        assert router._route_plan(20, 64, 4, True, table, x.device)[1]["PDL"] is pdl
        got = router.route(x, w, bias, 4, tables=table)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (per, warps, pdl)
    with pytest.raises(ValueError, match="experts and num_warps"):
        router.route(x, w, bias, 4, tables={"ROUTE": {"experts": 3, "num_warps": 1}})


def test_more_rows_than_one_launch_takes_run_the_matmul_and_the_pick(monkeypatch):
    monkeypatch.setattr(router, "ROUTE_MAX_TOKENS", 2)
    x, w, bias = _router_inputs(3, 20, 48, seed=6)
    launched = []
    real = router.launch_cached
    monkeypatch.setattr(router, "launch_cached", lambda kernel, *a, **k: launched.append(kernel) or real(kernel, *a, **k))
    got = router.route(x, w, bias, 4, norm=True, scale=2.5)
    want = router.route_reference(x, w, bias, 4, norm=True, scale=2.5)
    assert launched == [router._topk_gather_kernel]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_one_launch_routers_bad_inputs_are_named():
    x, w, bias = _router_inputs(2, 16, 32, seed=7)
    with pytest.raises(ValueError, match=r"x must be a float \[T, K\]"):
        router.route(x[0], w, bias, 2)
    with pytest.raises(ValueError, match=r"weight must be an fp32 \[E, 32\]"):
        router.route(x, w.bfloat16(), bias, 2)
    with pytest.raises(ValueError, match=r"weight must be an fp32 \[E, 32\]"):
        router.route(x, w[:, :31], bias, 2)
    with pytest.raises(ValueError, match=r"bias must be a float \[16\]"):
        router.route(x, w, bias[:15], 2)
    with pytest.raises(ValueError, match=r"k must be in \[1, 16\]"):
        router.route(x, w, bias, 0)


def test_the_one_launch_router_operator_is_the_launcher():
    from fp4kit.kernels import ops

    x, w, bias = _router_inputs(3, 24, 64, seed=8)
    args = (x, w, bias, 4, True, 2.5)
    got, want = ops.route(*args), router.route(x, w, bias, 4, norm=True, scale=2.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.library.opcheck(torch.ops.fp4kit.route.default, args, test_utils=("test_faketensor",))
