"""scripts/ncu_packed.py's reading of an Nsight Compute text report (pure Python)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import ncu_packed  # noqa: E402

REPORT = """==PROF== Connected to process 892 (/usr/bin/python3.12)
3712 2688 table's launch {'num_warps': 4}
  _packed_kernel (58, 2, 4)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    DRAM Throughput                   %        14.95
    Duration                         us        13.22
    Section: Launch Statistics
    Registers Per Thread             register/thread              90
    Waves Per SM                                                0.70
    OPT   Est. Local Speedup: 81.25%
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle        10.19
  nvjet_sm90_tst_40x64_64x16_4x1_v_bz_TNN (4, 24, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us     1,203.50
    Achieved Occupancy                        %        14.31
"""


def test_each_launch_gets_its_grid_and_metrics(tmp_path):
    rows = ncu_packed.parse(REPORT)
    assert rows == [
        {"kernel": "_packed_kernel", "grid": [58, 2, 4], "block": [128, 1, 1], "dram_pct": 14.95, "duration_us": 13.22,
         "registers": 90.0, "waves_per_sm": 0.70, "cycles_per_issue": 10.19},
        {"kernel": "nvjet_sm90_tst_40x64_64x16_4x1_v_bz_TNN", "grid": [4, 24, 1], "block": [384, 1, 1],
         "duration_us": 1203.5, "achieved_occupancy_pct": 14.31}]
    report, out = tmp_path / "ncu.txt", tmp_path / "r.json"
    report.write_text(REPORT)
    assert ncu_packed.main(["--parse", str(report), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["launches"] == rows and doc["command"].startswith("python scripts/ncu_packed.py --parse")
    report.write_text("==PROF== nothing profiled\n")
    assert ncu_packed.main(["--parse", str(report), "--out", str(out)]) == 1
