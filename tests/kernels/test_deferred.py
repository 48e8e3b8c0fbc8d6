"""Deferred data checks: a flag on the device, the reference's error raised after one read-back."""

from __future__ import annotations

import pytest
import torch

from fp4kit.formats import FormatError, nvfp4
from fp4kit.kernels import quantize as kq
from fp4kit.kernels.deferred import DeferredCheck, failed, run_all


def _raiser(msg):
    def f():
        raise FormatError(msg)
    return f


def test_run_all_raises_the_first_failing_check_in_order():
    checks = [DeferredCheck(torch.tensor(False), _raiser("a")), DeferredCheck(torch.tensor(True), _raiser("b")),
              DeferredCheck(torch.tensor([True]), _raiser("c"))]
    assert failed(checks) == [1, 2]
    with pytest.raises(FormatError, match="^b$"):
        run_all(checks)
    run_all(checks[:1])
    run_all([])


def test_a_failed_check_whose_error_function_returns_is_not_passed_silently():
    check = DeferredCheck(torch.tensor(True), lambda: None)
    with pytest.raises(AssertionError, match="did not raise"):
        check()
    check = DeferredCheck(torch.tensor(False), lambda: None)
    check()


def _w(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 16, 64, generator=g) * 0.1).to(torch.bfloat16)


def _same_error(eager, deferred_call):
    with pytest.raises(FormatError) as now:
        eager()
    deferred: list = []
    deferred_call(deferred)  # queued, not raised
    assert [type(c) for c in deferred] == [DeferredCheck]
    with pytest.raises(FormatError) as later:
        run_all(deferred)
    assert str(later.value) == str(now.value)
    return str(now.value)


def test_a_negative_importance_is_refused_when_deferred_as_it_is_at_once():
    w, imp = _w(), torch.rand(3, 64)
    imp[1, 5] = -1.0
    msg = _same_error(lambda: kq.quantize(w, scale_rule="4o6", importance=imp),
                      lambda d: kq.quantize(w, scale_rule="4o6", importance=imp, deferred=d))
    assert "importance must be finite and >= 0" in msg
    with pytest.raises(FormatError, match="importance must be finite"):
        nvfp4.quantize(w, scale_rule="4o6", importance=imp)


def test_a_wrongly_shaped_importance_is_refused_at_once_even_when_deferred():
    with pytest.raises(FormatError, match="importance shape"):
        kq.quantize(_w(), scale_rule="4o6", importance=torch.rand(2, 64), deferred=[])


def test_a_nan_weight_and_a_low_global_amax_are_refused_when_deferred():
    w = _w(1)
    bad = w.clone()
    bad[2, 3, 4] = float("nan")
    msg = _same_error(lambda: kq.quantize(bad), lambda d: kq.quantize(bad, deferred=d))
    assert "NaN" in msg
    low = torch.full((3,), 1e-3)
    msg = _same_error(lambda: kq.quantize(w, global_amax=low), lambda d: kq.quantize(w, global_amax=low, deferred=d))
    assert "below the tensor's own max|w|" in msg


def test_good_input_passes_its_deferred_check_with_the_eager_bytes():
    w, imp = _w(2), torch.rand(3, 64)
    deferred: list = []
    qt, choice = kq.quantize(w, scale_rule="4o6", importance=imp, return_choice=True, deferred=deferred)
    run_all(deferred)
    ref, ref_choice = nvfp4.quantize(w, scale_rule="4o6", importance=imp, return_choice=True)
    assert torch.equal(qt.packed, ref.packed) and torch.equal(choice, ref_choice)
    assert torch.equal(qt.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
