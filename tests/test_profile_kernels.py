"""scripts/profile_kernels.py's merging of a partial (--only) run into the earlier results file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "profile_kernels", Path(__file__).resolve().parents[1] / "scripts" / "profile_kernels.py")
profile_kernels = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(profile_kernels)


def test_only_selects_cases_by_comma_separated_texts():
    assert profile_kernels._wanted("stack kernel plain [128,1856,2688]", None)
    assert profile_kernels._wanted("stack kernel plain [128,1856,2688]", "gemv,stack kernel")
    assert not profile_kernels._wanted("gemv 8192x8192 M=1", "quantize,stack kernel")


def test_merge_keeps_other_cases_with_the_run_they_came_from():
    earlier = {"date_utc": "2026-01-01T00:00Z", "command": "python scripts/profile_kernels.py",
               "kernels": [{"case": "gemv 8192x8192 M=1", "us": 17.6},
                           {"case": "stack kernel plain", "us": 700.0},
                           {"case": "mma 8192x8192 M=4", "us": 20.2, "date_utc": "2025-12-31T00:00Z",
                            "command": "python scripts/profile_kernels.py --only mma"}]}
    fresh = [{"case": "stack kernel plain", "us": 680.0, "date_utc": "2026-01-02T00:00Z",
              "command": "python scripts/profile_kernels.py --only stack kernel"}]
    rows = profile_kernels.merge_rows(earlier, fresh, "stack kernel")
    assert [r["case"] for r in rows] == ["gemv 8192x8192 M=1", "mma 8192x8192 M=4", "stack kernel plain"]
    assert rows[0]["date_utc"] == "2026-01-01T00:00Z" and rows[0]["command"] == earlier["command"]
    assert rows[1]["date_utc"] == "2025-12-31T00:00Z"  # a row's own run is kept
    assert rows[2]["us"] == 680.0
    assert "date_utc" not in earlier["kernels"][0]  # the earlier file's rows are not changed in place
