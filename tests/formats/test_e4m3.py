"""E4M3: all 256 codes, every midpoint +-1 ulp, saturation, double rounding, sweeps vs torch and ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4kit.formats import e4m3
from fp4kit.formats.constants import E4M3_MAX, E4M3_VALUES

F8 = ml_dtypes.float8_e4m3fn


def torch_cast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def ml_cast(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.to(torch.float32).numpy().astype(F8).view(np.uint8).copy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_all_256_codes_decode_like_ml_dtypes_and_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = e4m3.decode(codes)
    ml = torch.from_numpy(codes.numpy().view(F8).astype(np.float32))
    th = codes.view(torch.float8_e4m3fn).to(torch.float32)
    nan = torch.isnan(ours)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(nan, torch.isnan(ml)) and torch.equal(nan, torch.isnan(th))
    assert same_bits(ours[~nan], ml[~nan]) and same_bits(ours[~nan], th[~nan])
    assert len(E4M3_VALUES) == 256 and ours[0x7E].item() == E4M3_MAX


def test_every_code_round_trips_by_bits():
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(e4m3.encode(e4m3.decode(codes)), codes)  # incl. 0x80 (-0.0) and both NaNs


def test_midpoints_and_neighbours():
    pos = e4m3.decode(torch.arange(0, 0x7F, dtype=torch.uint8))  # 0 .. 448
    mids = (pos[:-1].double() + pos[1:].double()) / 2
    mids = mids.float()  # every midpoint is exact in fp32
    assert torch.equal(mids.double(), (pos[:-1].double() + pos[1:].double()) / 2)
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    x = torch.cat([mids, up, down, pos])
    x = torch.cat([x, -x])
    got = e4m3.encode(x)
    assert torch.equal(got, torch_cast(x))
    assert torch.equal(got, ml_cast(x))
    # Ties go to the even code.
    n = mids.numel()
    lower = torch.arange(0, n, dtype=torch.int32)
    expect_tie = torch.where(lower % 2 == 0, lower, lower + 1).to(torch.uint8)
    assert torch.equal(got[:n], expect_tie)
    assert torch.equal(got[n : 2 * n], (lower + 1).to(torch.uint8))
    assert torch.equal(got[2 * n : 3 * n], lower.to(torch.uint8))


def test_saturation_above_448():
    x = torch.tensor([448.0, 449.0, 464.0, 465.0, 480.0, 1e30, float("inf"), -1e30, -float("inf")])
    assert e4m3.encode(x).tolist() == [0x7E] * 7 + [0xFE] * 2
    assert torch.equal(e4m3.encode(x), torch_cast(x))


def test_sign_of_zero_and_nan_by_bits():
    x = torch.tensor([0.0, -0.0, -1e-30, 2.0**-10, -(2.0**-10), float("nan"), -float("nan")])
    got = e4m3.encode(x)
    assert got.tolist() == [0x00, 0x80, 0x80, 0x00, 0x80, 0x7F, 0xFF]
    assert torch.equal(got, torch_cast(x))


def test_subnormal_ties():
    q = 2.0**-9
    x = torch.tensor([0.5 * q, 1.5 * q, 2.5 * q, 3.5 * q, 7.5 * q])
    assert e4m3.encode(x).tolist() == [0, 2, 2, 4, 8]  # 7.5 q -> 8 q = 2^-6, the first normal


def test_double_rounding_case():
    # 1.0625 is the midpoint between 1.0 (0x38) and 1.125 (0x39). An fp32 value just above it
    # must round up; rounding it to bf16 first lands exactly on the midpoint, which ties to even.
    x = torch.tensor([1.0625 + 2.0**-20], dtype=torch.float32)
    assert e4m3.encode(x).item() == 0x39
    assert e4m3.encode(x.to(torch.bfloat16)).item() == 0x38
    assert e4m3.encode(x.to(torch.float64)).item() == 0x39


@pytest.mark.parametrize("kind", ["range", "bits"])
def test_random_fp32_sweep(kind):
    g = torch.Generator().manual_seed(99)
    n = 1 << 20
    if kind == "range":
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 10, (n,), generator=g).float())
    else:
        x = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = e4m3.encode(x)
    assert torch.equal(got, torch_cast(x))
    finite = x.abs() <= E4M3_MAX  # ml_dtypes turns overflow into NaN instead of saturating
    assert torch.equal(got[finite], ml_cast(x[finite]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern(dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert torch.equal(e4m3.encode(x), torch_cast(x))


def test_decode_accepts_float8_and_rejects_others():
    t = torch.tensor([1.5]).to(torch.float8_e4m3fn)
    assert e4m3.decode(t).item() == 1.5
    with pytest.raises(TypeError, match="uint8"):
        e4m3.decode(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="floating-point"):
        e4m3.encode(torch.tensor([1]))
