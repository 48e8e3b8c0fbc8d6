"""scripts/bench_vs_modelopt.py: each tool's process environment (`--triton-cache`), and the
projection to 1000 samples from each tool's steady rate."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("bench_vs_modelopt", _ROOT / "scripts" / "bench_vs_modelopt.py")
bench_vs_modelopt = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_vs_modelopt)


def test_a_shared_cache_leaves_the_environment_and_a_fresh_one_is_empty_and_per_process():
    assert bench_vs_modelopt.child_env("shared") is None  # subprocess inherits this process's environment
    first, second = bench_vs_modelopt.child_env("fresh"), bench_vs_modelopt.child_env("fresh")
    assert first["TRITON_CACHE_DIR"] != second["TRITON_CACHE_DIR"]
    for env in (first, second):
        assert os.path.isdir(env["TRITON_CACHE_DIR"]) and not os.listdir(env["TRITON_CACHE_DIR"])
        assert env["PATH"] == os.environ["PATH"]  # everything else as here
    with pytest.raises(ValueError, match="--triton-cache"):
        bench_vs_modelopt.child_env("warm")


def test_the_projection_takes_each_tools_steady_rate():
    result = {"calib": "8x32k",
              "fp4kit": {"wall_s": 50.0, "calibrate_s_per_sample": 0.5, "stages_s": {"calibrate": 30.0}},
              "modelopt": {"wall_s": 130.0, "stages_s": {"calibration_forward_steady_s": 2.0, "calibration_forward_s": 20.0}}}
    p = bench_vs_modelopt.projected(result)
    assert p["rate"] == "steady, after the first sample"
    assert p["fp4kit_s"] == 50.0 + 992 * 0.5 and p["modelopt_s"] == 130.0 + 992 * 2.0
    assert p["speedup"] == p["modelopt_s"] / p["fp4kit_s"]


def test_the_shared_import_path_is_byte_compiled_before_either_tool_runs(tmp_path):
    pkg = tmp_path / "site" / "somepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "mod.py").write_text("Y = 2\n")
    missing = tmp_path / "missing"
    seconds = bench_vs_modelopt.compile_bytecode([str(tmp_path / "site"), str(missing), ""])
    assert seconds >= 0
    compiled = {p.name.split(".")[0] for p in (pkg / "__pycache__").iterdir()}
    assert compiled == {"__init__", "mod"}
    assert not missing.exists()
