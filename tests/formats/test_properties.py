"""Property-based tests of the formats: pack/unpack, codecs against their bit-level definitions."""

import math
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.formats import e2m1, e4m3, nvfp4, pack_nibbles, unpack_nibbles
from fp4kit.formats.constants import E2M1_MAGNITUDES


@given(st.lists(st.integers(0, 15), min_size=2, max_size=256).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_round_trip(codes):
    t = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_nibbles(t)
    assert torch.equal(unpack_nibbles(packed), t)
    assert all(b == codes[2 * i] | (codes[2 * i + 1] << 4) for i, b in enumerate(packed.tolist()))


def e4m3_by_definition(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return math.nan
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


@given(st.integers(0, 255))
def test_e4m3_decode_matches_the_bit_definition(code):
    got = e4m3.decode(torch.tensor([code], dtype=torch.uint8)).item()
    want = e4m3_by_definition(code)
    assert (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(1, want))


def nearest_even_e4m3(x: float) -> int:
    """Round |x| to the E4M3 grid by searching all 127 finite magnitudes (ties to even code)."""
    a = min(abs(x), 448.0)
    best = min(range(127), key=lambda c: (abs(e4m3_by_definition(c) - a), c % 2))
    return best | (0x80 if math.copysign(1, x) < 0 else 0)


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=400)
def test_e4m3_encode_random_fp32_bit_patterns(bits):
    x = struct.unpack("<f", struct.pack("<I", bits))[0]
    code = e4m3.encode(torch.tensor([x], dtype=torch.float32)).item()
    if math.isnan(x):
        assert code & 0x7F == 0x7F
    else:
        assert code == nearest_even_e4m3(x)


@given(st.floats(min_value=-100, max_value=100, allow_nan=False, width=32))
def test_e2m1_encode_is_the_nearest_value(x):
    code = e2m1.encode(torch.tensor([x], dtype=torch.float32)).item()
    a = min(abs(x), 6.0)
    dist = [abs(m - a) for m in E2M1_MAGNITUDES]
    best = min(dist)
    idx = code & 7
    assert dist[idx] == best
    if dist.count(best) == 2:  # a tie: the even mantissa
        assert idx in (0, 2, 4, 6)
    assert (code >> 3) == (1 if x < 0 else 0)  # sign from x < 0, also when |x| rounds to 0


@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from(["6", "4o6"]))
@settings(max_examples=40, deadline=None)
def test_nvfp4_dequantize_error_is_bounded_per_block(n, kblocks, seed, rule):
    w = torch.randn(n, 16 * kblocks, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed % 7 - 3)
    q = nvfp4.quantize(w, scale_rule=rule)
    err = (q.dequantize() - w).abs().view(n, kblocks, 16)
    step = q.block_multiplier().unsqueeze(-1)
    # each element is within half the widest E2M1 gap (1.0, between 4 and 6) of a grid point
    assert bool((err <= step * 1.0 + 1e-30).all())
