"""Data-parallel calibration on two GPUs (NCCL): the bytes of one GPU."""

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

RECIPE = """\
name: lightning-importance
kv_cache: fp8
rules:
  - roles: [routed_experts, shared_experts]
    format: nvfp4_w4a16
    scale_rule: 4o6
    importance: true
  - roles: [mamba_in_proj, mamba_out_proj]
    format: fp8
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_write_the_bytes_of_one(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    base = [sys.executable, "-m", "fp4kit.cli", "quantize", "--device", "cuda", "--calib", "9x256", "--batch-size", "2",
            "--recipe", str(recipe), "--no-progress", "--overwrite"]
    one = subprocess.run([*base, "-o", str(tmp_path / "one")], capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([*base, "-o", str(tmp_path / "two"), "--gpus", "2"], capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr
    assert "in each of 2 ranks" in two.stderr
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "two" / "model.safetensors").read_bytes()
