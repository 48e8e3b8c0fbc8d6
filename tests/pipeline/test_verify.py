"""`fp4kit verify`: a good checkpoint passes; one flipped byte fails and names the tensor."""

import json
import shutil
import struct

import pytest

from fp4kit.export.modelopt import export_checkpoint
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe
from fp4kit.verify import tensor_parallel, verify

from tiny_models import build_nemotron_h


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    import torch

    from fp4kit.quantize import load_model

    base = tmp_path_factory.mktemp("verify")
    build_nemotron_h().save_pretrained(base / "source")
    model, _ = load_model(str(base / "source"), device="cpu", tokenizer=False)  # as `fp4kit quantize` loads it
    samples = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    # ModelOpt's CPU arithmetic, so that `--against modelopt` can run ModelOpt here on the CPU
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), samples, progress=False, arith="cpu")
    export_checkpoint(qm, base / "ckpt", progress=False)
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), samples, progress=False, arith="cuda")
    export_checkpoint(qm, base / "ckpt-cuda-arith", progress=False)
    return base


def flip_byte(path, tensor, index=0, value=None):
    """Change one byte of `tensor` inside a safetensors file (XOR 0x01, or set `value`)."""
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    start = 8 + n + header[tensor]["data_offsets"][0] + index
    raw[start] = value if value is not None else raw[start] ^ 0x01
    path.write_bytes(bytes(raw))


def copy(made, name):
    dst = made / name
    shutil.copytree(made / "ckpt", dst)
    return dst


def test_a_good_checkpoint_passes_every_check(made):
    report = verify(made / "ckpt", source=str(made / "source"), against="modelopt")
    assert report.ok, report.text()
    names = {c.name for c in report.checks}
    assert names == {"conformance", "rederive", "modelopt"}
    assert sum(c.name == "rederive" for c in report.checks) > 100


def test_cuda_arithmetic_rederives_and_asks_for_cuda_to_compare_with_modelopt(made):
    report = verify(made / "ckpt-cuda-arith", source=str(made / "source"))
    assert report.ok, report.text()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ModelOpt must run on a CUDA device"):
            verify(made / "ckpt-cuda-arith", source=str(made / "source"), against="modelopt")


def test_nan_block_scale_fails_conformance_naming_the_tensor(made):
    ckpt = copy(made, "nan-scale")
    name = "backbone.layers.1.mixer.experts.3.up_proj.weight_scale"
    flip_byte(ckpt / "model.safetensors", name, index=5, value=0x7F)
    report = verify(ckpt)
    assert not report.ok
    assert any(not c.ok and c.tensor and name in c.tensor for c in report.checks), report.text()


@pytest.mark.parametrize(
    "name",
    [
        "backbone.layers.1.mixer.experts.3.up_proj.weight_scale",
        "backbone.layers.3.mixer.shared_experts.down_proj.weight",
        "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.2.mixer.q_proj.weight",
    ],
)
def test_one_flipped_byte_fails_rederivation_naming_the_tensor(made, name):
    ckpt = copy(made, "flip-" + name.replace(".", "-"))
    flip_byte(ckpt / "model.safetensors", name, index=3)
    report = verify(ckpt, source=str(made / "source"))
    bad = [c for c in report.checks if not c.ok]
    assert [c.tensor for c in bad] == [name], report.text()
    assert "1 of" in bad[0].detail


def test_tensor_parallel_report(made):
    ok = tensor_parallel(made / "ckpt", 2, ep=True)
    assert ok["ok"] is False and any("shared_experts.down_proj" in p for p in ok["problems"])  # K=48 -> 24 per rank
    one = tensor_parallel(made / "ckpt", 1)
    assert one["ok"] is True


def test_cli_exit_status_and_json(made, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "fp4kit.cli", "verify", str(made / "ckpt"), "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(out.read_text())["ok"] is True
    bad = copy(made, "cli-bad")
    flip_byte(bad / "model.safetensors", "backbone.layers.0.mixer.in_proj.weight_scale", index=3, value=0xFF)
    r = subprocess.run([sys.executable, "-m", "fp4kit.cli", "verify", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "in_proj.weight_scale" in r.stdout
