"""Calibration sums of x^2 are exact: the same bytes whatever the order of the batches and however
they are split between processes."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from fp4kit.calibrate import LIMBS, Statistics, exact_add, exact_value, exact_zeros


def _values(n: int, seed: int) -> torch.Tensor:
    """fp32 values over the whole range: subnormals, tiny, ordinary, huge, both signs, zeros."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**31 - 2**23, (n, 3), generator=g, dtype=torch.int64)  # every finite exponent
    x = bits.to(torch.int32).view(torch.float32) * torch.where(torch.rand(n, 3, generator=g) < 0.3, -1.0, 1.0)
    x[::7] = 0.0
    x[1::11] = torch.randn(len(x[1::11]), 3, generator=g)
    return x


def _exact(xs: torch.Tensor) -> list[Fraction]:
    return [sum((Fraction(float(v)) for v in col), Fraction(0)) for col in xs.double().T]


def test_the_sum_is_exact_and_rounds_once_to_float32():
    xs = _values(400, 0)
    limbs = exact_zeros((3,))
    for row in xs:
        exact_add(limbs, row)
    got = exact_value(limbs)
    for g, want in zip(got.tolist(), _exact(xs)):
        w = torch.tensor(float(want), dtype=torch.float64).float()
        if torch.isinf(w):
            continue
        ulp = torch.nextafter(w.abs(), torch.tensor(float("inf"))) - w.abs()
        assert abs(Fraction(g) - want) <= Fraction(float(ulp))


def test_no_order_and_no_split_changes_a_byte():
    xs = _values(300, 1)
    one = exact_zeros((3,))
    for row in xs:
        exact_add(one, row)
    g = torch.Generator().manual_seed(2)
    for parts in (1, 2, 3, 7):
        order = torch.randperm(len(xs), generator=g)
        pieces = [exact_zeros((3,)) for _ in range(parts)]
        for i, r in enumerate(order.tolist()):
            exact_add(pieces[i % parts], xs[r])
        total = sum(pieces)  # what an integer all_reduce computes
        assert torch.equal(exact_value(total).view(torch.int32), exact_value(one).view(torch.int32))
    # a float32 running sum depends on the order: what exact sums replace
    r = torch.rand(1000, generator=g)
    fwd, back = exact_zeros(()), exact_zeros(())
    f32_fwd = f32_back = torch.zeros(())
    for v, w in zip(r, r.flip(0)):
        exact_add(fwd, v)
        exact_add(back, w)
        f32_fwd, f32_back = f32_fwd + v, f32_back + w
    assert f32_fwd != f32_back
    assert torch.equal(fwd, back)


def test_special_values():
    limbs = exact_zeros((5,))
    exact_add(limbs, torch.tensor([0.0, -0.0, 1e-45, 3.4028235e38, 1.0]))
    exact_add(limbs, torch.tensor([0.0, 0.0, 1e-45, 3.4028235e38, float("nan")]))
    got = exact_value(limbs)
    assert got[:3].tolist() == [0.0, 0.0, 2.802596928649634e-45]
    assert got[3] == float("inf")  # 2 x FLT_MAX does not fit in float32
    assert torch.isnan(got[4])
    inf = exact_zeros((1,))
    exact_add(inf, torch.tensor([float("inf")]))
    exact_add(inf, torch.tensor([1.0]))
    assert torch.isnan(exact_value(inf))  # an Inf activation is as unusable as a NaN one


def test_statistics_snapshot_keeps_the_exact_sum_and_reads_an_old_float_sum():
    stats = Statistics(tokens_seen=6)
    stats.sq_sum["a"] = exact_add(exact_zeros((4,)), torch.tensor([1.0, 2.0, 3.0, 1e-40]))
    stats.sq_count["a"] = torch.tensor(6.0, dtype=torch.float64)
    back = Statistics.from_state_dict(stats.state_dict())
    assert back.sq_sum["a"].dtype == torch.int64 and back.sq_sum["a"].shape == (4, LIMBS)
    assert torch.equal(back.sq_sum["a"], stats.sq_sum["a"])
    assert back.square_sum("a").tolist() == pytest.approx([1.0, 2.0, 3.0, 1e-40])
    old = Statistics.from_state_dict({"tokens_seen": torch.tensor(6), "sq_sum|a": torch.tensor([1.0, 2.0, 3.0, 1e-40]),
                                      "sq_count|a": torch.tensor(6.0, dtype=torch.float64)})
    assert torch.equal(old.sq_sum["a"], stats.sq_sum["a"])
    assert torch.equal(old.importance("a"), torch.tensor([1.0, 2.0, 3.0, 1e-40]).double() / 6)
