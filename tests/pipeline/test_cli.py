"""`fp4kit quantize` end to end: bad input fails before loading, kill + --resume is byte-identical."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import build_nemotron_h

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "fp4kit", "data", "tiny-nemotron-h")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(TOKENIZER, "tokenizer.json")):
        pytest.skip("the bundled tokenizer is not present")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    path = tmp_path_factory.mktemp("model") / "rand-nemotron-h"
    build_nemotron_h(vocab_size=((len(tok) + 15) // 16) * 16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def fp4kit(*args, **kw):
    return subprocess.run([sys.executable, "-m", "fp4kit.cli", *args], capture_output=True, text=True, **kw)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calib", "0x32k"], "0x32k"),
        (["--calib", "1000x32q"], "1000x32q"),
        (["--recipe", "no-such-recipe"], "unknown recipe 'no-such-recipe'"),
        (["--model", "./no/such/folder"], "no such folder"),
        (["--batch-size", "0"], "--batch-size must be a whole number >= 1 or 'auto', got 0"),
    ],
)
def test_bad_input_fails_fast_with_a_clear_message(args, message, tmp_path):
    t0 = time.perf_counter()
    r = fp4kit("quantize", "-o", str(tmp_path / "out"), *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert not (tmp_path / "out").exists()
    assert "loading" not in r.stderr  # refused before any weight was read
    assert time.perf_counter() - t0 < 60


def test_existing_output_is_refused(tmp_path, model_dir):
    (tmp_path / "out").mkdir()
    r = fp4kit("quantize", "--model", str(model_dir), "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "--overwrite" in r.stderr


@pytest.mark.slow
def test_kill_mid_calibration_then_resume_is_byte_identical(tmp_path, model_dir):
    common = ["quantize", "--model", str(model_dir), "--calib", "96x128", "--checkpoint-every", "2", "--no-progress"]
    ref = fp4kit(*common, "-o", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "out"
    state = tmp_path / ".out.calib-state" / "state.json"
    proc = subprocess.Popen([sys.executable, "-m", "fp4kit.cli", *common, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # the moment the first snapshot lands: mid-calibration
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert state.exists() and not out.exists()
    assert not any(p.name.startswith(".out.partial") and (p / "config.json").exists() for p in tmp_path.iterdir())

    resumed = fp4kit(*common, "-o", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed calibration after" in resumed.stdout
    a, b = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    assert not state.parent.exists()  # the snapshot is removed once the checkpoint is written
