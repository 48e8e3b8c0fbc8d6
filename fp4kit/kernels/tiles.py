"""The NVFP4 tile pieces the GEMM-family kernels share (`@triton.jit` helpers and their PTX).

A weight tile is read as stored in the checkpoint layout: packed codes (8 per int32 word, or one
16-block per int64) and E4M3 block-scale bytes, decoded in registers. Two decodings, each exact
against `fp4kit.formats.nvfp4.NVFP4Tensor.dequantize`:

- `dequant_tile`: a [BLOCK_N, BLOCK_K] tile of W.dequantize() rounded to the activation dtype, for
  `tl.dot` (`accumulate`); per-block tables applied with byte permutes (inline PTX) on a GPU for
  16-bit activations, the same values by arithmetic elsewhere.
- `gemv_accumulate`: the CUDA-core form, the block scale factored out of each 16-block: the
  weights are W.dequantize()'s fp32 values, one fp32 fma per weight and activation row.

Also here: the split-K epilogue that sums the partials in the launch (`store_split`) and its tile
counters (`split_counters`), relu^2 as Nemotron-H's experts compute it, and the host-side helpers
that prepare activations for these loads.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .backend import cdiv, interpreted


@triton.jit
def e4m3_decode(code):
    """float8_e4m3fn byte (int32) -> its fp32 value, exactly (NaN for 0x7F/0xFF)."""
    mag = code & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # exponent bias 7 -> 127
    sub = (mag & 7).to(tl.float32) * 0.001953125  # exponent field 0: man * 2^-9
    v = tl.where(mag < 8, sub, normal)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where((code & 0x80) != 0, -v, v)


@triton.jit
def e2m1_bits(packed, SHIFT: tl.constexpr):
    """fp32 whose value is E2M1(code) * 2^-126, for the code in bits SHIFT..SHIFT+3 of `packed`.

    The code's 3 magnitude bits (2 exponent, 1 mantissa) land on fp32's lowest 2 exponent bits
    and top mantissa bit, its sign on the sign bit: exponent 0 is then fp32's subnormal range,
    mirroring E2M1's (0.5 -> 2^-127), so every code maps exactly, no table needed.
    """
    bits = ((packed << (22 - SHIFT)) & 0x01C00000) | ((packed << (28 - SHIFT)) & -0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_tile_arith(words, scale_code, gs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/8] packed words (4 bytes, 8 codes each, little-endian: code i of the
    word in bits 4i..4i+3) + [BLOCK_N, BLOCK_K/16] scale bytes -> fp32 weights [BLOCK_N, BLOCK_K].

    Each value is RN(e2m1 * (float(scale) * gs)), the reference's fp32 product: (bits * 2^126)
    is the E2M1 value exactly (scaling by a power of two; subnormals are kept, no flush-to-zero
    in these kernels), then one rounded multiply by the block's step.
    """
    codes = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    values = e2m1_bits(codes, 0) * 8.507059173023462e37  # 2^126
    step = e4m3_decode(scale_code.to(tl.int32)) * gs  # float(scale) * global_scale, fp32
    w = tl.reshape(values, (BLOCK_N, BLOCK_K // 16, 16)) * tl.reshape(step, (BLOCK_N, BLOCK_K // 16, 1))
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


# Per-block tables of the 8 magnitudes RN16(RN32(e2m1 * step)), e2m1 in {0, .5, 1, 1.5, 2, 3, 4, 6}
# ($4 = step): the high bytes of entries 0-3 ($0) and 4-7 ($1), the low bytes of 0-3 ($2) and
# 4-7 ($3). Each product is the reference's rounded fp32 product; cvt.rn rounds to the 16-bit
# type as torch's cast does (cvt.rn.T.f32 d, a, b puts a in the high half).
_LUT_ASM_TEMPLATE = """
{
.reg .f32 m1, m3, m4, m5, m6, m7;
.reg .b32 p01, p23, p45, p67;
mul.rn.f32 m1, $4, 0f3F000000;
mul.rn.f32 m3, $4, 0f3FC00000;
mul.rn.f32 m4, $4, 0f40000000;
mul.rn.f32 m5, $4, 0f40400000;
mul.rn.f32 m6, $4, 0f40800000;
mul.rn.f32 m7, $4, 0f40C00000;
cvt.rn.CVT.f32 p01, m1, 0f00000000;
cvt.rn.CVT.f32 p23, m3, $4;
cvt.rn.CVT.f32 p45, m5, m4;
cvt.rn.CVT.f32 p67, m7, m6;
prmt.b32 $0, p01, p23, 0x7531;
prmt.b32 $1, p45, p67, 0x7531;
prmt.b32 $2, p01, p23, 0x6420;
prmt.b32 $3, p45, p67, 0x6420;
}
"""
_DEQUANT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 20))
_LUT_ASM_BF16 = tl.constexpr(_LUT_ASM_TEMPLATE.replace("CVT", "bf16x2"))
_LUT_ASM_F16 = tl.constexpr(_LUT_ASM_TEMPLATE.replace("CVT", "f16x2"))

# Dequantization of one packed word ($4: 8 codes) by byte permutes: 2 instructions per weight.
# The asm runs on 4 copies of each input (pack=4; $4-$7 the word, $8-$11, $12-$15, $16-$19,
# $20-$23 the word's block tables: high bytes of entries 0-3 and 4-7, low bytes of 0-3 and 4-7)
# and reads the first. Outputs, two 16-bit values per register in K order: $0, $1 the codes of
# bytes 0-1 (K offsets 0-3), $2, $3 those of bytes 2-3 (K offsets 4-7).
# - prmt with selector nibbles code & 7 picks each code's table byte (high and low);
# - the sign: prmt over bytes {0x00 x4, 0x80 x4} with the selector (codes >> 1) picks 0x80 where
#   the code's bit 3 is set (the nibble's top bit then lands on the replicate-sign mode, which
#   turns 0x80 into 0xFF and leaves 0x00 alone: bit 7 is the sign either way), masked to bit 7
#   and or-ed into the high byte (-0.0 for code 8, as the reference's -0.0 * step);
# - prmt interleaves low and high bytes into 16-bit values.
_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 m, s, ha, la, sa, zero, neg;
mov.b32 zero, 0;
mov.b32 neg, 0x80808080;
and.b32 m, $4, 0x77777777;
shr.u32 s, $4, 1;
prmt.b32 ha, $8, $12, m;
prmt.b32 la, $16, $20, m;
prmt.b32 sa, zero, neg, s;
and.b32 sa, sa, 0x80808080;
or.b32 ha, ha, sa;
prmt.b32 $0, la, ha, 0x5140;
prmt.b32 $1, la, ha, 0x7362;
shr.u32 m, m, 16;
shr.u32 s, $4, 17;
prmt.b32 ha, $8, $12, m;
prmt.b32 la, $16, $20, m;
prmt.b32 sa, zero, neg, s;
and.b32 sa, sa, 0x80808080;
or.b32 ha, ha, sa;
prmt.b32 $2, la, ha, 0x5140;
prmt.b32 $3, la, ha, 0x7362;
}
""")


@triton.jit
def _per_word(t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/16] per-block values -> [BLOCK_N, BLOCK_K/8, 4]: each packed word's
    block value, 4 times (the 4 bytes the table asm takes at once)."""
    t = tl.broadcast_to(tl.reshape(t, (BLOCK_N, BLOCK_K // 16, 1, 1)), (BLOCK_N, BLOCK_K // 16, 2, 4))
    return tl.reshape(t, (BLOCK_N, BLOCK_K // 8, 4))


@triton.jit
def _dequant_tile_lut(words, scale_code, gs, DT: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_dequant_tile_arith` rounded to DT (bf16 or fp16), by per-block tables and byte permutes
    (inline PTX; CUDA only): the same values, about 2 instructions per weight instead of 11."""
    step = e4m3_decode(scale_code.to(tl.int32)) * gs  # float(scale) * global_scale, fp32
    if DT == tl.bfloat16:
        h0, h1, l0, l1 = tl.inline_asm_elementwise(
            _LUT_ASM_BF16, "=r,=r,=r,=r,r", [step], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
    else:
        h0, h1, l0, l1 = tl.inline_asm_elementwise(
            _LUT_ASM_F16, "=r,=r,=r,=r,r", [step], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
    # Each word 4 times, so that one asm instance (pack=4) sees one word and writes its 8 values.
    w4 = tl.broadcast_to(words[:, :, None], (BLOCK_N, BLOCK_K // 8, 4))
    tables = [w4, _per_word(h0, BLOCK_N, BLOCK_K), _per_word(h1, BLOCK_N, BLOCK_K),
              _per_word(l0, BLOCK_N, BLOCK_K), _per_word(l1, BLOCK_N, BLOCK_K)]
    if DT == tl.bfloat16:
        first, second = tl.inline_asm_elementwise(_DEQUANT_ASM, _DEQUANT_CONSTRAINTS, tables,
                                                  dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        first, second = tl.inline_asm_elementwise(_DEQUANT_ASM, _DEQUANT_CONSTRAINTS, tables,
                                                  dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    # first/second hold K offsets 0-3 / 4-7 of each word's run of 8: back to K order.
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))


@triton.jit
def dequant_tile(words, scale_code, gs, DT: tl.constexpr, LUT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile in DT: W.dequantize() exactly, rounded to DT."""
    if LUT:
        w = _dequant_tile_lut(words, scale_code, gs, DT, BLOCK_N, BLOCK_K)
    else:
        w = _dequant_tile_arith(words, scale_code, gs, BLOCK_N, BLOCK_K).to(DT)
    return w


@triton.jit
def load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Packed words [BLOCK_N, BLOCK_K/8] (int32: 8 codes each) and scale bytes
    [BLOCK_N, BLOCK_K/16] at K offset k0; zeros past N and K. The mask is on K (a multiple of
    16), so whole 16-blocks are in or out and the loads stay vectorized; with EVEN_N / EVEN_K
    (the tile divides N / K) there is no mask on that side."""
    word = tl.arange(0, BLOCK_K // 8)
    grp = tl.arange(0, BLOCK_K // 16)
    col = k0 // 8 + word
    gcol = k0 // 16 + grp
    w_at = wq_ptr + n64[:, None] * (K // 8) + col[None, :]
    s_at = ws_ptr + n64[:, None] * (K // 16) + gcol[None, :]
    if EVEN_N and EVEN_K:
        words = tl.load(w_at)
        sc = tl.load(s_at)
    elif EVEN_K:
        words = tl.load(w_at, mask=n_ok[:, None], other=0)
        sc = tl.load(s_at, mask=n_ok[:, None], other=0)
    else:
        words = tl.load(w_at, mask=n_ok[:, None] & (col < K // 8)[None, :], other=0)
        sc = tl.load(s_at, mask=n_ok[:, None] & (gcol < K // 16)[None, :], other=0)
    return words, sc


@triton.jit
def relu2(acc, ACT: tl.constexpr):
    """Nemotron-H's expert activation on a linear's fp32 accumulator, as torch computes it on ACT
    tensors: the output rounded to ACT, relu, square, rounded to ACT again."""
    h = tl.maximum(acc.to(ACT).to(tl.float32), 0.0)
    return (h * h).to(ACT)


@triton.jit
def _load_x(x_ptr, x_row, m_ok, k0, kk, K, EVEN_K: tl.constexpr, X_PARTS: tl.constexpr, part_stride,
            ACT: tl.constexpr):
    """The activation tile x[rows, k0:k0+BLOCK_K]^T ([BLOCK_K, BLOCK_M]), zeros past K and for
    rows not in m_ok.

    X_PARTS = 0: x_ptr is the activation itself. X_PARTS > 0: x_ptr holds X_PARTS fp32 split-K
    partial sums of a linear's output, part_stride elements apart; the tile is their sum in the
    order s = 0, 1, ..., rounded to ACT (the linear's output dtype), then relu^2 rounded to ACT
    again (Nemotron-H's expert activation, as torch computes it on ACT tensors)."""
    at = x_ptr + x_row[None, :] + (k0 + kk)[:, None]
    if EVEN_K:
        ok = m_ok[None, :]
    else:
        ok = m_ok[None, :] & ((k0 + kk) < K)[:, None]
    if X_PARTS == 0:
        x = tl.load(at, mask=ok, other=0.0)
    else:
        h = tl.load(at, mask=ok, other=0.0)
        for s in tl.static_range(1, X_PARTS):
            h += tl.load(at + s * part_stride, mask=ok, other=0.0)
        x = relu2(h, ACT)
    return x


@triton.jit
def k_ahead(k0, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STEPS: tl.constexpr = 1):
    """K offset of the tile STEPS tiles after k0 (the prefetch); with EVEN_K held at the last tile
    before k_end (the prefetch past the end re-reads it, in bounds), else left to the load's mask."""
    k = k0 + STEPS * BLOCK_K
    if EVEN_K:
        k = tl.minimum(k, k_end - BLOCK_K)
    return k


@triton.jit
def accumulate(acc, x_ptr, x_row, m_ok, wq_ptr, ws_ptr, gs, n64, n_ok, K, k_start, k_end,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, LUT: tl.constexpr,
                EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, X_PARTS: tl.constexpr = 0, part_stride=0,
                ACT: tl.constexpr = None):
    """acc[BLOCK_N, BLOCK_M] += W[n, k_start:k_end] @ x[rows, k_start:k_end]^T.

    x_row: [BLOCK_M] int64 element offsets of the activation rows (gathered rows for MoE);
    X_PARTS, part_stride, ACT: how the activation tile is read (`_load_x`);
    wq_ptr / ws_ptr: packed words [*, K/8] (int32 view of the packed bytes) and scale bytes
    [*, K/16] of the weight matrix.
    The next weight tile is loaded before the current one is dequantized (register double
    buffering: the weight stream is what decode sizes wait on). k_end - k_start is a multiple
    of BLOCK_K or ends at K (`k_ahead`).
    """
    kk = tl.arange(0, BLOCK_K)
    packed, sc = load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k_start, K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        packed_next, sc_next = load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k_ahead(k0, k_end, BLOCK_K, EVEN_K),
                                                 K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K)
        x = _load_x(x_ptr, x_row, m_ok, k0, kk, K, EVEN_K, X_PARTS, part_stride, ACT)  # [BLOCK_K, BLOCK_M]
        w = dequant_tile(packed, sc, gs, x.dtype, LUT, BLOCK_N, BLOCK_K)
        if IEEE:  # fp32 operands (16-bit ones convert exactly), IEEE fp32 sums
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        packed, sc = packed_next, sc_next
    return acc


@triton.jit
def store_split(acc, part_ptr, out_ptr, cnt_ptr, tile, off, ok, MN, pid_s, SPLIT: tl.constexpr, scale=None):
    """Split-K epilogue in the same launch: every program stores its fp32 partial and counts
    itself in at its tile's counter (one atomic); the last of the tile's SPLIT programs to arrive
    sums the SPLIT partials in the fixed order s = 0, 1, ... (the result does not depend on which
    program was last), multiplies the sum by `scale` (fp32) where one is given, writes the output
    in its dtype and puts the counter back to 0 for the next launch. The barrier orders the
    program's partial stores before its release; the partials are read through L2 (.cg), where
    the other programs' stores are."""
    tl.store(part_ptr + pid_s.to(tl.int64) * MN + off, acc, mask=ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        total = tl.load(part_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            total += tl.load(part_ptr + s * MN.to(tl.int64) + off, mask=ok, other=0.0, cache_modifier=".cg")
        if scale is not None:
            total = total * scale
        tl.store(out_ptr + off, total.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(cnt_ptr + tile, 0)



# The 16 codes of one 16-block (an int64, code i in bits 4i..4i+3; $16) as 16 fp32 values
# E2M1(code_i) * 2^-6 ($0-$15), exactly, in 7 bit operations per 8 codes plus conversions:
# - each code becomes an E4M3 byte with the same bits in other places: sign to bit 7, the two
#   exponent bits and the mantissa bit to bits 4..2. E4M3's exponent bias is 7 against E2M1's
#   1, so the byte's value is the code's * 2^-6, subnormals included (E2M1 0.5 -> E4M3 2^-7).
#   Even codes of a word q: ((q << 2) & 0x1C..) | ((q << 4) & 0x80..); odd codes:
#   ((q >> 2) & 0x1C..) | (q & 0x80..);
# - cvt.rn.f16x2.e4m3x2 turns two such bytes into two fp16 (exact), cvt.f32.f16 each into fp32.
# The four 5-line groups below mirror each other: even and odd codes of the low and high word.
_CODES16_ASM = tl.constexpr("""
{
.reg .b32 q0, q1, a, b, e0, e1, e2, e3, h0, h1, h2, h3, h4, h5, h6, h7;
.reg .b16 s0, s1, s2, s3, s4, s5, s6, s7;
.reg .b16 c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15;
mov.b64 {q0, q1}, $16;
shl.b32 a, q0, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 b, q0, 4;
and.b32 b, b, 0x80808080;
or.b32 e0, a, b;
shr.u32 a, q0, 2;
and.b32 a, a, 0x1C1C1C1C;
and.b32 b, q0, 0x80808080;
or.b32 e1, a, b;
shl.b32 a, q1, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 b, q1, 4;
and.b32 b, b, 0x80808080;
or.b32 e2, a, b;
shr.u32 a, q1, 2;
and.b32 a, a, 0x1C1C1C1C;
and.b32 b, q1, 0x80808080;
or.b32 e3, a, b;
mov.b32 {s0, s1}, e0;
mov.b32 {s2, s3}, e1;
mov.b32 {s4, s5}, e2;
mov.b32 {s6, s7}, e3;
cvt.rn.f16x2.e4m3x2 h0, s0;
cvt.rn.f16x2.e4m3x2 h1, s1;
cvt.rn.f16x2.e4m3x2 h2, s2;
cvt.rn.f16x2.e4m3x2 h3, s3;
cvt.rn.f16x2.e4m3x2 h4, s4;
cvt.rn.f16x2.e4m3x2 h5, s5;
cvt.rn.f16x2.e4m3x2 h6, s6;
cvt.rn.f16x2.e4m3x2 h7, s7;
mov.b32 {c0, c2}, h0;
mov.b32 {c4, c6}, h1;
mov.b32 {c1, c3}, h2;
mov.b32 {c5, c7}, h3;
mov.b32 {c8, c10}, h4;
mov.b32 {c12, c14}, h5;
mov.b32 {c9, c11}, h6;
mov.b32 {c13, c15}, h7;
cvt.f32.f16 $0, c0;
cvt.f32.f16 $1, c1;
cvt.f32.f16 $2, c2;
cvt.f32.f16 $3, c3;
cvt.f32.f16 $4, c4;
cvt.f32.f16 $5, c5;
cvt.f32.f16 $6, c6;
cvt.f32.f16 $7, c7;
cvt.f32.f16 $8, c8;
cvt.f32.f16 $9, c9;
cvt.f32.f16 $10, c10;
cvt.f32.f16 $11, c11;
cvt.f32.f16 $12, c12;
cvt.f32.f16 $13, c13;
cvt.f32.f16 $14, c14;
cvt.f32.f16 $15, c15;
}
""")


@triton.jit
def _code_value(word, SHIFT: tl.constexpr):
    """E2M1 * 2^-6 of the code in bits SHIFT..SHIFT+3 of an int32, exactly (2^120 rescales
    `e2m1_bits`' 2^-126)."""
    return e2m1_bits(word >> SHIFT, 0) * 1.329227995784916e36


@triton.jit
def _codes16(blocks, LUT: tl.constexpr):
    """A 16-block's codes (int64, code i in bits 4i..4i+3) -> its 16 values E2M1(code_i) * 2^-6
    in fp32 (exact), by the inline PTX `_CODES16_ASM` (LUT, CUDA) or the same values by
    arithmetic (`e2m1_bits`; the interpreter, and the GPU test comparing the two)."""
    if LUT:
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = tl.inline_asm_elementwise(
            _CODES16_ASM, "=f," * 16 + "l", [blocks], dtype=(tl.float32,) * 16, is_pure=True, pack=1)
    else:
        lo = blocks.to(tl.int32)
        hi = (blocks >> 32).to(tl.int32)
        v0, v1, v2, v3 = _code_value(lo, 0), _code_value(lo, 4), _code_value(lo, 8), _code_value(lo, 12)
        v4, v5, v6, v7 = _code_value(lo, 16), _code_value(lo, 20), _code_value(lo, 24), _code_value(lo, 28)
        v8, v9, v10, v11 = _code_value(hi, 0), _code_value(hi, 4), _code_value(hi, 8), _code_value(hi, 12)
        v12, v13, v14, v15 = _code_value(hi, 16), _code_value(hi, 20), _code_value(hi, 24), _code_value(hi, 28)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _x_at(xb, i, ok, X_PARTS: tl.constexpr, part_stride, ACT: tl.constexpr):
    """x[k + i] as fp32 for each block start k (xb); 0 where not ok. X_PARTS > 0: relu^2 of the
    sum of X_PARTS fp32 partials part_stride apart, summed in order and rounded to ACT as
    `_load_x` does."""
    h = tl.load(xb + i, mask=ok, other=0.0)
    if X_PARTS == 0:
        v = h.to(tl.float32)
    else:
        for s in tl.static_range(1, X_PARTS):
            h += tl.load(xb + s * part_stride + i, mask=ok, other=0.0)
        v = relu2(h, ACT).to(tl.float32)
    return v


@triton.jit
def _x_quad(x4_blk, p, ok, XT: tl.constexpr):
    """x[k + 4p : k + 4p + 4] as four fp32 for each block start k, from one 8-byte load of the
    16-bit activations (x4_blk: their int64 view, 4 values each); 0 where not ok."""
    q = tl.load(x4_blk + p, mask=ok, other=0)
    lo = q.to(tl.int32)
    hi = (q >> 32).to(tl.int32)
    if XT == tl.bfloat16:  # bf16 is fp32's top half
        v0 = (lo << 16).to(tl.float32, bitcast=True)
        v1 = (lo & -65536).to(tl.float32, bitcast=True)
        v2 = (hi << 16).to(tl.float32, bitcast=True)
        v3 = (hi & -65536).to(tl.float32, bitcast=True)
    else:
        v0 = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        v1 = (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        v2 = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        v3 = (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v0, v1, v2, v3


@triton.jit
def _block_dot(x_ptr, x4_ptr, rows, k_blk, ok, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13,
               v14, v15, X_PARTS: tl.constexpr, part_stride, ACT: tl.constexpr):
    """[BLOCK_M, BLOCK_N, BLOCK_K/16]: per activation row and 16-block, sum_i v_i * x[k + i] in
    K order, one fp32 fma per weight (the first a product). v_i: [1, BLOCK_N, BLOCK_K/16] block
    values; rows: [BLOCK_M, 1] element offsets of the activation rows; k_blk: [1, BLOCK_K/16]
    block starts; ok: [BLOCK_M, BLOCK_K/16] (rows and blocks in range). The activations: x itself
    (16-bit ones read 4 at a time through x4_ptr, their int64 view), or with X_PARTS > 0 relu^2
    of X_PARTS fp32 partial sums (`_x_at`)."""
    xb = x_ptr + rows + k_blk
    if X_PARTS > 0 or x_ptr.dtype.element_ty == tl.float32:
        P: tl.constexpr = X_PARTS
        x0, x1, x2, x3 = (_x_at(xb, 0, ok, P, part_stride, ACT), _x_at(xb, 1, ok, P, part_stride, ACT),
                          _x_at(xb, 2, ok, P, part_stride, ACT), _x_at(xb, 3, ok, P, part_stride, ACT))
        x4, x5, x6, x7 = (_x_at(xb, 4, ok, P, part_stride, ACT), _x_at(xb, 5, ok, P, part_stride, ACT),
                          _x_at(xb, 6, ok, P, part_stride, ACT), _x_at(xb, 7, ok, P, part_stride, ACT))
        x8, x9, x10, x11 = (_x_at(xb, 8, ok, P, part_stride, ACT), _x_at(xb, 9, ok, P, part_stride, ACT),
                            _x_at(xb, 10, ok, P, part_stride, ACT), _x_at(xb, 11, ok, P, part_stride, ACT))
        x12, x13, x14, x15 = (_x_at(xb, 12, ok, P, part_stride, ACT), _x_at(xb, 13, ok, P, part_stride, ACT),
                              _x_at(xb, 14, ok, P, part_stride, ACT), _x_at(xb, 15, ok, P, part_stride, ACT))
    else:
        xq = x4_ptr + (rows + k_blk) // 4
        XT: tl.constexpr = x_ptr.dtype.element_ty
        x0, x1, x2, x3 = _x_quad(xq, 0, ok, XT)
        x4, x5, x6, x7 = _x_quad(xq, 1, ok, XT)
        x8, x9, x10, x11 = _x_quad(xq, 2, ok, XT)
        x12, x13, x14, x15 = _x_quad(xq, 3, ok, XT)
    t = v0 * x0[:, None, :]
    t = tl.fma(v1, x1[:, None, :], t)
    t = tl.fma(v2, x2[:, None, :], t)
    t = tl.fma(v3, x3[:, None, :], t)
    t = tl.fma(v4, x4[:, None, :], t)
    t = tl.fma(v5, x5[:, None, :], t)
    t = tl.fma(v6, x6[:, None, :], t)
    t = tl.fma(v7, x7[:, None, :], t)
    t = tl.fma(v8, x8[:, None, :], t)
    t = tl.fma(v9, x9[:, None, :], t)
    t = tl.fma(v10, x10[:, None, :], t)
    t = tl.fma(v11, x11[:, None, :], t)
    t = tl.fma(v12, x12[:, None, :], t)
    t = tl.fma(v13, x13[:, None, :], t)
    t = tl.fma(v14, x14[:, None, :], t)
    t = tl.fma(v15, x15[:, None, :], t)
    return t


@triton.jit
def load_blocks(wb_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, KB: tl.constexpr = 0):
    """16-blocks [BLOCK_N, BLOCK_K/16] at K offset k0: the codes (int64 view of the packed bytes,
    one block each) and the scale bytes, which share their offsets; zeros past N and K.
    KB > 0: K / 16 known at compile time, n64 the rows counted from wb_ptr / ws_ptr (the
    program's first row): each row's blocks lie a constant distance from the first row's, which
    the loads take as an immediate offset instead of one 64-bit address sum per row and K step."""
    g = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    if KB == 0:
        off = n64[:, None] * (K // 16) + g[None, :]
    else:
        off = n64[:, None] * KB + g[None, :]
    if EVEN_N and EVEN_K:
        codes = tl.load(wb_ptr + off)
        sc = tl.load(ws_ptr + off)
    else:
        ok = n_ok[:, None] & (g < K // 16)[None, :]
        codes = tl.load(wb_ptr + off, mask=ok, other=0)
        sc = tl.load(ws_ptr + off, mask=ok, other=0)
    return codes, sc


@triton.jit
def gemv_accumulate(acc, x_ptr, x4_ptr, rows, m_ok, wb_ptr, ws_ptr, gs, n64, n_ok, K, k_start, k_end,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LUT: tl.constexpr, EVEN_N: tl.constexpr,
                     EVEN_K: tl.constexpr, X_PARTS: tl.constexpr = 0, part_stride=0, ACT: tl.constexpr = None,
                     KB: tl.constexpr = 0, AHEAD: tl.constexpr = 1, WAIT: tl.constexpr = False):
    """acc[BLOCK_M, BLOCK_N, BLOCK_K/16] += per block b: step_b * sum_i v(code_i) * x[m, k + i],
    over K in [k_start, k_end), on the CUDA cores.

    v(code) = E2M1(code) * 2^-6 (`_codes16`), step_b = float(scale_b) * global_scale in fp32 as
    the reference has it; the inner sum is one fp32 fma per weight and row (`_block_dot`), then
    one fma per block adds step_b times it. The caller's result is 64 * acc summed over its last
    axis: x @ W^T with W.dequantize()'s fp32 weights (not rounded to the activation dtype).
    rows: [BLOCK_M, 1] element offsets of the activation rows, m_ok: [BLOCK_M] which exist;
    wb_ptr: the weight's packed bytes as int64 (one 16-block each), ws_ptr its scale bytes;
    X_PARTS, part_stride, ACT: the activations as `_block_dot` reads them. Each thread holds its
    blocks of all BLOCK_N weight rows and BLOCK_M activation rows: a block's codes are decoded
    once for BLOCK_M rows, an activation converted once for BLOCK_N. KB > 0: K / 16 at compile
    time, n64 counted from wb_ptr / ws_ptr (`load_blocks`). AHEAD (1, 2 or 3): the K tiles whose
    weights are in flight while one is computed; more keep more bytes in flight per thread where
    few programs share a multiprocessor. WAIT: the program is a programmatic dependent launch
    (`backend.pdl`) whose activations its predecessor writes: the first AHEAD tiles' weights are
    requested, then it waits for the predecessor (`gdc_wait`) before the first activation load,
    so the weights' latency overlaps the predecessor's last work."""
    tl.static_assert((AHEAD >= 1) & (AHEAD <= 3), "AHEAD: 1, 2 or 3 K tiles")
    blk16 = tl.arange(0, BLOCK_K // 16) * 16
    codes, sc = load_blocks(wb_ptr, ws_ptr, n64, n_ok, k_start, K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, KB)
    if AHEAD >= 2:
        codes1, sc1 = load_blocks(wb_ptr, ws_ptr, n64, n_ok, k_ahead(k_start, k_end, BLOCK_K, EVEN_K),
                                  K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, KB)
    if AHEAD >= 3:
        codes2, sc2 = load_blocks(wb_ptr, ws_ptr, n64, n_ok, k_ahead(k_start, k_end, BLOCK_K, EVEN_K, 2),
                                  K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, KB)
    if WAIT:
        gdc_wait()
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            ok = m_ok[:, None]
        else:
            ok = m_ok[:, None] & ((k0 + blk16) < K)[None, :]
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _codes16(codes[None, :, :], LUT)
        codes_next, sc_next = load_blocks(wb_ptr, ws_ptr, n64, n_ok, k_ahead(k0, k_end, BLOCK_K, EVEN_K, AHEAD),
                                           K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, KB)
        t = _block_dot(x_ptr, x4_ptr, rows, (k0 + blk16)[None, :], ok, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9,
                       v10, v11, v12, v13, v14, v15, X_PARTS, part_stride, ACT)
        if LUT:
            scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            scale = e4m3_decode(sc.to(tl.int32))
        acc = tl.fma(t, (scale * gs)[None, :, :], acc)
        if AHEAD == 1:
            codes, sc = codes_next, sc_next
        elif AHEAD == 2:
            codes, sc, codes1, sc1 = codes1, sc1, codes_next, sc_next
        else:
            codes, sc, codes1, sc1, codes2, sc2 = codes1, sc1, codes2, sc2, codes_next, sc_next
    return acc



# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def activation_rows(x: torch.Tensor, k: int, n: int) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(x's leading shape, x as rows [M, K] with unit stride along K, the output [M, N] to fill
    in x's dtype) for a GEMM launcher."""
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # rows already: no view to make
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x.shape[:-1], x2, x2.new_empty((x2.shape[0], n))


def as_leading(out: torch.Tensor, lead: tuple, n: int) -> torch.Tensor:
    """A launcher's [M, N] output in the activations' leading shape (itself where that is [M])."""
    return out if len(lead) == 1 else out.reshape(*lead, n)


# The table dequantization (inline PTX) for 16-bit activations on a GPU; the arithmetic one


def gemv_k_tile(k: int, cfg: dict) -> dict:
    """BLOCK_K and warps halved together (the same blocks per thread) down to one warp, taking the
    one that pads K least to a whole number of K steps, the most warps among equals: K = 2688
    runs 3 steps of 1024 (2 warps), not 2 of 2048 (52% padding)."""
    bk, nw = cfg["BLOCK_K"], cfg["num_warps"]
    best = (bk, nw)
    while nw > 1:
        bk, nw = bk // 2, nw // 2
        if cdiv(k, bk) * bk < cdiv(k, best[0]) * best[0]:
            best = (bk, nw)
    return dict(cfg, BLOCK_K=best[0], num_warps=best[1])



def int64_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, its int64 view) for the CUDA-core kernels, which read 16-bit activations 4 at a time:
    x [rows, K] (last dimension contiguous) is copied first unless its rows start 8-byte aligned.
    fp32 activations are read one at a time: (x, x)."""
    if x.dtype == torch.float32:
        return x, x
    if x.stride(0) % 4 or x.data_ptr() % 8:
        x = x.clone(memory_format=torch.contiguous_format)
    return x, x.view(torch.int64)


_COUNTERS: dict = {}  # (device, stream) -> counters of eager launches
_CAPTURE_COUNTERS: dict = {}  # (device, stream) -> (capture id, counters of that capture's launches)


@functools.cache
def _capture_info():
    """The driver's cuStreamGetCaptureInfo_v2 (libcuda), or None where it cannot be found."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuStreamGetCaptureInfo_v2
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def capture_id(stream: int) -> int | None:
    """The id of the CUDA-graph capture sequence `stream` (a raw stream handle) is recorded into,
    unique in the process; None if the stream is not capturing or the driver does not say."""
    fn = _capture_info()
    if fn is None:
        return None
    status, cid = ctypes.c_int(0), ctypes.c_uint64(0)
    if fn(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(cid), None, None, None) != 0:
        return None
    return cid.value if status.value == 1 else None  # CU_STREAM_CAPTURE_STATUS_ACTIVE


def _stream_state(device: torch.device) -> tuple[int, bool, int | None]:
    """(stream handle, capturing, capture id) of the current stream of `device`."""
    if device.type != "cuda":
        return 0, False, None
    stream = torch.cuda.current_stream(device).cuda_stream
    if not torch.cuda.is_current_stream_capturing():
        return stream, False, None
    return stream, True, capture_id(stream)


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 tile counters for the split-K epilogue (`store_split`), at least `tiles`.

    Each launch leaves the counters it used at 0, so a buffer is reused without clearing by the
    launches that run one after another: eager launches share one buffer per device and stream.
    A CUDA graph's launches share one buffer of their own, made (and zeroed, one fill in the graph,
    run at each replay) at the first split-K launch of the capture, and the next capture on that
    stream gets a new one: graphs replay in any order, alongside eager launches and each other,
    and a replay pays one fill, not one per launch. Where the driver does not give the capture's
    id (`capture_id`), each launch in a capture gets a fresh zeroed buffer of its own."""
    stream, capturing, cid = _stream_state(device)
    key = (str(device), stream)
    if capturing:
        if cid is None:
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        held = _CAPTURE_COUNTERS.get(key)
        if held is None or held[0] != cid or held[1].numel() < tiles:
            held = (cid, torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
            _CAPTURE_COUNTERS[key] = held
        return held[1]
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def use_lut(dtype: torch.dtype, kernel, on: bool) -> bool:
    """Whether `kernel` dequantizes by the tables' inline PTX: `on` (a launch table's
    DEQUANT["lut"]), 16-bit activations, compiled for a GPU (not Triton's interpreter)."""
    return on and dtype in (torch.bfloat16, torch.float16) and not interpreted(kernel)


def lut_tile(cfg) -> bool:
    """Launch shapes whose table dequantization tests/gpu checks on an H200 (4 warps, BLOCK_K >=
    128: the decode and M <= 64 tiles); other shapes dequantize arithmetically (the same
    values, more instructions)."""
    return cfg.get("num_warps", 4) == 4 and cfg["BLOCK_K"] >= 128
