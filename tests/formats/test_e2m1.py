"""E2M1: exhaustive code table, every midpoint +-1 ulp, sign of zero, NaN, random sweeps."""

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4kit.formats import e2m1
from fp4kit.formats.constants import E2M1_MAGNITUDES, E2M1_MIDPOINTS, E2M1_VALUES

F4 = ml_dtypes.float4_e2m1fn
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bits32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).view(torch.int32)


def ml_encode(x: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' E2M1 cast of finite values, with ModelOpt's sign rule for -0.0.

    ml_dtypes keeps the sign bit of -0.0 (0x8); ModelOpt takes the sign from `x < 0`, so -0.0
    is 0x0. Its NaN policy differs too (see test_nan_policy_is_modelopt_export).
    """
    codes = torch.from_numpy(x.to(torch.float32).numpy().astype(F4).view(np.uint8).copy())
    return torch.where(x == 0, torch.zeros_like(codes), codes)


def test_table_matches_ml_dtypes_by_bits():
    ml_values = np.arange(16, dtype=np.uint8).view(F4).astype(np.float32)
    ours = e2m1.decode(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(bits32(ours), torch.from_numpy(ml_values).view(torch.int32))
    assert tuple(ours.tolist()) == E2M1_VALUES


def test_torch_float4_decode_if_supported():
    packed = torch.arange(0, 256, dtype=torch.uint8)
    try:
        values = packed.view(torch.float4_e2m1fn_x2).to(torch.float32)
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"this torch cannot convert float4_e2m1fn_x2: {exc}")
    lo, hi = e2m1.decode(packed & 0xF), e2m1.decode(packed >> 4)
    assert torch.equal(values.flatten(), torch.stack((lo, hi), -1).flatten())


def test_packed_decode_is_the_nibbles_decoded_for_every_byte():
    from fp4kit.formats.pack import unpack_nibbles

    packed = torch.arange(256, dtype=torch.uint8).reshape(2, 4, 32)  # leading dims kept, K/2 -> K
    got = e2m1.decode_packed(packed)
    assert got.shape == (2, 4, 64) and got.dtype == torch.float32
    assert torch.equal(bits32(got), bits32(e2m1.decode(unpack_nibbles(packed))))  # -0.0 from 0x8 included
    for bad in (packed.to(torch.int32), torch.tensor(7, dtype=torch.uint8)):
        with pytest.raises(TypeError, match="decode_packed"):
            e2m1.decode_packed(bad)


def test_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    back = e2m1.encode(e2m1.decode(codes))
    expected = codes.clone()
    expected[8] = 0  # -0.0 is not < 0, so it encodes as +0 (ModelOpt's sign rule)
    assert torch.equal(back, expected)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_midpoints_and_neighbours(dtype):
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=dtype)
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    x = torch.cat([mids, up, down])
    x = torch.cat([x, -x])
    got = e2m1.encode(x)
    assert torch.equal(got, ml_encode(x))
    # Spelled out: ties go to the even mantissa, everything else to the nearest value.
    tie_index = torch.tensor([0, 2, 2, 4, 4, 6, 6], dtype=torch.uint8)
    assert torch.equal(got[:7], tie_index)
    assert torch.equal(got[7:14], torch.arange(1, 8, dtype=torch.uint8))
    assert torch.equal(got[14:21], torch.arange(0, 7, dtype=torch.uint8))
    assert torch.equal(got[21:] & 0x7, got[:21])
    assert bool((got[21:] >> 3 == 1).all())


def test_exact_values_encode_to_their_codes():
    mags = torch.tensor(E2M1_MAGNITUDES)
    assert torch.equal(e2m1.encode(mags), torch.arange(8, dtype=torch.uint8))
    assert torch.equal(e2m1.encode(-mags[1:]), torch.arange(9, 16, dtype=torch.uint8))


def test_sign_of_zero_by_bits():
    x = torch.tensor([0.0, -0.0, -1e-30, -0.25, 1e-30, 0.25])
    assert e2m1.encode(x).tolist() == [0x0, 0x0, 0x8, 0x8, 0x0, 0x0]
    decoded = e2m1.decode(torch.tensor([0x0, 0x8], dtype=torch.uint8))
    assert bits32(decoded).tolist() == [0, torch.tensor(-0.0).view(torch.int32).item()]


def test_saturation_and_infinity():
    x = torch.tensor([5.0001, 6.0, 7.0, 1e30, float("inf"), -7.0, -float("inf")])
    assert e2m1.encode(x).tolist() == [7, 7, 7, 7, 7, 15, 15]


def test_nan_policy_is_modelopt_export():
    # ModelOpt's export writes NaN as 0x7 (+6), whatever the NaN's sign; ml_dtypes differs (0x8).
    x = torch.tensor([float("nan"), -float("nan")])
    assert e2m1.encode(x).tolist() == [7, 7]


@pytest.mark.parametrize("kind", ["grid", "bits"])
def test_random_sweep_matches_ml_dtypes(kind):
    g = torch.Generator().manual_seed(1234)
    n = 1 << 20
    if kind == "grid":
        x = (torch.rand(n, generator=g) * 16 - 8).to(torch.float32)
    else:
        x = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
        x = x[torch.isfinite(x)]
    assert torch.equal(e2m1.encode(x), ml_encode(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern(dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    assert torch.equal(e2m1.encode(x), ml_encode(x))


def test_rejects_bad_input():
    with pytest.raises(TypeError, match="floating-point"):
        e2m1.encode(torch.arange(4))
    with pytest.raises(ValueError, match="0..15"):
        e2m1.decode(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        e2m1.decode(torch.tensor([1.0]))
