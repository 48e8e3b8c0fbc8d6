"""kernels.ops: the Triton GEMMs as torch operators, for compiled code.

Each operator returns what its launcher returns, bit for bit; its fake (the shape and dtype the
compiler is told) matches the real output; and a compiled module calls the operator where eager
code calls the launcher, with the same result."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.formats import nvfp4  # noqa: E402
from fp4kit.kernels import moe_gemm, ops, packed_gemm, w4a16_gemm  # noqa: E402
from fp4kit.modules import NVFP4Experts, NVFP4Linear  # noqa: E402

from .helpers import _rand  # noqa: E402

FAKE_CHECKS = ("test_faketensor",)


def _weight(*shape, seed=0):
    return nvfp4.quantize(_rand(*shape, seed=seed))


def test_w4a16_operator_is_the_launcher():
    w = _weight(48, 64)
    x = _rand(3, 64, seed=1)
    args = (x, w.packed, w.block_scale, w.global_scale)
    assert torch.equal(ops.w4a16_matmul(*args), w4a16_gemm.w4a16_matmul(x, w, backend="triton"))
    torch.library.opcheck(torch.ops.fp4kit.w4a16_matmul.default, args, test_utils=FAKE_CHECKS)


def test_packed_operator_is_the_launcher():
    w = _weight(48, 128)
    p = packed_gemm.pack(w, torch.float16)
    x = _rand(2, 128, seed=2, dtype=torch.float16)
    args = (x, p.words, p.scales, p.global_scale, p.n, p.k)
    assert torch.equal(ops.packed_matmul(*args), packed_gemm.packed_matmul(x, p, backend="triton"))
    torch.library.opcheck(torch.ops.fp4kit.packed_matmul.default, args, test_utils=FAKE_CHECKS)


def test_moe_operator_is_the_launcher():
    n_exp, hid, inter, top_k = 4, 32, 48, 2
    up, down = _weight(n_exp, inter, hid, seed=3), _weight(n_exp, hid, inter, seed=4)
    x = _rand(5, hid, seed=5)
    idx = torch.randint(0, n_exp, (5, top_k), generator=torch.Generator().manual_seed(6))
    wts = torch.rand(5, top_k, generator=torch.Generator().manual_seed(7))
    args = (x, idx, wts, up.packed, up.block_scale, up.global_scale, down.packed, down.block_scale, down.global_scale)
    assert torch.equal(ops.moe_experts(*args), moe_gemm.moe_experts(x, idx, wts, up, down, backend="triton"))
    torch.library.opcheck(torch.ops.fp4kit.moe_experts.default, args, test_utils=FAKE_CHECKS)


def test_routed_moe_operator_is_the_router_then_the_experts_and_shared_expert():
    # the router inside the call: its picks and weights, then the routed experts and the shared
    # expert, bit for bit as the router's launch followed by moe_experts_and_shared
    from fp4kit.kernels import router

    n_exp, hid, inter, shared_inter, top_k = 8, 32, 48, 64, 3
    up, down = _weight(n_exp, inter, hid, seed=3), _weight(n_exp, hid, inter, seed=4)
    s_up, s_down = _weight(shared_inter, hid, seed=5), _weight(hid, shared_inter, seed=6)
    x = _rand(5, hid, seed=7)
    x32 = x.float()
    gate = _rand(n_exp, hid, seed=8).float()
    bias = _rand(n_exp, seed=9).float() * 0.1
    _, wts, idx = router.route(x32, gate, bias, top_k, norm=True, scale=2.5)
    want = moe_gemm.moe_experts_and_shared(x, idx, wts, up, down, s_up, s_down)
    got = moe_gemm.routed_experts_and_shared(x, x32, gate, bias, top_k, up, down, s_up, s_down, norm=True, scale=2.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    args = (x, x32, gate, bias, top_k, True, 2.5, up.packed, up.block_scale, up.global_scale, down.packed,
            down.block_scale, down.global_scale, s_up.packed, s_up.block_scale, s_up.global_scale, s_down.packed,
            s_down.block_scale, s_down.global_scale)
    assert all(torch.equal(a, b) for a, b in zip(ops.routed_experts_and_shared(*args), want))
    other = moe_gemm.routed_experts_and_shared(x, x32, gate, bias, top_k, up, down, s_up, s_down, norm=False, scale=1.0)
    assert not torch.equal(other[0], want[0]) and torch.equal(other[1], want[1])  # norm and scale reach the router
    torch.library.opcheck(torch.ops.fp4kit.routed_experts_and_shared.default, args, test_utils=FAKE_CHECKS)


def test_a_compiled_model_calls_the_operators_and_computes_what_eager_code_does(monkeypatch):
    linear = NVFP4Linear(_weight(64, 64), None, input_scale=None, act_quant=False, backend="triton")
    experts = NVFP4Experts(_weight(4, 48, 64, seed=1), _weight(4, 64, 48, seed=2), torch.nn.ReLU(),
                           up_input_scale=None, down_input_scale=None, act_quant=False, backend="triton")
    x = _rand(5, 64, seed=3)
    idx = torch.randint(0, 4, (5, 2), generator=torch.Generator().manual_seed(4))
    wts = torch.rand(5, 2, generator=torch.Generator().manual_seed(5))

    def layer(x):
        h = linear(x * 2)
        return experts(h + 1, idx, wts) * 3

    eager = layer(x)
    calls = []
    for name in ("w4a16_matmul", "moe_experts"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert sorted(set(calls)) == ["moe_experts", "w4a16_matmul"]  # traced through the operators
    assert torch.equal(compiled, eager)
