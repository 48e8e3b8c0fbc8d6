"""The code tables and codecs, down to the lines a mutation run showed no other test pinning:
the E4M3 table builder byte by byte, the per-device decode tables, the device and dtype of every
result, and the exact wording of every refusal."""

import math
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4kit.formats import constants, e2m1, e4m3, pack_nibbles, unpack_nibbles
from fp4kit.formats.constants import E2M1_VALUES, E4M3_VALUES

META = torch.device("meta")
CPU = torch.device("cpu")


def bits(v: float) -> bytes:
    return struct.pack("<d", v)


@pytest.fixture
def float64_default():
    """torch's default dtype set to float64 for one test (a caller's global setting)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_the_e4m3_table_builder_decodes_every_byte_like_ml_dtypes():
    # E4M3_VALUES is built once at import; this calls the builder itself for all 256 bytes.
    ml = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    for code in range(256):
        ours, ref = constants._e4m3_value(code), float(ml[code])
        if math.isnan(ref):
            assert math.isnan(ours) and math.copysign(1.0, ours) == math.copysign(1.0, ref), hex(code)
        else:
            assert bits(ours) == bits(ref), hex(code)  # -0.0 by its bits


@pytest.mark.parametrize("codec, values", [(e2m1, E2M1_VALUES), (e4m3, E4M3_VALUES)], ids=["e2m1", "e4m3"])
def test_a_decode_table_is_built_once_per_device_in_fp32(codec, values, monkeypatch, float64_default):
    monkeypatch.setattr(codec, "_TABLES", {})  # a cold cache, whatever ran before
    table = codec._value_table(CPU)
    assert table.dtype == torch.float32 and table.device == CPU
    assert [bits(v) for v in table.double().tolist()] == [bits(float(np.float32(v))) for v in values]
    assert codec._value_table(CPU) is table and codec._TABLES == {CPU: table}
    meta = codec._value_table(META)
    assert meta.device == META and meta.dtype == torch.float32 and meta.shape == (len(values),)
    assert codec._value_table(CPU) is table  # one table per device


def test_decode_returns_fp32_on_the_codes_device(monkeypatch, float64_default):
    monkeypatch.setattr(e2m1, "_TABLES", {})
    monkeypatch.setattr(e4m3, "_TABLES", {})
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1.decode(codes).dtype == torch.float32
    assert e4m3.decode(torch.arange(256, dtype=torch.uint8)).dtype == torch.float32
    out = e4m3.decode(torch.empty(3, 5, dtype=torch.uint8, device=META))
    assert out.device == META and out.dtype == torch.float32 and out.shape == (3, 5)


@pytest.mark.parametrize("codec", [e2m1, e4m3], ids=["e2m1", "e4m3"])
def test_encode_works_where_its_input_lives(codec):
    x = torch.empty(4, 32, dtype=torch.bfloat16, device=META)
    out = codec.encode(x)
    assert out.device == META and out.dtype == torch.uint8 and out.shape == (4, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_to_e4m3_computes_in_float64(dtype):
    x = torch.tensor([0.3, -1e-3, 500.0, 2.0**-10], dtype=dtype)
    assert e4m3.round_to_e4m3(x).dtype == torch.float64


@pytest.mark.parametrize("name, fn, wants", [
    ("e2m1.encode", e2m1.encode, "a floating-point tensor"),
    ("e4m3.encode", e4m3.encode, "a floating-point tensor"),
    ("e2m1.decode", e2m1.decode, "a uint8 tensor"),
    ("e4m3.decode", e4m3.decode, "a uint8 tensor"),
])
def test_codecs_name_what_they_were_given(name, fn, wants):
    wrong_dtype = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError) as err:
        fn(wrong_dtype)
    assert str(err.value) == f"{name}: expected {wants}, got torch.int32"
    with pytest.raises(TypeError) as err:
        fn([1.0])
    assert str(err.value) == f"{name}: expected {wants}, got <class 'list'>"


def test_packing_names_what_it_was_given():
    with pytest.raises(TypeError) as err:
        pack_nibbles(torch.zeros(4, dtype=torch.int32))
    assert str(err.value) == "pack_nibbles: expected uint8 codes, got torch.int32"
    with pytest.raises(TypeError) as err:
        unpack_nibbles(torch.zeros(4, dtype=torch.int32))
    assert str(err.value) == "unpack_nibbles: expected uint8, got torch.int32"
    with pytest.raises(ValueError) as err:
        unpack_nibbles(torch.tensor(7, dtype=torch.uint8))
    assert str(err.value) == "unpack_nibbles: expected at least one dimension"
