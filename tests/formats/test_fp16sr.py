"""Philox-4x32-R and the fp32 -> fp16 stochastic rounding of the SSM-state cache."""

from __future__ import annotations

import math

import pytest
import torch

from fp4kit.formats import FormatError
from fp4kit.formats.fp16sr import random_bits, round_state, round_stochastic
from fp4kit.formats.philox import philox4x32

# Random123's kat_vectors, philox4x32 with 10 rounds: counter, key -> output.
KAT_10 = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]
# Five rounds, Triton's randint4x(seed, offset, 5) layout (counter = (offset, 0, 0, 0), key =
# (seed, 0)), computed with an independent Python Philox that reproduces the vectors above.
KAT_5 = [
    (0, 0, [0xF10446C0, 0xC841128B, 0x23F43D26, 0x6CB9F044]),
    (42, 0, [0xEF374761, 0x452BC584, 0x20445C39, 0x61957CE9]),
    (42, 1, [0x3ECD2AB3, 0x79FDAC93, 0x0A23DF49, 0x27E9D7DA]),
]


@pytest.mark.parametrize("counter,key,want", KAT_10)
def test_philox_10_rounds_known_answers(counter, key, want):
    assert philox4x32(torch.tensor(counter), torch.tensor(key), 10).tolist() == want


@pytest.mark.parametrize("seed,offset,want", KAT_5)
def test_philox_5_rounds_known_answers(seed, offset, want):
    assert philox4x32(torch.tensor([offset, 0, 0, 0]), torch.tensor([seed, 0]), 5).tolist() == want


def test_philox_10_rounds_seed_42_and_batches():
    got = philox4x32(torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]]), torch.tensor([42, 0]), 10)
    assert got[0].tolist() == [0x9CEAF053, 0x77F5493B, 0x12BF50AD, 0x5742B3D7]
    assert got[1].tolist() == philox4x32(torch.tensor([1, 0, 0, 0]), torch.tensor([42, 0]), 10).tolist()


def test_philox_refuses_bad_words_and_rounds():
    with pytest.raises(FormatError, match="rounds"):
        philox4x32(torch.zeros(4, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0)
    with pytest.raises(FormatError, match=r"\[0, 2\^32\)"):
        philox4x32(torch.tensor([2**32, 0, 0, 0]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(FormatError, match="4 words"):
        philox4x32(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(FormatError, match="integer"):
        philox4x32(torch.zeros(4), torch.zeros(2, dtype=torch.long))


def test_random_bits_follow_groups_of_four_flat_offsets():
    bits = random_bits((3, 8), seed=(7 << 32) | 5, rounds=5, offset=4)
    for i in range(24):
        o = 4 + i
        base = o - o % 4
        word = philox4x32(torch.tensor([base, 0, 0, 0]), torch.tensor([5, 7]), 5)[o % 4]
        assert bits.reshape(-1)[i] == word & 0x1FFF
    # a 64-bit offset puts its high word in the second counter word
    big = 2**32 + 8
    assert random_bits((1,), 3, 5, offset=big)[0] == philox4x32(torch.tensor([8, 1, 0, 0]), torch.tensor([3, 0]), 5)[0] & 0x1FFF


def _fp16_grid() -> torch.Tensor:
    """Every finite non-negative fp16 value, as float64."""
    h = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return h.double()


def _oracle(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The rule restated in float64 for |x| <= 65536: the lower fp16 neighbour (toward zero), the
    fraction of the ulp above it cut to 13 bits, up when fraction + r reaches a whole ulp."""
    ax = x.double().abs()
    e = torch.floor(torch.log2(ax.clamp(min=2.0**-24)))
    ulp = torch.where(ax < 2.0**-14, torch.full_like(ax, 2.0**-24), torch.exp2(e - 10))
    lower = torch.floor(ax / ulp) * ulp
    frac13 = torch.floor((ax - lower) / ulp * 8192)
    up = frac13 + (r & 0x1FFF).double() >= 8192
    mag = lower + up.double() * ulp
    mag = torch.where(mag > 65504, math.inf, mag)
    return torch.where(torch.signbit(x), -mag, mag)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_fp16_interval_at_its_boundary_classes(sign):
    """For each of the 31743 finite fp16 intervals [h, h + ulp) (subnormals, normals, and the
    last one, which overflows to Inf), points at 0, 1, 4095, 4096 and 8191 / 8192 of the ulp, each
    with the random values that just keep it down and just lift it up, and 0 and 8191."""
    lo = _fp16_grid()
    hi = torch.cat([lo[1:], torch.tensor([65536.0], dtype=torch.float64)])
    ulp = hi - lo
    for k in (0, 1, 4095, 4096, 8191):
        x = (lo + ulp * k / 8192).float()  # exact in fp32: at most 11 + 13 significant bits
        assert torch.equal(x.double(), lo + ulp * k / 8192)
        for r in {0, 8191 - k, 8192 - k, 8191} - {8192}:
            rr = torch.full_like(x, r, dtype=torch.int64)
            got = round_stochastic(sign * x, rr).double()
            want = sign * (hi if k and r >= 8192 - k else lo)
            want = torch.where(want.abs() > 65504, sign * math.inf, want)
            assert torch.equal(got, want), (k, r)


def test_matches_the_float64_restatement_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-30, 17, (200_000,), generator=g).float())
    r = torch.randint(0, 2**32, (200_000,), generator=g)
    x = x[x.abs() <= 65535.0]
    r = r[: x.numel()]
    assert torch.equal(round_stochastic(x, r).double(), _oracle(x, r))


def test_specials_zero_nan_inf_and_tiny_values():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-30, -1e-30, 2.0**-38, 65536.0, 1e30])
    for r in (0, 8191):
        got = round_stochastic(x, torch.full(x.shape, r)).view(torch.int16).to(torch.int32) & 0xFFFF
        want = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x0000, 0x8000, 0x0000, 0x7C00, 0x7C00]
        assert got.tolist() == want, r
    # 2^-25 is half the smallest subnormal: up for r >= 4096
    half = torch.tensor([2.0**-25, -(2.0**-25)])
    assert round_stochastic(half, torch.tensor([4095, 4095])).tolist() == [0.0, -0.0]
    assert round_stochastic(half, torch.tensor([4096, 4096])).tolist() == [2.0**-24, -(2.0**-24)]
    # fp16-subnormal inputs lose their bits below 2^-37 before the random bits are added
    x = torch.tensor([2.0**-24 + 2.0**-38])
    assert round_stochastic(x, torch.tensor([8191])).item() == 2.0**-24


def test_exact_fp16_values_never_move():
    h = _fp16_grid().float()
    h = torch.cat([h, -h])
    for r in (0, 1, 8191):
        assert torch.equal(round_stochastic(h, torch.full(h.shape, r)).float(), h)


def test_unbiased_in_expectation():
    """Mean of 2^16 roundings of one value with Philox bits (seed 1234, 5 rounds): within
    4 standard errors (sd <= ulp / 2) plus the 13-bit truncation (ulp / 8192) of the value."""
    n = 1 << 16
    for v in (1.0 + 0.3 * 2.0**-10, -3.7e-3, 1234.567, 2.0**-20 * 1.7, 60000.1):
        x = torch.full((n,), v, dtype=torch.float32)
        got = round_state(x, seed=1234, rounds=5).double()
        lo = x.half().double()  # the nearest; the interval's ulp:
        ulp = (torch.nextafter(lo.abs().half(), torch.tensor(math.inf).half()).double() - lo.abs()).max().item()
        bound = 4 * (ulp / 2) / math.sqrt(n) + ulp / 8192
        assert abs(got.mean().item() - float(x[0])) <= bound, v
        assert set(got.unique().tolist()) <= {math.copysign(m, v) for m in _neighbours(abs(v))}


def _neighbours(a: float) -> set[float]:
    t = torch.tensor(a, dtype=torch.float32).half()
    lo = t.double().item() if t.double().item() <= a else torch.nextafter(t, torch.tensor(0.0).half()).double().item()
    hi = torch.nextafter(torch.tensor(lo).half(), torch.tensor(math.inf).half()).double().item()
    return {lo, hi}


def test_round_state_is_reproducible_and_seed_dependent():
    x = torch.randn(4, 8, 16)
    a, b = round_state(x, 99, 5), round_state(x, 99, 5)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), round_state(x, 100, 5).view(torch.int16))
    assert not torch.equal(a.view(torch.int16), round_state(x, 99, 10).view(torch.int16))
    with pytest.raises(FormatError, match="contiguous"):
        round_state(x.transpose(0, 2), 1, 5)
    with pytest.raises(FormatError, match="float32"):
        round_stochastic(x.half(), torch.zeros(1))


def _philox_reference(counter: list[int], key: list[int], rounds: int) -> list[int]:
    """Philox-4x32-R on Python integers, straight from the round function."""
    m = 0xFFFFFFFF
    c, (k0, k1) = list(counter), key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & m, (p0 >> 32) ^ c[3] ^ k1, p0 & m]
    return c


def test_philox_defaults_to_the_published_ten_rounds():
    counter, key, want = KAT_10[2]
    assert philox4x32(torch.tensor(counter), torch.tensor(key)).tolist() == want


@pytest.mark.parametrize("rounds", [1, 2, 7])
def test_philox_any_number_of_rounds(rounds):
    counter, key = [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]
    assert philox4x32(torch.tensor(counter), torch.tensor(key), rounds).tolist() == _philox_reference(counter, key, rounds)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_philox_takes_narrower_integer_words_and_python_lists(dtype):
    counter, key = [7, 100, 3, 120], [5, 9]
    want = _philox_reference(counter, key, 10)
    assert philox4x32(torch.tensor(counter, dtype=dtype), torch.tensor(key, dtype=dtype)).tolist() == want
    assert philox4x32(counter, key).tolist() == want


def test_philox_broadcasts_a_key_per_counter():
    counters = torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4]])
    keys = torch.tensor([[42, 0], [0xA4093822, 0x299F31D0]])
    got = philox4x32(counters, keys, 5)
    assert got.tolist() == [_philox_reference(c, k, 5) for c, k in zip(counters.tolist(), keys.tolist())]


@pytest.mark.parametrize("rounds", [0, -1, True, 2.0])
def test_philox_refuses_rounds_that_are_not_a_positive_integer(rounds):
    with pytest.raises(FormatError, match=rf"^philox: rounds must be a positive integer, got {rounds!r}$"):
        philox4x32([0, 0, 0, 0], [0, 0], rounds)


@pytest.mark.parametrize("what,counter,key", [
    ("counter", [0, -1, 0, 0], [0, 0]), ("counter", [0, 0, 2**32, 0], [0, 0]),
    ("key", [0, 0, 0, 0], [-1, 0]), ("key", [0, 0, 0, 0], [0, 2**32]),
])
def test_philox_names_the_word_out_of_range(what, counter, key):
    with pytest.raises(FormatError, match=rf"^philox: {what} words must lie in \[0, 2\^32\)$"):
        philox4x32(torch.tensor(counter), torch.tensor(key))


def test_philox_names_the_part_that_is_not_integer():
    with pytest.raises(FormatError, match=r"^philox: key must be integer words, got torch.float32$"):
        philox4x32([0, 0, 0, 0], torch.zeros(2))
    with pytest.raises(FormatError, match=r"^philox: counter must be integer words, got torch.float64$"):
        philox4x32(torch.zeros(4, dtype=torch.float64), [0, 0])
    with pytest.raises(FormatError, match=r"^philox: counter must end in 4 words and key in 2, got \(4,\) and \(3,\)$"):
        philox4x32([0, 0, 0, 0], [0, 0, 0])


def test_random_bits_start_at_offset_zero_and_take_every_seed_below_2_64():
    assert torch.equal(random_bits((2, 4), 11, 5), random_bits((2, 4), 11, 5, offset=0))
    for seed in (0, 2**64 - 1):
        word = philox4x32(torch.tensor([0, 0, 0, 0]), torch.tensor([seed & 0xFFFFFFFF, seed >> 32]), 5)[1]
        assert random_bits((2,), seed, 5)[1] == word & 0x1FFF


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7"])
def test_random_bits_refuse_a_seed_outside_64_bits(seed):
    with pytest.raises(FormatError, match=rf"^fp16sr.random_bits: seed must be an integer in \[0, 2\^64\), got {seed!r}$"):
        random_bits((4,), seed, 5)


@pytest.mark.parametrize("offset", [-1, 1.0])
def test_random_bits_refuse_a_negative_or_fractional_offset(offset):
    with pytest.raises(FormatError, match=rf"^fp16sr.random_bits: offset must be a non-negative integer, got {offset!r}$"):
        random_bits((4,), 1, 5, offset=offset)


def test_round_state_takes_its_random_bits_from_its_offset():
    x = torch.rand(3, 8) * 1e-3 + 1.0  # far from fp16 values, so the random bits decide
    for offset in (0, 4, 6):
        want = round_stochastic(x, random_bits(x.shape, 5, 5, offset=offset))
        assert torch.equal(round_state(x, 5, 5, offset=offset).view(torch.int16), want.view(torch.int16))
    assert not torch.equal(round_state(x, 5, 5, offset=8).view(torch.int16), round_state(x, 5, 5).view(torch.int16))
    assert torch.equal(round_state(x, 5, 5).view(torch.int16), round_state(x, 5, 5, offset=0).view(torch.int16))


def test_round_stochastic_and_round_state_name_what_they_refuse():
    with pytest.raises(FormatError, match=r"^fp16sr.round_stochastic: expected a float32 tensor, got torch.float16$"):
        round_stochastic(torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.long))
    with pytest.raises(FormatError, match=r"^fp16sr.round_stochastic: expected a float32 tensor, got <class 'list'>$"):
        round_stochastic([0.0], torch.zeros(1, dtype=torch.long))
    with pytest.raises(FormatError, match=r"^fp16sr.round_state: the state must be contiguous \(its random bits follow flat offsets\)$"):
        round_state(torch.zeros(4, 4).t(), 1, 5)



def test_every_nan_payload_becomes_the_quiet_nan():
    bits = torch.tensor([0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0xFF800001 - 2**32, 0x7F800000], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    got = round_stochastic(x, torch.full((6,), 0x1FFF)).view(torch.int16).to(torch.int64) & 0xFFFF
    assert got.tolist() == [0x7E00, 0x7E00, 0x7E00, 0x7E00, 0xFE00, 0x7C00]
