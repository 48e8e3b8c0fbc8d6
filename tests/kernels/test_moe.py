"""fp4kit.kernels.moe_gemm against transformers' Nemotron-H experts on the dequantized weights."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.formats import nvfp4  # noqa: E402
from fp4kit.formats.errors import FormatError  # noqa: E402
from fp4kit.kernels import launch, moe_gemm  # noqa: E402

from .helpers import DEVICE, _rand  # noqa: E402

MOE = launch.table("moe")


# --------------------------------------------------------------------------------------------
# Grouped MoE against transformers' Nemotron-H expert block on the dequantized weights
# --------------------------------------------------------------------------------------------
def _transformers_experts(n_exp, hid, inter, top_k, up_w, down_w):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = NemotronHConfig(n_routed_experts=n_exp, hidden_size=hid, moe_intermediate_size=inter,
                          num_experts_per_tok=top_k, mlp_hidden_act="relu2")
    cfg._experts_implementation = "eager"
    mod = NemotronHExperts(cfg).to(up_w.dtype)
    with torch.no_grad():
        mod.up_proj.copy_(up_w)
        mod.down_proj.copy_(down_w)
    return mod


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("path", ["small", "sorted", "small-split", "gemv", "gemv-split"])
def test_moe_matches_transformers_experts(dtype, rtol, tokens, path, monkeypatch):
    # small: routing in the kernels (1 token: a program per routed assignment; 13 tokens: a
    # program per expert); small-split: the same with K split 2 ways (partials summed in the
    # next kernel); gemv(-split): the same on the CUDA-core tiles (two rows of an expert per
    # program; fp32 weights); sorted: the sort-based path.
    n_exp, hid, inter, top_k = 8, 128, 96, 3
    split = path.endswith("-split")
    tables = launch.override(MOE, SMALL={"max_assignments": 0 if path == "sorted" else 512,
                                         "programs_per_sm": 1000 if path == "small-split" else 0},
                             MOE_GEMV={"max_assignments": 512 if path.startswith("gemv") else 0,
                                       "programs_per_sm": 1000 if path == "gemv-split" else 0})
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=12, scale=0.1), scale_rule="4o6")
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=13, scale=0.1))
    g = torch.Generator().manual_seed(14)
    x = _rand(tokens, hid, seed=15, dtype=dtype)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=g)
    with torch.no_grad():
        ref = _transformers_experts(n_exp, hid, inter, top_k, up.dequantize(dtype), down.dequantize(dtype))(x, ids, weights)
    splits = []
    split_k = moe_gemm.backend.split_k
    monkeypatch.setattr(moe_gemm.backend, "split_k", lambda *a: splits.append(split_k(*a)[0]) or split_k(*a))
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE),
                               tables=tables).cpu()
    assert got.dtype == dtype
    if path != "sorted":  # each projection split by its own path's entry (SMALL, or MOE_GEMV for the CUDA-core tiles)
        assert (min(splits) > 1) if split else splits == [1, 1]
    # Relative Frobenius error: fp32 -> accumulation order only; fp16 -> the reference rounds its
    # intermediates to fp16 as the kernel does, but sums in another order.
    assert float((got.double() - ref.double()).norm() / ref.double().norm()) < rtol
    torch_ref = moe_gemm.moe_experts(x, ids, weights, up, down, backend="torch")
    assert float((torch_ref.double() - ref.double()).norm() / ref.double().norm()) < rtol


@pytest.mark.parametrize("path", ["small", "sorted"])
def test_moe_bf16_on_the_matrix_units(path):
    # bf16 activations on the wgmma tiles of either path: in the interpreter their tl.dot runs on
    # exact fp32 operands (`backend.exact_dot`); against the reference with the bf16-dequantized
    # weights, loosely (the interpreter's fp32 -> bf16 casts truncate, which moves each rounded
    # value towards zero by up to 2^-7).
    n_exp, hid, inter, top_k, tokens = 8, 128, 64, 2, 5
    tables = launch.override(MOE, SMALL={"max_assignments": 512 if path == "small" else 0},
                             MOE_GEMV={"max_assignments": 0})
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=32, scale=0.1), scale_rule="4o6")
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=33, scale=0.1))
    x = _rand(tokens, hid, seed=34, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(35)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=g)
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE),
                               tables=tables).cpu()
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize(torch.bfloat16).double(),
                                     down.dequantize(torch.bfloat16).double())
    assert got.dtype == torch.bfloat16 and float((got.double() - ref).norm() / ref.norm()) < 5e-2


@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_gemv_tiles_in_flight_change_no_bit(tokens):
    # MOE_GEMV's AHEAD (K tiles in flight) moves loads only: both projections give AHEAD = 1's
    # output bit for bit (K = 96 and 160: ragged last tiles; 3 tiles ahead run past K).
    n_exp, hid, inter, top_k = 6, 160, 96, 2
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=40), scale_rule="4o6")
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=41))
    x = _rand(tokens, hid, seed=42, dtype=torch.float16)
    g = torch.Generator().manual_seed(43)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=g)
    args = (x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE))
    cfg = dict(gemv=True, BLOCK_M=2, BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1, programs_per_sm=0, max_parts=1)
    one = moe_gemm.moe_experts(*args, cfg=dict(cfg, AHEAD=1)).cpu()
    for ahead in (2, 3):
        assert torch.equal(moe_gemm.moe_experts(*args, cfg=dict(cfg, AHEAD=ahead)).cpu(), one), ahead
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(),
                                     down.dequantize().double())
    assert float((one.double() - ref).norm() / ref.norm()) < 2e-3


def _one_token_two_experts(n_exp, seed, hid=64, inter=32):
    """(up, down, x, ids, weights): n_exp experts' NVFP4 stacks and one token routed to experts 3
    and 1 with weights 0.25 and 0.75."""
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=seed))
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=seed + 1))
    return up, down, _rand(1, hid, seed=seed + 2), torch.tensor([[3, 1]]), torch.tensor([[0.25, 0.75]])


@pytest.mark.parametrize("gemv", [True, False])
def test_the_down_launch_is_a_programmatic_dependent_only_where_the_entry_and_device_allow(gemv, monkeypatch):
    # cfg "pdl" on the CUDA-core tiles: the up launch triggers its dependent and the down launch
    # goes as one (launch_pdl) that waits inside the tiles; never on the matrix units, and never
    # where `backend.pdl` says no (the interpreter, pre-Hopper GPUs). The kernels' own flags are
    # dropped before launching here, as the interpreter has no grid dependencies.
    n_exp = 4
    up, down, x, ids, weights = _one_token_two_experts(n_exp, seed=24)
    args = (x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE))
    cfg = dict(moe_gemm.moe_config(2, n_exp, torch.device(DEVICE))) if gemv else \
        dict(moe_gemm.matrix_unit_config(2, n_exp, torch.device(DEVICE)), small=True)
    assert not moe_gemm.backend.pdl(torch.device(DEVICE), moe_gemm._moe_small_kernel)
    seen = []
    real = moe_gemm.launch_cached

    def spy(kernel, grid, *a, **consts):
        seen.append({k: consts.pop(k) for k in ("TRIGGER", "WAIT", "launch_pdl") if k in consts})
        return real(kernel, grid, *a, **consts)

    monkeypatch.setattr(moe_gemm, "launch_cached", spy)
    plain = moe_gemm.moe_experts(*args, cfg=dict(cfg, pdl=True)).cpu()
    assert seen == [{"TRIGGER": False}, {"WAIT": False}]
    monkeypatch.setattr(moe_gemm.backend, "pdl", lambda device, kernel: True)
    seen.clear()
    assert torch.equal(moe_gemm.moe_experts(*args, cfg=dict(cfg, pdl=True)).cpu(), plain)
    assert seen == ([{"TRIGGER": True}, {"WAIT": True, "launch_pdl": True}] if gemv else
                    [{"TRIGGER": False}, {"WAIT": False}])
    seen.clear()
    moe_gemm.moe_experts(*args, cfg=dict(cfg, pdl=False))
    assert seen == [{"TRIGGER": False}, {"WAIT": False}]


def test_moe_unused_experts_and_errors():
    n_exp, hid, inter = 6, 32, 48
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=16))
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=17))
    x = _rand(4, hid, seed=18)
    ids = torch.tensor([[5, 0], [5, 2], [0, 5], [2, 0]])  # experts 1, 3, 4 get no tokens
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(19))
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE)).cpu()
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(), down.dequantize().double())
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(FormatError, match=re.escape("down_proj shape")):
        moe_gemm.moe_experts(x, ids, weights, up, up)


@pytest.mark.parametrize("cap", [None, 64])
def test_moe_gemv_register_cap_from_its_launch_entry(cap, monkeypatch):
    # MOE_GEMV's register cap goes with both projections' CUDA-core launches, and only there.
    up, down, x, ids, weights = _one_token_two_experts(4, seed=20)
    gemv = {k: v for k, v in launch.thaw(MOE["MOE_GEMV"]).items() if k != "maxnreg"}
    tables = launch.freeze({**launch.thaw(MOE), "MOE_GEMV": dict(gemv, max_assignments=512,
                                                                **({"maxnreg": cap} if cap else {}))})
    seen = {}
    real = moe_gemm.launch_cached

    def spy(kernel, grid, *args, **consts):
        seen.setdefault(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), []).append(consts.get("maxnreg"))
        return real(kernel, grid, *args, **consts)

    monkeypatch.setattr(moe_gemm, "launch_cached", spy)
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE),
                               tables=tables).cpu()
    assert seen["_moe_small_kernel"] == [cap, cap] and "_moe_combine_kernel" not in seen
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(), down.dequantize().double())
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize("ids", [[[5, 0]], [[5, 0], [5, 2], [0, 5], [2, 0]], [[1, 2], [9, -1], [-3, 7]]])
def test_the_down_launch_applies_the_routing_weights_as_their_own_launch_does(gemv, ids, monkeypatch):
    # The small path's last program of each token's slice combines it: the output of the third
    # launch bit for bit, with one split of down_proj and with several (the partials summed in
    # order), repeated experts across tokens, and ids outside [0, E) (a token with none routed
    # gets zeros); the counters are left at 0.
    from fp4kit.kernels.tiles import split_counters

    n_exp, hid, inter = 6, 64, 96
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=60))
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=61))
    ids = torch.tensor(ids)
    x = _rand(ids.shape[0], hid, seed=62)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(63))
    cfg = moe_gemm.moe_config(ids.numel(), n_exp, torch.device(DEVICE)) if gemv else \
        dict(moe_gemm.matrix_unit_config(ids.numel(), n_exp, torch.device(DEVICE)), small=True)
    launches = []
    monkeypatch.setattr(moe_gemm, "launch_cached",
                        lambda k, grid, *a, _f=moe_gemm.launch_cached, **c: launches.append((k, grid)) or _f(k, grid, *a, **c))
    for parts in (1, 2):
        split = {"programs_per_sm": 10**6, "max_parts": parts}
        tables = launch.freeze({**launch.thaw(MOE), "SMALL": dict(launch.thaw(MOE)["SMALL"], **split)})
        shape = dict(cfg, **split) if gemv else dict(cfg)
        args = (x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE))
        launches.clear()
        fused = moe_gemm.moe_experts(*args, cfg=dict(shape), tables=tables)
        assert [k for k, _ in launches] == [moe_gemm._moe_small_kernel] * 2 and launches[1][1][2] == parts
        separate = moe_gemm.moe_experts(*args, cfg=dict(shape, combine=False), tables=tables)
        assert [k for k, _ in launches[2:]] == [moe_gemm._moe_small_kernel] * 2 + [moe_gemm._moe_combine_kernel]
        assert torch.equal(fused, separate)
        assert not split_counters(fused.device, 64)[:64].any()
    routed = ((ids >= 0) & (ids < n_exp)).any(1)
    assert (fused[routed] != 0).any(1).all() and not fused[~routed].any()


def test_moe_mma_launch_defaults_to_the_sorted_path_when_small():
    # A few assignments (the in-kernel-routing path's size) with the register-fed launch shape
    # and no explicit path: the sorted path, which is the only one that runs it.
    n_exp, hid, inter, top_k, tokens = 4, 128, 64, 2, 3
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=44, scale=0.1))
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=45, scale=0.1))
    x = _rand(tokens, hid, seed=46, dtype=torch.float16)
    ids = torch.tensor([[0, 2], [2, 3], [0, 1]])
    weights = torch.rand((tokens, top_k), generator=torch.Generator().manual_seed(47))
    assert tokens * top_k <= MOE["SMALL"]["max_assignments"]
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE),
                               cfg=moe_gemm.moe_mma_config(1, 1, 0)).cpu()
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(),
                                     down.dequantize().double())
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3


def _fp16_case(n_exp, hid, inter, top_k, tokens, seed):
    """A 4/6 up and a plain down stack, fp16 hidden states, each token routed to top_k of the
    experts, routing weights; on DEVICE, with the float64 reference."""
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=seed, scale=0.1), scale_rule="4o6")
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=seed + 1, scale=0.1))
    x = _rand(tokens, hid, seed=seed + 2, dtype=torch.float16)
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=g)
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(),
                                     down.dequantize().double())
    return tuple(v.to(DEVICE) for v in (x, ids, weights, up, down)), ref


@pytest.mark.parametrize("launch", [(2, 2, 2), (1, 4, 0)])
def test_moe_sorted_mma(launch):
    # The sorted path on the register-fed matrix units (the launch table's MOE_MMA), forced: K of 2.125
    # and 1.125 steps, scale bytes one at a time (K / 16 odd), rows not filling the last tile,
    # runs of 5 to 9 assignments per expert (one past a tile of 8).
    args, ref = _fp16_case(6, 272, 144, 2, 19, seed=40)
    got = moe_gemm.moe_experts(*args, cfg=dict(moe_gemm.moe_mma_config(*launch), small=False)).cpu()
    assert got.dtype == torch.float16
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3


# --------------------------------------------------------------------------------------------
# Launch-shape picks from benchmark sweeps (pure Python: the rows are what the sweeps record)
# --------------------------------------------------------------------------------------------


def test_moe_config_paths_by_size_dtype_and_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    n_exp = 128
    gemv_max = MOE["MOE_GEMV"]["max_assignments"]
    mma_max = int(MOE["MOE_MMA"]["max_per_expert"] * n_exp)
    assert moe_gemm.moe_config(gemv_max, n_exp, cuda).get("gemv")
    assert moe_gemm.moe_config(gemv_max + 6, n_exp, cuda).get("mma")
    assert moe_gemm.moe_config(mma_max, n_exp, cuda, torch.float16).get("mma")
    beyond = moe_gemm.moe_config(mma_max + 6, n_exp, cuda)
    assert not beyond.get("mma") and not beyond.get("gemv") and beyond["BLOCK_M"] in (16, 64)
    for dtype, device in ((torch.float32, cuda), (torch.bfloat16, cpu)):  # fp32 or the interpreter: wgmma tiles
        assert not moe_gemm.moe_config(gemv_max + 6, n_exp, device, dtype).get("mma")
    # the table given decides: no CUDA-core tiles, the register-fed units' own launch shape
    tables = launch.override(MOE, MOE_GEMV={"max_assignments": 0}, MOE_MMA={"rows": 1, "num_warps": 2})
    cfg = moe_gemm.moe_config(6, n_exp, cuda, tables=tables)
    assert cfg["mma"] and cfg["BLOCK_N"] == 32 and cfg == moe_gemm.moe_mma_config(tables=tables)


