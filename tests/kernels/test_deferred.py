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
    checks = [DeferredCheck(_raiser("a"), bad=torch.tensor(False)), DeferredCheck(_raiser("b"), bad=torch.tensor(True)),
              DeferredCheck(_raiser("c"), bad=torch.tensor([True]))]
    assert failed(checks) == [1, 2]
    with pytest.raises(FormatError, match="^b$"):
        run_all(checks)
    run_all(checks[:1])
    run_all([])


def test_a_failed_check_whose_error_function_returns_is_not_passed_silently():
    check = DeferredCheck(lambda: None, bad=torch.tensor(True))
    with pytest.raises(AssertionError, match="did not raise"):
        check()
    check = DeferredCheck(lambda: None, bad=torch.tensor(False))
    check()


def _mixed_checks(n: int, failing: set[int]) -> list[DeferredCheck]:
    """n checks of every kind of condition and of several lengths (one a 0-d tensor, one empty),
    each failing in its own way where its index is in `failing`."""
    g = torch.Generator().manual_seed(n)
    checks = []
    for i in range(n):
        bad = i in failing
        own = torch.rand(i % 5 + 1, generator=g)
        imp = torch.rand(3, 8, generator=g)
        amax = torch.rand((), generator=g)
        cover = own + 1.0
        if bad:
            kind = i % 4
            if kind == 0:
                own[-1] = float("nan")
            elif kind == 1:
                imp[2, 7] = -1e-30
            elif kind == 2:
                cover[0] = own[0] * 0.5
            else:
                amax = torch.tensor(float("inf"))
        checks.append(DeferredCheck(_raiser(str(i)), finite=[own, amax, torch.empty(0)], finite_nonnegative=[imp],
                                    covers=[(cover, own)]))
    return checks


@pytest.mark.parametrize("failing", [set(), {0}, {3, 4, 9}, {1, 2, 5, 6, 10, 11}])
def test_every_kind_of_condition_flags_its_own_check(failing):
    assert failed(_mixed_checks(12, failing)) == sorted(failing)


def test_a_non_finite_cover_fails_even_above_the_floor():
    own = torch.tensor([1.0, 2.0])
    for bad in (float("nan"), float("inf")):
        assert failed([DeferredCheck(_raiser("x"), covers=[(torch.tensor([3.0, bad]), own)])]) == [0]
    assert failed([DeferredCheck(_raiser("x"), covers=[(torch.tensor([2.0, 2.0]), own)])]) == []  # equal covers
    with pytest.raises(ValueError, match="covers pairs"):
        DeferredCheck(_raiser("x"), covers=[(torch.ones(3), own)])


def test_the_checks_of_many_tensors_take_as_many_operations_as_those_of_few(op_counter):
    # The stage defers one check per weight; reading them back must not launch per check
    # (views of the checked tensors are not launches, and are not counted).
    counts = []
    for n in (3, 40):
        checks = _mixed_checks(n, {1})
        with op_counter() as c:
            assert failed(checks) == [1]
        counts.append(c.ops)
    assert counts[0] == counts[1], counts


def _w(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 16, 64, generator=g) * 0.1).to(torch.bfloat16)


def _same_error(eager, deferred_call):
    with pytest.raises(FormatError) as now:
        eager()
    deferred: list = []
    deferred_call(deferred)  # queued, not raised
    assert [type(c) for c in deferred] == [DeferredCheck]
    assert failed(deferred) == [0]
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


def test_values_are_tested_in_their_own_dtype():
    # A float64 value beyond fp32's range is finite; the tensors of one kind may mix dtypes.
    big = torch.tensor([1e300], dtype=torch.float64)
    checks = [DeferredCheck(_raiser("a"), finite=[big]), DeferredCheck(_raiser("b"), finite=[torch.tensor([1.0])]),
              DeferredCheck(_raiser("c"), finite=[torch.tensor([float("nan")], dtype=torch.bfloat16)])]
    assert failed(checks) == [2]
