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


def _busy(n):
    # the work in this frame's own loop, so that cProfile books it to `_busy` (a generator under
    # `sum` splits it between the two and the builtin, in proportions that vary from run to run)
    total = 0
    for i in range(n):
        total += i * i
    return total


def test_host_functions_rank_the_stages_python_by_own_time(monkeypatch):
    monkeypatch.setattr(profile_quantize, "stage", lambda qm: [_busy(200_000) for _ in range(3)])
    rows = profile_quantize.host_functions(None, top=5)
    assert rows[0]["function"].endswith("_busy") or rows[0]["function"].endswith("<genexpr>")
    busy = next(r for r in rows if r["function"].endswith("_busy"))
    assert busy["calls"] == 3 and busy["cum_us"] >= busy["own_us"] > 0
    assert "tests/test_profile_quantize.py:" in busy["function"]
    assert [r["own_us"] for r in rows] == sorted((r["own_us"] for r in rows), reverse=True)
