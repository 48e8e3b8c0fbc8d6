"""scripts/benchlib/packed.py: line fits of `packed_matmul`'s time against its K tiles per program, and
which of packed_cluster's launch shapes a row count takes
(pure Python: the timing itself runs on a GPU, `bench_packed.py --chain`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib.packed import chain_fits, line_fit  # noqa: E402


def test_line_fit_recovers_a_line_and_its_worst_residual():
    fit = line_fit([1, 2, 3, 4], [5.5, 6.0, 6.5, 7.5])
    # least squares by hand: mean x 2.5, mean y 6.375, slope 3.25 / 5 = 0.65
    assert fit["slope"] == pytest.approx(0.65)
    assert fit["intercept"] == pytest.approx(6.375 - 0.65 * 2.5)
    assert fit["max_residual"] == pytest.approx(max(abs(y - (4.75 + 0.65 * x)) for x, y in
                                                    zip([1, 2, 3, 4], [5.5, 6.0, 6.5, 7.5])))
    exact = line_fit([1, 3], [2.0, 8.0])
    assert (exact["intercept"], exact["slope"], exact["max_residual"]) == pytest.approx((-1.0, 3.0, 0.0))


@pytest.mark.parametrize("xs,ys", [([1], [2.0]), ([2, 2, 2], [1.0, 2.0, 3.0]), ([1, 2], [1.0])])
def test_line_fit_refuses_what_defines_no_line(xs, ys):
    with pytest.raises(ValueError, match="two distinct x values"):
        line_fit(xs, ys)


def test_chain_fits_one_line_per_case_in_us():
    rows = []
    for split, (fixed, per) in ((1, (4.0, 0.5)), (4, (5.0, 0.25))):
        for t in (1, 2, 4):
            rows.append({"M": 64, "variant": "table", "SPLIT": split, "tiles": t,
                         "ms_warm": (fixed + per * t) / 1e3, "ms_cold": (fixed + 1.0 + 2 * per * t) / 1e3})
    fits = {(f["SPLIT"], f["state"]): f for f in chain_fits(rows)}
    assert set(fits) == {(1, "warm"), (1, "cold"), (4, "warm"), (4, "cold")}
    assert (fits[1, "warm"]["intercept_us"], fits[1, "warm"]["us_per_tile"]) == pytest.approx((4.0, 0.5))
    assert (fits[1, "cold"]["intercept_us"], fits[1, "cold"]["us_per_tile"]) == pytest.approx((5.0, 1.0))
    assert (fits[4, "warm"]["intercept_us"], fits[4, "warm"]["us_per_tile"]) == pytest.approx((5.0, 0.25))
    assert fits[4, "cold"]["max_residual_us"] == pytest.approx(0.0, abs=1e-9)
    assert all(f["M"] == 64 and f["variant"] == "table" for f in fits.values())


def test_cluster_launches_that_do_not_fit_the_rows_shared_memory_are_left_out():
    from benchlib.packed import CLUSTER_LAUNCHES, fitting_launches

    s4, s5 = ({"WG": 4, "WN": 1, "CL": 2, "DB": 1, "STAGES": st} for st in (4, 5))
    assert s4 in CLUSTER_LAUNCHES and s5 in CLUSTER_LAUNCHES
    # four shares of STAGES tiles [BN, 128] bf16: 5 stages fit up to BN 40 (204,800 B), 4 up to BN 56
    # (229,376 B), of the 232,448 a block has (1 KiB of it to align them)
    kept = {m: [cfg for cfg, _ in fitting_launches((s4, s5), m, 3712, 2688, 132)] for m in (40, 41, 56, 57)}
    assert kept == {40: [s4, s5], 41: [s4], 56: [s4], 57: []}
    (cfg, shape), = fitting_launches((s4,), 44, 3712, 2688, 132)
    assert cfg is s4 and (shape["BN"], shape["STAGES"], shape["DB"]) == (48, 4, 1)
    with pytest.raises(ValueError, match="CL must be"):  # other errors still raise
        fitting_launches(({"CL": 9},), 16, 3712, 2688, 132)


def test_row_cluster_launches_take_the_rows_rounded_up_to_8_or_16():
    from benchlib.packed import ROW_CLUSTER_LAUNCHES, ROWS8, ROWS16, at_rows, fitting_launches

    r8, r16 = {"WG": 4, "CL": 2, "BN": ROWS8, "PDL": 0}, {"WG": 2, "CL": 2, "BN": ROWS16, "PDL": 0}
    assert r8 in ROW_CLUSTER_LAUNCHES and r16 in ROW_CLUSTER_LAUNCHES
    assert [at_rows(r8, m)["BN"] for m in (17, 20, 24, 36, 41, 52, 64)] == [24, 24, 24, 40, 48, 56, 64]
    assert [at_rows(r16, m)["BN"] for m in (17, 20, 24, 36, 41, 52, 64)] == [32, 32, 32, 48, 48, 64, 64]
    plain = {"WG": 2, "CL": 2}
    assert at_rows(plain, 36) is plain
    # 4 stages of two shares at BN 56: 114,688 B of the 232,448 a block has; at 64 rows the sixth
    # launch runs two blocks of 32 rows
    shapes = {m: [shape for _, shape in fitting_launches(ROW_CLUSTER_LAUNCHES, m, 3712, 2688, 132)] for m in (52, 64)}
    assert [s["BN"] for s in shapes[52]] == [56, 56, 64, 56, 56, 32, 64, 56, 56]
    assert shapes[64][5] == {"BN": 32, "CL": 1, "WG": 4, "WN": 1, "STAGES": 3, "PF": 2, "DB": 1, "PDL": 0}
    assert [s["PDL"] for s in shapes[52]] == [0] * 6 + [1] * 3
