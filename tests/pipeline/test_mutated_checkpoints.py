"""Checkpoints with lying headers: the readers answer with errors, never a crash or a huge allocation."""

import json
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4kit.export.conformance import check_checkpoint
from fp4kit.export.load import load_quantized
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe

from tiny_models import build_nemotron_h


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    base = tmp_path_factory.mktemp("mutate")
    samples = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    qm = quantize(build_nemotron_h(), load_recipe("nemotron-h-w4a16-4o6"), samples, progress=False)
    return export_checkpoint(qm, base / "ckpt", progress=False)


def mutate(src, dst, edit):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(raw)))
    return dst


def header_len(raw):
    return struct.unpack("<Q", raw[:8])[0]


def rewrite_header(raw, change):
    n = header_len(raw)
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    return struct.pack("<Q", len(new)) + new + raw[8 + n :]


def must_be_refused(folder):
    report = check_checkpoint(folder)
    assert not report.ok
    with pytest.raises((ValueError, OSError, RuntimeError)):
        load_quantized(folder)


def test_truncated_file(good, tmp_path):
    must_be_refused(mutate(good, tmp_path / "t", lambda raw: raw[: len(raw) // 2]))


def test_header_claiming_a_huge_size(good, tmp_path):
    must_be_refused(mutate(good, tmp_path / "h", lambda raw: struct.pack("<Q", 2**62) + raw[8:]))


def test_tensor_claiming_a_huge_shape(good, tmp_path):
    def grow(h):
        h["backbone.layers.1.mixer.experts.0.up_proj.weight"]["shape"] = [2**40, 2**20]

    must_be_refused(mutate(good, tmp_path / "s", lambda raw: rewrite_header(raw, grow)))


def test_tensor_with_a_wrong_dtype(good, tmp_path):
    def retype(h):
        h["backbone.layers.1.mixer.experts.0.up_proj.weight_scale"]["dtype"] = "F32"

    must_be_refused(mutate(good, tmp_path / "d", lambda raw: rewrite_header(raw, retype)))


@given(st.integers(0, 10**9), st.integers(0, 255))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_header_byte_never_crashes_the_reader(good, tmp_path, pos, value):
    def flip(raw):
        i = 8 + pos % header_len(raw)
        raw[i] = value
        return raw

    folder = mutate(good, tmp_path / "r", flip)
    report = check_checkpoint(folder)  # a report, whatever the byte did
    assert isinstance(report.ok, bool)
