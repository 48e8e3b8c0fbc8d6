"""fp4kit.kernels.quantize against fp4kit.formats.nvfp4.quantize: identical bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fp4kit.formats import nvfp4  # noqa: E402
from fp4kit.formats.constants import E2M1_MAGNITUDES  # noqa: E402
from fp4kit.formats.errors import FormatError  # noqa: E402
from fp4kit.formats.metrics import sqnr_terms  # noqa: E402
from fp4kit.kernels import backend, launch, quantize as kquant  # noqa: E402

from .helpers import DEVICE, _bits, _rand, assert_same_nvfp4  # noqa: E402


def stack_table(base=None, **stack):
    """A launch table (default: the device's) with some STACK entries replaced."""
    return launch.override(launch.table("quantize") if base is None else base, STACK=stack)


# The stack kernel's schedule for tests that are not about it: one tile per item and a lag of one
# member, so that the interpreter runs few masked-off tiles on members of one or a few tiles.
LEAN = stack_table(lag=1, max_tiles=4, quant_tiles=1)


def check_quantize(w: torch.Tensor, tables=LEAN, **kw) -> tuple[nvfp4.NVFP4Tensor, torch.Tensor]:
    """Kernel on DEVICE (with launch table `tables`) vs reference on CPU: identical bytes and 4/6
    choices, and the error terms summed in the quantizing pass (as the quantize stage asks for
    them) those of the reference's result. Returns the kernel's result and choice."""
    terms: list = []
    got, got_choice = kquant.quantize(w.to(DEVICE), return_choice=True, tables=tables, terms=terms, **kw)
    ref, ref_choice = nvfp4.quantize(w, return_choice=True, **kw)
    assert_same_nvfp4(got, ref)
    assert torch.equal(got_choice.cpu(), ref_choice)
    check_terms(terms, w, ref, ref_choice)
    return got, ref_choice


def check_terms(terms: list, w: torch.Tensor, ref: nvfp4.NVFP4Tensor, ref_choice: torch.Tensor) -> None:
    """One `Terms` entry: the count of blocks on the 4 candidate exact, the sums within 2e-6 of
    the reference's float64 sums (fp32 partial sums), where those lie inside fp32's range."""
    (entry,) = terms
    signal, noise, count4, blocks = entry.signal, entry.noise, entry.count4, entry.blocks
    assert entry.sums.dtype == torch.float64 and entry.sums.shape == (3,)
    assert blocks == ref_choice.numel() and float(count4) == int(ref_choice.sum())
    assert entry.frac4 == float(ref_choice.double().mean())
    want_signal, want_noise = sqnr_terms(w, ref.dequantize())
    for got, want in ((signal, want_signal), (noise, want_noise)):
        want = float(want)
        if want == 0 or 1e-30 < want < 1e30:
            assert abs(float(got) - want) <= 2e-6 * want, (float(got), want)


# --------------------------------------------------------------------------------------------
# quantize: bytes identical to fp4kit.formats.nvfp4.quantize
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["6", "4o6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(64, 128), (3, 40, 96), (256,), (2, 2, 8, 48), (3, 64, 32), (2, 128, 64)])
def test_quantize_random(rule, dtype, shape):
    check_quantize(_rand(*shape, dtype=dtype, seed=len(shape)), scale_rule=rule)


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_bf16_weights(rule):
    # bf16 weights are only loaded and widened to fp32 (exact; no bf16 arithmetic, so the
    # interpreter runs it): random bf16 bit patterns of every exponent (the per-element division
    # path), both zeros, and normal weights (the fast path), as one tensor and as a stack.
    g = torch.Generator().manual_seed(15)
    bits = torch.randint(-32768, 32768, (8, 32, 64), generator=g, dtype=torch.int32).to(torch.int16)
    wide = bits.view(torch.bfloat16)
    wide = torch.where(torch.isfinite(wide.float()), wide, torch.zeros_like(wide))
    wide[0, 0, :4] = torch.tensor([0.0, -0.0, -0.0, 0.0], dtype=torch.bfloat16)
    normal = _rand(8, 32, 64, seed=15).to(torch.bfloat16)
    normal[1, 2, 3] = -0.0
    for w in (wide, normal, normal[0]):
        check_quantize(w, scale_rule=rule)


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_subnormal_block_scales_at_the_saturation_edge(rule):
    # Blocks whose E4M3 scale is subnormal round it down by up to 1.5x, so quotients reach 8-9
    # (saturated to 6 in the packed word, 8 nibbles at once) and 4/6's candidate 4 reaches 6
    # without its saturation. Block amax / global amax sweeps that range: the true scale runs over
    # [1, 2.5] * 2^-9 for the plain rule (448 * amax / g), candidate 6 (256 * amax / g) and
    # candidate 4 (384 * amax / g), each block's other elements spread below its amax, both signs.
    g = torch.Generator().manual_seed(12)
    ratio = torch.linspace(1.0, 2.5, 193) * 2.0**-9  # true scale / 2^-9 over the tie points
    amax = torch.cat([ratio / 448, ratio / 256, ratio / 384])
    body = amax[:, None] * torch.rand(amax.numel(), 15, generator=g) * torch.where(
        torch.rand(amax.numel(), 15, generator=g) < 0.5, -1.0, 1.0)
    blocks = torch.cat([amax[:, None] * torch.where(torch.rand(amax.numel(), 1, generator=g) < 0.5, -1.0, 1.0),
                        body], dim=1)
    w = torch.cat([torch.full((1, 16), 1.0), blocks]).reshape(-1, 64)  # row 0's 1.0: the global amax
    check_quantize(w, scale_rule=rule)
    check_quantize(w.to(torch.bfloat16), scale_rule=rule)


def _check_markstein():
    spec = importlib.util.spec_from_file_location("check_markstein", Path(__file__).parents[2] / "scripts" / "check_markstein.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_reciprocal_quotient_is_the_ieee_quotient():
    # The kernel's division-free quotient (scripts/check_markstein.py; that script covers every
    # bf16 mantissa against every fp32 step mantissa): here every bf16 mantissa against every
    # 64th step mantissa, and 2^20 random fp32 pairs.
    pytest.importorskip("triton._C.libtriton")
    check = _check_markstein()
    assert check.bf16_against_steps(step_stride=64)[0] == 0
    assert check.random_pairs(2**20)[0] == 0
    # and the check can fail: a plain reciprocal multiply is wrong on some pairs
    a = np.linspace(1.0, 4.0, 2**16, dtype=np.float32)
    s = np.full_like(a, np.float32(1.2345679))
    assert int(((a * (np.float32(1.0) / s)).astype(np.float32) != (a / s).astype(np.float32)).sum()) > 0


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_where_the_uncorrected_quotient_misrounds(rule):
    # The quotient's two fused multiply-adds cannot be dropped, not even per expert: for a
    # third to a half of bf16 global amaxes, some bf16 weight under some block scale sits so
    # close to an E2M1 midpoint that RN(a * RN(1 / s)) rounds it the other way
    # (scripts/check_markstein.py --uncorrected). A member built from such weights: blocks whose
    # scale is the bad code and which hold the bad weight, beside the member's global amax.
    check = _check_markstein()
    g = next(float(v) for v in torch.arange(0x40A0, 0x4100, dtype=torch.int16).view(torch.bfloat16).float()
             if check.uncorrected_misrounds(float(v), rule))
    hard = check.uncorrected_misrounds(g, rule)
    blocks = []
    for code, a in hard:
        lo = torch.tensor([a], dtype=torch.bfloat16).view(torch.int16).item()
        amax = torch.arange(lo, lo + 4 * 128, dtype=torch.int16).view(torch.bfloat16).float()  # a up to 16 a
        cand = torch.zeros(amax.numel(), 16)
        cand[:, 0], cand[:, 1] = amax, a
        cand[:, 2] = -a
        ref = nvfp4.quantize(torch.cat([torch.full((1, 16), g), cand]), scale_rule=rule)
        keep = ref.block_scale.view(torch.uint8)[1:, 0] == code
        blocks.append(cand[keep][:2])
    blocks = torch.cat(blocks)
    assert blocks.shape[0] >= 2, "no block took a scale where the shortcut misrounds"
    w = torch.cat([torch.full((1, 16), g), blocks])  # [blocks + 1, 16]: one block per row
    check_quantize(w.to(torch.bfloat16), scale_rule=rule)


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_both_constant_divisions(rule):
    w = _rand(8, 16, 64, seed=7)  # 8 global scales: the two divisions differ on 2 (plain) and 4 (4/6)
    a, _ = check_quantize(w, scale_rule=rule, arith="cuda")
    b, _ = check_quantize(w, scale_rule=rule, arith="cpu")
    assert not torch.equal(_bits(a.global_scale).cpu(), _bits(b.global_scale).cpu())  # the switch reaches the kernel


@pytest.mark.parametrize("rule", ["6", "4o6"])
@pytest.mark.parametrize("rows", [16, 32])  # 64 or 128 blocks per member: members per block or per program
def test_quantize_zero_members_blocks_and_tiny_blocks(rule, rows):
    w = _rand(5, rows, 64, seed=1)
    w[1] = 0.0  # an all-zero expert: global scale 1, scales 1, codes 0
    w[2, :, :16] = 0.0  # zero blocks in a non-zero expert
    w[3, :, 16:32] *= 1e-6  # blocks under the 2^-9 scale floor
    w[0, 3, :] = -0.0  # negative zeros: code 0, not 0x8
    w[4, :, 32:48] = -1e-30  # negative values whose quotient rounds to zero: code 0x8
    check_quantize(w, scale_rule=rule)
    check_quantize(torch.zeros(32, 64), scale_rule=rule)  # all-zero tensor


@pytest.mark.parametrize("rule", ["6", "4o6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_e2m1_ties(rule, dtype):
    # Block max 6 * 2^j with the other elements on E2M1 midpoints (and codes) times 2^j: with the
    # plain rule every quotient lands exactly on a midpoint, exercising round-half-even.
    g = torch.Generator().manual_seed(2)
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.25])
    w = values[torch.randint(0, 16, (32, 128), generator=g)]
    w = w * torch.randint(0, 2, (32, 128), generator=g).mul(2).sub(1)
    w[:, ::16] = 6.0
    w = w * 2.0 ** torch.randint(-3, 3, (32, 1), generator=g).float()
    check_quantize(w.to(dtype), scale_rule=rule)


@triton.jit
def _bit_tricks_probe(q_ptr, x_ptr, idx_ptr, ref_ptr, sign_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    q = tl.load(q_ptr + offs, mask=ok, other=0.0)
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(idx_ptr + offs, kquant._e2m1_index_finite(q), mask=ok)
    tl.store(ref_ptr + offs, kquant._e2m1_index(kquant._e2m1_round_finite(q)), mask=ok)
    tl.store(sign_ptr + offs, kquant._sign8(x), mask=ok)


def test_quantize_index_and_sign_bit_tricks():
    # The quantize kernel's fast path takes a code's magnitude index straight from its rounding
    # addition (`_e2m1_index_finite`) and its sign from x's bits (`_sign8`). Against the value
    # route (`_e2m1_round_finite`, then `_e2m1_index`) and x < 0, in the kernels' own arithmetic:
    # every fp32 within 64 ulps of each E2M1 value, midpoint and binade edge up to 16, every bf16
    # value in [0, 16), 2^16 random quotients in [0, 10], and tiny negative quotients; the sign
    # on every bf16 bit pattern, as fp32 (NaN left out), both zeros, the smallest subnormals.
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0,
                           10.0, 12.0, 16.0]).view(torch.int32)
    near = (points[:, None] + torch.arange(-64, 65)[None, :]).reshape(-1)
    near = near[(near >= 0) & (near <= torch.tensor([16.0]).view(torch.int32))].view(torch.float32)
    bf = (torch.arange(0, 0x4180, dtype=torch.int32) << 16).view(torch.float32)
    rnd = torch.rand(1 << 16, generator=torch.Generator().manual_seed(7)) * 10
    tiny = -torch.tensor([1e-30, 1e-38, 1.4e-45, 0.0])
    q = torch.cat([near, bf, rnd, tiny]).contiguous()
    every = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    x = torch.cat([every[~torch.isnan(every)], torch.tensor([0.0, -0.0, 1.4e-45, -1.4e-45])])
    n = max(q.numel(), x.numel())
    q = torch.cat([q, torch.zeros(n - q.numel())]).to(DEVICE)
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    idx, ref, sign = (torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(3))
    _bit_tricks_probe[(triton.cdiv(n, 4096),)](q, x, idx, ref, sign, n, BLOCK=4096)
    assert torch.equal(idx.cpu(), ref.cpu())
    assert set(ref.cpu().tolist()) == set(range(8))  # every index reached
    assert torch.equal(sign.cpu(), torch.where(x.cpu() < 0, 8, 0).to(torch.int32))
    assert int(sign.cpu()[torch.signbit(x.cpu()) & (x.cpu() == 0)].sum()) == 0  # -0.0: no sign


E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES)


@triton.jit
def _codes_probe(x_ptr, idx_ptr, out_ptr, n, VALUES: tl.constexpr, BLOCKS: tl.constexpr):
    rows = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    ok = rows < n
    at = rows * 8 + tl.arange(0, 8)[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    idx = tl.load(idx_ptr + at, mask=ok, other=0)
    tl.store(out_ptr + rows, kquant._codes(x, idx, True, 0, False, BLOCKS, SAT=True, VALUES=VALUES), mask=ok)


def codes_probe(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The fast path's code packing (`_codes`: `_sign_word`, saturation, `_index_word`) on its
    own: x fp32 [n, 8], idx [n, 8] int32 magnitude indices 0..8 (8 meaning 7) or fp32 E2M1
    values. Returns the n packed words (int32; element i's code in bits 4i..4i+3)."""
    n = x.shape[0]
    out = torch.empty(n, dtype=torch.int32, device=x.device)
    _codes_probe[(triton.cdiv(n, 128),)](x.contiguous(), idx.contiguous(), out, n, VALUES=idx.is_floating_point(),
                                         BLOCKS=128, num_warps=4, **backend.launch_options())
    return out


def packed_codes(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reference for `codes_probe`: code i = min(idx_i, 7) | 8 if x_i < 0, in bits 4i..4i+3."""
    code = idx.clamp(max=7).long() | torch.where(x < 0, 8, 0)
    word = (code << (4 * torch.arange(8))).sum(dim=1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def test_quantize_code_packing():
    # The fast path packs 8 codes at once (`_codes`): the sign bits from x (-0.0 none), indices
    # 0..8 saturated to 7 in the packed word, or indices read off the E2M1 values (4/6).
    g = torch.Generator().manual_seed(11)
    pool = torch.tensor([0.0, -0.0, 1.4e-45, -1.4e-45, -1e-30, 2.5, -2.5, -448.0, 3e38, -3e38, 1.0, -1.0])
    x = pool[torch.randint(0, len(pool), (4096, 8), generator=g)]
    idx = torch.randint(0, 9, (4096, 8), generator=g, dtype=torch.int32)
    assert torch.equal(codes_probe(x.to(DEVICE), idx.to(DEVICE)).cpu(), packed_codes(x, idx))
    vi = torch.randint(0, 8, (4096, 8), generator=g)
    got = codes_probe(x.to(DEVICE), E2M1_VALUES[vi].to(DEVICE)).cpu()
    assert torch.equal(got, packed_codes(x, vi.to(torch.int32)))


@pytest.mark.parametrize("rows", [24, 32])  # 96 or 128 blocks per member
def test_quantize_4o6_importance_and_global_amax(rows):
    w = _rand(2, rows, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    _, choice = check_quantize(w, scale_rule="4o6", importance=torch.rand(64, generator=g))
    assert 0 < int(choice.sum()) < choice.numel()  # both candidates occur
    check_quantize(w, scale_rule="4o6", importance=torch.rand(2, 64, generator=g))
    check_quantize(w, scale_rule="4o6", importance=torch.zeros(64))  # every error 0: ties keep 6
    check_quantize(w, scale_rule="4o6", global_amax=10.0)
    check_quantize(w, scale_rule="6", global_amax=torch.tensor([7.0, 9.0]))
    check_quantize(w, scale_rule="6", global_amax=[7.0, 9.0])


@pytest.mark.parametrize("rule", ["6", "4o6"])
@pytest.mark.parametrize("scale", [1e-39, 1e-20, 1e30, 1e38])
def test_quantize_extreme_magnitudes(rule, scale):
    check_quantize(_rand(8, 32, seed=5, scale=scale), scale_rule=rule)


def test_quantize_default_rule_and_plain_return():
    w = _rand(16, 32, seed=6)
    got = kquant.quantize(w.to(DEVICE))
    assert isinstance(got, nvfp4.NVFP4Tensor)
    assert_same_nvfp4(got, nvfp4.quantize(w))


@pytest.mark.parametrize("rule", [pytest.param("6", marks=pytest.mark.slow), "4o6"])
def test_quantize_stack_in_one_launch(rule, monkeypatch):
    # A stack of whole-tile members without a given global amax runs `_stack_kernel` (each
    # member's max pass and quantization in one launch); the two-launch path gives the same bytes.
    w = _rand(4, 32, 64, seed=9)  # 128 blocks per member: one tile each
    w[2] = 0.0
    w[3, 5, :16] *= 1e-6
    max_passes = []
    real_max_pass = kquant.member_amax
    monkeypatch.setattr(kquant, "member_amax", lambda t: (max_passes.append(t.shape), real_max_pass(t))[1])
    imp = torch.rand(4, 64, generator=torch.Generator().manual_seed(9)) if rule == "4o6" else None
    _, fused = check_quantize(w, launch.table("quantize"), scale_rule=rule, importance=imp)  # the shipped schedule
    assert max_passes == []  # no separate max pass
    two, choice = kquant.quantize(w.to(DEVICE), scale_rule=rule, importance=imp, return_choice=True,
                                  tables=stack_table(max_member_bytes=None))
    assert max_passes == [(4, 32, 64)]
    assert torch.equal(choice.cpu(), fused)
    assert_same_nvfp4(two, nvfp4.quantize(w, scale_rule=rule, importance=imp))


_SCHEDULES = (dict(lag=1, max_tiles=4, quant_tiles=2, prefetch=True),
              dict(lag=2, max_tiles=8, quant_tiles=4, prefetch=False),
              dict(lag=5, max_tiles=4, quant_tiles=4, prefetch=True))
_SCHEDULE_INPUTS = ((torch.float32, "4o6"), (torch.float16, "6"), (torch.bfloat16, "6"))


@pytest.mark.parametrize("schedule,inputs", [
    pytest.param(s, i, id=f"schedule{s}-{str(_SCHEDULE_INPUTS[i][0])[6:]}",
                 marks=() if s == i else pytest.mark.slow)  # each schedule and each dtype once, all pairs slow
    for s in range(len(_SCHEDULES)) for i in range(len(_SCHEDULE_INPUTS))])
def test_quantize_stack_schedules(schedule, inputs):
    # Members of 5 tiles: max items and quantize items that run past a member's end, groups
    # with more quantize slots than items, a lag longer than the stack, with and without the
    # prefetch; every tile quantized once, and every tile in its member's max (member i has its
    # max in tile i); fp32, fp16 and bf16 (the last two with their maxima on bit patterns).
    dtype, rule = _SCHEDULE_INPUTS[inputs]
    w = _rand(5, 40, 256, seed=13)
    for i in range(5):
        w[i, 8 * i + 3] *= 50.0
    check_quantize(w.to(dtype), stack_table(**_SCHEDULES[schedule]), scale_rule=rule)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_stack_max_on_bit_patterns(dtype):
    # 16-bit stacks take their member maxima on bit patterns (`_max_pair`): a negative maximum
    # beside a smaller positive one in the other half of its word, subnormals only (fp16: the
    # interpreter widens bf16 subnormals inexactly; tests/gpu covers them), zeros of both signs,
    # the largest finite value; each member's max is exactly max|w|, the bytes the reference's.
    # NaN and Inf of either sign in a member are flagged and named.
    info = torch.finfo(dtype)
    w = _rand(5, 32, 64, seed=16).to(dtype)
    w[0, 9, 20], w[0, 9, 21] = -7.5, 7.0  # one word: the negative half is the larger
    tiny = info.smallest_normal / 8 if dtype == torch.float16 else info.smallest_normal * 8
    w[1] = (torch.arange(32 * 64).reshape(32, 64) % 7 - 3).to(dtype) * tiny
    w[2] = 0.0
    w[2, ::2, 1::3] = -0.0
    w[3, 31, 63] = -info.max
    got, _, own = kquant.launch(w.to(DEVICE), "6", tables=LEAN)
    assert torch.equal(own.cpu(), w.float().abs().amax(dim=(1, 2)))
    assert_same_nvfp4(got, nvfp4.quantize(w, scale_rule="6"))
    for bad in (float("nan"), float("inf"), -float("inf")):
        v = w.clone()
        v[3, 4, 17] = bad
        flagged = kquant.launch(v.to(DEVICE), "6", tables=LEAN)[2].cpu()  # NaN counts as +Inf
        assert flagged[3] == float("inf") and torch.equal(flagged[:3], own[:3].cpu())
        with pytest.raises(FormatError, match=r"first at index \(3, 4, 17\)"):
            kquant.quantize(v.to(DEVICE), scale_rule="4o6", tables=LEAN)


def test_quantize_stack_schedule_checked():
    with pytest.raises(ValueError, match="max_tiles a multiple of 4"):
        kquant.quantize(_rand(2, 32, 64).to(DEVICE), tables=stack_table(max_tiles=6))


def test_quantize_stack_reach_and_non_finite_member():
    w = _rand(3, 32, 64, seed=10).to(DEVICE)
    assert kquant.fused_stack(w, 3, 128) and not kquant.fused_stack(w, 1, 128)
    assert not kquant.fused_stack(w[:, :24], 3, 96)  # members not whole tiles of 128 blocks
    exact = stack_table(max_member_bytes=32 * 64 * 4)  # the member's size exactly
    assert kquant.fused_stack(w, 3, 128, exact) and not kquant.fused_stack(w.double(), 3, 128, exact)
    assert not kquant.fused_stack(w, 3, 128, stack_table(max_member_bytes=32 * 64 * 4 - 1))
    assert not kquant.fused_stack(w, 3, 128, launch.override(launch.table("quantize"), TUNING={"blocks": 256}))
    w[1, 7, 3] = float("nan")  # flagged by the stack kernel's own max pass
    with pytest.raises(FormatError, match=r"1 NaN and 0 Inf values \(first at index \(1, 7, 3\)\)"):
        kquant.quantize(w, scale_rule="4o6", tables=LEAN)


_BAD_INPUTS = {
    "rule": lambda: dict(w=_rand(4, 32), scale_rule="5"),
    "dtype": lambda: dict(w=torch.ones(4, 32, dtype=torch.int32)),
    "k": lambda: dict(w=_rand(4, 20)),
    "nan": lambda: dict(w=torch.tensor([[float("nan")] * 16, [1.0] * 16])),
    "inf": lambda: dict(w=torch.tensor([[1.0] * 15 + [float("-inf")]])),
    "global_small": lambda: dict(w=_rand(4, 32), global_amax=0.1),
    "global_shape": lambda: dict(w=_rand(3, 4, 32), global_amax=torch.ones(2)),
    "global_nan": lambda: dict(w=_rand(4, 32), global_amax=float("nan")),
    "importance_rule6": lambda: dict(w=_rand(4, 32), importance=torch.ones(32)),
    "importance_shape": lambda: dict(w=_rand(4, 32), scale_rule="4o6", importance=torch.ones(16)),
    "importance_negative": lambda: dict(w=_rand(4, 32), scale_rule="4o6", importance=-torch.ones(32)),
}


@pytest.mark.parametrize("case", sorted(_BAD_INPUTS))
def test_quantize_validation_matches_reference(case):
    kw = _BAD_INPUTS[case]()
    with pytest.raises(Exception) as ref:
        nvfp4.quantize(**kw)
    kw["w"] = kw["w"].to(DEVICE)
    with pytest.raises(type(ref.value)) as got:
        kquant.quantize(**kw)
    assert str(got.value) == str(ref.value).replace("nvfp4.quantize", "kernels.quantize")


def test_backend_switch():
    w = _rand(4, 32)
    assert_same_nvfp4(kquant.quantize(w, backend="torch"), nvfp4.quantize(w))
    with pytest.raises(ValueError, match="backend must be one of"):
        kquant.quantize(w, backend="cuda")
    # A compiled (non-interpreted) kernel asked to run on CPU tensors refuses instead of falling back.
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        backend.check_backend("triton", object(), w, what="test")
