"""scripts/profile_quantize.py: a profile's CUDA events are summed per kernel name; host events
are left out."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
_spec = importlib.util.spec_from_file_location("profile_quantize", ROOT / "scripts" / "profile_quantize.py")
profile_quantize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_quantize)

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def test_cuda_events_are_summed_per_kernel():
    events = [SimpleNamespace(name="_stack_kernel", device_type=CUDA, device_time_total=1200.0),
              SimpleNamespace(name="_stack_kernel", device_type=CUDA, device_time_total=800.0),
              SimpleNamespace(name="_fp8_kernel", device_type=CUDA, device_time_total=40.0),
              SimpleNamespace(name="aten::empty", device_type=CPU, device_time_total=0.0)]
    assert profile_quantize.kernel_table(events) == {"_stack_kernel": {"us": 2000.0, "count": 2},
                                                     "_fp8_kernel": {"us": 40.0, "count": 1}}
