"""fp4kit.kernels against the fp4kit.formats reference, on small shapes.

The kernels run in Triton's interpreter, on CPU tensors, on every machine: TRITON_INTERPRET=1
is set here before triton is imported (Triton reads it when `triton.language` and the kernels
are decorated). Where that cannot hold in this process (some earlier module imported triton
without it, or a CUDA machine, whose kernels in this process are compiled for the GPU that
tests/gpu uses), `test_in_fresh_process` runs this file in a subprocess with TRITON_INTERPRET=1.
tests/gpu runs the kernels compiled, on bf16 and real shapes. Quantized bytes and dequantized
weights must be identical; GEMM and MoE outputs within the tolerances stated at each test.
fp32 / fp16 activations only: bf16 arithmetic is not reliable in the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# Not interpreting already, and triton imported without it or a GPU here (whose tests need
# compiled kernels in this process): the interpreter runs in a subprocess instead.
IN_SUBPROCESS_ONLY = (os.environ.get("TRITON_INTERPRET") != "1"
                      and ("triton" in sys.modules or torch.cuda.is_available()))
if not IN_SUBPROCESS_ONLY:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fp4kit.formats import e2m1, nvfp4  # noqa: E402
from fp4kit.formats.errors import FormatError  # noqa: E402
from fp4kit.kernels import backend, moe_gemm, packed_gemm, quantize as kquant, w4a16_gemm  # noqa: E402


@pytest.fixture(autouse=True)
def _in_this_process(request):
    if IN_SUBPROCESS_ONLY and request.node.name != "test_in_fresh_process":
        pytest.skip("the interpreter cannot run in this process (triton imported without "
                    "TRITON_INTERPRET=1, or a GPU here); see test_in_fresh_process")


def test_in_fresh_process():
    if not IN_SUBPROCESS_ONLY:
        pytest.skip("the tests of this file ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


DEVICE = "cpu"  # the interpreter's


def _rand(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_nvfp4(got: nvfp4.NVFP4Tensor, ref: nvfp4.NVFP4Tensor) -> None:
    assert got.packed.shape == ref.packed.shape
    assert torch.equal(got.packed.cpu(), ref.packed.cpu()), "packed codes differ"
    assert torch.equal(_bits(got.block_scale).cpu(), _bits(ref.block_scale).cpu()), "block scales differ"
    assert torch.equal(_bits(got.global_scale).cpu(), _bits(ref.global_scale).cpu()), "global scales differ"


def check_quantize(w: torch.Tensor, **kw) -> torch.Tensor:
    """Kernel on DEVICE vs reference on CPU: identical bytes and 4/6 choices. Returns the choice."""
    got, got_choice = kquant.quantize(w.to(DEVICE), return_choice=True, **kw)
    ref, ref_choice = nvfp4.quantize(w, return_choice=True, **kw)
    assert_same_nvfp4(got, ref)
    assert torch.equal(got_choice.cpu(), ref_choice)
    return ref_choice


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
    spec = importlib.util.spec_from_file_location("check_markstein", Path(__file__).parents[1] / "scripts" / "check_markstein.py")
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
@pytest.mark.parametrize("arith", ["cuda", "cpu"])
def test_quantize_both_constant_divisions(rule, arith):
    w = _rand(32, 16, 64, seed=7)  # 32 global scales: the two divisions differ on some of them
    check_quantize(w, scale_rule=rule, arith=arith)
    other = "cpu" if arith == "cuda" else "cuda"
    a = kquant.quantize(w.to(DEVICE), scale_rule=rule, arith=arith)
    b = kquant.quantize(w.to(DEVICE), scale_rule=rule, arith=other)
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


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


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
    assert torch.equal(kquant.codes_probe(x.to(DEVICE), idx.to(DEVICE)).cpu(), packed_codes(x, idx))
    vi = torch.randint(0, 8, (4096, 8), generator=g)
    got = kquant.codes_probe(x.to(DEVICE), E2M1_VALUES[vi].to(DEVICE)).cpu()
    assert torch.equal(got, packed_codes(x, vi.to(torch.int32)))
    with pytest.raises(ValueError, match="codes_probe takes fp32 x and idx"):
        kquant.codes_probe(x[:, :4].to(DEVICE), idx[:, :4].to(DEVICE))


@pytest.mark.parametrize("rows", [24, 32])  # 96 or 128 blocks per member
def test_quantize_4o6_importance_and_global_amax(rows):
    w = _rand(2, rows, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    choice = check_quantize(w, scale_rule="4o6", importance=torch.rand(64, generator=g))
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


@pytest.mark.parametrize("rule", ["6", "4o6"])
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
    fused = check_quantize(w, scale_rule=rule, importance=imp)
    assert max_passes == []  # no separate max pass
    monkeypatch.setitem(kquant.STACK, "max_member_bytes", None)
    two, choice = kquant.quantize(w.to(DEVICE), scale_rule=rule, importance=imp, return_choice=True)
    assert max_passes == [(4, 32, 64)]
    assert torch.equal(choice.cpu(), fused)
    assert_same_nvfp4(two, nvfp4.quantize(w, scale_rule=rule, importance=imp))


@pytest.mark.parametrize("schedule", [dict(lag=1, max_tiles=4, quant_tiles=2, prefetch=True),
                                      dict(lag=2, max_tiles=8, quant_tiles=4, prefetch=False),
                                      dict(lag=5, max_tiles=4, quant_tiles=4, prefetch=True)])
def test_quantize_stack_schedules(schedule, monkeypatch):
    # Members of 5 tiles: max items and quantize items that run past a member's end, groups
    # with more quantize slots than items, a lag longer than the stack; every tile quantized once,
    # and every tile in its member's max (member i has its max in tile i); fp32, fp16 and bf16
    # (the last two with their maxima on bit patterns).
    for key, value in schedule.items():
        monkeypatch.setitem(kquant.STACK, key, value)
    w = _rand(5, 40, 256, seed=13)
    for i in range(5):
        w[i, 8 * i + 3] *= 50.0
    check_quantize(w, scale_rule="4o6")
    check_quantize(w.to(torch.float16), scale_rule="6")
    check_quantize(w.to(torch.bfloat16), scale_rule="6")


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
    got, _, own = kquant.launch(w.to(DEVICE), "6")
    assert torch.equal(own.cpu(), w.float().abs().amax(dim=(1, 2)))
    assert_same_nvfp4(got, nvfp4.quantize(w, scale_rule="6"))
    for bad in (float("nan"), float("inf"), -float("inf")):
        v = w.clone()
        v[3, 4, 17] = bad
        flagged = kquant.launch(v.to(DEVICE), "6")[2].cpu()  # NaN counts as +Inf
        assert flagged[3] == float("inf") and torch.equal(flagged[:3], own[:3].cpu())
        with pytest.raises(FormatError, match=r"first at index \(3, 4, 17\)"):
            kquant.quantize(v.to(DEVICE), scale_rule="4o6")


def test_quantize_stack_schedule_checked(monkeypatch):
    monkeypatch.setitem(kquant.STACK, "max_tiles", 6)
    with pytest.raises(ValueError, match="max_tiles a multiple of 4"):
        kquant.quantize(_rand(2, 32, 64).to(DEVICE))


def test_quantize_stack_reach_and_non_finite_member(monkeypatch):
    w = _rand(3, 32, 64, seed=10).to(DEVICE)
    assert kquant.fused_stack(w, 3, 128) and not kquant.fused_stack(w, 1, 128)
    assert not kquant.fused_stack(w[:, :24], 3, 96)  # members not whole tiles of 128 blocks
    monkeypatch.setitem(kquant.STACK, "max_member_bytes", 32 * 64 * 4)  # the member's size exactly
    assert kquant.fused_stack(w, 3, 128) and not kquant.fused_stack(w.double(), 3, 128)
    w[1, 7, 3] = float("nan")  # flagged by the stack kernel's own max pass
    with pytest.raises(FormatError, match=r"1 NaN and 0 Inf values \(first at index \(1, 7, 3\)\)"):
        kquant.quantize(w, scale_rule="4o6")


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


# --------------------------------------------------------------------------------------------
# dequantize: the GEMM's in-register weights equal W.dequantize() bit for bit
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_dequantize_exact(dtype, rule):
    w = _rand(40, 80, seed=7)  # K=80: a partial 64-wide tile; N=40: a partial row tile
    w[3] = 0.0
    w[5, :16] *= 1e-7  # subnormal e4m3 block scales
    wq = nvfp4.quantize(w, scale_rule=rule)
    got = w4a16_gemm.dequantize(wq.to(DEVICE), dtype)
    assert torch.equal(_bits(got).cpu(), _bits(wq.dequantize(dtype)))


def test_dequantize_every_code_and_scale_byte():
    # All 256 packed bytes against all 126 finite positive scale bytes (subnormals included).
    codes = torch.arange(256, dtype=torch.uint8).repeat(126, 1)  # [126, 256] -> K = 512
    scale_bytes = torch.arange(1, 127, dtype=torch.uint8)[:, None].repeat(1, 32)
    wq = nvfp4.NVFP4Tensor(codes, scale_bytes.view(torch.float8_e4m3fn), torch.tensor(0.37))
    for dtype in (torch.float32, torch.float16):
        got = w4a16_gemm.dequantize(wq.to(DEVICE), dtype)
        assert torch.equal(_bits(got).cpu(), _bits(wq.dequantize(dtype)))


# --------------------------------------------------------------------------------------------
# W4A16 GEMM
# --------------------------------------------------------------------------------------------
def _gemm_tolerance(x, wdq, dtype):
    """Elementwise bound: rounding of the output to `dtype` (half an ulp, relative) plus fp32
    accumulation error K * 2^-24 * sum|x||w| (products of fp16/fp32 inputs: the fp32 reference's
    own error counted twice)."""
    k = x.shape[-1]
    out_ulp = {torch.float32: 2.0**-24, torch.float16: 2.0**-11}[dtype]
    return lambda ref: out_ulp * ref.abs() + 2 * k * 2.0**-24 * (x.double().abs() @ wdq.double().abs().T) + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 17, 70, 140])
@pytest.mark.parametrize("split", [None, 1])
def test_w4a16_matmul(dtype, m, split):
    n, k = 72, 160
    wq = nvfp4.quantize(_rand(n, k, seed=8), scale_rule="4o6")
    x = _rand(m, k, seed=9, dtype=dtype)
    cfg = None
    if split == 1:
        cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE))
        cfg.update(SPLIT=1, k_per_split=k)
    y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=cfg).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    # the CUDA-core GEMV and the mma kernel (GPU) multiply by the fp32 weights, the wgmma kernel
    # by them in x's dtype
    used = cfg or w4a16_gemm.config(m, n, k, torch.device(DEVICE), dtype)
    wdq = wq.dequantize(torch.float32 if used.get("gemv") or used.get("mma") else dtype)
    ref = x.double() @ wdq.double().T
    assert torch.all((y.double() - ref).abs() <= _gemm_tolerance(x, wdq, dtype)(ref))
    torch_y = w4a16_gemm.w4a16_matmul(x, wq, backend="torch")
    assert torch_y.shape == y.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("nk", [(72, 160), (64, 256)])  # ragged (masked) and even tiles
def test_w4a16_gemv(dtype, m, nk, monkeypatch):
    # The CUDA-core kernel for a few rows (w4a16_gemm.GEMV), with and without split-K. Its
    # weights are W.dequantize()'s fp32 values (not rounded to the activation dtype).
    monkeypatch.setitem(w4a16_gemm.GEMV, "max_m", 4)
    monkeypatch.setitem(w4a16_gemm.MMA, "max_m", 0)
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=12), scale_rule="4o6")
    x = _rand(m, k, seed=13, dtype=dtype)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE))
    assert cfg["gemv"]
    for split in (cfg["SPLIT"], 1):
        forced = dict(cfg, SPLIT=split, k_per_split=cfg["k_per_split"] if split > 1 else k)
        y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=forced).cpu()
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.all((y.double() - ref).abs() <= _gemm_tolerance(x, wdq, dtype)(ref)), split


@pytest.mark.parametrize("m", [1, 5, 9, 16])
@pytest.mark.parametrize("nk", [(40, 256), (72, 400), (64, 224)])
@pytest.mark.parametrize("launch", [(2, 4, 2, 0), (1, 8, 1, 0), (1, 1, 2, 0, 4), (2, 2, 1, 0, 2)])
def test_w4a16_mma(m, nk, launch):
    # The register-fed matrix-unit kernel (w4a16_gemm.MMA), forced: on a GPU its inline PTX, here
    # its interpreter form (the same lanes, loads, K order and epilogue; the warp's mma.sync
    # emulated). One or two activation tiles (9, 16 rows) and weight tiles per warp, ragged N
    # (rows past N read the last one), K of 2, 3.125 (K / 16 odd: scale bytes one at a time)
    # and 1.75 steps, split-K and not; the K range shared by 2 or 4 groups of warps (runs of whole
    # steps, the last one ragged or masked, groups left without a step where there are fewer
    # steps than groups). Its weights are W.dequantize()'s fp32 values (E2M1 times
    # the scale exactly, the global scale applied to the sum): within fp32-accumulation error,
    # counted for tensor-core accumulation as in tests/gpu.
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=30), scale_rule="4o6")
    x = _rand(m, k, seed=31, dtype=torch.float16)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    bound = 2.0**-11 * ref.abs() + 4 * k * 2.0**-24 * (x.double().abs() @ wdq.double().abs().T)
    cfg = w4a16_gemm.mma_config(m, n, k, torch.device(DEVICE), *launch)
    assert cfg["BLOCK_M"] == (8 if m <= 8 else 16) and cfg["KWARPS"] == (launch[4] if len(launch) > 4 else 1)
    for forced in (cfg, dict(cfg, SPLIT=1, k_per_split=-(-k // 128) * 128)):
        y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=dict(forced)).cpu()
        assert y.dtype == torch.float16 and y.shape == (m, n)
        assert torch.all((y.double() - ref).abs() <= bound), forced["SPLIT"]


def test_mma_vec_needs_aligned_rows_and_k_multiple_of_32():
    # 16-byte loads only where every address they read is 16-byte aligned, and never in the
    # interpreter (which runs the kernels' emulation instead of their PTX).
    k = 2688
    packed = torch.zeros(64, k // 2, dtype=torch.uint8)
    x = torch.zeros(4, k, dtype=torch.bfloat16)
    x4 = x.view(torch.int64)
    compiled = object()  # anything but an interpreted kernel
    assert packed.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
    assert w4a16_gemm.mma_vec(packed, x4, k // 4, k, compiled)
    assert not w4a16_gemm.mma_vec(packed, x4, k // 4 + 1, k, compiled)  # rows 8 bytes off
    assert not w4a16_gemm.mma_vec(packed.view(-1)[8:], x4, k // 4, k, compiled)
    assert not w4a16_gemm.mma_vec(packed, x4.view(-1)[1:], k // 4, k, compiled)
    assert not w4a16_gemm.mma_vec(packed, x4, k // 4, k + 16, compiled)  # K % 32 == 16
    if w4a16_gemm.interpreted(w4a16_gemm._mma_kernel):
        assert not w4a16_gemm.mma_vec(packed, x4, k // 4, k, w4a16_gemm._mma_kernel)


def test_mma_kernel_picks_and_refusals():
    # Picked for 2-8 rows of 16-bit activations on a GPU only; fp32 activations are refused, and
    # warps or K groups of warps that are not powers of 2 (a program's lanes are a power of 2).
    for bad in ((3, 4, 2, 2, 1), (1, 4, 2, 2, 3)):
        with pytest.raises(ValueError, match="powers of 2"):
            w4a16_gemm.mma_config(4, 64, 256, torch.device("cpu"), *bad)
    n, k = 64, 256
    for m in (1, 2, 8, 9):
        assert not w4a16_gemm.config(m, n, k, torch.device("cpu"), torch.float16).get("mma")
    wq = nvfp4.quantize(_rand(n, k, seed=14), scale_rule="4o6")
    x = _rand(4, k, seed=15)
    cfg = w4a16_gemm.mma_config(4, n, k, torch.device(DEVICE))
    with pytest.raises(ValueError, match="register-fed matrix-unit kernel takes bf16/fp16 activations"):
        w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE), cfg=cfg)


def test_split_k_counters_reset_between_launches():
    # Split-K sums its partials in the launch itself (the last program of each tile); the tile
    # counters are left at 0, so the same buffer serves the next launch: repeated calls agree
    # bit for bit with a launch that does not split.
    n, k, m = 72, 320, 3
    wq = nvfp4.quantize(_rand(n, k, seed=21), scale_rule="4o6")
    x = _rand(m, k, seed=22).to(DEVICE)
    cfg = w4a16_gemm.config(m, n, k, torch.device(DEVICE))
    assert cfg["SPLIT"] > 1
    ys = [w4a16_gemm.w4a16_matmul(x, wq.to(DEVICE), cfg=cfg).cpu() for _ in range(3)]
    counters = w4a16_gemm.split_counters(torch.device(DEVICE), 1)
    assert int(counters.abs().sum()) == 0
    assert all(torch.equal(y, ys[0]) for y in ys)
    ref = x.cpu().double() @ wq.dequantize().double().T
    assert torch.all((ys[0].double() - ref).abs() <= _gemm_tolerance(x.cpu(), wq.dequantize(), torch.float32)(ref))


def test_split_counters_per_stream_and_per_capture(monkeypatch):
    # Eager launches share a buffer per (device, stream); the launches of one graph capture share
    # a buffer of their own, zeroed when it is made; the next capture gets a new one; without a
    # capture id every launch in the capture gets a fresh one.
    dev = torch.device("cpu")
    state = {"value": (7, False, None)}
    monkeypatch.setattr(w4a16_gemm, "_stream_state", lambda device: state["value"])
    monkeypatch.setattr(w4a16_gemm, "_COUNTERS", {})
    monkeypatch.setattr(w4a16_gemm, "_CAPTURE_COUNTERS", {})
    eager = w4a16_gemm.split_counters(dev, 10)
    assert eager is w4a16_gemm.split_counters(dev, 10) and int(eager.abs().sum()) == 0
    state["value"] = (8, False, None)
    assert w4a16_gemm.split_counters(dev, 10) is not eager  # another stream
    state["value"] = (7, True, 41)
    eager[:3] = 5  # a graph's buffer is not the eager one, and starts at zero
    first = w4a16_gemm.split_counters(dev, 10)
    assert first is not eager and int(first.abs().sum()) == 0
    assert w4a16_gemm.split_counters(dev, 100) is first  # the same capture
    bigger = w4a16_gemm.split_counters(dev, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and int(bigger.abs().sum()) == 0
    state["value"] = (7, True, 42)  # the next capture on the stream
    second = w4a16_gemm.split_counters(dev, 10)
    assert second is not bigger and int(second.abs().sum()) == 0
    state["value"] = (7, True, None)  # capturing, id unknown
    a, b = w4a16_gemm.split_counters(dev, 10), w4a16_gemm.split_counters(dev, 10)
    assert a is not b and a.numel() == 10 and int(a.abs().sum()) == 0
    state["value"] = (7, False, None)
    assert w4a16_gemm.split_counters(dev, 10) is eager


def test_w4a16_matmul_batched_input_and_errors():
    wq = nvfp4.quantize(_rand(32, 64, seed=10))
    x = _rand(2, 3, 64, seed=11)
    y = w4a16_gemm.w4a16_matmul(x.to(DEVICE), wq.to(DEVICE)).cpu()
    ref = x.double() @ wq.dequantize().double().T
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(FormatError, match="does not end in K=64"):
        w4a16_gemm.w4a16_matmul(_rand(3, 48).to(DEVICE), wq.to(DEVICE))
    with pytest.raises(TypeError, match="expected an NVFP4Tensor"):
        w4a16_gemm.w4a16_matmul(x, torch.zeros(32, 64))


# --------------------------------------------------------------------------------------------
# Grouped MoE against transformers' Nemotron-H expert block on the dequantized weights
# --------------------------------------------------------------------------------------------
def _transformers_experts(n_exp, hid, inter, top_k, up_w, down_w):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = NemotronHConfig(n_routed_experts=n_exp, hidden_size=hid, moe_intermediate_size=inter,
                          num_experts_per_tok=top_k, mlp_hidden_act="relu2")
    cfg._experts_implementation = "eager"
    mod = NemotronHExperts(cfg).to(up_w.dtype)
    with torch.no_grad():
        mod.up_proj.copy_(up_w)
        mod.down_proj.copy_(down_w)
    return mod


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("path", ["small", "sorted", "small-split", "gemv", "gemv-split"])
def test_moe_matches_transformers_experts(dtype, rtol, tokens, path, monkeypatch):
    # small: routing in the kernels (1 token: a program per routed assignment; 13 tokens: a
    # program per expert); small-split: the same with K split 2 ways (partials summed in the
    # next kernel); gemv(-split): the same on the CUDA-core tiles (two rows of an expert per
    # program; fp32 weights); sorted: the sort-based path.
    n_exp, hid, inter, top_k = 8, 128, 96, 3
    monkeypatch.setitem(moe_gemm.SMALL, "max_assignments", 0 if path == "sorted" else 512)
    monkeypatch.setitem(moe_gemm.SMALL, "programs_per_sm", 1000 if path.endswith("-split") else 0)
    monkeypatch.setitem(moe_gemm.MOE_GEMV, "max_assignments", 512 if path.startswith("gemv") else 0)
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=12, scale=0.1), scale_rule="4o6")
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=13, scale=0.1))
    g = torch.Generator().manual_seed(14)
    x = _rand(tokens, hid, seed=15, dtype=dtype)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=g)
    with torch.no_grad():
        ref = _transformers_experts(n_exp, hid, inter, top_k, up.dequantize(dtype), down.dequantize(dtype))(x, ids, weights)
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE)).cpu()
    assert got.dtype == dtype
    # Relative Frobenius error: fp32 -> accumulation order only; fp16 -> the reference rounds its
    # intermediates to fp16 as the kernel does, but sums in another order.
    assert float((got.double() - ref.double()).norm() / ref.double().norm()) < rtol
    torch_ref = moe_gemm.moe_experts(x, ids, weights, up, down, backend="torch")
    assert float((torch_ref.double() - ref.double()).norm() / ref.double().norm()) < rtol


def test_moe_unused_experts_and_errors():
    n_exp, hid, inter = 6, 32, 48
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=16))
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=17))
    x = _rand(4, hid, seed=18)
    ids = torch.tensor([[5, 0], [5, 2], [0, 5], [2, 0]])  # experts 1, 3, 4 get no tokens
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(19))
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE)).cpu()
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(), down.dequantize().double())
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(FormatError, match=re.escape("down_proj shape")):
        moe_gemm.moe_experts(x, ids, weights, up, up)


def test_moe_mma_launch_defaults_to_the_sorted_path_when_small():
    # A few assignments (the in-kernel-routing path's size) with the register-fed launch shape
    # and no explicit path: the sorted path, which is the only one that runs it.
    n_exp, hid, inter, top_k, tokens = 4, 128, 64, 2, 3
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=44, scale=0.1))
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=45, scale=0.1))
    x = _rand(tokens, hid, seed=46, dtype=torch.float16)
    ids = torch.tensor([[0, 2], [2, 3], [0, 1]])
    weights = torch.rand((tokens, top_k), generator=torch.Generator().manual_seed(47))
    assert tokens * top_k <= moe_gemm.SMALL["max_assignments"]
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE),
                               cfg=moe_gemm.moe_mma_config(1, 1, 0)).cpu()
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(),
                                     down.dequantize().double())
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("launch", [(2, 2, 2), (1, 4, 0)])
def test_moe_sorted_mma(launch):
    # The sorted path on the register-fed matrix units (moe_gemm.MOE_MMA), forced: K of 3.125
    # and 1.625 steps, scale bytes one at a time (K / 16 odd), rows not filling the last tile,
    # runs of 1 to 10 assignments per expert.
    n_exp, hid, inter, top_k, tokens = 8, 400, 208, 2, 37
    up = nvfp4.quantize(_rand(n_exp, inter, hid, seed=40, scale=0.1), scale_rule="4o6")
    down = nvfp4.quantize(_rand(n_exp, hid, inter, seed=41, scale=0.1))
    x = _rand(tokens, hid, seed=42, dtype=torch.float16)
    g = torch.Generator().manual_seed(43)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand((tokens, top_k), generator=g)
    cfg = dict(moe_gemm.moe_mma_config(*launch), small=False)
    got = moe_gemm.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), up.to(DEVICE), down.to(DEVICE),
                               cfg=cfg).cpu()
    ref = moe_gemm.experts_reference(x.double(), ids, weights.double(), up.dequantize().double(),
                                     down.dequantize().double())
    assert got.dtype == torch.float16
    assert float((got.double() - ref).norm() / ref.norm()) < 5e-3


# --------------------------------------------------------------------------------------------
# Launch-shape picks from benchmark sweeps (pure Python: the rows are what the sweeps record)
# --------------------------------------------------------------------------------------------
def test_pick_decode_sums_over_shapes_and_keeps_register_cap():
    base = {"K": 1, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}
    rows = [dict(base, N=n, M=1, maxnreg=mr, ms=t) for n, mr, t in
            ((1, None, 1.0), (2, None, 5.0), (1, 96, 2.0), (2, 96, 3.0), (1, 80, None), (2, 80, 0.1))]
    # None: 6.0, 96: 5.0, 80: failed once (inf) -> 96, carried as maxnreg
    assert w4a16_gemm.pick_decode(rows) == dict({k: v for k, v in base.items() if k != "K"}, maxnreg=96)
    rows = [dict(r, maxnreg=None, ms=1.0) if r["maxnreg"] == 96 else r for r in rows]
    assert "maxnreg" not in w4a16_gemm.pick_decode(rows)


def test_split_count_balances_long_k_only():
    # About programs_per_sm programs per multiprocessor; with balance (0.9, 16) a split count
    # that leaves the busiest multiprocessors with a program more than most is raised while a
    # split's K range keeps 16 K tiles: 448 tiles of 64 K tiles on 132 multiprocessors fill 448 / 528
    # of 4 slots each -> 2 splits (896 / 924). Balanced counts stay; short K is not split further.
    sc = w4a16_gemm.split_count
    assert sc(448, 64, 132, 4) == 1 and sc(448, 64, 132, 4, (0.9, 16)) == 2
    assert sc(128, 64, 132, 4) == sc(128, 64, 132, 4, (0.9, 16)) == 4  # 512 of 528
    assert sc(58, 21, 132, 4) == sc(58, 21, 132, 4, (0.9, 16)) == 9  # 21 K tiles: nothing to spare
    assert sc(448, 30, 132, 4, (0.9, 16)) == 1  # 2 splits would be 15 K tiles each
    assert sc(448, 31, 132, 4, (0.9, 16)) == 2  # 16 and 15
    assert sc(1000, 8, 132, 4, (0.9, 1)) == 1  # more tiles than wanted programs: one split
    # a share never reached: the first count stays
    assert sc(133, 64, 132, 1, (1.0, 64)) == 1


def test_pick_mma_sums_relative_times_over_problems():
    def row(n, m, launch, t):
        nw, pps, rows, pf, kw = launch
        r = {"N": n, "K": n, "M": m, "num_warps": nw, "programs_per_sm": pps, "rows": rows, "prefetch": pf, "ms": t}
        return r if kw is None else dict(r, kwarps=kw)

    # a (a row of an older sweep, without K groups: 1), b, c: the same but for the K groups.
    # Problems 1 (small) and 2 (large). Summed times would pick b (10.9 against 11.0); relative
    # to each problem's best: a 1 + 10/9 = 2.11, b 1.9 + 1 = 2.9, c 1.2 + 9.5/9 = 2.26 -> a.
    a, b, c = (2, 4, 2, 2, None), (4, 8, 1, 0, 1), (4, 8, 1, 0, 4)
    rows = [row(1, 2, a, 1.0), row(2, 4, a, 10.0), row(1, 2, b, 1.9), row(2, 4, b, 9.0), row(1, 2, c, 1.2),
            row(2, 4, c, 9.5)]
    assert w4a16_gemm.pick_mma(rows) == {"num_warps": 2, "programs_per_sm": 4, "rows": 2, "prefetch": 2, "kwarps": 1}
    # a failed launch (None) never wins: without a, problem 1's best is c's 1.2: b 2.58, c 2.06
    rows[0]["ms"] = None
    assert w4a16_gemm.pick_mma(rows) == {"num_warps": 4, "programs_per_sm": 8, "rows": 1, "prefetch": 0, "kwarps": 4}
    rows[4]["ms"] = None
    assert w4a16_gemm.pick_mma(rows) == {"num_warps": 4, "programs_per_sm": 8, "rows": 1, "prefetch": 0, "kwarps": 1}


def test_pick_mma_wide_launch_and_reach():
    def row(n, m, kernel, t, launch=None):
        r = {"N": n, "K": 1000, "M": m, "kernel": kernel, "ms": t}
        if launch:
            r.update(zip(("num_warps", "programs_per_sm", "rows", "prefetch"), launch))
        return r

    a, b = (1, 8, 2, 2), (2, 4, 2, 2)
    rows = []
    # wgmma, a, b per (N, M): a is nearer each problem's best; summed over M it wins at N >= 200 (at N = 400
    # though it loses at M = 16), loses at N = 100
    for n, m, base, ta, tb in ((100, 12, 5.0, 6.0, 4.0), (100, 16, 5.0, 6.0, 9.0), (200, 12, 9.0, 8.0, 9.5),
                               (200, 16, 9.0, 8.5, 9.5), (400, 12, 20.0, 15.0, 18.0), (400, 16, 20.0, 21.0, 18.0)):
        rows += [row(n, m, "matrix-unit", base), row(n, m, "mma", ta, a), row(n, m, "mma", tb, b)]
    want = {"rows": 2, "num_warps": 1, "programs_per_sm": 8, "prefetch": 2, "kwarps": 1}
    assert w4a16_gemm.pick_mma_wide(rows) == dict(want, min_weights=200 * 1000)
    # a loss on the middle shape in the sum: reach only from the largest
    rows = [dict(r, ms=10.5) if r["kernel"] == "mma" and r["N"] == 200 and r["M"] == 16 and r["rows"] == 2
            and r["num_warps"] == 1 else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(rows)["min_weights"] == 400 * 1000
    # losing on the largest shape: never
    slow = [dict(r, ms=30.0) if r["kernel"] == "mma" and r["N"] == 400 else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(slow) == dict(want, min_weights=None)
    # a failed launch (None) never wins: b, which beats the wgmma kernel on the largest shape only
    rows = [dict(r, ms=None) if r["kernel"] == "mma" and r["N"] == 400 and r["M"] == 12 and r["num_warps"] == 1
            else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(rows) == {"rows": 2, "num_warps": 2, "programs_per_sm": 4, "prefetch": 2,
                                              "kwarps": 1, "min_weights": 400 * 1000}


def test_pick_mma_wide_judges_a_launch_where_it_would_run():
    # c is nearer the best on the small shape (where a loses to the wgmma kernel and would not run)
    # but far from it on the large one: over all problems c is the nearer (what pick_mma takes),
    # routed (a from N = 400 up, the wgmma kernel below) a is
    def row(n, m, kernel, t, launch=None):
        r = {"N": n, "K": 1000, "M": m, "kernel": kernel, "ms": t}
        if launch:
            r.update(zip(("num_warps", "programs_per_sm", "rows", "prefetch", "kwarps"), launch))
        return r

    a, c = (1, 8, 2, 2, 1), (1, 2, 2, 2, 4)
    rows = []
    for n, base, ta, tc in ((100, 5.0, 10.0, 4.2), (400, 40.0, 20.0, 30.0)):
        for m in (12, 16):
            rows += [row(n, m, "matrix-unit", base), row(n, m, "mma", ta, a), row(n, m, "mma", tc, c)]
    assert w4a16_gemm.pick_mma([r for r in rows if r["kernel"] == "mma"])["kwarps"] == 4
    assert w4a16_gemm.pick_mma_wide(rows) == {"num_warps": 1, "programs_per_sm": 8, "rows": 2, "prefetch": 2,
                                              "kwarps": 1, "min_weights": 400 * 1000}
    # where c's routing is the nearer (a no faster than c on the large shape), c and its reach
    rows = [dict(r, ms=30.0) if r["kernel"] == "mma" and r["N"] == 400 and r.get("kwarps") == 1 else r for r in rows]
    assert w4a16_gemm.pick_mma_wide(rows) == {"num_warps": 1, "programs_per_sm": 2, "rows": 2, "prefetch": 2,
                                              "kwarps": 4, "min_weights": 100 * 1000}


def test_mma_wide_routing(monkeypatch):
    # 9-16 rows of 16-bit activations on a GPU go to the register-fed kernel's two activation tiles
    # for weights of MMA_WIDE["min_weights"] elements or more; smaller weights, fp32 activations,
    # 17 rows and the interpreter keep the wgmma kernel.
    monkeypatch.setattr(w4a16_gemm, "_sm_count", lambda device: 132)
    monkeypatch.setitem(w4a16_gemm.MMA_WIDE, "min_weights", 8192 * 8192)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    w = w4a16_gemm.MMA_WIDE
    for m in (9, 12, 16):
        cfg = w4a16_gemm.config(m, 8192, 8192, cuda, torch.float16)
        assert cfg["mma"] and cfg["BLOCK_M"] == 16 and cfg["num_warps"] == w["num_warps"]
        assert cfg["BLOCK_N"] == 16 * w["rows"] * w["num_warps"] and cfg["PREFETCH"] == w["prefetch"]
        assert w4a16_gemm.path(m, 8192, 8192, cuda) == "mma"
    for m, n, k, dtype, device in ((12, 3712, 2688, torch.bfloat16, cuda), (17, 8192, 8192, torch.bfloat16, cuda),
                                   (12, 8192, 8192, torch.float32, cuda), (12, 8192, 8192, torch.float16, cpu)):
        assert not w4a16_gemm.config(m, n, k, device, dtype).get("mma"), (m, n, k, dtype, device)
    monkeypatch.setitem(w4a16_gemm.MMA_WIDE, "min_weights", None)
    assert not w4a16_gemm.config(12, 8192, 8192, cuda).get("mma")


def test_row_mma_routing(monkeypatch):
    # One row of 16-bit activations on a GPU goes to the register-fed kernel (MMA's launch shape)
    # where the weight has ROW_MMA["min_weights"] elements or more and the GEMV's K step does not
    # divide K; smaller weights, a K the GEMV's step divides, fp32 activations, the interpreter
    # and a reach of None keep the GEMV.
    monkeypatch.setattr(w4a16_gemm, "_sm_count", lambda device: 132)
    monkeypatch.setitem(w4a16_gemm.ROW_MMA, "min_weights", 32768 * 1856)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for n, k, dtype in ((131072, 2688, torch.bfloat16), (32768, 1856, torch.float16), (65536, 3712, torch.bfloat16)):
        cfg = w4a16_gemm.config(1, n, k, cuda, dtype)
        assert cfg["mma"] and cfg["BLOCK_M"] == 8 and cfg["num_warps"] == w4a16_gemm.MMA["num_warps"], (n, k)
        assert w4a16_gemm.path(1, n, k, cuda, dtype) == "mma"
    for n, k, dtype, device in ((16384, 2688, torch.bfloat16, cuda), (32768, 1840, torch.bfloat16, cuda),
                                (65536, 4096, torch.bfloat16, cuda), (131072, 8192, torch.bfloat16, cuda),
                                (131072, 2688, torch.float32, cuda), (131072, 2688, torch.bfloat16, cpu)):
        assert w4a16_gemm.config(1, n, k, device, dtype).get("gemv"), (n, k, dtype, device)
    monkeypatch.setitem(w4a16_gemm.ROW_MMA, "min_weights", None)
    assert w4a16_gemm.config(1, 131072, 2688, cuda).get("gemv")


def test_pick_row_mma_reach():
    # ROW_MMA's reach: the smallest size from which the mma kernel is faster on every ragged-step
    # shape at least as large (same-size shapes summed; shapes whose GEMV step divides K do not
    # count; a failed launch counts as never faster).
    def rows(n, k, gemv, mma, ragged=True):
        return [{"N": n, "K": k, "M": 1, "kernel": "gemv", "ragged": ragged, "ms": gemv},
                {"N": n, "K": k, "M": 1, "kernel": "mma", "ragged": ragged, "ms": mma}]

    base = rows(100, 10, 1.0, 2.0) + rows(200, 10, 2.0, 1.5) + rows(400, 10, 4.0, 3.0) + rows(50, 80, 4.5, 4.0)
    assert w4a16_gemm.pick_row_mma(base) == {"min_weights": 2000}
    # a smaller shape where the mma kernel wins does not reach past a larger one where it loses
    assert w4a16_gemm.pick_row_mma(base + rows(10, 10, 1.0, 0.5) + rows(300, 10, 1.0, 1.0)) == {"min_weights": 4000}
    # same-size shapes are summed: one loss outweighed by a larger win keeps the size
    assert w4a16_gemm.pick_row_mma(base + rows(20, 100, 1.0, 1.2)) == {"min_weights": 2000}
    # a shape whose GEMV step divides K is ignored, however slow the mma kernel is there
    assert w4a16_gemm.pick_row_mma(base + rows(1000, 10, 1.0, 9.0, ragged=False)) == {"min_weights": 2000}
    # the largest ragged shape failing on the mma kernel: never
    assert w4a16_gemm.pick_row_mma(base + rows(800, 10, 1.0, None)) == {"min_weights": None}


@pytest.mark.parametrize("nk", [(32, 256), (16, 128)])
def test_gemv_probe_parts(nk):
    # The GEMV probe's three parts (`gemv_limits`): the whole loop is the GEMV's result bit for
    # bit; the arithmetic-only part gives row n the result of row n % BLOCK_N; the loads-only part
    # folds the weight's code words and scale bytes by xor per thread slot, then each fold's bytes,
    # and sums them.
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=40), scale_rule="4o6").to(DEVICE)
    x = _rand(1, k, seed=41, dtype=torch.float16).to(DEVICE)
    cfg = w4a16_gemm.config(1, n, k, torch.device(DEVICE), torch.float16)
    if cfg.get("mma"):
        cfg = dict(cfg, **{key: w4a16_gemm.GEMV["1"][key] for key in ("BLOCK_N", "num_warps")}, BLOCK_K=64)
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    gemv_cfg = dict(gemv=True, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=1,
                    SPLIT=1, k_per_split=k)
    y = w4a16_gemm.w4a16_matmul(x, wq, cfg=gemv_cfg)[0]
    whole = w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_ALL, gemv_cfg)
    assert torch.equal(whole.cpu().view(torch.int16), y.cpu().view(torch.int16))
    arith = w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_ARITHMETIC, gemv_cfg)
    assert torch.equal(arith.cpu().view(torch.int16), y.cpu()[torch.arange(n) % bn].view(torch.int16))
    loads = w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_LOADS, gemv_cfg).cpu()
    codes = wq.packed.cpu().view(torch.int64).view(n, k // bk, bk // 16)
    scales = wq.block_scale.cpu().view(torch.uint8).to(torch.int64).view(n, k // bk, bk // 16)
    fold = torch.zeros((n, bk // 16), dtype=torch.int64)
    for step in range(k // bk):
        fold ^= codes[:, step] ^ scales[:, step]
    for shift in (32, 16, 8):
        fold ^= fold >> shift
    want = (fold & 0xFF).sum(dim=1).to(torch.float32).to(torch.float16)
    assert want.abs().max() > 0 and torch.isfinite(want).all()
    assert torch.equal(loads, want)
    with pytest.raises(ValueError, match="GEMV probe takes one row and whole tiles"):
        w4a16_gemm.gemv_probe(x, wq, w4a16_gemm.PROBE_ALL, dict(gemv_cfg, BLOCK_K=3 * k))


def test_pick_gemv_max_m_stops_at_first_loss():
    def gemv(n, m, bn, t, pps=8):
        return {"N": n, "M": m, "kernel": "gemv", "tile": [m, bn, 2048, 4], "programs_per_sm": pps, "maxnreg": None,
                "ms": t}

    rows = []
    for n in (1, 2):
        for m, base_ms, gemv_ms in ((1, 3.0, 2.0), (2, 3.0, 2.5), (4, 3.0, 4.0)):
            rows.append({"N": n, "M": m, "kernel": "matrix-unit", "ms": base_ms})
            rows.append(gemv(n, m, 8, gemv_ms))
            rows.append(gemv(n, m, 16, gemv_ms + (0.1 if n == 1 else -0.3)))  # 16 wins the sum over shapes
    rows.append(gemv(1, 1, 8, None, pps=4))  # a failed launch shape is never picked
    rows.append(gemv(2, 1, 8, 0.1, pps=4))
    got = w4a16_gemm.pick_gemv(rows)
    assert got["1"] == {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 4, "programs_per_sm": 8}
    assert got["max_m"] == 2  # loses at M = 4
    rows = [dict(r, ms=5.0) if r["kernel"] == "gemv" and r["M"] == 1 and r["N"] == 2 else r for r in rows]
    assert w4a16_gemm.pick_gemv(rows)["max_m"] == 0


def test_gemv_k_tile_pads_k_least():
    # The CUDA-core K step is halved with the warps while that pads K less; among equal padding
    # the most warps. Activation rows per program: 1, 2, or 4 for 3-4 rows.
    tile = {"BLOCK_K": 2048, "num_warps": 4, "BLOCK_N": 8}
    got = {k: (c["BLOCK_K"], c["num_warps"]) for k in (8192, 2688, 3712, 1856, 4112)
           for c in [w4a16_gemm._gemv_k_tile(k, tile)]}
    assert got == {8192: (2048, 4), 2688: (1024, 2), 3712: (2048, 4), 1856: (2048, 4), 4112: (512, 1)}
    assert w4a16_gemm._gemv_k_tile(2688, tile)["BLOCK_N"] == 8
    assert [w4a16_gemm.gemv_block_m(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_pick_moe_gemv_tile_and_threshold():
    rows = []
    for t, base, a, b in ((1, 40.0, 20.0, 25.0), (8, 190.0, 100.0, 90.0), (16, 300.0, 280.0, 320.0), (64, 500.0, 600.0, 400.0)):
        rows.append({"tokens": t, "path": "matrix-unit", "ms": base})
        rows.append({"tokens": t, "path": "gemv", "tile": [1, 8, 2048, 4], "ms": a})
        rows.append({"tokens": t, "path": "gemv", "tile": [2, 8, 2048, 4], "ms": b})
    got = moe_gemm.pick_gemv(rows, top_k=6, decode_tokens=8)
    # summed up to 8 tokens: 120 against 115 -> the second tile; it loses at 16 tokens
    assert got == {"max_assignments": 48, "BLOCK_M": 2, "BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1}


def test_moe_config_paths_by_size_dtype_and_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    n_exp = 128
    gemv_max = moe_gemm.MOE_GEMV["max_assignments"]
    mma_max = int(moe_gemm.MOE_MMA["max_per_expert"] * n_exp)
    assert moe_gemm.moe_config(gemv_max, n_exp, cuda).get("gemv")
    assert moe_gemm.moe_config(gemv_max + 6, n_exp, cuda).get("mma")
    assert moe_gemm.moe_config(mma_max, n_exp, cuda, torch.float16).get("mma")
    beyond = moe_gemm.moe_config(mma_max + 6, n_exp, cuda)
    assert not beyond.get("mma") and not beyond.get("gemv") and beyond["BLOCK_M"] in (16, 64)
    for dtype, device in ((torch.float32, cuda), (torch.bfloat16, cpu)):  # fp32 or the interpreter: wgmma tiles
        assert not moe_gemm.moe_config(gemv_max + 6, n_exp, device, dtype).get("mma")


def test_pick_moe_mma_launch_and_reach():
    rows = []
    for t, wg, a, b in ((32, 400.0, 300.0, 290.0), (64, 500.0, 350.0, 340.0), (128, 560.0, 420.0, 600.0),
                        (256, 640.0, 700.0, 710.0)):
        rows.append({"tokens": t, "path": "sorted", "ms": wg})
        rows.append({"tokens": t, "path": "sorted-mma", "launch": [2, 2, 2], "ms": a})
        rows.append({"tokens": t, "path": "sorted-mma", "launch": [1, 2, 2], "ms": b})
    # [1, 2, 2] is faster at 32 and 64 tokens but loses at 128; [2, 2, 2] wins up to 128
    assert moe_gemm.pick_mma(rows, n_exp=128, top_k=6) == {"max_per_expert": 6.0, "rows": 2, "num_warps": 2,
                                                           "prefetch": 2}
    rows = [dict(r, ms=None) if r["path"] == "sorted-mma" and r["launch"] == [2, 2, 2] else r for r in rows]
    assert moe_gemm.pick_mma(rows, n_exp=128, top_k=6) == {"max_per_expert": 3.0, "rows": 1, "num_warps": 2,
                                                           "prefetch": 2}
    rows = [dict(r, ms=1e9) if r["path"] == "sorted-mma" else r for r in rows]
    assert moe_gemm.pick_mma(rows, n_exp=128, top_k=6)["max_per_expert"] == 0


def test_pick_small_threshold_from_the_sorted_path():
    rows = []
    for t, sorted_ms, small_ms in ((1, 8.0, 4.0), (2, 9.0, 6.0), (8, 20.0, 19.0), (64, 50.0, 55.0)):
        rows.append({"tokens": t, "path": "sorted", "ms": sorted_ms})
        rows.append({"tokens": t, "path": "small", "programs_per_sm": 2, "max_parts": 4, "ms": small_ms})
        rows.append({"tokens": t, "path": "small", "programs_per_sm": 4, "max_parts": 4, "ms": small_ms + 1})
    assert moe_gemm.pick_small(rows, top_k=6) == {"max_assignments": 48, "programs_per_sm": 2, "max_parts": 4}
    rows = [dict(r, ms=1.0) if r["path"] == "small" else r for r in rows]
    assert moe_gemm.pick_small(rows)["max_assignments"] == 512


# --------------------------------------------------------------------------------------------
# W4A16 GEMM on a pre-packed weight (packed_gemm)
# --------------------------------------------------------------------------------------------
def _any_weight(n, k, seed):
    """Random codes and block-scale bytes of both signs (not NaN), global scale 0.37."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.int32)
    scales = finite[torch.randint(0, len(finite), (n, k // 16), generator=g)].to(torch.uint8)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.tensor(0.37))


@pytest.mark.parametrize("nk", [(16, 128), (40, 272), (200, 1008), (64, 2704)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_layout_round_trip(nk, dtype):
    # pack -> unpack gives the checkpoint bytes back, ragged N (rows past N zero) and ragged K
    # (K tiles of 128: 1008 = 7.9, 2704 = 21.1) included; the padding is zero codes and scales.
    n, k = nk
    w = _any_weight(n, k, seed=n + k)
    p = packed_gemm.pack(w, dtype)
    assert p.words.shape == (-(-n // 16), -(-k // 128), 32, 16) and p.scales.dtype == dtype
    back = p.unpack()
    assert torch.equal(back.packed, w.packed)
    assert torch.equal(_bits(back.block_scale), _bits(w.block_scale))
    assert torch.equal(_bits(back.global_scale), _bits(w.global_scale))
    full = nvfp4.NVFP4Tensor(torch.full((n, k // 2), 0xFF, dtype=torch.uint8),
                             torch.ones(n, k // 16).to(torch.float8_e4m3fn), torch.tensor(1.0))
    pf = packed_gemm.pack(full, dtype)  # every code 15 (four bits set): the padding adds none
    bits = (pf.words.to(torch.int32) & 0xFFFF).reshape(-1, 1) >> torch.arange(16) & 1
    assert int(bits.sum()) == 4 * n * k
    assert int(torch.count_nonzero(pf.scales)) == n * k // 16


def test_packed_fragments_exact():
    # The weights the kernel's matrix units get, decoded by the kernel's own code path (here the
    # interpreter's arithmetic on the same words): E2M1 * scale * 2^-7 of every element, fp16,
    # signed zeros included, zero in the padding. (bf16: tests/gpu, on the PTX path too.)
    w = _any_weight(128, 384, seed=3)
    got = packed_gemm.fragments(packed_gemm.pack(w, torch.float16), warps=4)
    want = (e2m1.decode(w.codes()).reshape(128, -1, 16) * w.block_scale.float().unsqueeze(-1) * 2.0 ** -7)
    assert torch.equal(_bits(got), _bits(want.reshape(128, 384).to(torch.float16)))


@pytest.mark.parametrize("m", [1, 5, 17, 40])
@pytest.mark.parametrize("nk", [(64, 256), (40, 272), (72, 160)])
@pytest.mark.parametrize("cfg", [None, {"SPLIT": 1}, {"SPLIT": 2, "BLOCK_M": 16}, {"num_warps": 8},
                                 {"SPLIT": 1, "UNROLL": 2}, {"SPLIT": 1, "UNROLL": 2, "PREFETCH": 3}])
def test_packed_matmul(m, nk, cfg):
    # fp16 activations (the interpreter's bf16 is not reliable); ragged N and K; split-K with
    # the partials summed in the launch and not; several row programs (BLOCK_M 16 below M);
    # 8 warps per program (two warpgroups); two K tiles per loop step (2 or 3 tiles here).
    n, k = nk
    wq = nvfp4.quantize(_rand(n, k, seed=10), scale_rule="4o6")
    x = _rand(m, k, seed=11, dtype=torch.float16)
    p = packed_gemm.pack(wq, torch.float16)
    y = packed_gemm.packed_matmul(x, p, cfg=cfg)
    assert y.dtype == torch.float16 and y.shape == (m, n)
    wdq = wq.dequantize(torch.float32)  # E2M1 * scale exactly, times the global scale at the end
    ref = x.double() @ wdq.double().T
    assert torch.all((y.double() - ref).abs() <= _gemm_tolerance(x, wdq, torch.float16)(ref))
    y_torch = packed_gemm.packed_matmul(x, p, backend="torch")
    assert torch.equal(y_torch, torch.nn.functional.linear(x, wq.dequantize(torch.float16)))


@pytest.mark.parametrize("unroll", [1, 2])
@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_packed_matmul_long_k(split, unroll):
    # K ranges of 7, 4 + 3, 3 + 3 + 1 and 1 x 7 tiles (the last ragged), each program's range
    # from its own start, one or two tiles per loop step (odd ranges end on a half step):
    # every tile's weights are distinct, so a tile used twice or skipped changes the sums
    # beyond the bound.
    cfg = {"SPLIT": split, "UNROLL": unroll}
    n, k = 24, 784
    wq = nvfp4.quantize(_rand(n, k, seed=13), scale_rule="6")
    x = _rand(3, k, seed=14, dtype=torch.float16)
    y = packed_gemm.packed_matmul(x, packed_gemm.pack(wq, torch.float16), cfg=cfg)
    wdq = wq.dequantize(torch.float32)
    ref = x.double() @ wdq.double().T
    assert torch.all((y.double() - ref).abs() <= _gemm_tolerance(x, wdq, torch.float16)(ref))


def test_packed_matmul_batched_strided_and_errors():
    n, k = 48, 256
    wq = nvfp4.quantize(_rand(n, k, seed=12))
    p = packed_gemm.pack(wq, torch.float16)
    x = _rand(2, 3, 2 * k, seed=13, dtype=torch.float16)[..., :k]  # rows 2K apart
    y = packed_gemm.packed_matmul(x, p)
    assert y.shape == (2, 3, n)
    assert torch.equal(y, packed_gemm.packed_matmul(x.contiguous(), p))
    with pytest.raises(ValueError, match="packed for torch.float16"):
        packed_gemm.packed_matmul(x.to(torch.bfloat16), p)
    with pytest.raises(FormatError, match="does not end in K=256"):
        packed_gemm.packed_matmul(x[..., :128], p)
    with pytest.raises(TypeError, match="PackedNVFP4"):
        packed_gemm.packed_matmul(x, wq)
    with pytest.raises(ValueError, match="unknown launch keys"):
        packed_gemm.packed_matmul(x, p, cfg={"STAGES": 3})
    with pytest.raises(ValueError, match="backend"):
        packed_gemm.packed_matmul(x, p, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        packed_gemm.pack(wq, torch.float32)
    with pytest.raises(FormatError, match="words"):
        packed_gemm.PackedNVFP4(p.words[:, :1], p.scales, p.global_scale, n, k)


def test_packed_config_and_pick():
    dev = torch.device("cpu")  # 4 multiprocessors
    c = packed_gemm.config(64, 8192, 8192, dev)
    assert (c["BLOCK_M"], c["num_warps"]) == (64, packed_gemm.PACKED["64"]["large"]["num_warps"])
    assert c["SPLIT"] * c["kt_per_split"] >= 64 > (c["SPLIT"] - 1) * c["kt_per_split"]
    assert packed_gemm.config(3, 64, 256, dev, {"SPLIT": 9})["SPLIT"] == 2  # no empty programs
    assert packed_gemm.row_class(1) == 16 and packed_gemm.row_class(17) == 32 and packed_gemm.row_class(999) == 128
    with pytest.raises(ValueError, match="BLOCK_M"):
        packed_gemm.config(3, 64, 256, dev, {"BLOCK_M": 8})
    with pytest.raises(ValueError, match="num_warps"):
        packed_gemm.config(3, 64, 256, dev, {"num_warps": 2})
    with pytest.raises(ValueError, match="UNROLL"):
        packed_gemm.config(3, 64, 256, dev, {"UNROLL": 4})
    assert packed_gemm.config(3, 64, 256, dev, {"UNROLL": 2})["UNROLL"] == 2
    with pytest.raises(ValueError, match="PREFETCH"):
        packed_gemm.config(3, 64, 256, dev, {"PREFETCH": 17})
    with pytest.raises(ValueError, match="PREFETCH"):
        packed_gemm.config(3, 64, 256, dev, {"PREFETCH": -1})
    assert packed_gemm.config(3, 64, 256, dev, {"PREFETCH": 16})["PREFETCH"] == 16
    for stages in (0, 5):
        with pytest.raises(ValueError, match="num_stages"):
            packed_gemm.config(3, 64, 256, dev, {"num_stages": stages})
    c = packed_gemm.config(3, 64, 256, dev, {"num_stages": 3, "TMA": True})
    assert (c["num_stages"], c["TMA"]) == (3, True)
    assert (packed_gemm.config(3, 64, 256, dev)["num_stages"], packed_gemm.config(3, 64, 256, dev)["TMA"]) == (1, False)
    x = torch.zeros((4, 64), dtype=torch.bfloat16)
    assert packed_gemm.tma_ready(x) and not packed_gemm.tma_ready(x[:, 1:]) and not packed_gemm.tma_ready(x.T)
    assert not packed_gemm.tma_ready(torch.zeros((4, 68), dtype=torch.bfloat16)[:, :64])  # rows 136 bytes apart
    rows = []
    for n, k in ((8192, 8192), (3712, 2688)):
        for bm, nw, pps, ms in ((64, 4, 2, 2.0), (64, 8, 2, 1.0), (32, 4, 2, 1.5)):
            small = n * k < packed_gemm.LARGE_WEIGHTS
            rows.append({"N": n, "K": k, "M": 64, "BLOCK_M": bm, "num_warps": nw, "programs_per_sm": pps,
                         "ms": ms if not small else {4: 1.0, 8: 3.0}[nw] * (0.5 if bm == 32 else 1.0)})
    table = packed_gemm.pick(rows)
    assert table["64"]["large"] == {"BLOCK_M": 64, "num_warps": 8, "programs_per_sm": 2, "UNROLL": 1, "PREFETCH": 0}
    # a prefetch distance is picked like the other keys
    rows.append({"N": 8192, "K": 8192, "M": 64, "BLOCK_M": 64, "num_warps": 8, "programs_per_sm": 2, "PREFETCH": 4,
                 "ms": 0.8})
    assert packed_gemm.pick(rows)["64"]["large"]["PREFETCH"] == 4
    table = packed_gemm.pick(rows[:-1])
    assert table["64"]["small"] == {"BLOCK_M": 32, "num_warps": 4, "programs_per_sm": 2, "UNROLL": 1, "PREFETCH": 0}
    assert table["16"] == packed_gemm.PACKED["16"]  # not swept: kept
