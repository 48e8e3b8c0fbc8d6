"""scripts/tune_kernels.py and its sweeps' picks (pure Python: the rows are what the sweeps record)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "scripts"))

import tune_kernels  # noqa: E402
from sweeps import Sweep, fp8 as sf, moe as sm, packed as sp, router as sr, w4a16 as sw  # noqa: E402
from sweeps.common import updated, with_maxnreg  # noqa: E402

from fp4kit.kernels import launch  # noqa: E402


def _tuning_copy(tmp_path, monkeypatch) -> tuple[dict, Path]:
    """(the package's tuning file as read, a copy of it in tmp_path that `launch.tuning_path` names
    for the test)."""
    before = json.loads(launch.tuning_path("h200").read_text())
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(before))
    monkeypatch.setattr(launch, "tuning_path", lambda gpu: path)
    return before, path


def test_every_sweep_names_a_table_of_its_kernel():
    known = tune_kernels.sweeps()
    assert {"w4a16.gemv", "w4a16.mma", "w4a16.mma_wide", "w4a16.row_mma", "w4a16.decode", "w4a16.mid", "moe.decode",
            "moe.small", "moe.gemv", "moe.mma", "packed.launch", "fp8.gemv", "fp8.mma", "router.route"} <= set(known)
    for name, sweep in known.items():
        assert isinstance(sweep, Sweep) and name.split(".")[0] == sweep.kernel
        assert sweep.table in launch.table(sweep.kernel), name


def test_write_pick_records_the_table_and_who_chose_it(tmp_path, monkeypatch):
    # The pick and its chosen_by go into the tuning file given; the other tables stay as they were.
    before, path = _tuning_copy(tmp_path, monkeypatch)
    chosen_by = {"command": "python scripts/tune_kernels.py w4a16.mid", "date": "2027-01-01T00:00Z", "results": "r.json"}
    mid = dict(launch.thaw(launch.table("w4a16")["MID"]), programs_per_sm=8)
    tune_kernels.write_pick("h200", "w4a16", "MID", launch.freeze(mid), chosen_by)
    doc = json.loads(path.read_text())
    assert doc["kernels"]["w4a16"]["tables"]["MID"] == mid
    assert doc["kernels"]["w4a16"]["chosen_by"]["MID"] == chosen_by
    assert doc["kernels"]["moe"] == before["kernels"]["moe"]
    assert doc["kernels"]["w4a16"]["tables"]["DECODE"] == before["kernels"]["w4a16"]["tables"]["DECODE"]


def test_later_sweeps_of_one_run_see_the_earlier_picks(tmp_path, monkeypatch):
    # Two sweeps in one command: the second builds its candidates on the table the first wrote.
    before, path = _tuning_copy(tmp_path, monkeypatch)
    monkeypatch.setattr(tune_kernels, "ROOT", tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    launch.tables.cache_clear()
    seen = []
    first = Sweep("moe", "MOE_GEMV", lambda: [], lambda rows: dict(launch.thaw(launch.table("moe")["MOE_GEMV"]),
                                                                   BLOCK_N=16), "first")
    second = Sweep("moe", "SMALL", lambda: seen.append(launch.table("moe")["MOE_GEMV"]["BLOCK_N"]) or [],
                   lambda rows: launch.thaw(launch.table("moe")["SMALL"]), "second")
    monkeypatch.setattr(tune_kernels, "sweeps", lambda: {"moe.first": first, "moe.second": second})
    try:
        assert tune_kernels.main(["moe.first", "moe.second"]) == 0
    finally:
        monkeypatch.undo()
        launch.tables.cache_clear()
    assert seen == [16]
    assert launch.table("moe")["MOE_GEMV"]["BLOCK_N"] == before["kernels"]["moe"]["tables"]["MOE_GEMV"]["BLOCK_N"]


def test_a_pick_is_made_again_from_a_results_file_without_sweeping(tmp_path, monkeypatch):
    # --rows: the named sweep's pick from the rows a run of it wrote; nothing is timed, the rows
    # file stays as it was, and the table records the command and that file.
    before, path = _tuning_copy(tmp_path, monkeypatch)
    monkeypatch.setattr(tune_kernels, "ROOT", tmp_path)
    rows_file = tmp_path / "benchmarks" / "results" / "kernels-sweeps-fp8-gemv-h200.json"
    rows_file.parent.mkdir(parents=True)
    rows = [{"N": n, "K": 4096, "M": 1, "kernel": kernel, "tile": [1, 1024, 2], "ms": ms}
            for n, kernel, ms in ((2688, "gemv", 5.0), (2688, "_scaled_mm", 6.0), (10304, "gemv", 11.0),
                                  (10304, "_scaled_mm", 10.0))]
    rows_file.write_text(json.dumps({"sweep": "fp8.gemv", "rows": rows}))
    written = rows_file.read_text()

    def never():
        raise AssertionError("--rows must not sweep")

    monkeypatch.setattr(tune_kernels, "sweeps", lambda: {"fp8.gemv": Sweep("fp8", "GEMV", never, sf.pick_gemv, "d"),
                                                         "fp8.mma": Sweep("fp8", "MMA", never, sf.pick_mma, "d")})
    try:
        assert tune_kernels.main(["fp8.gemv", "--rows", str(rows_file)]) == 0
        assert tune_kernels.main(["fp8.gemv", "fp8.mma", "--rows", str(rows_file)]) == 2  # one sweep only
        assert tune_kernels.main(["fp8.mma", "--rows", str(rows_file)]) == 2  # another sweep's rows
    finally:
        monkeypatch.undo()
        launch.tables.cache_clear()
    doc = json.loads(path.read_text())
    gemv = doc["kernels"]["fp8"]["tables"]["GEMV"]
    assert gemv["max_m"] == 0 and gemv["shapes"] == {"2688x4096": 1, "10304x4096": 0}
    by = doc["kernels"]["fp8"]["chosen_by"]["GEMV"]
    assert "--rows" in by["command"] and by["results"] == "benchmarks/results/kernels-sweeps-fp8-gemv-h200.json"
    assert rows_file.read_text() == written


def test_every_table_says_who_chose_it():
    doc = json.loads(launch.tuning_path("h200").read_text())
    for kernel in ("w4a16", "moe", "packed", "fp8", "router", "mamba"):
        entry = doc["kernels"][kernel]
        assert set(entry["chosen_by"]) == set(entry["tables"]), kernel
        for name, by in entry["chosen_by"].items():
            assert by.get("command") or by.get("note"), (kernel, name)
            if by.get("results"):
                assert (_ROOT / by["results"]).exists(), (kernel, name, by["results"])


def test_a_pick_replaces_only_the_keys_it_picks():
    current = launch.table("w4a16")["MMA"]
    picked = {"num_warps": 2, "programs_per_sm": 4, "rows": 2, "prefetch": 2, "kwarps": 1}
    got = updated(current, picked)
    assert got == dict(launch.thaw(current), **picked) and got["balance"] == [0.9, 16]
    assert with_maxnreg({"a": 1}, None) == {"a": 1} and with_maxnreg({"a": 1}, 96) == {"a": 1, "maxnreg": 96}


# --------------------------------------------------------------------------------------------
# w4a16 (scripts/sweeps/w4a16.py)
# --------------------------------------------------------------------------------------------
def test_pick_decode_sums_over_shapes_and_keeps_register_cap():
    base = {"K": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}
    rows = [dict(base, N=n, M=1, maxnreg=mr, ms=t) for n, mr, t in
            ((1, None, 1.0), (2, None, 5.0), (1, 96, 2.0), (2, 96, 3.0), (1, 80, None), (2, 80, 0.1))]
    # None: 6.0, 96: 5.0, 80: failed once (inf) -> 96, carried as maxnreg
    assert sw.pick_decode(rows) == dict({k: v for k, v in base.items() if k != "K"}, maxnreg=96)
    rows = [dict(r, maxnreg=None, ms=1.0) if r["maxnreg"] == 96 else r for r in rows]
    assert "maxnreg" not in sw.pick_decode(rows)


def test_pick_gemv_max_m_stops_at_first_loss():
    def gemv(n, m, bn, t, pps=8):
        return {"N": n, "M": m, "kernel": "gemv", "tile": [m, bn, 2048, 4], "programs_per_sm": pps, "maxnreg": None,
                "ms": t}

    rows = []
    for n in (1, 2):
        for m, base_ms, gemv_ms in ((1, 3.0, 2.0), (2, 3.0, 2.5), (4, 3.0, 4.0)):
            rows.append({"N": n, "M": m, "kernel": "matrix-unit", "ms": base_ms})
            rows.append(gemv(n, m, 8, gemv_ms))
            rows.append(gemv(n, m, 16, gemv_ms + (0.1 if n == 1 else -0.3)))  # 16 wins the sum over shapes
    rows.append(gemv(1, 1, 8, None, pps=4))  # a failed launch shape is never picked
    rows.append(gemv(2, 1, 8, 0.1, pps=4))
    got = sw.pick_gemv(rows)
    assert got["1"] == {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 4, "programs_per_sm": 8}
    assert got["max_m"] == 2  # loses at M = 4
    rows = [dict(r, ms=5.0) if r["kernel"] == "gemv" and r["M"] == 1 and r["N"] == 2 else r for r in rows]
    assert sw.pick_gemv(rows)["max_m"] == 0


def test_pick_gemv_weighs_each_shape_alike():
    # A large weight's 60 us against two small ones' 3 us: the sum of times would pick tile 16
    # (60 + 3.6 + 3.6 = 67.2 against 62 + 3 + 3 = 68); relative to each shape's best, tile 8
    # (62/60 + 1 + 1 = 3.03 against 1 + 1.2 + 1.2 = 3.4).
    def gemv(n, bn, t):
        return {"N": n, "K": 2688, "M": 1, "kernel": "gemv", "tile": [1, bn, 1024, 2], "programs_per_sm": 8,
                "maxnreg": None, "ms": t}

    rows = [gemv(131072, 8, 62.0), gemv(131072, 16, 60.0), gemv(3712, 8, 3.0), gemv(3712, 16, 3.6),
            gemv(2688, 8, 3.0), gemv(2688, 16, 3.6)]
    rows += [{"N": n, "K": 2688, "M": 1, "kernel": "matrix-unit", "ms": 100.0} for n in (131072, 3712, 2688)]
    got = sw.pick_gemv(rows)
    assert got["1"]["BLOCK_N"] == 8 and got["max_m"] == 1


# --------------------------------------------------------------------------------------------
# fp8 (scripts/sweeps/fp8.py)
# --------------------------------------------------------------------------------------------
def test_pick_fp8_gemv_tiles_per_row_class_and_max_m_against_the_library():
    def gemv(n, m, tile, t):
        return {"N": n, "K": 2688, "M": m, "kernel": "gemv", "tile": list(tile), "ms": t}

    def lib(n, m, t):
        return {"N": n, "K": 2688, "M": m, "kernel": "_scaled_mm", "ms": t}

    a, b = (8, 512, 4), (4, 256, 2)
    rows = []
    for n, big in ((10304, 1.0), (2688, 0.1)):  # each shape counts alike, whatever its size
        rows += [gemv(n, 1, a, 6.0 * big), gemv(n, 1, b, 6.6 * big)]   # a at 1 row (sum 2.0 against 2.2)
        rows += [gemv(n, 2, a, 8.0 * big), gemv(n, 2, b, 7.0 * big)]   # b at 2 rows
        rows += [gemv(n, 4, a, 9.0 * big), gemv(n, 4, b, None)]         # a failed launch is never picked
        rows += [gemv(n, 8, a, 19.0 * big), gemv(n, 8, b, 12.0 * big)]  # 8 rows run class 4's tile: a
        rows += [lib(n, m, 10.0 * big) for m in (1, 2, 4, 8)]
    got = sf.pick_gemv(rows)
    assert got == {"1": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), a)),
                   "2": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), b)),
                   "4": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), a)), "max_m": 4,  # a loses at 8 rows
                   "shapes": {"10304x2688": 4, "2688x2688": 4}}
    slower = [dict(r, ms=0.5) if r["kernel"] == "_scaled_mm" and r["M"] == 2 and r["N"] == 2688 else r for r in rows]
    got = sf.pick_gemv(slower)
    assert got["max_m"] == 1  # the library wins at 2 rows on one shape...
    assert got["shapes"] == {"10304x2688": 4, "2688x2688": 1}  # ...which alone stops at 1 row
    assert sf.pick_gemv([dict(r, ms=0.01) if r["kernel"] == "_scaled_mm" else r for r in rows])["max_m"] == 0


def test_pick_fp8_gemv_takes_the_programmatic_dependent_launch_where_it_was_faster():
    # pdl rows exist where they were timed (one row here): the launch is (tile, pdl), picked as
    # any other; a class without pdl rows keeps the plain launch and no "pdl" key.
    def gemv(n, m, tile, t, pdl=False):
        return {"N": n, "K": 4096, "M": m, "kernel": "gemv", "tile": list(tile), "pdl": pdl, "ms": t}

    a = (1, 1024, 2)
    rows = []
    for n in (10304, 2688):
        rows += [gemv(n, 1, a, 10.0), gemv(n, 1, a, 9.0, pdl=True), gemv(n, 2, a, 12.0)]
        rows += [{"N": n, "K": 4096, "M": m, "kernel": "_scaled_mm", "ms": 9.5} for m in (1, 2)]
    got = sf.pick_gemv(rows)
    assert got["1"] == {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 2, "pdl": True}
    assert got["2"] == {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 2}
    assert got["max_m"] == 1 and got["shapes"] == {"2688x4096": 1, "10304x4096": 1}  # 9.0 < 9.5, 12.0 > 9.5
    slow = [dict(r, ms=11.0) if r.get("pdl") else r for r in rows]
    assert "pdl" not in sf.pick_gemv(slow)["1"] and sf.pick_gemv(slow)["max_m"] == 0


def test_pick_fp8_mma_one_tile_and_max_m_against_the_library():
    def mma(n, m, tile, t):
        return {"N": n, "K": 2688, "M": m, "kernel": "mma", "tile": list(tile), "ms": t}

    def lib(n, m, t):
        return {"N": n, "K": 2688, "M": m, "kernel": "_scaled_mm", "ms": t}

    a, b = (64, 128, 4, 5, 2), (128, 256, 8, 3, 1)
    rows = []
    for n, big in ((10304, 1.0), (2688, 0.1)):  # each problem counts alike, whatever its size
        rows += [mma(n, 1, a, 5.0 * big), mma(n, 1, b, 5.5 * big)]
        rows += [mma(n, 4, a, 6.0 * big), mma(n, 4, b, 5.8 * big)]
        rows += [mma(n, 16, a, 9.0 * big), mma(n, 16, b, None)]  # a failed launch is never picked
        rows += [lib(n, m, 7.0 * big) for m in (1, 4, 16)]
    got = sf.pick_mma(rows)
    assert got == {"max_m": 4, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5, "programs_per_sm": 2,
                   "max_parts": 4}  # a: the smaller sum; it loses to the library at 16 rows
    assert sf.pick_mma([dict(r, ms=0.01) if r["kernel"] == "_scaled_mm" else r for r in rows])["max_m"] == 0


def test_pick_route_sums_relative_times_over_token_counts():
    def row(t, per, warps, ms, pdl=False):
        return {"T": t, "experts": per, "num_warps": warps, "pdl": pdl, "ms": ms}

    rows = [row(1, 4, 8, 7.1), row(1, 4, 4, 7.2), row(1, 1, 1, 6.1),
            row(16, 4, 8, 15.3), row(16, 4, 4, 11.5), row(16, 1, 1, 15.3),
            row(64, 4, 8, 40.9), row(64, 4, 4, 28.6), row(64, 1, 1, None)]  # a failed launch is never picked
    assert sr.pick_route(rows) == {"experts": 4, "num_warps": 4, "pdl": False}
    assert sr.pick_route([r for r in rows if r["T"] == 1]) == {"experts": 1, "num_warps": 1, "pdl": False}
    # the dependent launch is one more candidate of the same shape, picked where its sum is smaller
    dependent = [row(1, 4, 4, 6.9, True), row(16, 4, 4, 11.0, True), row(64, 4, 4, 28.0, True)]
    assert sr.pick_route(rows + dependent) == {"experts": 4, "num_warps": 4, "pdl": True}
    assert sr.pick_route(rows + [dict(r, ms=r["ms"] + 1.0) for r in dependent])["pdl"] is False


def test_pick_mma_sums_relative_times_over_problems():
    def row(n, m, launch, t):
        nw, pps, rows, pf, kw = launch
        r = {"N": n, "K": n, "M": m, "num_warps": nw, "programs_per_sm": pps, "rows": rows, "prefetch": pf, "ms": t}
        return r if kw is None else dict(r, kwarps=kw)

    # a (a row of an older sweep, without K groups: 1), b, c: the same but for the K groups.
    # Problems 1 (small) and 2 (large). Summed times would pick b (10.9 against 11.0); relative
    # to each problem's best: a 1 + 10/9 = 2.11, b 1.9 + 1 = 2.9, c 1.2 + 9.5/9 = 2.26 -> a.
    a, b, c = (2, 4, 2, 2, None), (4, 8, 1, 0, 1), (4, 8, 1, 0, 4)
    rows = [row(1, 2, a, 1.0), row(2, 4, a, 10.0), row(1, 2, b, 1.9), row(2, 4, b, 9.0), row(1, 2, c, 1.2),
            row(2, 4, c, 9.5)]
    assert sw.pick_mma(rows) == {"num_warps": 2, "programs_per_sm": 4, "rows": 2, "prefetch": 2, "kwarps": 1}
    # a failed launch (None) never wins: without a, problem 1's best is c's 1.2: b 2.58, c 2.06
    rows[0]["ms"] = None
    assert sw.pick_mma(rows) == {"num_warps": 4, "programs_per_sm": 8, "rows": 1, "prefetch": 0, "kwarps": 4}
    rows[4]["ms"] = None
    assert sw.pick_mma(rows) == {"num_warps": 4, "programs_per_sm": 8, "rows": 1, "prefetch": 0, "kwarps": 1}


def test_pick_mma_wide_launch_and_reach():
    def row(n, m, kernel, t, launch=None):
        r = {"N": n, "K": 1000, "M": m, "kernel": kernel, "ms": t}
        if launch:
            r.update(zip(("num_warps", "programs_per_sm", "rows", "prefetch"), launch))
        return r

    a, b = (1, 8, 2, 2), (2, 4, 2, 2)
    rows = []
    # wgmma, a, b per (N, M): a is nearer each problem's best; summed over M it wins at N >= 200 (at N = 400
    # though it loses at M = 16), loses at N = 100
    for n, m, base, ta, tb in ((100, 12, 5.0, 6.0, 4.0), (100, 16, 5.0, 6.0, 9.0), (200, 12, 9.0, 8.0, 9.5),
                               (200, 16, 9.0, 8.5, 9.5), (400, 12, 20.0, 15.0, 18.0), (400, 16, 20.0, 21.0, 18.0)):
        rows += [row(n, m, "matrix-unit", base), row(n, m, "mma", ta, a), row(n, m, "mma", tb, b)]
    want = {"rows": 2, "num_warps": 1, "programs_per_sm": 8, "prefetch": 2, "kwarps": 1}
    assert sw.pick_mma_wide(rows) == dict(want, min_weights=200 * 1000)
    # a loss on the middle shape in the sum: reach only from the largest
    rows = [dict(r, ms=10.5) if r["kernel"] == "mma" and r["N"] == 200 and r["M"] == 16 and r["rows"] == 2
            and r["num_warps"] == 1 else r for r in rows]
    assert sw.pick_mma_wide(rows)["min_weights"] == 400 * 1000
    # losing on the largest shape: never
    slow = [dict(r, ms=30.0) if r["kernel"] == "mma" and r["N"] == 400 else r for r in rows]
    assert sw.pick_mma_wide(slow) == dict(want, min_weights=None)
    # a failed launch (None) never wins: b, which beats the wgmma kernel on the largest shape only
    rows = [dict(r, ms=None) if r["kernel"] == "mma" and r["N"] == 400 and r["M"] == 12 and r["num_warps"] == 1
            else r for r in rows]
    assert sw.pick_mma_wide(rows) == {"rows": 2, "num_warps": 2, "programs_per_sm": 4, "prefetch": 2,
                                              "kwarps": 1, "min_weights": 400 * 1000}


def test_pick_mma_wide_judges_a_launch_where_it_would_run():
    # c is nearer the best on the small shape (where a loses to the wgmma kernel and would not run)
    # but far from it on the large one: over all problems c is the nearer (what pick_mma takes),
    # routed (a from N = 400 up, the wgmma kernel below) a is
    def row(n, m, kernel, t, launch=None):
        r = {"N": n, "K": 1000, "M": m, "kernel": kernel, "ms": t}
        if launch:
            r.update(zip(("num_warps", "programs_per_sm", "rows", "prefetch", "kwarps"), launch))
        return r

    a, c = (1, 8, 2, 2, 1), (1, 2, 2, 2, 4)
    rows = []
    for n, base, ta, tc in ((100, 5.0, 10.0, 4.2), (400, 40.0, 20.0, 30.0)):
        for m in (12, 16):
            rows += [row(n, m, "matrix-unit", base), row(n, m, "mma", ta, a), row(n, m, "mma", tc, c)]
    assert sw.pick_mma([r for r in rows if r["kernel"] == "mma"])["kwarps"] == 4
    assert sw.pick_mma_wide(rows) == {"num_warps": 1, "programs_per_sm": 8, "rows": 2, "prefetch": 2,
                                              "kwarps": 1, "min_weights": 400 * 1000}
    # where c's routing is the nearer (a no faster than c on the large shape), c and its reach
    rows = [dict(r, ms=30.0) if r["kernel"] == "mma" and r["N"] == 400 and r.get("kwarps") == 1 else r for r in rows]
    assert sw.pick_mma_wide(rows) == {"num_warps": 1, "programs_per_sm": 2, "rows": 2, "prefetch": 2,
                                              "kwarps": 4, "min_weights": 100 * 1000}


def test_pick_row_mma_reach():
    # ROW_MMA's reach: the smallest size from which the mma kernel is faster on every ragged-step
    # shape at least as large (same-size shapes summed; shapes whose GEMV step divides K do not
    # count; a failed launch counts as never faster).
    def rows(n, k, gemv, mma, ragged=True):
        return [{"N": n, "K": k, "M": 1, "kernel": "gemv", "ragged": ragged, "ms": gemv},
                {"N": n, "K": k, "M": 1, "kernel": "mma", "ragged": ragged, "ms": mma}]

    base = rows(100, 10, 1.0, 2.0) + rows(200, 10, 2.0, 1.5) + rows(400, 10, 4.0, 3.0) + rows(50, 80, 4.5, 4.0)
    assert sw.pick_row_mma(base) == {"min_weights": 2000}
    # a smaller shape where the mma kernel wins does not reach past a larger one where it loses
    assert sw.pick_row_mma(base + rows(10, 10, 1.0, 0.5) + rows(300, 10, 1.0, 1.0)) == {"min_weights": 4000}
    # same-size shapes are summed: one loss outweighed by a larger win keeps the size
    assert sw.pick_row_mma(base + rows(20, 100, 1.0, 1.2)) == {"min_weights": 2000}
    # a shape whose GEMV step divides K is ignored, however slow the mma kernel is there
    assert sw.pick_row_mma(base + rows(1000, 10, 1.0, 9.0, ragged=False)) == {"min_weights": 2000}
    # the largest ragged shape failing on the mma kernel: never
    assert sw.pick_row_mma(base + rows(800, 10, 1.0, None)) == {"min_weights": None}

# --------------------------------------------------------------------------------------------
# moe (scripts/sweeps/moe.py)
# --------------------------------------------------------------------------------------------
def test_pick_moe_gemv_tile_and_threshold():
    rows = []
    for t, base, a, b in ((1, 40.0, 20.0, 25.0), (8, 190.0, 100.0, 90.0), (16, 300.0, 280.0, 320.0), (64, 500.0, 600.0, 400.0)):
        rows.append({"tokens": t, "path": "matrix-unit", "ms": base})
        rows.append({"tokens": t, "path": "gemv", "tile": [1, 8, 2048, 4], "maxnreg": None, "ms": a})
        rows.append({"tokens": t, "path": "gemv", "tile": [2, 8, 2048, 4], "maxnreg": None, "ms": b})
    got = sm.pick_gemv(rows, top_k=6, decode_tokens=8)
    # relative to each token count's best up to 8 tokens: 1 + 100/90 against 25/20 + 1 -> the
    # first tile (a sum of times, 120 against 115, would take the second); it loses at 64 tokens
    assert got == {"max_assignments": 96, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1,
                   "programs_per_sm": 2, "max_parts": 4, "AHEAD": 1, "pdl": False}
    # the same tile under a register cap or another split target is a launch of its own, and its
    # cap and split go with the pick (rows without a split ran SMALL's: 2 programs per SM, 4 parts)
    assert got["programs_per_sm"] == 2 and got["max_parts"] == 4
    rows += [{"tokens": t, "path": "gemv", "tile": [1, 8, 2048, 4], "maxnreg": 96, "programs_per_sm": 64,
              "max_parts": 4, "ms": ms} for t, ms in ((1, 18.0), (8, 80.0), (16, 250.0), (64, 300.0))]
    assert sm.pick_gemv(rows, top_k=6, decode_tokens=8) == {
        "max_assignments": 6 * 64, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1,
        "programs_per_sm": 64, "max_parts": 4, "AHEAD": 1, "pdl": False, "maxnreg": 96}
    # so are the K tiles in flight, which go with the pick
    rows += [{"tokens": t, "path": "gemv", "tile": [1, 8, 2048, 4], "maxnreg": 96, "programs_per_sm": 64,
              "max_parts": 4, "ahead": 2, "ms": ms} for t, ms in ((1, 17.0), (8, 79.0), (16, 240.0), (64, 290.0))]
    assert sm.pick_gemv(rows, top_k=6, decode_tokens=8)["AHEAD"] == 2
    # and so is the down launch as a programmatic dependent of the up launch
    rows += [{"tokens": t, "path": "gemv", "tile": [1, 8, 2048, 4], "maxnreg": 96, "programs_per_sm": 64,
              "max_parts": 4, "ahead": 2, "pdl": True, "ms": ms} for t, ms in ((1, 15.0), (8, 78.0), (16, 240.0),
                                                                             (64, 290.0))]
    picked = sm.pick_gemv(rows, top_k=6, decode_tokens=8)
    assert (picked["AHEAD"], picked["pdl"]) == (2, True)


def test_pick_moe_gemv_weighs_only_the_counts_the_tiles_serve():
    # At 8 tokens the matrix units beat every tile: that count does not choose the tile (b would
    # win 25/20 + 60/60 against 1 + 100/60 if it did), and the tiles serve one token only.
    def gemv(t, bn, ms):
        return {"tokens": t, "path": "gemv", "tile": [1, bn, 512, 1], "maxnreg": None, "ms": ms}

    rows = [{"tokens": 1, "path": "matrix-unit", "ms": 40.0}, gemv(1, 4, 20.0), gemv(1, 8, 25.0),
            {"tokens": 8, "path": "matrix-unit", "ms": 50.0}, gemv(8, 4, 100.0), gemv(8, 8, 60.0)]
    got = sm.pick_gemv(rows, top_k=6, decode_tokens=8)
    assert (got["BLOCK_N"], got["max_assignments"]) == (4, 6)
    # no tile wins anywhere: chosen at one token, serving none
    slow = [dict(r, ms=99.0) if r["path"] == "gemv" and r["tile"][1] == 4 else r for r in rows]
    slow = [dict(r, ms=r["ms"] + 100.0) if r["path"] == "gemv" else r for r in slow]
    assert sm.pick_gemv(slow, top_k=6)["BLOCK_N"] == 8 and sm.pick_gemv(slow, top_k=6)["max_assignments"] == 0


def test_a_pick_drops_a_register_cap_it_does_not_carry(monkeypatch):
    from sweeps.common import merged

    live = launch.override(launch.table("moe"), MOE_GEMV={"maxnreg": 96})
    monkeypatch.setattr(launch, "table", lambda kernel, device=None: live)
    plain = {"BLOCK_N": 4}
    assert "maxnreg" not in merged("moe", "MOE_GEMV", lambda rows: plain, owned=("maxnreg",))([])
    assert merged("moe", "MOE_GEMV", lambda rows: plain)([])["maxnreg"] == 96  # not owned: kept
    assert merged("moe", "MOE_GEMV", lambda rows: dict(plain, maxnreg=64), owned=("maxnreg",))([])["maxnreg"] == 64
    # the sweeps that pick a register cap own it: an uncapped MOE_GEMV pick drops the live cap
    rows = [{"tokens": 1, "path": "matrix-unit", "ms": 9.0},
            {"tokens": 1, "path": "gemv", "tile": [1, 8, 512, 1], "maxnreg": None, "ms": 2.0}]
    assert "maxnreg" not in tune_kernels.sweeps()["moe.gemv"].pick(rows)


def test_moe_gemv_sweep_runs_each_candidate_right(monkeypatch):
    # The sweep's own code on small CPU stacks (the interpreter): every candidate launch reaches the
    # launcher with its split target and gives the reference's output; timing stands in as the
    # error check alone.
    import torch

    from fp4kit.formats import nvfp4
    from fp4kit.kernels import backend

    if not backend.interpreted(sm.mg._moe_small_kernel):
        pytest.skip("runs the kernels under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    monkeypatch.setattr(sm, "_nano_experts", lambda n, h, i: (nvfp4.quantize(torch.randn(n, i, h, generator=g)),
                                                               nvfp4.quantize(torch.randn(n, h, i, generator=g))))

    def routed(t, n, k, h, up, down):
        x, ids, w = torch.randn(t, h, generator=g), torch.randperm(n, generator=g)[:k].expand(t, k), torch.rand(t, k)
        return x, ids, w, sm.mg.moe_experts(x, ids, w, up, down, backend="torch").float()

    used = []
    split_k = sm.mg.backend.split_k
    monkeypatch.setattr(sm.mg.backend, "split_k",
                        lambda *a: used.append((a[-1]["programs_per_sm"], split_k(*a)[0])) or split_k(*a))
    monkeypatch.setattr(sm, "_routed_tokens", routed)
    monkeypatch.setattr(sm, "_cold_copies", lambda *a: [])
    aheads = []
    launch_cached = sm.mg.launch_cached
    monkeypatch.setattr(sm.mg, "launch_cached", lambda kernel, grid, *a, **c: (
        aheads.append(c.get("AHEAD")) if c.get("GEMV") else None, launch_cached(kernel, grid, *a, **c))[1])
    monkeypatch.setattr(sm, "time_if_right", lambda fn, ref, others: {"ms": float((fn().float() - ref).norm() / ref.norm())})
    tables = launch.override(launch.table("moe"), MOE_MMA={"max_per_expert": 0})  # the matrix units: wgmma tiles
    rows = sm.sweep_gemv(tokens=(1,), n_exp=4, top_k=2, hid=128, inter=128, tiles=((2, 32, 64, 1), (2, 32, 64, 1, 96)),
                         programs_per_sm=(2, 1000), ahead=(1, 2), pdl=(False, True), tables=tables)
    assert [(r["path"], r.get("maxnreg"), r.get("programs_per_sm"), r.get("ahead")) for r in rows if not r.get("pdl")] == [
        ("matrix-unit", None, None, None), ("gemv", None, 2, 1), ("gemv", None, 2, 2), ("gemv", None, 1000, 1),
        ("gemv", None, 1000, 2), ("gemv", 96, 2, 1), ("gemv", 96, 2, 2), ("gemv", 96, 1000, 1), ("gemv", 96, 1000, 2)]
    assert [r.get("pdl") for r in rows] == [None] + [False, True] * 8  # under the interpreter: the plain launches
    assert all(r["ms"] < 1e-5 for r in rows)
    # each candidate's split target reached both projections: no split at 2, a split at 1000
    assert {p for p, _ in used} == {2, 1000} and all((n > 1) == (p == 1000) for p, n in used)
    assert sm.pick_gemv(rows, top_k=2)["programs_per_sm"] in (2, 1000)
    assert aheads == [1, 1, 1, 1, 2, 2, 2, 2] * 4  # each candidate's K tiles in flight reached both projections


def test_pick_moe_mma_launch_and_reach():
    rows = []
    for t, wg, a, b in ((32, 400.0, 300.0, 290.0), (64, 500.0, 350.0, 340.0), (128, 560.0, 420.0, 600.0),
                        (256, 640.0, 700.0, 710.0)):
        rows.append({"tokens": t, "path": "sorted", "ms": wg})
        rows.append({"tokens": t, "path": "sorted-mma", "launch": [2, 2, 2], "ms": a})
        rows.append({"tokens": t, "path": "sorted-mma", "launch": [1, 2, 2], "ms": b})
    # [1, 2, 2] is faster at 32 and 64 tokens but loses at 128; [2, 2, 2] wins up to 128
    assert sm.pick_mma(rows, n_exp=128, top_k=6) == {"max_per_expert": 6.0, "rows": 2, "num_warps": 2,
                                                           "prefetch": 2}
    rows = [dict(r, ms=None) if r["path"] == "sorted-mma" and r["launch"] == [2, 2, 2] else r for r in rows]
    assert sm.pick_mma(rows, n_exp=128, top_k=6) == {"max_per_expert": 3.0, "rows": 1, "num_warps": 2,
                                                           "prefetch": 2}
    rows = [dict(r, ms=1e9) if r["path"] == "sorted-mma" else r for r in rows]
    assert sm.pick_mma(rows, n_exp=128, top_k=6)["max_per_expert"] == 0


def test_pick_small_threshold_from_the_sorted_path():
    rows = []
    for t, sorted_ms, small_ms in ((1, 8.0, 4.0), (2, 9.0, 6.0), (8, 20.0, 19.0), (64, 50.0, 55.0)):
        rows.append({"tokens": t, "path": "sorted", "ms": sorted_ms})
        rows.append({"tokens": t, "path": "small", "programs_per_sm": 2, "max_parts": 4, "ms": small_ms})
        rows.append({"tokens": t, "path": "small", "programs_per_sm": 4, "max_parts": 4, "ms": small_ms + 1})
    assert sm.pick_small(rows, top_k=6) == {"max_assignments": 48, "programs_per_sm": 2, "max_parts": 4}
    rows = [dict(r, ms=1.0) if r["path"] == "small" else r for r in rows]
    assert sm.pick_small(rows)["max_assignments"] == 512

# --------------------------------------------------------------------------------------------
# packed (scripts/sweeps/packed.py)
# --------------------------------------------------------------------------------------------
def test_packed_pick_per_class_and_size():
    rows = []
    for n, k in ((8192, 8192), (3712, 2688)):
        for bm, nw, pps, ms in ((64, 4, 2, 2.0), (64, 8, 2, 1.0), (32, 4, 2, 1.5)):
            small = n * k < launch.table("packed")["LARGE_WEIGHTS"]
            rows.append({"N": n, "K": k, "M": 64, "BLOCK_M": bm, "num_warps": nw, "programs_per_sm": pps,
                         "ms": ms if not small else {4: 1.0, 8: 3.0}[nw] * (0.5 if bm == 32 else 1.0)})
    table = sp.pick(rows)
    assert table["64"]["large"] == {"BLOCK_M": 64, "num_warps": 8, "programs_per_sm": 2, "UNROLL": 1, "PREFETCH": 0}
    # a prefetch distance is picked like the other keys
    rows.append({"N": 8192, "K": 8192, "M": 64, "BLOCK_M": 64, "num_warps": 8, "programs_per_sm": 2, "PREFETCH": 4,
                 "ms": 0.8})
    assert sp.pick(rows)["64"]["large"]["PREFETCH"] == 4
    table = sp.pick(rows[:-1])
    assert table["64"]["small"] == {"BLOCK_M": 32, "num_warps": 4, "programs_per_sm": 2, "UNROLL": 1, "PREFETCH": 0}
    assert table["16"] == launch.thaw(launch.table("packed")["PACKED"]["16"])  # not swept: kept
    # classes and sizes not swept are kept from the table given
    other = launch.override(launch.table("packed"), PACKED={"16": {"small": {"BLOCK_M": 16, "num_warps": 8,
                                                                             "programs_per_sm": 1, "UNROLL": 1}}})
    assert sp.pick(rows, other)["16"]["small"]["num_warps"] == 8


def test_copy_count_fills_the_l2_four_times(monkeypatch):
    from sweeps import common

    monkeypatch.setattr(common.torch.cuda, "get_device_properties", lambda device: type("P", (), {"L2_cache_size": 50 << 20}))
    assert common.copy_count(0, 20 << 20) == 10  # 200 MB of 20 MB weights
    assert common.copy_count(0, 5_600_000) == 38
    assert common.copy_count(0, 400 << 20) == 2  # larger than the L2: still two, one after the other
    assert common.copy_count(0, 1 << 10) == 64  # at most 64


def test_packed_sweep_times_each_copy_in_turn_when_cold(monkeypatch):
    # Several weights: one closure per copy, run in turn (time_calls); one weight: replayed alone.
    seen = {}
    monkeypatch.setattr(sp.pg, "config", lambda m, n, k, device, cfg: {"SPLIT": 3})
    monkeypatch.setattr(sp.pg, "packed_matmul", lambda x, w, cfg: seen.setdefault("weights", []).append(w))
    monkeypatch.setattr(sp, "time_calls", lambda calls: [c() for c in calls] and 2.0)
    monkeypatch.setattr(sp, "time_graph", lambda fn: fn() or 1.0)
    x = type("X", (), {"device": "cuda"})()
    row = sp._timed(64, 64, 16, x, ["w0", "w1", "w2"], {"BLOCK_M": 16})
    assert row["ms"] == 2.0 and seen["weights"] == ["w0", "w1", "w2"] and row["SPLIT"] == 3
    seen.clear()
    assert sp._timed(64, 64, 16, x, ["w0"], {"BLOCK_M": 16})["ms"] == 1.0 and seen["weights"] == ["w0"]
