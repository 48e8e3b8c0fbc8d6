"""`fp4kit quantize --device auto --max-memory CAPS`: accelerate's per-device caps, checked before
anything loads and handed to transformers' placement."""

from __future__ import annotations

import pytest
import torch

from fp4kit import quantize as q


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_caps_per_gpu_and_cpu(two_gpus):
    assert q.parse_max_memory("0=40GiB, 1=38.5GB,cpu=200GiB") == {0: "40GiB", 1: "38.5GB", "cpu": "200GiB"}
    assert q.parse_max_memory("cpu=1000000") == {"cpu": 1000000}


@pytest.mark.parametrize("text, device, words", [
    ("cpu=4GiB", "cpu", "does not apply to --device cpu"),
    ("cpu=4GiB", "cuda", "does not apply to --device cuda"),
    ("cpu:4GiB", "auto", "'cpu:4GiB' is not DEVICE=SIZE"),
    ("cpu=", "auto", "'cpu=' is not DEVICE=SIZE"),
    ("cpu=lots", "auto", "'lots' (for cpu) is not a size"),
    ("cpu=4GiBs", "auto", "'4GiBs' (for cpu) is not a size"),
    ("disk=4GiB", "auto", "'disk' is not a GPU index or cpu"),
    ("2=4GiB", "auto", "GPU 2 does not exist here (2 CUDA device(s))"),
    ("0=4GiB,0=5GiB", "auto", "0 is given twice"),
])
def test_bad_caps_are_named(two_gpus, text, device, words):
    with pytest.raises(ValueError) as err:
        q.parse_max_memory(text, device)
    assert words in str(err.value)


def test_the_job_is_refused_before_loading(tmp_path):
    job = q.QuantizeJob(device="cpu", max_memory="cpu=4GiB", output=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="does not apply to --device cpu"):
        q.validate_job(job)


def test_the_caps_reach_from_pretrained(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.update({k: dict(v) if isinstance(v, dict) else v for k, v in kwargs.items()})  # as given (placement edits it)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    lines = []
    job = q.QuantizeJob(device="auto", max_memory="cpu=2GiB", calib="2x64", output=str(tmp_path / "out"), progress=False)
    q.run(job, log=lines.append)
    assert seen["device_map"] == "auto" and seen["max_memory"] == {"cpu": "2GiB"}
    assert "placed over cpu (--max-memory cpu=2GiB)" in lines
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_model_that_accelerate_offloads_quantizes_and_exports_as_one_in_memory(tmp_path, token_samples):
    """`--device auto` beside a GPU offloads the modules placed on "cpu": their parameters sit on the
    meta device and accelerate's hooks hold the values. The weights are read from those hooks."""
    from accelerate import cpu_offload
    from safetensors.torch import load_file
    from tiny_models import build_nemotron_h

    from fp4kit.export.modelopt import export_checkpoint
    from fp4kit.recipe import load_recipe

    recipe = load_recipe(q.DEFAULT_RECIPE)
    plain = export_checkpoint(q.quantize(build_nemotron_h(), recipe, token_samples, progress=False), tmp_path / "plain",
                              progress=False)
    model = cpu_offload(build_nemotron_h(), execution_device=torch.device("cpu"))
    assert any(p.device.type == "meta" for p in model.parameters())
    offloaded = export_checkpoint(q.quantize(model, recipe, token_samples, progress=False), tmp_path / "offloaded",
                                  progress=False)
    want, got = load_file(plain / "model.safetensors"), load_file(offloaded / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)) for k in want)
