"""Data-parallel calibration on two GPUs (NCCL): the bytes of one GPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "pipeline" / "tiny_models.py")
tiny_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_models)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_write_the_bytes_of_one(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(tiny_models.IMPORTANCE_RECIPE)
    base = [sys.executable, "-m", "fp4kit.cli", "quantize", "--device", "cuda", "--calib", "9x256", "--batch-size", "2",
            "--recipe", str(recipe), "--no-progress", "--overwrite"]
    one = subprocess.run([*base, "-o", str(tmp_path / "one")], capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([*base, "-o", str(tmp_path / "two"), "--gpus", "2"], capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr
    assert "in each of 2 ranks" in two.stderr
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "two" / "model.safetensors").read_bytes()
