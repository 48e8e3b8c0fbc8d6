"""NVFP4 weight quantization on the GPU: the plain rule "6" and Four-Over-Six ("4o6").

Contract: `fp4kit.formats.nvfp4.quantize`. For every input the reference accepts this returns
its bytes (codes, block scales, global scales, 4/6 choices), for every other its error. Every
fp32 operation is the reference's, in its order: divisions by data are correctly rounded (a
reciprocal and two fused multiply-adds, exact by Markstein's theorem where `_fast_range` admits
the global scale, scripts/check_markstein.py; else an IEEE division per element), divisions by
6, 1536 and 2688 follow `arith`, E4M3 and E2M1 rounding is done on the bits, the 4/6 error sums
follow the reference's addition tree, and nothing is contracted into a multiply-add
(`backend.launch_options`).

Launches per call, whatever the number of batch members (the experts of an [E, N, K] stack):
one, `_stack_kernel`, for a stack of whole-tile members without a given global amax
(`fused_stack`): its programs take the members' max items and quantize items from one queue,
the max items `lag` members ahead, so the DRAM-bound max pass runs beside the issue-bound
quantization. Otherwise `_amax_kernel` (max|w| per member, NaN and Inf flagged), then
`_quantize_kernel`; with a given global amax that one alone, folding in the member maxima the
checks need. Launch shapes: the "quantize" launch table (`fp4kit.kernels.launch`), or `tables`.
With a `terms` list the same launches also sum what the quantize stage reports of each weight
(TERMS): sum x^2, sum (x - dequantized)^2 and the blocks on the 4 candidate, per program in fp32,
added in float64 (`_tile_terms`; the stack kernel sums x^2 in its max items), so the stage needs
no other pass over a weight. The stack kernel's programs take its items in ticket order, so
which program adds up which tile changes from run to run: its sums agree between runs to fp32
rounding (its 4/6 counts and every byte exactly). Tests: tests/kernels/test_quantize.py,
tests/gpu/test_quantize_gpu.py; speed: benchmarks/README.md.

Known limit, shared with nothing real: an fp32 weight so small that its global scale underflows
(max|w| < ~2e-42) makes the reference's block scales NaN with a platform-dependent sign bit;
this kernel writes 0x7F there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.formats.constants import (
    BLOCK_SCALE_MAX,
    BLOCK_SCALE_MIN,
    E2M1_MAX,
    E4M3_MIN_NORMAL,
    FP8_NORM_4O6,
    NVFP4_BLOCK_SIZE,
    NVFP4_GLOBAL_DENOM,
)
from fp4kit.formats.arith import DEFAULT_ARITH, check_mode, fp32_reciprocal
from fp4kit.formats.errors import FormatError, check_finite, check_float_tensor
from fp4kit.formats.metrics import Terms, sqnr_terms

from .backend import cdiv, check_backend, interpreted, launch_cached, launch_options, sm_count
from .deferred import DeferredCheck
from .error import _e2m1_value
from .launch import table as launch_table

_WHAT = "kernels.quantize"


# --------------------------------------------------------------------------------------------
# Bit-level rounding helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _e4m3_round(s):
    """fp32 value of e4m3(s) for s in [2^-9, 448] or NaN: round to nearest, ties to even."""
    bits = s.to(tl.int32, bitcast=True)
    # Normal range: drop 20 of the 23 mantissa bits with round-half-even on the integer bits.
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = rounded.to(tl.float32, bitcast=True)
    # Subnormal range (s < 2^-6): quantum 2^-9; s * 512 is exact and adding 2^23 rounds it to an
    # integer, half to even (the fp32 spacing at 2^23 is 1).
    sub = ((s * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    return tl.where(s < 0.015625, sub, normal)


@triton.jit
def _e4m3_code(v):
    """E4M3 byte (int32 0..0x7F) of a value `v` that `_e4m3_round` produced."""
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits >> 20) - 960  # (exponent - 127 + 7) << 3 | top 3 mantissa bits
    # Subnormal: v * 512 is an integer 0..8; adding 2^23 puts it in the low mantissa bits.
    sub = (v * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(v < 0.015625, sub, normal)
    return tl.where(v != v, 0x7F, code)


@triton.jit
def _e2m1_round(q):
    """|E2M1 value| of a quotient magnitude q >= 0: round half to even, saturate at 6, NaN -> 6."""
    return _e2m1_round_finite(tl.where(q < 8.0, q, 8.0))  # NaN compares false -> 8 -> 6


@triton.jit
def _e2m1_round_finite(q, SAT: tl.constexpr = True):
    """`_e2m1_round` of a finite q < 2^100, no clamp needed: everything above 5 ends at 6, and a
    tiny negative q (which the reciprocal quotient can give for |x| = 0) rounds to 0. SAT=False
    leaves out the saturation at 6, for quotients known to stay below 7 (they round to 6 at most).

    Add and subtract c = 2^(e + 22), e = max(exponent of q, 0): the fp32 spacing at c is the
    E2M1 quantum of q's binade (0.5 below 2, then 1, then 2), so the addition is the rounding.
    Both additions are fused multiply-adds of e by +-2^22: the products are exact, so each fma
    rounds exactly as the addition it stands for.
    """
    e = tl.maximum(q.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000).to(tl.float32, bitcast=True)
    v = tl.fma(e, -4194304.0, tl.fma(e, 4194304.0, q))
    if SAT:
        v = tl.minimum(v, 6.0)
    return v


@triton.jit
def _e2m1_index_finite(q, SAT: tl.constexpr = True):
    """Magnitude index 0..7 of `_e2m1_round_finite(q)` without forming the value: the rounding
    addition t = RN(q + c), c = e * 2^22, lands in c's binade (q < 2e), so bits(t) - bits(c)
    counts quanta of e / 2: 2v / e. The index is that plus 2 * log2(e) (0.5 -> 1, 1 -> 2, 2 -> 4,
    4 -> 6, 6 -> 7), saturated at 7. bits(c) = bits(e) + (22 << 23), and 2 * log2(e) =
    (bits(e) >> 22) - 254, so four integer operations replace `_e2m1_index`'s four and the
    second fused multiply-add and the clamp of `_e2m1_round_finite`. SAT=False: 8 (a quotient
    of 7 or more) is left for `_codes` to saturate, eight at a time."""
    eb = tl.maximum(q.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    t = tl.fma(eb.to(tl.float32, bitcast=True), 4194304.0, q).to(tl.int32, bitcast=True)
    idx = t - eb - 0x0B0000FE + (eb >> 22)
    if SAT:
        idx = tl.minimum(idx, 7)
    return idx


@triton.jit
def _e2m1_index(v):
    """Magnitude index 0..7 of an E2M1 value v in {0, .5, 1, 1.5, 2, 3, 4, 6}, from its bits.

    For v >= 1, (bits - bits(0.5)) >> 22 counts half-binades: 1 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5,
    4 -> 6, 6 -> 7; for v < 1 it is <= 0 and bits >> 29 gives 0.5 -> 1, 0 -> 0 (and is <= 2
    above). Integer operations only: no float-to-int conversion (a slow instruction on GPUs).
    """
    bits = v.to(tl.int32, bitcast=True)
    return tl.maximum((bits - 0x3F000000) >> 22, bits >> 29)


@triton.jit
def _half_sum(x, HALF: tl.constexpr, BLOCKS: tl.constexpr):
    """[BLOCKS, 2*HALF] -> [BLOCKS, HALF]: element i + element i + HALF, one addition each."""
    return tl.sum(tl.reshape(x, (BLOCKS, 2, HALF)), axis=1)


@triton.jit
def _block_sum16(lo, hi, BLOCKS: tl.constexpr):
    """Sum of 16 errors per block (elements 0-7 in `lo`, 8-15 in `hi`), in the reference's order:
    (i, i+8), then (i, i+4), (i, i+2), (i, i+1)."""
    s = lo + hi
    s = _half_sum(s, 4, BLOCKS)
    s = _half_sum(s, 2, BLOCKS)
    return tl.sum(s, axis=1, keep_dims=True)  # the last level: two numbers, one addition


@triton.jit
def _clamped_scale(s):
    """e4m3(clamp(s, 2^-9, 448)) as its fp32 value; NaN passes through like torch.clamp."""
    s = tl.where(s < 0.001953125, 0.001953125, s)
    s = tl.where(s > 448.0, 448.0, s)
    return _e4m3_round(s)


@triton.jit
def _e2m1_of_quotient(a, step):
    """E2M1 value of RN(a / step) and whether that quotient is > 0: the reference's arithmetic
    (the sign of a quotient that underflows to zero is the reference's `x / step < 0`).
    `div_rn`, not `/`: Triton's fp32 `/` is div.full.f32, which is not correctly rounded."""
    q = tl.math.div_rn(a, step)
    return _e2m1_round(q), q > 0.0


@triton.jit
def _e2m1_of_quotient_fast(a, step, y, SAT: tl.constexpr = True):
    """E2M1 value of RN(a / step) from y = RN(1 / step), without a division per element.

    q0 = RN(a * y) is within an ulp of a / step; the residual a - step * q0 is then exact in one
    fused multiply-add, and q0 + residual * y rounded once is the correctly rounded quotient
    (Markstein's theorem for a correctly rounded reciprocal). That needs a normal step, and a,
    q0 and the residual away from the subnormal range wherever the quotient can reach an E2M1
    midpoint (>= 0.25): `_fast_range` admits only steps in [2^-96, STEP_MAX), so every such
    a >= 2^-98; a smaller quotient may come out inexact but stays far below 0.25 (E2M1 value 0
    either way). No clamp: q <= 10 here. SAT: as `_e2m1_round_finite`."""
    return _e2m1_round_finite(_quotient_fast(a, step, y), SAT)


@triton.jit
def _quotient_fast(a, step, y):
    """RN(a / step) from y = RN(1 / step) (see `_e2m1_of_quotient_fast`)."""
    q0 = a * y
    r = tl.fma(-step, q0, a)
    return tl.fma(r, y, q0)


@triton.jit
def _fast_range(gs_lo, gs_hi, STEP_MAX: tl.constexpr):
    """True if every step a block can get from global scales in [gs_lo, gs_hi] (block scales
    lie in [2^-9, 448]) lies in [2^-96, STEP_MAX). The fast quotients are then exact (see
    `_e2m1_of_quotient_fast`; `_div_by` for the block-scale quotients), and a nonzero |x| never
    gives a quotient that rounds to zero (STEP_MAX = the input dtype's smallest positive value
    * 2^150), so a code's sign is simply x < 0."""
    return (gs_lo * 0.001953125 >= 1.2621774483536189e-29) & (gs_hi * 448.0 < STEP_MAX)


@triton.jit
def _div_by(a, d, y, MARKSTEIN: tl.constexpr):
    """RN(a / d): with MARKSTEIN, `_quotient_fast` from y = RN(1 / d) (exact while a, d and the
    quotient stay normal, which `_fast_range` guarantees wherever the quotient can matter); else
    an IEEE division."""
    if MARKSTEIN:
        return _quotient_fast(a, d, y)
    else:
        return tl.math.div_rn(a, d)


@triton.jit
def _sq_error(v, step, a, imp, HAS_IMP: tl.constexpr):
    """(E2M1 value * step - |x|)^2 (* importance): |decode(code) * step - x|, the sign cancels."""
    err = v * step - a
    err = err * err
    if HAS_IMP:
        err = err * imp
    return err


@triton.jit
def _sign8(x):
    """8 where x < 0, else 0 (-0.0 gives 0), from x's bits: x & (x - 1) keeps the sign bit of a
    negative x but clears it for -0.0 (0x80000000 & 0x7FFFFFFF), and +0.0 stays 0. Integer
    operations: no comparison whose predicate would live until the codes are packed."""
    xb = x.to(tl.int32, bitcast=True)
    return ((xb & (xb - 1)) >> 28) & 8


@triton.jit
def _code_word(code, BLOCKS: tl.constexpr):
    """[BLOCKS, 8] 4-bit codes -> [BLOCKS, 1] int32, code i in bits 4i..4i+3: the 4 packed bytes
    of 8 elements as one little-endian word."""
    even, odd = tl.split(tl.reshape(code, (BLOCKS, 4, 2)))
    byte = even | (odd << 4)  # bytes 0-3
    b02, b13 = tl.split(tl.reshape(byte, (BLOCKS, 2, 2)))
    half = b02 | (b13 << 8)  # bytes 0-1, 2-3
    lo, hi = tl.split(half)
    return (lo | (hi << 16))[:, None]


_SIGN_WORD_ASM = tl.constexpr("""
{
.reg .f32 z0, z1, z2, z3, z4, z5, z6, z7;
.reg .b32 p, q, e, o;
add.rn.f32 z0, $1, 0f00000000;
add.rn.f32 z1, $2, 0f00000000;
add.rn.f32 z2, $3, 0f00000000;
add.rn.f32 z3, $4, 0f00000000;
add.rn.f32 z4, $5, 0f00000000;
add.rn.f32 z5, $6, 0f00000000;
add.rn.f32 z6, $7, 0f00000000;
add.rn.f32 z7, $8, 0f00000000;
prmt.b32 p, z0, z2, 0x0073;
prmt.b32 q, z4, z6, 0x7300;
prmt.b32 e, p, q, 0x7610;
prmt.b32 p, z1, z3, 0x0073;
prmt.b32 q, z5, z7, 0x7300;
prmt.b32 o, p, q, 0x7610;
shr.b32 e, e, 4;
and.b32 e, e, 0x08080808;
and.b32 o, o, 0x80808080;
or.b32 $0, e, o;
}
""")

_SIGN_WORD_CONSTRAINTS = tl.constexpr("=r," + ",".join(["f"] * 8))


@triton.jit
def _eight(x, BLOCKS: tl.constexpr):
    """[BLOCKS, 8] -> its 8 columns in order, [BLOCKS] each (a thread holds whole rows: free)."""
    even, odd = tl.split(tl.reshape(x, (BLOCKS, 4, 2)))  # elements 0, 2, 4, 6 and 1, 3, 5, 7
    e04, e26 = tl.split(tl.reshape(even, (BLOCKS, 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (BLOCKS, 2, 2)))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _nibble(b, i: tl.constexpr):
    """Bits 21-24 of the int32 b moved to bits 4i..4i+3 (`_index_word`)."""
    if 4 * i <= 21:
        r = (b >> (21 - 4 * i)) & (15 << (4 * i))
    elif i == 6:
        r = (b << 3) & 0x0F000000
    else:
        r = (b << 7) & -0x10000000  # bits 28-31
    return r


@triton.jit
def _index_word(v, BLOCKS: tl.constexpr):
    """`_code_word` of the magnitude indices of 8 E2M1 values v ([BLOCKS, 8] fp32), read off
    bits(v + 2): 2, 2.5, 3, 3.5 have mantissa bits 21-22 = 0..3 in the binade of 2, and 4, 5, 6
    have 4..6 counting the binade's bit 23, so bits 21-24 are the index (0, .5, 1, 1.5 -> 0..3;
    2, 3, 4 -> 4..6), except 6 -> 8, which `_codes` saturates to 7. One fp32 addition (the FMA
    pipe) and a shift and a masked merge per element against `_e2m1_index`'s four integer
    operations and the packing's."""
    b = (v + 2.0).to(tl.int32, bitcast=True)
    b0, b1, b2, b3, b4, b5, b6, b7 = _eight(b, BLOCKS)
    w = _nibble(b0, 0) | _nibble(b1, 1) | _nibble(b2, 2) | _nibble(b3, 3)
    w = w | _nibble(b4, 4) | _nibble(b5, 5) | _nibble(b6, 6) | _nibble(b7, 7)
    return w[:, None]


@triton.jit
def _sign_word(x, ASM: tl.constexpr, BLOCKS: tl.constexpr):
    """Sign bits of 8 elements ([BLOCKS, 8] fp32) where `_code_word` puts them: bit 4i + 3 set
    where x_i < 0 (-0.0 excluded, as `_sign8`). ASM (CUDA): inline PTX, 8 elements at once: x + 0
    turns -0.0 into +0.0 (one fp32 addition each, on the FMA pipe), three byte permutes gather the
    top bytes of the even and three those of the odd elements, and a shift and masks put their
    sign bits at bits 3 and 7 of each byte, about one integer instruction per element against
    `_sign8`'s three; else `_sign8` per element, packed."""
    if ASM:
        x0, x1, x2, x3, x4, x5, x6, x7 = _eight(x, BLOCKS)
        s = tl.inline_asm_elementwise(_SIGN_WORD_ASM, _SIGN_WORD_CONSTRAINTS,
                                      [x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.int32, is_pure=True, pack=1)
        s = s[:, None]
    else:
        s = _code_word(_sign8(x), BLOCKS)
    return s


@triton.jit
def _codes(x, idx, FROM_X: tl.constexpr, sign8, ASM: tl.constexpr, BLOCKS: tl.constexpr,
           SAT: tl.constexpr = False, VALUES: tl.constexpr = False):
    """Packed words [BLOCKS, 1] (`_code_word`) of 8 elements: magnitude index `idx` (0..7) and the
    sign, the reference's `x / step < 0` (a negative x whose quotient is -0.0 gets code 0):
    with FROM_X, x < 0 and x != -0.0 (`_sign_word`; every nonzero |x| has a quotient > 0 there),
    else `sign8` (8 or 0 per element). SAT (FROM_X only): idx may be 8, which means 7
    (`_e2m1_index_finite` unsaturated); the packed nibbles are saturated together, 8 - 1 where
    a nibble's top bit is set (before the signs go in). VALUES (FROM_X only): idx holds the
    E2M1 values themselves (`_index_word`; needs SAT)."""
    if FROM_X:
        if VALUES:
            m = _index_word(idx, BLOCKS)
        else:
            m = _code_word(idx, BLOCKS)
        if SAT:
            m = m - ((m >> 3) & 0x11111111)
        w = m | _sign_word(x, ASM, BLOCKS)
    else:
        w = _code_word(idx | sign8, BLOCKS)
    return w


@triton.jit
def _div_const(x, c: tl.constexpr, r, RECIP: tl.constexpr):
    """x / c as fp4kit.formats.arith.div_const: times the fp32 reciprocal r (ModelOpt on CUDA),
    or the correctly rounded quotient (ModelOpt on CPU)."""
    if RECIP:
        return x * r
    else:
        return tl.math.div_rn(x, c)


@triton.jit
def _tile_core(x_lo, x_hi, a_lo, a_hi, block_amax, g, y_den, zero, live, imp_lo, imp_hi, r6, r1536, r2688,
               RECIP: tl.constexpr, RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr,
               FAST: tl.constexpr, MARKSTEIN: tl.constexpr, ASM: tl.constexpr, BLOCKS: tl.constexpr):
    """`_quantize_tile` for one arithmetic path: FAST (reciprocal quotients per element, valid
    under `_fast_range`) or not (an IEEE division per element); MARKSTEIN: the block-scale
    quotient by the member's divisor from its reciprocal y_den (a uniform g under FAST); ASM:
    inline PTX where it saves instructions (CUDA; `_sign_word`)."""
    if RULE_4O6:
        gs = _div_const(g, 1536.0, r1536, RECIP)  # g / (6 * 256)
        g6 = _div_const(g, 6.0, r6, RECIP)
        # static_block_scale(a * mult, g, 256): s = a*mult/6; s==0 -> 1; e4m3(clamp(s*256/(g/6)))
        s6 = _div_const(block_amax, 6.0, r6, RECIP)
        s4 = _div_const(block_amax * 1.5, 6.0, r6, RECIP)
        s6 = tl.where(s6 == 0.0, 1.0, s6)
        s4 = tl.where(s4 == 0.0, 1.0, s4)
        scale6 = _clamped_scale(_div_by(s6 * 256.0, g6, y_den, MARKSTEIN))
        scale4 = _clamped_scale(_div_by(s4 * 256.0, g6, y_den, MARKSTEIN))
        step6 = scale6 * gs
        step4 = scale4 * gs
        if FAST:
            y6 = tl.math.div_rn(1.0, step6)
            y4 = tl.math.div_rn(1.0, step4)
            v6_lo = _e2m1_of_quotient_fast(a_lo, step6, y6)
            v6_hi = _e2m1_of_quotient_fast(a_hi, step6, y6)
            # Candidate 4's quotients stay below 7 (scale4 rounds down at most by 1.5, on E4M3
            # subnormals, from amax / 4), so they round to 6 at most without the saturation.
            v4_lo = _e2m1_of_quotient_fast(a_lo, step4, y4, SAT=False)
            v4_hi = _e2m1_of_quotient_fast(a_hi, step4, y4, SAT=False)
        else:
            v6_lo, p6_lo = _e2m1_of_quotient(a_lo, step6)
            v6_hi, p6_hi = _e2m1_of_quotient(a_hi, step6)
            v4_lo, p4_lo = _e2m1_of_quotient(a_lo, step4)
            v4_hi, p4_hi = _e2m1_of_quotient(a_hi, step4)
        err6 = _block_sum16(_sq_error(v6_lo, step6, a_lo, imp_lo, HAS_IMP),
                            _sq_error(v6_hi, step6, a_hi, imp_hi, HAS_IMP), BLOCKS)
        err4 = _block_sum16(_sq_error(v4_lo, step4, a_lo, imp_lo, HAS_IMP),
                            _sq_error(v4_hi, step4, a_hi, imp_hi, HAS_IMP), BLOCKS)
        choose4 = (err4 < err6) & live  # strict: a tie keeps 6
        scale = tl.where(choose4, scale4, scale6)
        noise = tl.where(choose4, err4, err6)  # the result's squared error where unweighted (HAS_IMP off)
        if FAST:  # every quotient of a nonzero |x| is > 0 here (`_fast_range`): sign from x
            i_lo = tl.where(choose4, v4_lo, v6_lo)  # the values: `_index_word` reads them
            i_hi = tl.where(choose4, v4_hi, v6_hi)
            sgn_lo = 0
            sgn_hi = 0
        else:
            i_lo = _e2m1_index(tl.where(choose4, v4_lo, v6_lo))
            i_hi = _e2m1_index(tl.where(choose4, v4_hi, v6_hi))
            sgn_lo = tl.where((x_lo < 0.0) & tl.where(choose4, p4_lo, p6_lo), 8, 0)
            sgn_hi = tl.where((x_hi < 0.0) & tl.where(choose4, p4_hi, p6_hi), 8, 0)
    else:
        gs = _div_const(g, 2688.0, r2688, RECIP)  # g / (6 * 448)
        s = _div_by(block_amax, 6.0 * gs, y_den, MARKSTEIN)  # 6 * gs rounded first
        s = tl.where(s == 0.0, 1.0, s)
        scale = _clamped_scale(s)
        step = scale * gs
        if FAST:
            y = tl.math.div_rn(1.0, step)
            i_lo = _e2m1_index_finite(_quotient_fast(a_lo, step, y), SAT=False)  # `_codes` saturates
            i_hi = _e2m1_index_finite(_quotient_fast(a_hi, step, y), SAT=False)
            sgn_lo = 0  # from x (`_codes`)
            sgn_hi = 0
        else:
            v_lo, pos_lo = _e2m1_of_quotient(a_lo, step)
            v_hi, pos_hi = _e2m1_of_quotient(a_hi, step)
            i_lo = _e2m1_index(v_lo)
            i_hi = _e2m1_index(v_hi)
            sgn_lo = tl.where((x_lo < 0.0) & pos_lo, 8, 0)
            sgn_hi = tl.where((x_hi < 0.0) & pos_hi, 8, 0)
        choose4 = (block_amax < 0.0) & live  # all False, one per block
        noise = 0.0 * block_amax  # not known here (`_tile_terms` decodes the codes)
    # All-zero member: scales 1.0 and global scale 1.0; its elements are 0, so the codes are 0
    # whichever step they were divided by.
    scale = tl.where(zero, 1.0, scale)
    code_lo = _codes(x_lo, i_lo, FAST, sgn_lo, ASM, BLOCKS, SAT=FAST, VALUES=FAST and RULE_4O6)
    code_hi = _codes(x_hi, i_hi, FAST, sgn_hi, ASM, BLOCKS, SAT=FAST, VALUES=FAST and RULE_4O6)
    return (code_lo, code_hi, _e4m3_code(scale).to(tl.uint8), choose4, tl.where(zero, 1.0, gs + 0.0 * block_amax),
            scale, noise)


@triton.jit
def _tile_start(x_lo, x_hi, g):
    """|x| of both halves and the block maxima; from the global amax g of the blocks' member (a
    scalar, or one per block): the blocks of an all-zero member (zero: global scale 1, block
    scales 1, codes 0), the others (live), and g with 0 counted as 1."""
    a_lo = tl.abs(x_lo)
    a_hi = tl.abs(x_hi)
    block_amax = tl.max(tl.maximum(a_lo, a_hi), axis=1, keep_dims=True)  # exact in any order
    g_b = g + 0.0 * block_amax  # per block
    return a_lo, a_hi, block_amax, g_b == 0.0, g_b != 0.0, tl.where(g == 0.0, 1.0, g)


@triton.jit
def _divisor(g, r6, r1536, r2688, RECIP: tl.constexpr, RULE_4O6: tl.constexpr):
    """For a nonzero global amax g: the smallest global scale a step is made of (for
    `_fast_range`) and the block-scale divisor den (g / 6 for 4/6, 6 * (g / 2688) plain)."""
    if RULE_4O6:
        gs_check = _div_const(g, 1536.0, r1536, RECIP)
        den = _div_const(g, 6.0, r6, RECIP)
    else:
        gs_check = _div_const(g, 2688.0, r2688, RECIP)
        den = 6.0 * gs_check
    return gs_check, den


@triton.jit
def _member_prep(g, r6, r1536, r2688, RECIP: tl.constexpr, RULE_4O6: tl.constexpr, STEP_MAX: tl.constexpr):
    """What a member's global amax g (a scalar) fixes for all its tiles: the block-scale divisor
    den (`_divisor`; g = 0 counts as 1), y_den = RN(1 / den) and whether the fast path is exact
    (`_fast_range`). A kernel that quantizes several tiles of one member computes these once,
    outside its tile loop."""
    gs_check, den = _divisor(tl.where(g == 0.0, 1.0, g), r6, r1536, r2688, RECIP, RULE_4O6)
    return den, tl.math.div_rn(1.0, den), _fast_range(gs_check, gs_check, STEP_MAX)


@triton.jit
def _tile_path(x_lo, x_hi, g, fast, d_fast, den, imp_lo, imp_hi, r6, r1536, r2688,
               RECIP: tl.constexpr, RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr,
               MARKSTEIN: tl.constexpr, ASM: tl.constexpr, BLOCKS: tl.constexpr):
    """`_tile_core` on the fast path where `fast` (its block-scale divisor argument d_fast: the
    member's reciprocal y_den with MARKSTEIN, else den), else on the division path (den). A tile
    inside one member takes MARKSTEIN with its member's `_member_prep`."""
    a_lo, a_hi, block_amax, zero, live, g = _tile_start(x_lo, x_hi, g)
    if fast:
        out = _tile_core(x_lo, x_hi, a_lo, a_hi, block_amax, g, d_fast, zero, live, imp_lo, imp_hi,
                         r6, r1536, r2688, RECIP, RULE_4O6, HAS_IMP, True, MARKSTEIN, ASM, BLOCKS)
    else:
        out = _tile_core(x_lo, x_hi, a_lo, a_hi, block_amax, g, den, zero, live, imp_lo, imp_hi,
                         r6, r1536, r2688, RECIP, RULE_4O6, HAS_IMP, False, False, ASM, BLOCKS)
    return out


@triton.jit
def _quantize_tile(x_lo, x_hi, g, imp_lo, imp_hi, r6, r1536, r2688,
                   RECIP: tl.constexpr, RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr,
                   UNIFORM: tl.constexpr, STEP_MAX: tl.constexpr, ASM: tl.constexpr, BLOCKS: tl.constexpr):
    """Quantizes BLOCKS 16-element blocks held as two rows of 8 (elements 0-7 in x_lo, 8-15 in
    x_hi; fp32); g: the global amax of the blocks' member, a scalar if UNIFORM (the whole tile in
    one member), else one per block ([BLOCKS, 1]). Returns the packed codes (lo, hi: one int32
    word each, `_code_word`), E4M3 scale bytes, the 4/6 choice and the global scale ([BLOCKS, 1]
    each; the last a scalar if UNIFORM), then for `_tile_terms` the block scales' fp32 values and,
    under 4/6, the chosen candidate's squared error per block. A thread owns whole blocks, so
    maxima, error sums and packing never cross threads. The arithmetic path is chosen once per tile (`_fast_range`);
    every path gives the reference's bytes."""
    if UNIFORM:
        den, y_den, fast = _member_prep(g, r6, r1536, r2688, RECIP, RULE_4O6, STEP_MAX)
        out = _tile_path(x_lo, x_hi, g, fast, y_den, den, imp_lo, imp_hi, r6, r1536, r2688,
                         RECIP, RULE_4O6, HAS_IMP, True, ASM, BLOCKS)
    else:  # per-block divisors: the fast path divides by each block's own (MARKSTEIN off)
        gs_check, den = _divisor(tl.where(g == 0.0, 1.0, g), r6, r1536, r2688, RECIP, RULE_4O6)
        fast = _fast_range(tl.min(gs_check), tl.max(gs_check), STEP_MAX)
        out = _tile_path(x_lo, x_hi, g, fast, den, den, imp_lo, imp_hi, r6, r1536, r2688,
                         RECIP, RULE_4O6, HAS_IMP, False, ASM, BLOCKS)
    return out


@triton.jit
def _tile_terms(x_lo, x_hi, code_lo, code_hi, scale, gs, noise, choose4, ok,
                RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr):
    """Per block ([BLOCKS, 1] each): the sum of x^2, the sum of (x - dequantized)^2 and whether it
    took the 4 candidate, the values formed as `NVFP4Tensor.dequantize` forms them (fp32 step =
    block scale * global scale, value = E2M1 value * step). Under unweighted 4/6 the quantizer's
    own error of the chosen candidate is that squared error already (|value - |x|| per element,
    the sign cancels); else the stored codes are decoded. Blocks outside the tensor hold zeros
    and count nothing."""
    signal = tl.sum(x_lo * x_lo + x_hi * x_hi, axis=1, keep_dims=True)
    if RULE_4O6 and not HAS_IMP:
        err = noise
    else:
        step = scale * gs
        j = tl.arange(0, 8)[None, :] * 4
        d_lo = x_lo - _e2m1_value((code_lo >> j) & 15) * step
        d_hi = x_hi - _e2m1_value((code_hi >> j) & 15) * step
        err = tl.sum(d_lo * d_lo + d_hi * d_hi, axis=1, keep_dims=True)
    return signal, tl.where(ok, err, 0.0), (choose4 & ok).to(tl.int32)


@triton.jit
def _store_terms(terms_ptr, pid, signal, err, count4):
    """A program's sums of `_tile_terms` ([BLOCKS, ...] each) to terms_ptr[pid, 0:3] (fp32)."""
    tl.store(terms_ptr + pid * 3, tl.sum(tl.sum(signal, axis=1), axis=0))
    tl.store(terms_ptr + pid * 3 + 1, tl.sum(tl.sum(err, axis=1), axis=0))
    tl.store(terms_ptr + pid * 3 + 2, tl.sum(tl.sum(count4, axis=1), axis=0).to(tl.float32))


@triton.jit
def _amax_kernel(w_ptr, own_ptr, per_batch, chunk, BLOCK: tl.constexpr):
    """own[b] = max(own[b], max|w| over chunk program_id(1) of batch member b) (atomic max into
    zeros; max is order-free, so the result is exact); NaN counts as +Inf (flags it)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    base = w_ptr + b.to(tl.int64) * per_batch
    start = c * chunk
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(start, start + chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < per_batch, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.where(x == x, tl.abs(x), float("inf")))
    tl.atomic_max(own_ptr + b, tl.max(acc, axis=0), sem="relaxed")


@triton.jit
def _load_blocks(w_ptr, blk, ok):
    """Elements 0-7 and 8-15 of the blocks `blk` ([BLOCKS, 1]) as fp32 [BLOCKS, 8] each."""
    j = tl.arange(0, 8)[None, :]
    x_lo = tl.load(w_ptr + blk * 16 + j, mask=ok, other=0.0).to(tl.float32)
    x_hi = tl.load(w_ptr + blk * 16 + 8 + j, mask=ok, other=0.0).to(tl.float32)
    return x_lo, x_hi


@triton.jit
def _nan_max(x_lo, x_hi):
    """max|x| over a tile with NaN counted as +Inf ([BLOCKS, 1])."""
    m = tl.maximum(tl.where(x_lo == x_lo, tl.abs(x_lo), float("inf")),
                   tl.where(x_hi == x_hi, tl.abs(x_hi), float("inf")))
    return tl.max(m, axis=1, keep_dims=True)


@triton.jit
def _store_tile(packed_ptr, scale_ptr, choice_ptr, blk, ok, code_lo, code_hi, scale_code, choose4,
                WRITE_CHOICE: tl.constexpr):
    out = packed_ptr.to(tl.pointer_type(tl.int32)) + blk * 2  # a block's 8 bytes as two words
    tl.store(out, code_lo, mask=ok)
    tl.store(out + 1, code_hi, mask=ok)
    tl.store(scale_ptr + blk, scale_code, mask=ok)
    if WRITE_CHOICE:
        tl.store(choice_ptr + blk, choose4.to(tl.uint8), mask=ok)


@triton.jit
def _load_importance(imp_ptr, member, blk, ok, blocks_per_row, imp_stride, HAS_IMP: tl.constexpr):
    imp_lo = 0.0
    imp_hi = 0.0
    if HAS_IMP:
        j = tl.arange(0, 8)[None, :]
        imp_at = imp_ptr + member * imp_stride + (blk % blocks_per_row) * 16 + j
        imp_lo = tl.load(imp_at, mask=ok, other=0.0)
        imp_hi = tl.load(imp_at + 8, mask=ok, other=0.0)
    return imp_lo, imp_hi


@triton.jit
def _quantize_kernel(
    w_ptr, g_ptr, own_ptr, imp_ptr, packed_ptr, scale_ptr, gs_ptr, choice_ptr, terms_ptr,
    n_blocks, blocks_per_member, blocks_per_row, imp_stride, r6, r1536, r2688,
    RECIP: tl.constexpr, RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr, WRITE_CHOICE: tl.constexpr,
    OWN_MAX: tl.constexpr, MEMBERS: tl.constexpr, OFFSET_DTYPE: tl.constexpr,
    STEP_MAX: tl.constexpr, ASM: tl.constexpr, BLOCKS: tl.constexpr, TERMS: tl.constexpr = False,
):
    """Quantizes BLOCKS consecutive 16-element blocks of the flattened weight, each member's
    global amax read from g_ptr. K % 16 == 0, so the weight is a flat run of blocks: block b
    holds elements 16b..16b+15 and owns packed bytes 8b..8b+7 and scale byte b.

    MEMBERS: 0 = one member, 1 = members of a multiple of BLOCKS blocks (a program's global amax
    is one scalar), 2 = any (a member per block). OWN_MAX: also fold max|x| of the blocks into
    own_ptr[member] (atomic max; NaN as +Inf), the maxima the caller checks a given global amax
    against, so the weight is read once. TERMS: the tile's `_tile_terms` to terms_ptr[pid, 0:3]."""
    pid = tl.program_id(0)
    blk = (pid * BLOCKS + tl.arange(0, BLOCKS)[:, None]).to(OFFSET_DTYPE)  # [BLOCKS, 1]
    ok = blk < n_blocks
    x_lo, x_hi = _load_blocks(w_ptr, blk, ok)
    if MEMBERS == 2:
        member = blk // blocks_per_member
        g = tl.load(g_ptr + member, mask=ok, other=1.0)  # global amax of the block's member
        uniform: tl.constexpr = False
    else:
        if MEMBERS == 0:
            member = pid * 0
        else:
            member = pid // (blocks_per_member // BLOCKS)
        g = tl.load(g_ptr + member)
        uniform: tl.constexpr = True
    imp_lo, imp_hi = _load_importance(imp_ptr, member, blk, ok, blocks_per_row, imp_stride, HAS_IMP)
    code_lo, code_hi, scale_code, choose4, gs, scale, noise = _quantize_tile(
        x_lo, x_hi, g, imp_lo, imp_hi, r6, r1536, r2688, RECIP, RULE_4O6, HAS_IMP, uniform,
        STEP_MAX, ASM, BLOCKS)
    _store_tile(packed_ptr, scale_ptr, choice_ptr, blk, ok, code_lo, code_hi, scale_code, choose4,
                WRITE_CHOICE)
    if TERMS:
        signal, err, count4 = _tile_terms(x_lo, x_hi, code_lo, code_hi, scale, gs, noise, choose4, ok,
                                          RULE_4O6, HAS_IMP)
        _store_terms(terms_ptr, pid, signal, err, count4)
    # Each member's first block writes its global scale (a member may be shorter than a program).
    tl.store(gs_ptr + member + blk * 0, gs, mask=ok & (blk % blocks_per_member == 0))
    if OWN_MAX:
        m = _nan_max(x_lo, x_hi)
        if MEMBERS == 2:
            first = (pid * BLOCKS).to(OFFSET_DTYPE) // blocks_per_member
            last = tl.minimum(pid * BLOCKS + BLOCKS, n_blocks).to(OFFSET_DTYPE) - 1
            if first == last // blocks_per_member:
                tl.atomic_max(own_ptr + first, tl.max(m), sem="relaxed")
            else:
                tl.atomic_max(own_ptr + member, m, mask=ok, sem="relaxed")
        else:
            tl.atomic_max(own_ptr + member, tl.max(m), sem="relaxed")


@triton.jit
def _max_abs(acc, x_lo, x_hi):
    """Elementwise max of acc and |x| over both halves, NaN kept (it stays NaN to the end)."""
    acc = tl.maximum(acc, tl.abs(x_lo), propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(acc, tl.abs(x_hi), propagate_nan=tl.PropagateNan.ALL)


_MAX_PAIR_ASM = tl.constexpr("""
{
.reg .b32 t;
and.b32 t, $2, 0x7FFF7FFF;
max.u16x2 $0, $1, t;
}
""")


@triton.jit
def _max_pair(acc, w, ASM: tl.constexpr):
    """Per 16-bit half of the int32 words: max(acc, |x| bits) for two 16-bit floats x per word.
    A float's magnitude bits order as its |value| does (Inf above every finite, NaN above Inf),
    so this is max|x| on bit patterns. ASM (sm_90): one mask and one paired unsigned max per two
    elements; else the same on each half. acc's and the masked words' top bit is clear, so the
    arithmetic shift is a logical one."""
    if ASM:
        out = tl.inline_asm_elementwise(_MAX_PAIR_ASM, "=r,r,r", [acc, w], dtype=tl.int32, is_pure=True, pack=1)
    else:
        m = w & 0x7FFF7FFF
        hi = tl.maximum(acc >> 16, m >> 16)
        lo = tl.maximum(acc & 0xFFFF, m & 0xFFFF)
        out = (hi << 16) | lo
    return out


@triton.jit
def _pair_max_value(acc, HALF: tl.constexpr):
    """max|x| (fp32 scalar) from `_max_pair`'s words; NaN as +Inf. HALF: 1 = bf16, 2 = fp16."""
    p = tl.maximum(tl.max(acc >> 16), tl.max(acc & 0xFFFF))
    if HALF == 1:
        v = (p << 16).to(tl.float32, bitcast=True)
        inf_bits: tl.constexpr = 0x7F80
    else:
        v = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        inf_bits: tl.constexpr = 0x7C00
    return tl.where(p > inf_bits, float("inf"), v)


@triton.jit
def _pair_squares(w, HALF: tl.constexpr):
    """x^2 + y^2 (fp32) for the two 16-bit floats x, y of each int32 word (HALF 1: bf16, 2: fp16)."""
    if HALF == 1:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo * lo + hi * hi


@triton.jit
def _load_words(w_ptr, blk, ok):
    """The 8 int32 words (two 16-bit elements each) of the blocks `blk` ([BLOCKS, 1]) of a 16-bit
    weight, [BLOCKS, 8]."""
    j = tl.arange(0, 8)[None, :]
    return tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + blk * 8 + j, mask=ok, other=0)


@triton.jit
def _stack_tile(e, tile, tiles_per_member, OFFSET_DTYPE: tl.constexpr, BLOCKS: tl.constexpr):
    """Block indices ([BLOCKS, 1]) of tile `tile` of member e, and whether the tile exists."""
    blk = (e * tiles_per_member + tile).to(OFFSET_DTYPE) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    return blk, (tl.arange(0, BLOCKS)[:, None] * 0 + tile) < tiles_per_member


@triton.jit
def _stack_kernel(
    w_ptr, own_ptr, done_ptr, ticket_ptr, imp_ptr, packed_ptr, scale_ptr, gs_ptr, choice_ptr, terms_ptr,
    n_members, tiles_per_member, blocks_per_row, imp_stride, max_items, quant_items, r6, r1536, r2688,
    LAG: tl.constexpr, MAX_TILES: tl.constexpr, QUANT_TILES: tl.constexpr, PREFETCH: tl.constexpr,
    HALF: tl.constexpr,
    RECIP: tl.constexpr, RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr, WRITE_CHOICE: tl.constexpr,
    OFFSET_DTYPE: tl.constexpr, STEP_MAX: tl.constexpr, ASM: tl.constexpr, BLOCKS: tl.constexpr,
    TERMS: tl.constexpr = False,
):
    """A whole [E, N, K] stack in one launch: the max pass and the quantization as one queue of
    work items, which the programs take in ticket order until it runs out.

    Slot s holds `max_items` groups; group i is max item i of member s (max|w| of MAX_TILES
    tiles, four tiles' loads in flight at once, folded into own_ptr[s], then counted in
    done_ptr[s]) followed by MAX_TILES // QUANT_TILES quantize items of member s - LAG
    (QUANT_TILES tiles each, once all that member's max items are counted; with PREFETCH the next
    tile is loaded before a tile's arithmetic). Tickets past a member's items are skipped. A
    quantize item waits only on max items with earlier tickets, which programs already running
    hold: no program waits on one that has not started, whatever the grid or the scheduling.
    HALF (1 bf16, 2 fp16, 0 fp32): 16-bit max items work on bit patterns, two elements per
    instruction (`_max_pair`). A quantize item prepares its member once (`_member_prep`).
    TERMS: the program's sums of x^2 (over its max items: the max pass reads each element once,
    and has the arithmetic to spare), of the squared error and of the blocks on the 4 candidate
    (over its quantize items, `_tile_terms`) to terms_ptr[pid, 0:3].
    """
    R: tl.constexpr = MAX_TILES // QUANT_TILES
    signal_sum = tl.zeros((BLOCKS, 8), dtype=tl.float32)
    err_sum = tl.zeros((BLOCKS, 1), dtype=tl.float32)
    count_sum = tl.zeros((BLOCKS, 1), dtype=tl.int32)
    per_slot = max_items * (R + 1)
    total = (n_members + LAG) * per_slot
    t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    while t < total:
        slot = t // per_slot
        within = t - slot * per_slot
        group = within // (R + 1)
        pos = within - group * (R + 1)
        if pos == 0:
            if slot < n_members:
                if HALF != 0:
                    acc_w = tl.zeros((BLOCKS, 8), dtype=tl.int32)
                else:
                    acc = tl.zeros((BLOCKS, 8), dtype=tl.float32)
                for j in range(0, MAX_TILES, 4):  # four tiles' loads in flight at once
                    first = group * MAX_TILES + j
                    blk0, ok0 = _stack_tile(slot, first, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                    blk1, ok1 = _stack_tile(slot, first + 1, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                    blk2, ok2 = _stack_tile(slot, first + 2, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                    blk3, ok3 = _stack_tile(slot, first + 3, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                    if HALF != 0:
                        a_w = _load_words(w_ptr, blk0, ok0)
                        b_w = _load_words(w_ptr, blk1, ok1)
                        c_w = _load_words(w_ptr, blk2, ok2)
                        d_w = _load_words(w_ptr, blk3, ok3)
                        acc_w = _max_pair(acc_w, a_w, ASM)
                        acc_w = _max_pair(acc_w, b_w, ASM)
                        acc_w = _max_pair(acc_w, c_w, ASM)
                        acc_w = _max_pair(acc_w, d_w, ASM)
                        if TERMS:
                            signal_sum += _pair_squares(a_w, HALF) + _pair_squares(b_w, HALF)
                            signal_sum += _pair_squares(c_w, HALF) + _pair_squares(d_w, HALF)
                    else:
                        a_lo, a_hi = _load_blocks(w_ptr, blk0, ok0)
                        b_lo, b_hi = _load_blocks(w_ptr, blk1, ok1)
                        c_lo, c_hi = _load_blocks(w_ptr, blk2, ok2)
                        d_lo, d_hi = _load_blocks(w_ptr, blk3, ok3)
                        acc = _max_abs(acc, a_lo, a_hi)
                        acc = _max_abs(acc, b_lo, b_hi)
                        acc = _max_abs(acc, c_lo, c_hi)
                        acc = _max_abs(acc, d_lo, d_hi)
                        if TERMS:
                            signal_sum += (a_lo * a_lo + a_hi * a_hi) + (b_lo * b_lo + b_hi * b_hi)
                            signal_sum += (c_lo * c_lo + c_hi * c_hi) + (d_lo * d_lo + d_hi * d_hi)
                if HALF != 0:
                    m = _pair_max_value(acc_w, HALF)
                else:
                    m = tl.max(tl.where(acc == acc, acc, float("inf")))  # NaN as +Inf
                tl.atomic_max(own_ptr + slot, m, sem="relaxed")
                tl.atomic_add(done_ptr + slot, 1, sem="release")
        else:
            e = slot - LAG
            item = group * R + pos - 1
            if (e >= 0) & (item < quant_items):
                done = tl.atomic_add(done_ptr + e, 0, sem="acquire")
                while done < max_items:
                    done = tl.atomic_add(done_ptr + e, 0, sem="acquire")
                g = tl.atomic_max(own_ptr + e, 0.0, sem="relaxed")  # the member's max|w| (read, unchanged)
                den, y_den, fast = _member_prep(g, r6, r1536, r2688, RECIP, RULE_4O6, STEP_MAX)
                blk, ok = _stack_tile(e, item * QUANT_TILES, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                x_lo, x_hi = _load_blocks(w_ptr, blk, ok)
                for j in range(QUANT_TILES):
                    if PREFETCH:  # the next tile's loads issued before this tile's arithmetic
                        n_blk, n_ok = _stack_tile(e, item * QUANT_TILES + j + 1, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                        n_ok = n_ok & (j + 1 < QUANT_TILES)
                        n_lo, n_hi = _load_blocks(w_ptr, n_blk, n_ok)
                    else:
                        blk, ok = _stack_tile(e, item * QUANT_TILES + j, tiles_per_member, OFFSET_DTYPE, BLOCKS)
                        x_lo, x_hi = _load_blocks(w_ptr, blk, ok)
                    imp_lo, imp_hi = _load_importance(imp_ptr, e, blk, ok, blocks_per_row, imp_stride, HAS_IMP)
                    code_lo, code_hi, scale_code, choose4, gs, scale, noise = _tile_path(
                        x_lo, x_hi, g, fast, y_den, den, imp_lo, imp_hi, r6, r1536, r2688, RECIP, RULE_4O6,
                        HAS_IMP, True, ASM, BLOCKS)
                    _store_tile(packed_ptr, scale_ptr, choice_ptr, blk, ok, code_lo, code_hi, scale_code,
                                choose4, WRITE_CHOICE)
                    if TERMS:  # the signal is summed in the max items, which read every element once
                        _, err, count4 = _tile_terms(x_lo, x_hi, code_lo, code_hi, scale, gs, noise, choose4,
                                                     ok, RULE_4O6, HAS_IMP)
                        err_sum += err
                        count_sum += count4
                    tl.store(gs_ptr + e + blk * 0, gs, mask=blk == (e * tiles_per_member).to(OFFSET_DTYPE) * BLOCKS)
                    if PREFETCH:
                        blk, ok, x_lo, x_hi = n_blk, n_ok, n_lo, n_hi
        t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    if TERMS:
        _store_terms(terms_ptr, tl.program_id(0), signal_sum, err_sum, count_sum)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
_AMAX_BLOCK = 4096
_AMAX_CHUNK = 8 * _AMAX_BLOCK  # 32K elements a program: a 10M-element weight fills the GPU

# The launch table ("quantize"), by entry:
#   TUNING  {"blocks", "num_warps"}: 16-element blocks per program (a tile) and warps per program.
#   STACK   when and how `_stack_kernel` runs: members of at most "max_member_bytes" (None:
#           never; larger members were not timed and keep the two launches), max items "lag"
#           members ahead of the quantize items, "max_tiles" and "quant_tiles" tiles per item,
#           "programs_per_sm" programs per multiprocessor, "prefetch": the next tile's loads
#           issued before a tile's arithmetic.


def _tables(tables: Mapping | None, device: torch.device | None) -> Mapping:
    return launch_table("quantize", device) if tables is None else tables


def _broadcast_global_amax(global_amax, batch: tuple, device) -> torch.Tensor:
    """A given global amax as an fp32 tensor of the batch shape (the reference's shape check)."""
    g = torch.as_tensor(global_amax, dtype=torch.float32, device=device)
    try:
        return torch.broadcast_to(g, batch).contiguous()
    except RuntimeError:
        raise FormatError(
            f"{_WHAT}: global_amax of shape {tuple(g.shape)} does not broadcast to the batch "
            f"shape {batch}"
        ) from None


def _check_global_amax(g: torch.Tensor, own: torch.Tensor) -> None:
    """The reference's value checks of a given global amax, against the kernel's own max|w|."""
    if not bool(torch.isfinite(g).all()):
        raise FormatError(f"{_WHAT}: global_amax must be finite")
    if bool((g < own).any()):
        raise FormatError(
            f"{_WHAT}: global_amax {g.min().item():.6g} is below the tensor's own max|w| "
            f"{own.max().item():.6g}; a shared global amax must cover every member"
        )


def member_amax(w: torch.Tensor) -> torch.Tensor:
    """max|w| per batch member (fp32, shape w.shape[:-2]); +Inf where w holds NaN or Inf."""
    k = w.shape[-1]
    n = w.shape[-2] if w.dim() >= 2 else 1
    batch = tuple(w.shape[:-2])
    b = w.numel() // (n * k)
    per_batch = n * k
    own = torch.zeros(batch, dtype=torch.float32, device=w.device)
    launch_cached(_amax_kernel, (b, cdiv(per_batch, _AMAX_CHUNK)), w, own, per_batch, _AMAX_CHUNK, BLOCK=_AMAX_BLOCK,
                  num_warps=8, **launch_options())
    return own


def fused_stack(w: torch.Tensor, n_members: int, blocks_per_member: int, tables: Mapping | None = None) -> bool:
    """Whether `launch` quantizes w (no global amax given) in one `_stack_kernel` launch: two or
    more members, each a whole number of tiles and of at most STACK["max_member_bytes"]."""
    t = _tables(tables, w.device)
    most = t["STACK"]["max_member_bytes"]
    if most is None or n_members < 2 or blocks_per_member % t["TUNING"]["blocks"]:
        return False
    return blocks_per_member * NVFP4_BLOCK_SIZE * w.element_size() <= most


# Smallest positive value of each input dtype: with steps below its 2^150 multiple, no nonzero
# |x| has a quotient that rounds to zero (see `_fast_range`).
_STEP_MAX = {torch.bfloat16: 2.0**17, torch.float16: 2.0**126, torch.float32: 2.0}


def launch(w: torch.Tensor, scale_rule: str, global_amax: torch.Tensor | None = None,
           importance: torch.Tensor | None = None, return_choice: bool = False,
           arith: str = DEFAULT_ARITH, *, tables: Mapping | None = None, terms: list | None = None):
    """The launches and nothing else: no validation, no host synchronisation.

    w contiguous, already validated; global_amax None or an fp32 tensor of the batch shape;
    importance None or fp32 [1 or batch members, K]; tables: the launch table (default: the
    device's, `launch.table("quantize", w.device)`). Returns (NVFP4Tensor, choice uint8 or None,
    own max|w| per member). `quantize` is this plus the reference's checks. terms: a list that
    receives the weight's `formats.metrics.Terms` (sum w^2, sum (w - dequantized)^2, blocks on
    the 4 candidate), summed in the quantizing pass (`_tile_terms`).
    """
    t = _tables(tables, w.device)
    tuning, stack = t["TUNING"], t["STACK"]
    k = w.shape[-1]
    n = w.shape[-2] if w.dim() >= 2 else 1
    batch = tuple(w.shape[:-2])
    n_blocks = w.numel() // NVFP4_BLOCK_SIZE
    blocks_per_row = k // NVFP4_BLOCK_SIZE
    blocks_per_member = n * blocks_per_row
    n_members = max(1, n_blocks // blocks_per_member)
    if importance is not None:
        imp, imp_stride = importance, (0 if importance.shape[0] == 1 else k)
    else:
        imp, imp_stride = w, 0  # unused
    packed = torch.empty((*w.shape[:-1], k // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((*w.shape[:-1], k // NVFP4_BLOCK_SIZE), dtype=torch.uint8, device=w.device)
    gs = torch.empty(batch, dtype=torch.float32, device=w.device)
    choice = torch.empty(scale.shape, dtype=torch.uint8, device=w.device) if return_choice else scale
    offset_dtype = tl.int32 if w.numel() < 2**31 - 2**20 else tl.int64
    consts = dict(RECIP=arith == "cuda", RULE_4O6=scale_rule == "4o6", HAS_IMP=importance is not None,
                  WRITE_CHOICE=return_choice, OFFSET_DTYPE=offset_dtype,
                  STEP_MAX=_STEP_MAX[w.dtype], ASM=not interpreted(_quantize_kernel), BLOCKS=tuning["blocks"])
    recips = tuple(fp32_reciprocal(c) for c in (E2M1_MAX, E2M1_MAX * FP8_NORM_4O6, NVFP4_GLOBAL_DENOM))
    opts = dict(num_warps=tuning["num_warps"], **launch_options())
    if global_amax is None and fused_stack(w, n_members, blocks_per_member, t):
        # own (fp32 maxima: zero bits), the members' max-item counts and the ticket counter, zeroed at once
        counters = torch.zeros(2 * n_members + 1, dtype=torch.int32, device=w.device)
        own, done, ticket = counters[:n_members].view(torch.float32), counters[n_members:-1], counters[-1:]
        tiles = blocks_per_member // consts["BLOCKS"]
        max_tiles, quant_tiles = stack["max_tiles"], stack["quant_tiles"]
        if max_tiles % 4 or max_tiles % quant_tiles or stack["lag"] < 1:
            raise ValueError(f"{_WHAT}: STACK needs max_tiles a multiple of 4 and of quant_tiles, lag >= 1: "
                             f"{dict(stack)}")
        programs = 1 if interpreted(_stack_kernel) else stack["programs_per_sm"] * sm_count(w.device)
        part = _terms_buffer(programs, terms, w.device)
        launch_cached(
            _stack_kernel, (programs,),
            w, own, done, ticket, imp, packed, scale, gs, choice, part, n_members, tiles, blocks_per_row, imp_stride,
            cdiv(tiles, max_tiles), cdiv(tiles, quant_tiles), *recips, LAG=stack["lag"], MAX_TILES=max_tiles,
            QUANT_TILES=quant_tiles, PREFETCH=stack["prefetch"],
            HALF={torch.bfloat16: 1, torch.float16: 2}.get(w.dtype, 0), TERMS=terms is not None, **consts, **opts)
        _add_terms(part, terms, n_blocks)
        qt = nvfp4.NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs)
        return qt, (choice if return_choice else None), own.reshape(batch)
    if global_amax is None:
        own = member_amax(w).reshape(-1)
        g, own_max = own, False
    else:
        own = torch.zeros(n_members, dtype=torch.float32, device=w.device)
        g, own_max = global_amax.reshape(-1), True
    programs = cdiv(n_blocks, consts["BLOCKS"])
    part = _terms_buffer(programs, terms, w.device)
    launch_cached(
        _quantize_kernel, (programs,),
        w, g, own, imp, packed, scale, gs, choice, part, n_blocks, blocks_per_member, blocks_per_row,
        imp_stride, *recips, OWN_MAX=own_max,
        MEMBERS=0 if n_members == 1 else (1 if blocks_per_member % consts["BLOCKS"] == 0 else 2),
        TERMS=terms is not None, **consts, **opts)
    _add_terms(part, terms, n_blocks)
    qt = nvfp4.NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs)
    return qt, (choice if return_choice else None), own.reshape(batch)


def _terms_buffer(programs: int, terms: list | None, device: torch.device) -> torch.Tensor:
    """Each program's three `_tile_terms` sums (fp32), or a placeholder the kernel never touches."""
    return torch.empty((programs if terms is not None else 1, 3), dtype=torch.float32, device=device)


def _add_terms(part: torch.Tensor, terms: list | None, n_blocks: int) -> None:
    """The programs' partial sums appended to `terms` as `Terms` (added where they are read)."""
    if terms is not None:
        terms.append(Terms(part, n_blocks))


def _importance_rows(importance, w: torch.Tensor, eager: bool) -> torch.Tensor:
    """importance as fp32 [1 or batch members, K] rows. The reference's shape checks run here;
    its value checks (finite, >= 0) too when `eager`, else with the caller's deferred checks."""
    imp = torch.as_tensor(importance, device=w.device).float()
    k = w.shape[-1]
    shape_ok = imp.dim() >= 1 and imp.shape[-1] == k and (imp.dim() == 1 or tuple(imp.shape[:-1]) == tuple(w.shape[:-2]))
    if eager or not shape_ok:
        nvfp4._importance_weights(importance, w, _WHAT)  # raises the reference's errors
    return imp.reshape(-1, k).contiguous()


# The signature is an intended mirror of fp4kit.formats.nvfp4.quantize's (the contract), plus
# `backend` and `tables`.
def quantize(
    w: torch.Tensor,
    *,
    scale_rule: str = "6",
    global_amax=None,
    importance=None,
    return_choice: bool = False,
    arith: str = DEFAULT_ARITH,
    backend: str = "triton",
    tables: Mapping | None = None,
    deferred: list | None = None,
    terms: list | None = None,
):
    """`fp4kit.formats.nvfp4.quantize` on the GPU: same arguments, same errors, same bytes.

    w: [..., N, K] (or [K]) fp32/fp16/bf16, K % 16 == 0; leading dims are batch members (an
    [E, N, K] expert stack is quantized in one call, one global scale per expert).
    backend: "triton" (this kernel; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or
    "torch" (the reference itself). tables: the launch table (default: the device's).
    The checks that need the data (finite weights, a given global amax covering max|w|) run
    after both kernels are queued, so the GPU never waits on the host between them; with a
    `deferred` list they are appended to it as a `DeferredCheck` instead (the tensors to test and
    the function that raises the same error; `deferred.run_all` tests many at once), so that
    a caller quantizing many tensors waits on the GPU once. terms: a list that receives the
    weight's `formats.metrics.Terms` (sum w^2, sum (w - dequantized)^2, blocks on the 4
    candidate: per-program partial sums on w's device), summed as the kernel quantizes (`launch`).
    """
    check_backend(backend, _quantize_kernel, w, what=_WHAT)
    if backend == "torch":
        qt, choice = nvfp4.quantize(w, scale_rule=scale_rule, global_amax=global_amax,
                                    importance=importance, return_choice=True, arith=arith)
        if terms is not None:
            terms.append(Terms.of(*sqnr_terms(w, qt.dequantize()), choice.double().sum(), choice.numel()))
        return (qt, choice) if return_choice else qt
    check_mode(arith)
    if scale_rule not in nvfp4.SCALE_RULES:
        raise FormatError(f"{_WHAT}: scale_rule must be one of {nvfp4.SCALE_RULES}, got {scale_rule!r}")
    check_float_tensor(w, _WHAT)
    if w.shape[-1] % NVFP4_BLOCK_SIZE:
        raise FormatError(
            f"{_WHAT}: last dim K={w.shape[-1]} of shape {tuple(w.shape)} is not a multiple of "
            f"the {NVFP4_BLOCK_SIZE}-element block"
        )
    if importance is not None and scale_rule != "4o6":
        raise FormatError(f"{_WHAT}: importance only applies to scale_rule='4o6'")
    w = w.contiguous()
    batch = tuple(w.shape[:-2])
    g = None if global_amax is None else _broadcast_global_amax(global_amax, batch, w.device)
    imp = None
    if importance is not None:
        imp = _importance_rows(importance, w, eager=deferred is None)
    qt, choice, own = launch(w, scale_rule, g, imp, return_choice, arith, tables=tables, terms=terms)

    def check() -> None:
        if importance is not None and deferred is not None:
            nvfp4._importance_weights(importance, w, _WHAT)  # the reference's value checks
        if not bool(torch.isfinite(own).all()):
            check_finite(w, _WHAT)  # raises, naming the count and first position
        if g is not None:
            _check_global_amax(g, own)

    if deferred is None:
        check()
    else:
        deferred.append(DeferredCheck(check, finite=[own], finite_nonnegative=[] if imp is None else [imp],
                                      covers=[] if g is None else [(g.reshape(own.shape), own)]))
    return (qt, choice.bool()) if return_choice else qt


# The kernel spells these constants as literals; tied here to their one home, fp4kit.formats.
assert (E2M1_MAX, FP8_NORM_4O6, NVFP4_GLOBAL_DENOM) == (6.0, 256.0, 2688.0)
assert (BLOCK_SCALE_MIN, BLOCK_SCALE_MAX, E4M3_MIN_NORMAL) == (2.0**-9, 448.0, 2.0**-6)
