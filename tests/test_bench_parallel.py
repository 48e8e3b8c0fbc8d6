"""scripts/bench_parallel.py reads the stage times from the line `fp4kit quantize` prints."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_parallel import stage_times  # noqa: E402


def test_stage_times_of_the_quantize_summary():
    out = "role ...\ntime: import 1.2s, load 2.7s, calibration set 0.0s, calibrate 4.5s, compile beside calibrate 1.8s, quantize 2.0s, export 0.0s\nwrote x\n"
    assert stage_times(out) == {"import": 1.2, "load": 2.7, "calibration set": 0.0, "calibrate": 4.5,
                                "compile beside calibrate": 1.8, "quantize": 2.0, "export": 0.0}
    with pytest.raises(RuntimeError, match="no `time:` line"):
        stage_times("wrote x\n")
    with pytest.raises(RuntimeError, match="cannot read"):
        stage_times("time: import fast\n")
