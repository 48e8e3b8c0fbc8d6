"""Nemotron-H MoE blocks whose routed and shared experts run on fp4kit's W4A16 Triton modules run
both in one call (`models.nemotron_h.overlap_shared_experts`; on a GPU the shared expert on a
second stream): the block's output is its own forward's bit for bit, eagerly and compiled. On the
CPU the Triton kernels run in the interpreter, so only the MoE blocks are switched to them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fp4kit.export.load import load_quantized
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.models import nemotron_h
from fp4kit.modules import NVFP4Experts
from fp4kit.quantize import quantize
from fp4kit.recipe import DEFAULT_RECIPE, load_recipe

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parent / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    calib = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("overlap") / "nvfp4"
    export_checkpoint(quantize(models.build_nemotron_h(), load_recipe(DEFAULT_RECIPE), calib, progress=False), folder,
                      progress=False)
    return folder


def _moe_blocks(model):
    return [m for m in model.modules() if isinstance(m, nemotron_h._classes().NemotronHMoE)]


def _on_triton(model):
    """The model as load_quantized(backend="torch") gives it, with its MoE blocks' experts and
    shared experts on the Triton backend."""
    for block in _moe_blocks(model):
        for m in (block.experts, block.shared_experts.up_proj, block.shared_experts.down_proj):
            m.backend = "triton"
    return model


def _shared_kinds(monkeypatch) -> list:
    """Records the type of each weight `moe_gemm.shared_linear` is called with."""
    from fp4kit.kernels import moe_gemm

    kinds, real = [], moe_gemm.shared_linear

    def spy(x, w):
        kinds.append(type(w).__name__)
        return real(x, w)

    monkeypatch.setattr(moe_gemm, "shared_linear", spy)
    return kinds


@pytest.mark.parametrize("layout", ["checkpoint", "packed"])
def test_the_blocks_give_their_own_forwards_output(checkpoint, layout, monkeypatch):
    model = _on_triton(load_quantized(checkpoint, backend="torch", layout=layout))
    kinds = _shared_kinds(monkeypatch)
    blocks = _moe_blocks(model)
    assert blocks and all(type(b) is nemotron_h._classes().NemotronHMoE for b in blocks)
    assert nemotron_h.overlap_shared_experts(model) == len(blocks)
    assert all(type(b).__name__ == "NemotronHMoEOverlapped" for b in blocks)
    ids = torch.tensor([[1, 5, 9, 11, 13], [7, 7, 2, 40, 3]])
    with torch.no_grad():
        overlapped = model(input_ids=ids).logits
        with nemotron_h.shared_experts_after_routed(model) as n:
            assert n == len(blocks) and all(type(b) is nemotron_h._classes().NemotronHMoE for b in blocks)
            own = model(input_ids=ids).logits
    assert all(type(b).__name__ == "NemotronHMoEOverlapped" for b in blocks)
    assert torch.equal(overlapped, own)
    # the probes and the overlapped forward: two shared linears per block each, of the layout's kind
    assert set(kinds) == {"PackedNVFP4" if layout == "packed" else "NVFP4Tensor"} and len(kinds) == 4 * len(blocks)


@pytest.mark.parametrize("layout", ["checkpoint", "packed"])
def test_compiled_block_calls_one_operator_with_the_same_output(checkpoint, layout, monkeypatch):
    model = _on_triton(load_quantized(checkpoint, backend="torch", layout=layout))
    nemotron_h.overlap_shared_experts(model)
    block = _moe_blocks(model)[0]
    x = torch.randn((2, 3, model.config.hidden_size), generator=torch.Generator().manual_seed(1)).bfloat16()
    seen = []
    real = NVFP4Experts.with_shared

    def spy(self, *args):
        seen.append(torch.compiler.is_compiling())
        return real(self, *args)

    NVFP4Experts.with_shared = spy
    kinds = _shared_kinds(monkeypatch)
    try:
        with torch.no_grad():
            compiled = torch.compile(block, fullgraph=True, dynamic=False, options={"cpp.simdlen": 1})(x)
            eager = block(x)
    finally:
        NVFP4Experts.with_shared = real
    assert seen == [True, False]  # traced once through the operator, then run eagerly
    assert torch.equal(compiled, eager)
    assert set(kinds) == {"PackedNVFP4" if layout == "packed" else "NVFP4Tensor"}


@pytest.mark.parametrize("layout", ["checkpoint", "packed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_one_launch_router_runs_inside_the_call(checkpoint, monkeypatch, compiled, layout):
    # Within one_launch_routing (generate's step) the block hands its router to the call, so the
    # shared expert's launches can go out before the router's: the output is the block's own
    # forward's, whose router runs the same launch. The CPU stands in for a GPU here: the router's
    # rows are taken as the kernels' (its kernel runs in the interpreter).
    model = _on_triton(load_quantized(checkpoint, backend="torch", layout=layout))
    nemotron_h.overlap_shared_experts(model)
    monkeypatch.setattr(nemotron_h, "_kernel_rows", lambda x: True)
    block = _moe_blocks(model)[0]
    x = torch.randn((1, 3, model.config.hidden_size), generator=torch.Generator().manual_seed(2)).bfloat16()
    calls = {"routed_with_shared": [], "with_shared": []}
    for name in calls:
        real = getattr(NVFP4Experts, name)

        def spy(self, *args, _real=real, _name=name):
            calls[_name].append(torch.compiler.is_compiling())
            return _real(self, *args)

        monkeypatch.setattr(NVFP4Experts, name, spy)
    with torch.no_grad(), nemotron_h.single_group_routing(model) as n, nemotron_h.one_launch_routing():
        assert n == len(_moe_blocks(model))
        run = torch.compile(block, fullgraph=True, dynamic=False, options={"cpp.simdlen": 1}) if compiled else block
        got = run(x)
        own = nemotron_h._classes().NemotronHMoE.forward(block, x)
        more_rows = block(torch.randn((1, 65, model.config.hidden_size)).bfloat16())  # past ROUTE_MAX_TOKENS
    assert torch.equal(got, own)
    assert more_rows.shape == (1, 65, model.config.hidden_size)
    assert calls == {"routed_with_shared": [compiled], "with_shared": [False]}
    with torch.no_grad():
        block(x)  # outside one_launch_routing: the router's own forward, then the experts
    assert calls["with_shared"] == [False, False]


def test_blocks_off_the_triton_modules_keep_their_forward(checkpoint):
    model = load_quantized(checkpoint, backend="torch")  # the emulation: nothing to overlap
    assert nemotron_h.overlap_shared_experts(model) == 0
    assert all(type(b) is nemotron_h._classes().NemotronHMoE for b in _moe_blocks(model))


def test_a_block_whose_probe_differs_keeps_its_forward(checkpoint, monkeypatch):
    model = _on_triton(load_quantized(checkpoint, backend="torch"))
    real = NVFP4Experts.with_shared

    def doubled(self, *args):
        routed, shared = real(self, *args)
        return routed, shared * 2

    monkeypatch.setattr(NVFP4Experts, "with_shared", doubled)
    with pytest.warns(RuntimeWarning, match="keeps its forward.*differs from the block's own forward's on a probe"):
        assert nemotron_h.overlap_shared_experts(model) == 0
    assert all(type(b) is nemotron_h._classes().NemotronHMoE for b in _moe_blocks(model))
