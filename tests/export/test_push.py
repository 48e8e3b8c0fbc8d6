"""`fp4kit push`: a conformant folder is uploaded whole; anything else is refused before any upload."""

import pytest
import torch

from fp4kit.export.modelopt import export_checkpoint
from fp4kit.export.push import push
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe


class FakeHub:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw))
        return type("Commit", (), {"commit_url": f"https://hub.invalid/{kw['repo_id']}/commit/1"})()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))
    from tiny_models import build_nemotron_h  # noqa: E402

    samples = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    qm = quantize(build_nemotron_h(), load_recipe("nemotron-h-w4a16-4o6"), samples, progress=False)
    return export_checkpoint(qm, tmp_path_factory.mktemp("push") / "ckpt", progress=False)


def test_uploads_the_whole_folder(ckpt):
    hub = FakeHub()
    url = push(ckpt, "me/tiny-nvfp4", private=True, api=hub)
    assert url.endswith("/commit/1")
    assert hub.calls[0] == ("create_repo", "me/tiny-nvfp4", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert hub.calls[1][1]["folder_path"] == str(ckpt) and hub.calls[1][1]["repo_id"] == "me/tiny-nvfp4"


def test_refuses_bad_ids_and_nonconformant_folders(ckpt, tmp_path):
    import shutil

    hub = FakeHub()
    with pytest.raises(ValueError, match="owner/name"):
        push(ckpt, "no-owner", api=hub)
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "INT3"}}')
    with pytest.raises(ValueError, match="conformance"):
        push(bad, "me/x", api=hub)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        push(tmp_path, "me/x", api=hub)
    assert hub.calls == []  # nothing reached the hub


def test_push_without_network_is_one_line_and_exit_2(ckpt):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "fp4kit.cli", "push", str(ckpt), "--repo", "me/tiny-nvfp4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: push to me/tiny-nvfp4 failed ("), r.stderr
    assert lines[0].endswith("nothing was uploaded: HF_HUB_OFFLINE is set; unset it to upload"), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("exc, fix", [
    (OSError("[Errno -2] Name or service not known"), "the hub could not be reached"),
    (RuntimeError("401 Client Error: Unauthorized for url"), "hf auth login"),
    (RuntimeError("Invalid user token."), "HF_TOKEN"),
    (ValueError("something else"), "--debug shows the traceback"),
])
def test_a_failed_push_names_what_to_do(exc, fix):
    from fp4kit.cli import _push_fix

    assert _push_fix(exc).startswith("nothing was uploaded") and fix in _push_fix(exc)


def test_checkpoint_files_readable_by_others(ckpt):
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o777 & ~mask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~mask}, modes
