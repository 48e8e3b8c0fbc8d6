"""Compiling mamba-ssm's kernels in worker processes while a Nemotron-H model loads
(fp4kit.models.mamba_compile): which lengths compile the same variants, how the configurations
are shared, when the workers start, and how the job waits for them."""

from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest

from fp4kit.models import mamba_compile as mc
from fp4kit.models.tiny import tiny_model_path
from fp4kit.quantize import QuantizeJob, run


def _variant(n: int) -> tuple[bool, bool]:
    """What Triton specialises an int argument on."""
    return n == 1, n % 16 == 0


@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_the_compile_length_launches_the_same_variants_as_the_sample_length(chunk):
    for seq_len in [*range(2, 5000), *range(5000, 140000, 97), 32768, 65536, 131072]:
        short = mc.compile_length(seq_len, chunk)
        assert 2 <= short <= min(seq_len, 2 * 16 * chunk)
        for scale in (1, 3, 16, 4096 + 2 * 8 * 128 + 64):  # the length and strides that carry it as a factor
            assert _variant(short * scale) == _variant(seq_len * scale), (seq_len, short, scale)
        assert _variant(math.ceil(short / chunk)) == _variant(math.ceil(seq_len / chunk)), (seq_len, short)
        assert short % chunk == seq_len % chunk  # the last, partial chunk too
    assert mc.compile_length(32768, 128) == 2048


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("parts", range(1, 10))
def test_every_configuration_is_compiled_by_some_worker_and_each_worker_runs_the_mixer(n, parts):
    configs = [f"c{i}" for i in range(n)]
    shares = [mc.share(configs, part, parts) for part in range(parts)]
    assert all(shares), "a worker with no configuration cannot launch the kernel"
    assert sorted({c for s in shares for c in s}) == sorted(configs)
    if n >= parts:
        assert sum(len(s) for s in shares) == n, "no configuration compiled twice"
        assert max(len(s) for s in shares) == math.ceil(n / parts)


def _nemotron_folder(tmp_path, **changes):
    config = json.loads((tiny_model_path() / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.fixture
def kernels_here(monkeypatch, tmp_path):
    """As on a GPU machine with mamba-ssm, causal-conv1d and triton installed, and an empty
    Triton cache."""
    import importlib.util

    import torch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace(name=name)
                        if name in ("mamba_ssm", "causal_conv1d", "triton") else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_it_starts_for_a_nemotron_h_on_a_gpu_with_the_kernels_installed(tmp_path, kernels_here):
    folder = _nemotron_folder(tmp_path)
    assert mc.wanted(folder, "cuda", 32768)
    assert mc.wanted(folder, "cuda:1", 32768)
    assert not mc.wanted(folder, "auto", 32768), "accelerate places the model by the free memory the workers would take"
    assert not mc.wanted(folder, "cpu", 32768)
    assert not mc.wanted(folder, "cuda", 1), "one token runs the recurrent step, not the chunked scan"
    assert not mc.wanted(str(tmp_path / "absent"), "cuda", 32768)


def test_it_does_not_start_for_other_models_or_remote_code(tmp_path, kernels_here):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert not mc.wanted(_nemotron_folder(tmp_path / "a", model_type="llama"), "cuda", 4096)
    remote = _nemotron_folder(tmp_path / "b", auto_map={"AutoModelForCausalLM": "modeling_x.Model"})
    assert not mc.wanted(remote, "cuda", 4096, trust_remote_code=True)
    assert mc.wanted(remote, "cuda", 4096), "without trust_remote_code transformers runs its own mixer"


def test_it_does_not_start_without_the_kernels(tmp_path, monkeypatch, kernels_here):
    import importlib.util

    folder = _nemotron_folder(tmp_path)
    patched = importlib.util.find_spec
    for missing in ("mamba_ssm", "causal_conv1d", "triton"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, m=missing: None if name == m else patched(name, *a))
        assert not mc.wanted(folder, "cuda", 4096), missing
    monkeypatch.setattr(importlib.util, "find_spec", patched)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not mc.wanted(folder, "cuda", 4096)


class _Scripted(mc.MambaPrecompile):
    """Workers that run a given script each instead of compiling."""

    scripts: tuple = ()

    def command(self, part):
        return [sys.executable, "-c", self.scripts[part]]


def test_the_job_waits_for_the_workers_and_names_the_ones_that_failed():
    pre = _Scripted("m", "cuda", 4096, workers=3)
    pre.scripts = ("import time; time.sleep(0.5)",
                   "import sys; print('warming up', file=sys.stderr); sys.exit('boom: no GPU 7')",
                   "pass")
    with pre.start():
        waited = pre.wait(timeout=60)
        assert 0.4 < waited < 30
        assert [p.returncode for p in pre.procs] == [0, 1, 0]
        assert pre.failures() == ["worker 1 exited 1: boom: no GPU 7"]
    assert pre.seconds >= waited


def test_a_worker_past_the_timeout_is_stopped():
    pre = _Scripted("m", "cuda", 4096, workers=2)
    pre.scripts = ("import time; time.sleep(600)", "pass")
    with pre.start():
        waited = pre.wait(timeout=0.5)
        assert waited < 20
        assert pre.procs[0].returncode is not None and pre.procs[0].returncode != 0
    assert all(p.poll() is not None for p in pre.procs)


def test_the_worker_command_names_its_share_of_the_job():
    pre = mc.MambaPrecompile("/models/nano", "cuda:1", 32768, batch=4, workers=6)
    argv = pre.command(2)
    assert argv[:3] == [sys.executable, "-m", "fp4kit.models.mamba_compile"]
    args = dict(zip(argv[3::2], argv[4::2]))
    assert args == {"--model": "/models/nano", "--device": "cuda:1", "--seq-len": "32768", "--batch": "4",
                    "--part": "2", "--parts": "6"}


def test_the_quantize_job_starts_the_workers_before_loading_and_waits_before_calibrating(tmp_path, monkeypatch):
    events = []

    class Recorded(_Scripted):
        def start(self):
            events.append(("start", self.seq_len, self.batch))
            self.scripts = ("pass",) * self.workers
            return super().start()

        def wait(self, timeout=300.0):
            events.append(("wait",))
            return super().wait(timeout)

    import fp4kit.quantize as q

    monkeypatch.setattr(mc, "wanted", lambda *a, **k: True)
    monkeypatch.setattr(mc, "MambaPrecompile", Recorded)
    real_load, real_quantize = q.load_model, q.quantize
    monkeypatch.setattr(q, "load_model", lambda *a, **k: (events.append(("load",)), real_load(*a, **k))[1])
    monkeypatch.setattr(q, "quantize", lambda *a, **k: (events.append(("calibrate",)), real_quantize(*a, **k))[1])
    lines = []
    qm, _ = run(QuantizeJob(calib="2x64", batch_size=2, output=str(tmp_path / "out"), progress=False), log=lines.append)
    assert [e[0] for e in events] == ["start", "load", "wait", "calibrate"]
    assert events[0][1:] == (64, 2)
    assert any("compiling mamba-ssm's kernels for 64-token samples" in line for line in lines)
    assert {"mamba compile beside load", "mamba compile wait"} <= set(qm.timings)


GB = 10**9


def test_the_workers_take_only_the_gpu_memory_the_model_leaves():
    gib = mc.WORKER_GPU_BYTES
    assert mc.workers_that_fit(141 * GB, 31 * GB, 8) == 8  # the half model on an H200
    assert mc.workers_that_fit(141 * GB, 63 * GB, 8) == 8  # the full model
    # the full model on an 80 GB GPU: 80 - 63 - 6.3 GB leaves room for 9 workers of 1 GiB, 8 wanted
    assert mc.workers_that_fit(80 * GB, 63 * GB, 8) == 8
    assert mc.workers_that_fit(int(63 * 1.1 * GB) + 3 * gib + gib // 2, 63 * GB, 8) == 3
    assert mc.workers_that_fit(int(63 * 1.1 * GB) + gib - 1, 63 * GB, 8) == 0
    assert mc.workers_that_fit(40 * GB, 63 * GB, 8) == 0
    assert mc.workers_that_fit(1, None, 5) == 5  # a hub id: nothing to weigh


def test_the_model_bytes_are_its_weight_files(tmp_path):
    assert mc.weight_bytes(str(tmp_path)) is None
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "config.json").write_text("{}")
    assert mc.weight_bytes(str(tmp_path)) == 500
    assert mc.weight_bytes(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("room", [0, 3])
def test_the_quantize_job_starts_as_many_workers_as_the_gpu_has_room_for(tmp_path, monkeypatch, room):
    started = []

    class Recorded(_Scripted):
        def start(self):
            started.append(self.workers)
            self.scripts = ("pass",) * self.workers
            return super().start()

    monkeypatch.setattr(mc, "wanted", lambda *a, **k: True)
    monkeypatch.setattr(mc, "workers_for", lambda model_ref, device: (room, 70 * GB, 63 * GB))
    monkeypatch.setattr(mc, "MambaPrecompile", Recorded)
    lines = []
    qm, _ = run(QuantizeJob(calib="2x64", output=str(tmp_path / "out"), progress=False), log=lines.append)
    assert started == ([room] if room else [])
    assert ("mamba compile wait" in qm.timings) == bool(room)
    if not room:
        assert any("not compiling mamba-ssm's kernels ahead: 70.0 GB free on cpu leaves no room beside the 63.0 GB model"
                   in line for line in lines), lines


def _compiled(cache, counts):
    """Triton's layout: a folder per compiled binary, named by its hash, holding <kernel>.cubin."""
    for name, n in counts.items():
        for _ in range(n):
            entry = cache / os.urandom(8).hex()
            entry.mkdir(parents=True)
            (entry / f"{name}.cubin").write_bytes(b"")
            (entry / f"{name}.json").write_text("{}")


def test_a_cache_holding_every_configuration_compiled_is_not_compiled_again(tmp_path, kernels_here):
    folder = _nemotron_folder(tmp_path)
    cache = mc.triton_cache_dir()
    assert cache == tmp_path / "triton-cache"
    assert mc.wanted(folder, "cuda", 32768)
    _compiled(cache, {**mc.SCAN_KERNELS, "_chunk_scan_fwd_kernel": mc.SCAN_KERNELS["_chunk_scan_fwd_kernel"] - 1,
                      "_other_kernel": 50})
    assert not mc.compiled_before(cache), "one configuration of one kernel short"
    assert mc.wanted(folder, "cuda", 32768)
    _compiled(cache, {"_chunk_scan_fwd_kernel": 1})
    assert mc.compiled_before(cache)
    assert not mc.wanted(folder, "cuda", 32768)
    assert sum(mc.SCAN_KERNELS.values()) == 42  # mamba-ssm 2.3's configurations, as tests/gpu counts them
