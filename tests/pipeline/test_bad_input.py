"""Bad weights and untrusted checkpoints: clear errors naming the problem, nothing executed."""

import pytest
import torch

from fp4kit.quantize import load_model, quantize
from fp4kit.recipe import load_recipe

from tiny_models import build_nemotron_h


def test_nan_in_a_weight_names_the_tensor(token_samples):
    model = build_nemotron_h()
    with torch.no_grad():
        model.model.layers[3].mixer.experts.down_proj[5, 7, 3] = float("nan")
    with pytest.raises(ValueError, match=r"backbone\.layers\.3\.mixer\.experts\.5\.down_proj\.weight \(routed_experts\): 1 NaN and 0 Inf values \(first at \(7, 3\)\)"):
        quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples[:, :8], progress=False)


def test_all_zero_expert_quantizes_to_zero(token_samples):
    model = build_nemotron_h()
    with torch.no_grad():
        model.model.layers[1].mixer.experts.up_proj[2].zero_()
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples[:, :8], progress=False)
    q = qm.quantized["model.layers.1.mixer.experts.up_proj"]
    assert bool((q.tensors["weight"][2] == 0).all())
    assert q.tensors["weight_scale_2"][2].item() == 1.0
    assert bool((q.tensors["weight_scale"][2].float() == 1.0).all())


def test_pickle_checkpoints_are_refused(tmp_path):
    model = build_nemotron_h()
    path = tmp_path / "pickled"
    path.mkdir()
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors|model.safetensors"):
        load_model(str(path), device="cpu", tokenizer=False)
    from fp4kit.quantize import QuantizeJob, validate_job

    with pytest.raises(ValueError, match="only pickle .* --allow-pickle"):
        validate_job(QuantizeJob(model=str(path), output=str(tmp_path / "out"), calib="4x64"))
    validate_job(QuantizeJob(model=str(path), output=str(tmp_path / "out"), calib="4x64", allow_pickle=True))


def test_remote_code_is_not_run_unless_asked(tmp_path):
    model = build_nemotron_h()
    model.save_pretrained(tmp_path / "m")
    import json

    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "ran"
    (tmp_path / "m" / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit\n")
    loaded, _ = load_model(str(tmp_path / "m"), device="cpu", tokenizer=False)
    assert type(loaded).__name__ == "NemotronHForCausalLM"
    assert not marker.exists()


def test_too_little_disk_space_is_refused_before_loading(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from fp4kit.quantize import QuantizeJob, validate_job

    build_nemotron_h().save_pretrained(tmp_path / "m")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OSError, match="100 B free|0.0 GB free"):
        validate_job(QuantizeJob(model=str(tmp_path / "m"), output=str(tmp_path / "out")))


def test_resume_with_different_settings_is_refused(tmp_path):
    from fp4kit.calibrate import Statistics
    from fp4kit.quantize import CalibState

    CalibState(tmp_path / "s", {"calib": "32x512", "seed": 0}).save(Statistics(tokens_seen=64), 2)
    assert CalibState(tmp_path / "s", {"calib": "32x512", "seed": 0}).load()[1] == 2
    with pytest.raises(ValueError, match="different settings"):
        CalibState(tmp_path / "s", {"calib": "32x512", "seed": 1}).load()


def test_a_run_killed_while_it_saves_a_snapshot_resumes_from_the_previous_one(tmp_path, monkeypatch):
    """The statistics and the record naming them are written one after the other; a kill between
    the two must leave the earlier pair, not new statistics under the old sample count (which a
    resumed run would count twice)."""
    import os

    import torch

    from fp4kit.calibrate import Statistics
    from fp4kit.quantize import CalibState

    state = CalibState(tmp_path / "s", {"calib": "32x512"})
    state.save(Statistics(tokens_seen=64, input_amax={"a": torch.tensor([2.0])}), 2)
    real = os.replace

    def killed_at_the_record(src, dst):
        if str(dst).endswith("state.json"):
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_record)
    with pytest.raises(KeyboardInterrupt):
        state.save(Statistics(tokens_seen=128, input_amax={"a": torch.tensor([4.0])}), 4)
    monkeypatch.setattr(os, "replace", real)
    stats, done = CalibState(tmp_path / "s", {"calib": "32x512"}).load()
    assert done == 2 and stats.tokens_seen == 64 and stats.input_amax["a"].tolist() == [2.0]
    state.save(Statistics(tokens_seen=192), 6)  # a completed save leaves one statistics file
    assert sorted(p.name for p in (tmp_path / "s").glob("stats*")) == ["stats-6.safetensors"]


def test_a_damaged_snapshot_is_refused_by_name(tmp_path):
    from fp4kit.calibrate import Statistics
    from fp4kit.quantize import CalibState

    state = CalibState(tmp_path / "s", {"calib": "32x512"})
    state.save(Statistics(tokens_seen=64), 2)
    (tmp_path / "s" / "stats-2.safetensors").write_bytes(b"\x08\x00")
    with pytest.raises(ValueError, match=r"snapshot in .*/s is damaged"):
        state.load()


def test_model_folder_without_config_is_refused(tmp_path):
    from fp4kit.quantize import QuantizeJob, validate_job

    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        validate_job(QuantizeJob(model=str(tmp_path / "m"), output=str(tmp_path / "out")))
