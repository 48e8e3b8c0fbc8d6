"""scripts/bench_decode.py end to end on the embedded model (CPU, the static step run eagerly):
every model it compares is timed, the ratios are the tokens/s it reports, and the checkpoint's
tokens are compared with BF16's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tiny_run_writes_every_comparison(tmp_path):
    out = tmp_path / "decode.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "scripts/bench_decode.py", "--device", "cpu", "--tiny", "--no-progress",
                    "--new-tokens", "3", "--batches", "1,2", "--reps", "1", "--step-ops", "fp4kit,transformers",
                    "--sequential-shared", "--layouts", "checkpoint,packed", "--out", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["decode"] == "step" and doc["recipes"] == ["nemotron-h-w4a16-4o6"]
    assert doc["layouts"] == ["checkpoint", "packed"]
    assert [c["layout"] for c in doc["checkpoints"].values()] == ["checkpoint", "packed"]
    assert doc["compile"] is False and doc["inductor_pdl"] is False
    assert doc["weight_memory_bytes"] is None  # allocator bytes exist on CUDA only
    assert {"date", "command", "versions"} <= doc.keys()
    one, two = doc["batches"]["1"], doc["batches"]["2"]
    packed = "nemotron-h-w4a16-4o6_packed-layout"  # the same checkpoint, its NVFP4 linears packed
    labels = ["bf16_step", "bf16_eager", "nemotron-h-w4a16-4o6_step", f"{packed}_step"]
    other = ["bf16_step_transformers-ops", "nemotron-h-w4a16-4o6_step_transformers-ops", f"{packed}_step_transformers-ops"]
    # over BF16 under the first step ops
    labels += ["nemotron-h-w4a16-4o6_step_sequential-shared", f"{packed}_step_sequential-shared"]
    assert doc["step_ops"] == ["fp4kit", "transformers"] and doc["sequential_shared"] is True
    assert sorted(one["speedup_over_bf16_step"]) == sorted(labels + other)
    assert "bf16_eager" not in two["speedup_over_bf16_step"]  # eager only at --eager-batches (1)
    for label in labels:
        # tokens/s and ms per step come from one decode time (timings themselves vary with load).
        assert one[f"tokens_per_s_{label}"] * one[f"ms_per_decode_step_{label}"] / 1e3 == pytest.approx(1)
        assert len(one[f"generate_1_s_{label}"]) == len(one[f"generate_3_s_{label}"]) == 1
        if label != "bf16_eager":  # fp4kit's generate: its decode steps timed alone, within the whole call
            assert 0 < one[f"decode_steps_s_{label}"][0] < one[f"generate_3_s_{label}"][0]
            assert one[f"steps_tokens_per_s_{label}"] == pytest.approx(2 / one[f"decode_steps_s_{label}"][0])
        assert one["speedup_over_bf16_step"][label] == one[f"tokens_per_s_{label}"] / one["tokens_per_s_bf16_step"]
        assert len(one["row0_tokens"][label]) == 3
    assert "steps_tokens_per_s_bf16_eager" not in one
    for label in other:  # over BF16 under the same step ops
        assert one["speedup_over_bf16_step"][label] == (one[f"tokens_per_s_{label}"]
                                                        / one["tokens_per_s_bf16_step_transformers-ops"])
    # Over the same trained model the static step, under either step ops, and transformers'
    # generate give the same tokens.
    assert one["agree_bf16_eager"]["row0_agree_prefix"] == 3
    assert one["agree_bf16_step_transformers-ops"]["row0_agree_prefix"] == 3
    assert one["row0_tokens"]["nemotron-h-w4a16-4o6_step_sequential-shared"] == one["row0_tokens"]["nemotron-h-w4a16-4o6_step"]
    # the emulation computes the same values from either layout
    assert one["row0_tokens"][f"{packed}_step"] == one["row0_tokens"]["nemotron-h-w4a16-4o6_step"]
    assert 0 <= one["agree_nemotron-h-w4a16-4o6_step"]["teacher_forced_agree"] <= 1


def test_an_unknown_layout_is_refused_before_anything_is_built():
    run = subprocess.run([sys.executable, "scripts/bench_decode.py", "--device", "cpu", "--tiny", "--layouts", "packed,tiled"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--layouts takes distinct values of checkpoint, packed" in run.stderr


def test_inductor_pdl_either_way_is_refused_without_compile():
    # Inductor's programmatic dependent launches exist only in a compiled step: asked for without
    # --compile the run stops before building anything, naming the missing flag.
    run = subprocess.run([sys.executable, "scripts/bench_decode.py", "--device", "cpu", "--tiny", "--inductor-pdl"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "add --compile" in run.stderr
    run = subprocess.run([sys.executable, "scripts/bench_decode.py", "--device", "cpu", "--tiny", "--no-inductor-pdl"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "add --compile" in run.stderr
