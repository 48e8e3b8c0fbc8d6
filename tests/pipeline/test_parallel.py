"""Data-parallel calibration under torchrun (gloo on the CPU): the same checkpoint bytes from 1, 2
and 3 ranks as from one process, a rank that dies ends the run, and a killed run resumes per rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp4kit import cli
from fp4kit.parallel import batch_layout, shard
from fp4kit.quantize import calib_state_dir
from tiny_models import IMPORTANCE_RECIPE

# 7 samples in batches of 2: four batches, the last one short; 3 ranks get 2, 1 and 1 of them.
ARGS = ["quantize", "--calib", "7x96", "--batch-size", "2", "--no-progress", "--overwrite"]


def _env() -> dict:
    # torchrun gives each rank one thread; a CPU reduction may split differently on another
    # number of threads, so the one-process run gets one too.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def _torchrun(ranks: int, argv: list[str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "fp4kit.cli", *argv]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "lightning-importance.yaml"
    path.write_text(IMPORTANCE_RECIPE)
    return path


@pytest.fixture(scope="module")
def one_process(recipe, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("one") / "ckpt"
    done = subprocess.run([sys.executable, "-m", "fp4kit.cli", *ARGS, "--recipe", str(recipe), "-o", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return (out / "model.safetensors").read_bytes()


def test_batches_are_laid_out_as_one_process_does_and_dealt_by_index():
    assert batch_layout(7, 2, False) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert batch_layout(7, 3, True) == [(0, 1), (1, 4), (4, 7)]
    assert batch_layout(0, 2, True) == []
    layout = batch_layout(7, 2, False)
    assert [shard(layout, r, 3) for r in range(3)] == [[(0, 2), (6, 7)], [(2, 4)], [(4, 6)]]
    assert shard(layout, 3, 5) == [(6, 7)] and shard(layout, 4, 5) == []


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_any_number_of_ranks_writes_the_same_bytes(ranks, recipe, one_process, tmp_path):
    out = tmp_path / "ckpt"
    proc = _torchrun(ranks, [*ARGS, "--recipe", str(recipe), "-o", str(out)])
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert (out / "model.safetensors").read_bytes() == one_process
    assert stdout.count("wrote ") == 1  # rank 0 reports, the others are quiet
    if ranks > 1:
        assert f"in each of {ranks} ranks" in stderr
    assert not calib_state_dir(out).exists()


GROUP_AFTER_FINISH = """
import gc, os
from fp4kit import parallel

parallel.init("cpu")
import transformers.modeling_utils  # noqa: E402,F401  (what loading a model imports, after the group exists)

parallel.finish()
gc.collect()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("rank", os.environ["RANK"], "gloo threads", sorted(t for t in threads if "gloo" in t))
"""


def test_the_process_group_is_gone_after_finish_though_the_model_code_was_imported_after_it(tmp_path):
    """torch modules that take group.WORLD as a default argument, imported once the group exists,
    keep it alive past destroy_process_group; gloo's threads then run on into the interpreter's
    teardown, where they can abort a rank that has done its work (and torchrun stops the rest)."""
    script = tmp_path / "group.py"
    script.write_text(GROUP_AFTER_FINISH)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 gloo threads []", "rank 1 gloo threads []"], done.stdout


def _workers(parent: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(proc.name)
    return out


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _kill_all(proc: subprocess.Popen) -> None:
    """torchrun and its ranks at once, as a machine that loses power (the ranks run in sessions of
    their own)."""
    for pid in [*_workers(proc.pid).values(), proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)


LONG = ["quantize", "--calib", "64x96", "--checkpoint-every", "1", "--no-progress", "--overwrite"]


def test_a_rank_that_dies_ends_the_run_and_is_named(tmp_path):
    out = tmp_path / "ckpt"
    proc = _torchrun(2, [*LONG, "-o", str(out)])
    _wait_for(calib_state_dir(out) / "rank-1-of-2" / "state.json", proc)
    os.kill(_workers(proc.pid)[1], signal.SIGKILL)
    t0 = time.time()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - t0 < 60  # not the collective's 30-minute timeout
    assert "rank      : 1" in stderr and "Signal 9 (SIGKILL)" in stderr
    assert not out.exists()


def test_a_killed_run_resumes_each_rank_from_its_snapshot(recipe, one_process, tmp_path):
    out = tmp_path / "ckpt"
    argv = [*ARGS, "--recipe", str(recipe), "-o", str(out), "--checkpoint-every", "1"]
    proc = _torchrun(2, argv)
    state = calib_state_dir(out)
    deadline = time.time() + 300
    while not list(state.glob("rank-*-of-2/state.json")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
        time.sleep(0.01)
    _kill_all(proc)
    assert not out.exists() and list(state.glob("rank-*-of-2/state.json"))
    again = _torchrun(2, [*argv, "--resume"])
    _, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    assert (out / "model.safetensors").read_bytes() == one_process
    assert not state.exists()


def test_snapshots_of_another_number_of_ranks_are_refused(recipe, tmp_path):
    out = tmp_path / "ckpt"
    argv = [*ARGS, "--recipe", str(recipe), "-o", str(out), "--checkpoint-every", "1"]
    proc = _torchrun(2, argv)
    state = calib_state_dir(out)
    _wait_for(state / "rank-1-of-2" / "state.json", proc)
    _kill_all(proc)
    again = _torchrun(3, [*argv, "--resume"])
    _, stderr = again.communicate(timeout=600)
    assert again.returncode != 0
    assert "--resume: no calibration snapshot of a 3-rank run" in stderr


def test_gpus_is_refused_where_it_cannot_run(capsys, monkeypatch):
    assert cli.main(["quantize", "--gpus", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == "error: --gpus 2 runs one rank per GPU with --device cuda, got --device cpu"
    assert cli.main(["quantize", "--gpus", "0", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == "error: --gpus must be at least 1, got 0"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["quantize", "--gpus", "2", "--no-progress"]) == 2
    assert "under torchrun, leave it out" in capsys.readouterr().err


def test_ctrl_c_counts_the_samples_in_every_ranks_snapshot(tmp_path, capsys, monkeypatch):
    import shlex

    from fp4kit import quantize as q
    from fp4kit.calibrate import Statistics

    out = tmp_path / "ckpt"
    base = q.CalibState(calib_state_dir(out), {})
    base.for_rank(0, 2).save(Statistics(), 4, batch_size=2)
    base.for_rank(1, 2).save(Statistics(), 2, batch_size=2)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(q, "run", interrupted)
    argv = ["quantize", "--calib", "7x96", "-o", str(out), "--no-progress"]
    assert cli.main(argv) == 130
    resume = f"{cli._prog()} {shlex.join([*argv, '--resume'])}"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: interrupted; the calibration snapshot holds 6 of 7 samples; continue with: {resume}")


def test_a_job_on_one_named_gpu_makes_it_the_current_one(monkeypatch):
    """Triton launches on the current GPU, as CUDA graphs and events do: `--device cuda:1` in one
    process makes cuda:1 current; other devices leave the current GPU alone."""
    import torch

    from fp4kit import parallel
    from fp4kit.kernels.backend import make_current

    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(str(d)))
    for device in ("cpu", "cuda", "auto", torch.device("cpu"), torch.device("cuda")):
        make_current(device)
    assert made == []
    make_current("cuda:1")
    make_current(torch.device("cuda", 2))
    assert made == ["cuda:1", "cuda:2"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.init("cuda:3") == "cuda:3" and made[-1] == "cuda:3"
