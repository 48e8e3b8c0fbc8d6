"""A mamba-ssm compile worker's share of an autotuned kernel (fp4kit.models.mamba_compile.take_share),
on real triton.autotune kernels run in the interpreter: each configuration of the share launches
once, to compile, and nothing else does."""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from fp4kit.models import mamba_compile as mc

BLOCKS = (1, 2, 4, 8, 16)


def _module():
    @triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in BLOCKS], key=["n"])
    @triton.jit
    def count(out_ptr, n, BLOCK: tl.constexpr):
        tl.atomic_add(out_ptr + BLOCK, 1)  # one program: each launch counts itself under its config

    @triton.jit
    def plain(out_ptr):
        tl.store(out_ptr, 1)

    wrapped = triton.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})(
        triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in BLOCKS], key=["n"])(
            triton.jit(lambda out_ptr, n, BLOCK: None)))
    return types.SimpleNamespace(count=count, plain=plain, wrapped=wrapped, helper=len, triton=triton)


def test_a_share_launches_each_of_its_configurations_once_and_times_none():
    m = _module()
    compiled = mc.take_share([m], part=1, parts=2)
    assert compiled == 2 * 2  # BLOCK 2 and 8 of both autotuned kernels
    assert [c.kwargs["BLOCK"] for c in m.count.configs] == [2, 8]
    assert [c.kwargs["BLOCK"] for c in m.wrapped.fn.configs] == [2, 8], "found under triton.heuristics"
    assert m.count.cache_results is False and m.wrapped.fn.cache_results is False
    out = torch.zeros(17, dtype=torch.int32)
    m.count[(1,)](out, 5)
    # One launch per configuration for its "benchmark", then the pick (the first) once more.
    assert {b: int(out[b]) for b in BLOCKS} == {1: 0, 2: 2, 4: 0, 8: 1, 16: 0}


def test_a_worker_past_the_end_of_a_short_list_still_launches_one():
    m = _module()
    assert mc.take_share([m], part=6, parts=7) == 2
    assert [c.kwargs["BLOCK"] for c in m.count.configs] == [2]  # configs[6 % 5]
    out = torch.zeros(17, dtype=torch.int32)
    m.count[(1,)](out, 5)
    assert {b: int(out[b]) for b in BLOCKS} == {1: 0, 2: 1, 4: 0, 8: 0, 16: 0}
