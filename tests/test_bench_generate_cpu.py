"""scripts/bench_generate_cpu.py: the README's main job into a temporary folder, then the
checkpoint's greedy decode timed on the CPU and recorded with its tokens."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_run_records_its_tokens_and_speed(tmp_path):
    out = tmp_path / "generate-cpu.json"
    subprocess.run([sys.executable, "scripts/bench_generate_cpu.py", "--tokens", "3", "--repeats", "2", "--out", str(out)],
                   cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, text=True,
                   timeout=600)
    doc = json.loads(out.read_text())
    assert {"date", "command", "versions"} <= set(doc) and doc["recipe"] == "nemotron-h-w4a16-4o6"
    assert len(doc["seconds"]) == 2 and len(doc["tokens"]) == 3 and doc["threads"] == 1
    assert doc["median_s"] == statistics.median(doc["seconds"]) and doc["tokens_per_s"] == 3 / doc["median_s"]
