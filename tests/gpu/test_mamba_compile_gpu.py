"""mamba-ssm's kernels compiled by worker processes (fp4kit.models.mamba_compile) leave the
calibration's first forward nothing to compile, on an empty Triton cache. Runs where mamba-ssm
and causal-conv1d are installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fp4kit.models.nemotron_h import mamba_kernels

pytestmark = pytest.mark.skipif(None in mamba_kernels().values(), reason="needs mamba-ssm and causal-conv1d")

# In a process of its own, so that TRITON_CACHE_DIR is empty when Triton first reads it.
SCRIPT = textwrap.dedent("""
    import json, pathlib, sys, time
    from fp4kit.models import mamba_compile as mc

    folder, cache, seq_len, workers = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    compiled = lambda: len(list(cache.rglob("*.cubin")))
    out = {}
    if workers:
        with mc.MambaPrecompile(folder, "cuda:0", seq_len, 1, workers=workers).start() as pre:
            out["wait_s"] = pre.wait()
            out["failures"] = pre.failures()
    out["before"] = compiled()
    out["compiled_before"] = mc.compiled_before(cache)
    mixer = mc.mixer_for(folder, "cuda:0")
    t0 = time.perf_counter()
    mc.run_mixer(mixer, 1, seq_len)
    out["first_forward_s"] = time.perf_counter() - t0
    out["after"] = compiled()
    out["compiled_after"] = mc.compiled_before(cache)
    mc.run_mixer(mixer, 2, seq_len)  # two rows: a variant the workers did not compile
    out["after_two_rows"] = compiled()
    print(json.dumps(out))
""")


def _run(tmp_path, name, seq_len, workers):
    from transformers import NemotronHConfig

    from fp4kit.models.nemotron_h import NANO_WIDTHS

    folder = tmp_path / "model"
    if not folder.exists():
        NemotronHConfig(**NANO_WIDTHS, layers_block_type=["mamba", "moe"]).save_pretrained(folder)
    cache = tmp_path / name
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(cache), str(seq_len), str(workers)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_workers_leave_the_first_forward_nothing_to_compile(tmp_path):
    seq_len = 8192 + 128 * 3 + 5  # compiled at a shorter length with the same variants
    with_workers = _run(tmp_path, "with", seq_len, workers=4)
    print("with workers", with_workers)
    assert with_workers["failures"] == []
    assert with_workers["before"] >= 5, "each kernel of the chunked scan compiled by some worker"
    assert with_workers["after"] == with_workers["before"], "the first forward compiled nothing"
    assert with_workers["after_two_rows"] > with_workers["after"], "a new variant does compile (the count sees it)"
    assert with_workers["compiled_before"], "a later job on this cache starts no workers"
    alone = _run(tmp_path, "alone", seq_len, workers=0)
    print("alone", alone)
    assert alone["before"] == 0 and alone["after"] >= with_workers["before"]
    assert not alone["compiled_before"] and alone["compiled_after"]
    assert with_workers["first_forward_s"] < alone["first_forward_s"]
