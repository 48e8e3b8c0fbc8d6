"""W4A16 GEMM: y = x @ dequant(W)^T with W an NVFP4Tensor [N, K] in ModelOpt's checkpoint layout.

Reference: `fp4kit.formats.nvfp4.NVFP4Tensor.dequantize` followed by a matmul (backend="torch").

The weight is read as stored (packed uint8 [N, K/2], E4M3 block scales [N, K/16], fp32 global
scale): no re-layout, so a checkpoint tensor is used as loaded. Three kernels:

- One row (GEMV["max_m"]: 2 for fp32 activations), the CUDA cores (`_gemv_kernel`,
  `_gemv_accumulate`), except large weights whose K the GEMV's K step does not divide
  (`ROW_MMA`), which go to the mma kernel below. The block scale is factored out of each
  16-block: y = 64 * sum_b step_b * sum_i v(code_i) * x_i, with v(code) = E2M1(code) * 2^-6 and
  step_b = float(scale_b) * global_scale, the reference's fp32 step. The weights are thus W.dequantize()'s fp32 values
  (not rounded to the activation dtype), and the products v * x are exact for 16-bit
  activations: one fp32 fma per weight and row, one per block. A block's 16 codes become fp32
  values in inline PTX (`_CODES16_ASM`: each code's bits moved into an E4M3 byte, which the
  hardware converts to fp16 exactly, then fp32; 7 bit operations per 8 codes). Each thread
  holds its blocks of all BLOCK_N weight rows and BLOCK_M activation rows, so nothing passes
  through shared memory in the loop.
- MMA["min_m"] to MMA["max_m"] rows (2-8) of bf16/fp16 activations, 9-16 rows on weights of
  MMA_WIDE["min_weights"] elements or more and one row where `row_on_mma`, the matrix units fed
  from registers (`_mma_kernel`):
  each warp runs mma.sync m16n8k16 with the weight decoded by inline PTX straight into the A
  fragment (`mma_asm`: per pair of codes 16 bits apart, one shift puts both signs and another
  both magnitudes where a 16-bit float's bits read as the E2M1 value times a power of 2, two
  masks merge them, one paired multiply by the block scale), the activations as the B fragment,
  the global scale applied to the fp32 result. Its weights are E2M1 * scale * 2^-7 exactly
  (bf16 and fp16 hold them; the epilogue multiplies by 2^7 and the global scale):
  W.dequantize()'s fp32 values up to one rounding. The K order inside each mma is chosen so
  that every lane loads whole 16-blocks and pairs its codes cheaply; L2 prefetch runs two K
  steps ahead. A
  program's warps can also be stacked in K groups (`MMA["kwarps"]`) that share its K range and
  add their sums in the program (a reduction over warps, fixed order) instead of splitting K
  across programs. In
  Triton's interpreter the same kernel runs with the warp's mma.sync emulated
  (`_mma_step_emulated`), so CPU CI covers its loads, masks and epilogue.
- More rows, the matrix units through shared memory (`_w4a16_kernel`): every weight the dot sees
  is W.dequantize() rounded to the activation dtype (`_dequant_tile`: per-block tables of the 8
  magnitudes applied with byte permutes, inline PTX, for bf16/fp16; `_dequant_tile_arith` for
  fp32 activations and the interpreter, the same values). The dot is computed transposed,
  acc[N, M] = W_tile @ x_tile^T: the weight fills the matrix unit's 64-row side (wgmma) and the
  few tokens its narrow side. The next weight tile is loaded while the current one is
  dequantized. `dequantize(..., backend="triton")` runs the same helper and writes the tile
  out, so tests compare it bit for bit.

Split-K keeps the GPU full when N / BLOCK_N alone is too few programs: the partials are fp32,
and the last program of each tile to finish sums them in a fixed order in the same launch
(`_store_split`), counting in at tile counters that each launch leaves at 0 for the next
(`split_counters`: no clearing per launch, one per CUDA-graph replay); the mma kernel also
splits long K ranges further where that spreads its programs evenly over the multiprocessors
(`split_count`). Above LARGE_M rows the weight is
dequantized once by the same helper and multiplied by torch.matmul.

Measured on an H200 (benchmarks/results/kernels-h200.json, CUDA graphs, against torch.matmul on
the bf16 weight): M = 1: 2.49x on 8192 x 8192 (GEMV, 13.6 us), 2.53x on 28672 x 8192 (GEMV,
43.6 us; 2.46x / 2.60x and 2.52x / 2.47x in earlier runs, bf16's time moving most), 1.90x and
1.67x on the Nano shapes (GEMV), 2.18x on 131072 x 2688 (mma, `ROW_MMA`); M = 4 (mma): 1.99x,
1.97x, 1.36x, 1.29x and 2.15x; M = 16: 1.45-1.86x on the three large shapes (mma, two
activation tiles), 0.89x and 0.94x on the Nano shapes (wgmma); M = 64: 0.52-0.96x
(`packed_gemm` on the pre-packed weight is faster from 4-16 rows up: 1.25-2.23x at 16 rows,
0.72-1.55x at 64). The GEMV
loop spends 4.5 SASS instructions per weight at one row (fma, fp16-to-fp32 conversion, 0.9 of
code decoding, loads and addresses), and that arithmetic sets its time: `gemv_limits` runs the
loop with its weight loads alone and with its arithmetic alone on cache-resident weights, 7.5
and 13.0 us on 8192 x 8192 against 13.2 for the whole loop (36.9 and 39.2 against 44.1 on
28672 x 8192); under Nsight Compute (scripts/profile_kernels.py, kernels-pipes-h200.json) its
issue is 69% busy and the integer ALU pipe, which takes about 44% of its instructions at half
the issue rate, 61%. The mma kernel's loop spends 3.5-3.9 SASS instructions per weight (one or two
weight tiles per warp), about 1.5 of them on the integer ALU pipe (two logic operations per pair
of codes, shifts, the activations' byte permutes; the left shifts go to the FMA pipe as IMAD).
Each lane reads its codes and activations 16 bytes at a time (`_load16`, where `mma_vec` finds
them aligned): with 8-byte loads a warp's load touched every 32-byte sector it read twice, and at
16 rows the L1 was the busiest unit. 2-8 rows cost little more than two do (sweep_mma in
benchmarks/results/kernels-sweeps-mma-h200.json, the pick: 17.0, 17.5 and 19.9 us at 2, 4 and 8
rows on 8192 x 8192), still more than the GEMV's one row where the GEMV's K step divides K
(sweep_row_mma in kernels-sweeps-row-mma-h200.json: 17.0 against 15.3 us on 8192 x 8192);
where it does not, from 32768 x 1856 up, one row is faster here (`ROW_MMA`). With a
second activation tile (9-16 rows) it beats the wgmma kernel from 8192 x 8192 weights up but
not on the Nano shapes (sweep_mma_wide; `MMA_WIDE`).
The wgmma kernel spends ~6.5 instructions per weight in its main loop: the table dequantization, then
the tile written to shared memory and read back in the wgmma operand layout (8 STS.128, 8 LDSM,
5 barriers per K step, read from the sm_90 PTX), address and mask arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

from .backend import cdiv, check_backend, interpreted, launch_options
from .backend import sm_count as _sm_count

_WHAT = "kernels.w4a16_matmul"
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _e4m3_decode(code):
    """float8_e4m3fn byte (int32) -> its fp32 value, exactly (NaN for 0x7F/0xFF)."""
    mag = code & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # exponent bias 7 -> 127
    sub = (mag & 7).to(tl.float32) * 0.001953125  # exponent field 0: man * 2^-9
    v = tl.where(mag < 8, sub, normal)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where((code & 0x80) != 0, -v, v)


@triton.jit
def _e2m1_bits(packed, SHIFT: tl.constexpr):
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
    values = _e2m1_bits(codes, 0) * 8.507059173023462e37  # 2^126
    step = _e4m3_decode(scale_code.to(tl.int32)) * gs  # float(scale) * global_scale, fp32
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
    step = _e4m3_decode(scale_code.to(tl.int32)) * gs  # float(scale) * global_scale, fp32
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
def _dequant_tile(words, scale_code, gs, DT: tl.constexpr, LUT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile in DT: W.dequantize() exactly, rounded to DT."""
    if LUT:
        w = _dequant_tile_lut(words, scale_code, gs, DT, BLOCK_N, BLOCK_K)
    else:
        w = _dequant_tile_arith(words, scale_code, gs, BLOCK_N, BLOCK_K).to(DT)
    return w


@triton.jit
def _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N: tl.constexpr,
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
def _relu2(acc, ACT: tl.constexpr):
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
        x = _relu2(h, ACT)
    return x


@triton.jit
def _ahead(k0, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K offset of the tile after k0 (the prefetch); with EVEN_K held at the last tile before
    k_end (the prefetch past the end re-reads it, in bounds), else left to the load's mask."""
    k = k0 + BLOCK_K
    if EVEN_K:
        k = tl.minimum(k, k_end - BLOCK_K)
    return k


@triton.jit
def _accumulate(acc, x_ptr, x_row, m_ok, wq_ptr, ws_ptr, gs, n64, n_ok, K, k_start, k_end,
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
    of BLOCK_K or ends at K (`_ahead`).
    """
    kk = tl.arange(0, BLOCK_K)
    packed, sc = _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k_start, K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        packed_next, sc_next = _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, _ahead(k0, k_end, BLOCK_K, EVEN_K),
                                                 K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K)
        x = _load_x(x_ptr, x_row, m_ok, k0, kk, K, EVEN_K, X_PARTS, part_stride, ACT)  # [BLOCK_K, BLOCK_M]
        w = _dequant_tile(packed, sc, gs, x.dtype, LUT, BLOCK_N, BLOCK_K)
        if IEEE:
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        packed, sc = packed_next, sc_next
    return acc


@triton.jit
def _store_split(acc, part_ptr, out_ptr, cnt_ptr, tile, off, ok, MN, pid_s, SPLIT: tl.constexpr):
    """Split-K epilogue in the same launch: every program stores its fp32 partial and counts
    itself in at its tile's counter (one atomic); the last of the tile's SPLIT programs to arrive
    sums the SPLIT partials in the fixed order s = 0, 1, ... (the result does not depend on which
    program was last), writes the output in its dtype and puts the counter back to 0 for the
    next launch. The barrier orders the program's partial stores before its release; the partials
    are read through L2 (.cg), where the other programs' stores are."""
    tl.store(part_ptr + pid_s.to(tl.int64) * MN + off, acc, mask=ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        total = tl.load(part_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            total += tl.load(part_ptr + s * MN.to(tl.int64) + off, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + off, total.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(cnt_ptr + tile, 0)


@triton.jit
def _w4a16_kernel(
    x_ptr, wq_ptr, ws_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, LUT: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    n64 = n.to(tl.int64)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _accumulate(acc, x_ptr, m.to(tl.int64) * stride_xm, m_ok, wq_ptr, ws_ptr, tl.load(gs_ptr),
                      n64, n_ok, K, k_start, k_end, BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
    out_off = m[None, :].to(tl.int64) * N + n64[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        _store_split(acc, part_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, out_off, ok,
                     M * N, pid_s, SPLIT)


# The 16 codes of one 16-block (an int64, code i in bits 4i..4i+3; $16) as 16 fp32 values
# E2M1(code_i) * 2^-6 ($0-$15), exactly, in 7 bit operations per 8 codes plus conversions:
# - each code becomes an E4M3 byte with the same bits in other places: sign to bit 7, the two
#   exponent bits and the mantissa bit to bits 4..2. E4M3's exponent bias is 7 against E2M1's
#   1, so the byte's value is the code's * 2^-6, subnormals included (E2M1 0.5 -> E4M3 2^-7).
#   Even codes of a word q: ((q << 2) & 0x1C..) | ((q << 4) & 0x80..); odd codes:
#   ((q >> 2) & 0x1C..) | (q & 0x80..);
# - cvt.rn.f16x2.e4m3x2 turns two such bytes into two fp16 (exact), cvt.f32.f16 each into fp32.
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
    `_e2m1_bits`' 2^-126)."""
    return _e2m1_bits(word >> SHIFT, 0) * 1.329227995784916e36


@triton.jit
def _codes16(blocks, LUT: tl.constexpr):
    """A 16-block's codes (int64, code i in bits 4i..4i+3) -> its 16 values E2M1(code_i) * 2^-6
    in fp32 (exact), by the inline PTX `_CODES16_ASM` (LUT, CUDA) or the same values by
    arithmetic (`_e2m1_bits`; the interpreter, and the GPU test comparing the two)."""
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
        v = _relu2(h, ACT).to(tl.float32)
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
def _load_blocks(wb_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
def _gemv_accumulate(acc, x_ptr, x4_ptr, rows, m_ok, wb_ptr, ws_ptr, gs, n64, n_ok, K, k_start, k_end,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LUT: tl.constexpr, EVEN_N: tl.constexpr,
                     EVEN_K: tl.constexpr, X_PARTS: tl.constexpr = 0, part_stride=0, ACT: tl.constexpr = None,
                     KB: tl.constexpr = 0):
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
    time, n64 counted from wb_ptr / ws_ptr (`_load_blocks`)."""
    blk16 = tl.arange(0, BLOCK_K // 16) * 16
    codes, sc = _load_blocks(wb_ptr, ws_ptr, n64, n_ok, k_start, K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, KB)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            ok = m_ok[:, None]
        else:
            ok = m_ok[:, None] & ((k0 + blk16) < K)[None, :]
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _codes16(codes[None, :, :], LUT)
        codes_next, sc_next = _load_blocks(wb_ptr, ws_ptr, n64, n_ok, _ahead(k0, k_end, BLOCK_K, EVEN_K),
                                           K, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, KB)
        t = _block_dot(x_ptr, x4_ptr, rows, (k0 + blk16)[None, :], ok, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9,
                       v10, v11, v12, v13, v14, v15, X_PARTS, part_stride, ACT)
        if LUT:
            scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            scale = _e4m3_decode(sc.to(tl.int32))
        acc = tl.fma(t, (scale * gs)[None, :, :], acc)
        codes, sc = codes_next, sc_next
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, x4_ptr, wb_ptr, ws_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, KB: tl.constexpr,
):
    """y = x @ W^T for a few activation rows on the CUDA cores (grid: N tiles, row tiles, K
    splits), the block scale factored out of each 16-block (`_gemv_accumulate`). KB: K / 16 (a
    compile-time constant: the rows' blocks are addressed from the program's first row)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    first = (pid_n * BLOCK_N).to(tl.int64) * KB
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    acc = _gemv_accumulate(acc, x_ptr, x4_ptr, m.to(tl.int64)[:, None] * stride_xm, m_ok, wb_ptr + first,
                           ws_ptr + first, tl.load(gs_ptr), tl.arange(0, BLOCK_N), n_ok, K, k_start, k_end,
                           BLOCK_N, BLOCK_K, LUT, EVEN_N, EVEN_K, KB=KB)
    n64 = n.to(tl.int64)
    y = tl.sum(acc, axis=2) * 64.0  # [BLOCK_M, BLOCK_N]; 64: the block values are E2M1 * 2^-6
    out_off = m.to(tl.int64)[:, None] * N + n64[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        _store_split(y, part_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, out_off, ok,
                     M * N, pid_s, SPLIT)


# Parts of the GEMV's loop for `_gemv_probe_kernel`.
PROBE_ALL, PROBE_LOADS, PROBE_ARITHMETIC = 0, 1, 2


@triton.jit
def _gemv_probe_kernel(x_ptr, x4_ptr, wb_ptr, ws_ptr, gs_ptr, out_ptr, N, K, k_from,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LUT: tl.constexpr, PART: tl.constexpr,
                       KB: tl.constexpr):
    """The GEMV's loop at one activation row (no split; N % BLOCK_N == 0, K % BLOCK_K == 0) with
    part of its work left out, to place its time (`gemv_limits`). PART: PROBE_ALL, the whole loop
    (`_gemv_accumulate`: `_gemv_kernel`'s result); PROBE_LOADS, the same weight loads with their
    bits folded by xor instead of decoded (the memory traffic alone; each row gets the sum over
    its thread slots of the fold's bytes xor-ed together); PROBE_ARITHMETIC, the whole
    loop with every program reading the first BLOCK_N weight rows (a few KB that stay in cache:
    the decoding and multiply-adds alone), so row n gets the result of row n % BLOCK_N. k_from:
    the loop's first K offset (0), a run-time value as the split GEMV's is: with a compile-time
    0 Triton lays the weight loads out differently (16-byte vectors, then a layout conversion
    through shared memory) and the probe would time another loop."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, BLOCK_N)  # counted from the program's first row, as `_gemv_kernel` does
    if PART == 2:
        first = tl.zeros((), dtype=tl.int64)
    else:
        first = (tl.program_id(0) * BLOCK_N).to(tl.int64) * KB
    wb_ptr += first
    ws_ptr += first
    if PART == 1:
        fold = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.int64)
        codes, sc = _load_blocks(wb_ptr, ws_ptr, rows, n_ok, k_from, K, BLOCK_N, BLOCK_K, True, True, KB)
        for k0 in range(k_from, K, BLOCK_K):
            codes_next, sc_next = _load_blocks(wb_ptr, ws_ptr, rows, n_ok, _ahead(k0, K, BLOCK_K, True), K, BLOCK_N,
                                               BLOCK_K, True, True, KB)
            fold = fold ^ codes ^ sc.to(tl.int64)
            codes, sc = codes_next, sc_next
        fold = fold ^ (fold >> 32)  # every bit loaded reaches the low byte, which is summed
        fold = fold ^ (fold >> 16)
        fold = fold ^ (fold >> 8)
        y = tl.sum(fold & 0xFF, axis=1).to(tl.float32)
    else:
        acc = tl.zeros((1, BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        acc = _gemv_accumulate(acc, x_ptr, x4_ptr, tl.zeros((1, 1), dtype=tl.int64), tl.arange(0, 1) < 1, wb_ptr,
                               ws_ptr, tl.load(gs_ptr), rows, n_ok, K, k_from, K, BLOCK_N, BLOCK_K, LUT, True, True,
                               KB=KB)
        y = tl.sum(tl.sum(acc, axis=2), axis=0) * 64.0
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_probe(x: torch.Tensor, w: nvfp4.NVFP4Tensor, part: int, cfg: dict) -> torch.Tensor:
    """`_gemv_probe_kernel` on one row x [1, K] (bf16/fp16) with a GEMV launch shape cfg (`config`)."""
    n, k = w.shape
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if x.shape != (1, k) or n % bn or k % bk:
        raise ValueError(f"{_WHAT}: the GEMV probe takes one row and whole tiles, got x {tuple(x.shape)}, "
                         f"W {tuple(w.shape)}, tile ({bn}, {bk})")
    x2, x4 = int64_activations(x)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_probe_kernel[(n // bn,)](x2, x4, w.packed.view(torch.int64), w.block_scale.view(torch.uint8), w.global_scale,
                                   out, n, k, 0, BLOCK_N=bn, BLOCK_K=bk,
                                   LUT=DEQUANT["lut"] and not interpreted(_gemv_probe_kernel), PART=part, KB=k // 16,
                                   num_warps=cfg["num_warps"], num_stages=1, **launch_options())
    return out


# --------------------------------------------------------------------------------------------
# Few rows on the matrix units from registers: mma.sync fed by in-register decoding (inline PTX)
# --------------------------------------------------------------------------------------------
# Each warp computes D[16 weight rows, 8 activation rows] += A @ B with mma.sync m16n8k16 for
# each of its one or two weight tiles and one or two activation tiles, the weight A decoded
# straight into the A fragment's registers (no shared memory, no layout conversion). Lane
# l = 4g + c holds A rows g and g + 8 and B column g (PTX ISA fragment layout).
# The order of K inside a mma is free as long as A and B agree; it is chosen so that each lane
# reads whole 16-blocks and decodes with few integer instructions: in a K step of 128 (8 mma)
# lane c owns K offsets 32c..32c+31 (blocks 2c, 2c+1) of both its rows, a word of 8 codes per
# two mma. Mma s takes word s // 2 (K offsets k = 32c + 8(s // 2) onwards) and in it the code
# pairs (j, j + 4) and (j + 1, j + 5), j = 2(s % 2): A columns (2c, 2c + 1) and (2c + 8, 2c + 9)
# of each row; the B fragment pairs the activations at the same offsets, (x[k + j], x[k + j + 4])
# and (x[k + j + 1], x[k + j + 5]), one byte permute each from the two 4-value loads.
# Decoding: codes j and j + 4 of a word sit 16 bits apart, as the two halves of a 16-bit pair do,
# so one shift puts both signs at bits 15 and 31 and another both magnitudes (3 bits) at the
# top of the exponent field's low bits: bits 6-8 for bf16, 9-11 for fp16, where the bits read as
# E2M1 * 2^-126 (bf16) or E2M1 * 2^-14 (fp16), subnormal for code 1; two masks merge them (two
# logic instructions per pair). One paired multiply by the block scale times 2^119 (bf16) or
# 2^7 (fp16) then gives A = E2M1 * scale * 2^-7 exactly (at most 6 significant bits, at least
# 2^-17: normal in bf16, possibly subnormal in fp16, which mma.sync takes as it is). The fp32
# sums are thus 2^-7 times those of E2M1 * scale, and the epilogue multiplies by the global
# scale times 2^7 (`MMA_UNSCALE`).
MMA_UNSCALE = tl.constexpr(128.0)
_MMA_SCALE_BIAS = {"bf16": 0x7B000000, "f16": 0x58005800}  # 2^119 (fp32), (2^7, 2^7) (fp16x2)
_MMA_MAG = {"bf16": (6, 0x01C001C0), "f16": (9, 0x0E000E00)}  # magnitude bit position, mask


def mma_asm(tiles: int, rows: int, kind: str) -> str:
    """The PTX of one K step of 128 for `rows` m16 tiles of weight rows and `tiles` n8 tiles of
    activation rows (1 or 2 each); kind "bf16" or "f16" (the activation dtype, which the weight
    values take).

    Operands (R = rows, T = tiles): $0..$(4RT-1) the fp32 accumulators out (D fragment order,
    weight tile r and activation tile t at 4(rT + t)), then in: the accumulators; per weight tile
    the lane's codes of row g (blocks 2c, 2c+1: two int64) and of row g + 8; per weight tile the
    two scale bytes of row g (blocks 2c, 2c+1, low 16 bits) and of row g + 8; per activation tile,
    8 int64 of activations (the 4 values at K offset 32c + 4i, i = 0..7). The accumulators come
    out as 2^-7 times the products' sums (see above).
    """
    n_acc = 4 * tiles * rows
    w_in = 2 * n_acc
    s_in = w_in + 4 * rows
    x_in = s_in + 2 * rows
    mag_at, mag_mask = _MMA_MAG[kind]
    words = [f"w{r}{h}" for r in range(rows) for h in "gh"]
    lines = [
        "{",
        ".reg .b32 " + ", ".join(f"{w}<4>" for w in words) + ";",
        ".reg .b32 " + ", ".join(f"s{w}<2>" for w in words) + ";",
        ".reg .b32 " + ", ".join(f"x{t}q<4>" for t in range(tiles)) + ";",
        ".reg .b32 " + ", ".join(f"b{t}f<2>" for t in range(tiles)) + ";",
        ".reg .b32 sg, mg, fs, bias, a<4>;",
        ".reg .b16 e<2>;",
        ".reg .f32 f<2>;",
    ]
    if kind == "f16":
        lines.append(f"mov.b32 bias, {_MMA_SCALE_BIAS['f16']:#010x};")
    lines += [f"mov.f32 ${i}, ${n_acc + i};" for i in range(n_acc)]
    for i, w in enumerate(words):
        lines += [f"mov.b64 {{{w}0, {w}1}}, ${w_in + 2 * i};", f"mov.b64 {{{w}2, {w}3}}, ${w_in + 2 * i + 1};"]
        # the two block scales (times the bias) as value pairs (s, s): E4M3 -> fp16 exactly
        lines += [f"mov.b32 {{e0, e1}}, ${s_in + i};", "cvt.rn.f16x2.e4m3x2 fs, e0;"]
        if kind == "bf16":
            lines += ["mov.b32 {e0, e1}, fs;", "cvt.f32.f16 f0, e0;", "cvt.f32.f16 f1, e1;",
                      f"mul.rn.f32 f0, f0, 0f{_MMA_SCALE_BIAS['bf16']:08X};",
                      f"mul.rn.f32 f1, f1, 0f{_MMA_SCALE_BIAS['bf16']:08X};",
                      f"cvt.rn.bf16x2.f32 s{w}0, f0, f0;", f"cvt.rn.bf16x2.f32 s{w}1, f1, f1;"]
        else:
            lines += ["mul.rn.f16x2 fs, fs, bias;",
                      f"prmt.b32 s{w}0, fs, fs, 0x1010;", f"prmt.b32 s{w}1, fs, fs, 0x3232;"]
    shape = "m16n8k16.row.col.f32.{0}.{0}.f32".format(kind)
    for s in range(8):
        word, half = s // 2, s % 2
        for t in range(tiles):
            if half == 0:  # the word's 8 activations: two int64 of 4
                lines += [f"mov.b64 {{x{t}q0, x{t}q1}}, ${x_in + 8 * t + 2 * word};",
                          f"mov.b64 {{x{t}q2, x{t}q3}}, ${x_in + 8 * t + 2 * word + 1};"]
            lines += [f"prmt.b32 b{t}f0, x{t}q{half}, x{t}q{half + 2}, 0x5410;",
                      f"prmt.b32 b{t}f1, x{t}q{half}, x{t}q{half + 2}, 0x7632;"]
        for r in range(rows):
            for w, lo, hi in ((f"w{r}g", "a0", "a2"), (f"w{r}h", "a1", "a3")):
                q = f"{w}{word}"
                for j, dst in ((2 * half, lo), (2 * half + 1, hi)):
                    # signs of codes j, j + 4 to bits 15, 31; magnitudes to mag_at.. and 16 up
                    sign = q
                    if j < 3:
                        lines.append(f"shl.b32 sg, {q}, {12 - 4 * j};")
                        sign = "sg"
                    shift = mag_at - 4 * j
                    lines.append(f"shl.b32 mg, {q}, {shift};" if shift >= 0 else f"shr.u32 mg, {q}, {-shift};")
                    lines += [f"and.b32 mg, mg, {mag_mask:#010x};", f"and.b32 sg, {sign}, 0x80008000;",
                              f"or.b32 {dst}, sg, mg;",
                              f"mul.rn.{kind}x2 {dst}, {dst}, s{w}{word // 2};"]
            for t in range(tiles):
                d = ", ".join(f"${4 * (r * tiles + t) + i}" for i in range(4))
                lines.append(f"mma.sync.aligned.{shape} {{{d}}}, {{a0, a1, a2, a3}}, {{b{t}f0, b{t}f1}}, {{{d}}};")
    lines.append("}")
    return "\n".join(lines)


def _mma_constraints(tiles: int, rows: int) -> str:
    n_acc = 4 * tiles * rows
    return ",".join(["=f"] * n_acc + ["f"] * n_acc + ["l"] * (4 * rows) + ["r"] * (2 * rows) + ["l"] * (8 * tiles))


_MMA_ASM = {(t, r, k): tl.constexpr(mma_asm(t, r, k)) for t in (1, 2) for r in (1, 2) for k in ("bf16", "f16")}
_MMA_C = {(t, r): tl.constexpr(_mma_constraints(t, r)) for t in (1, 2) for r in (1, 2)}
_MMA_BF16_11, _MMA_BF16_21, _MMA_BF16_12, _MMA_BF16_22 = (_MMA_ASM[1, 1, "bf16"], _MMA_ASM[2, 1, "bf16"],
                                                          _MMA_ASM[1, 2, "bf16"], _MMA_ASM[2, 2, "bf16"])
_MMA_F16_11, _MMA_F16_21, _MMA_F16_12, _MMA_F16_22 = (_MMA_ASM[1, 1, "f16"], _MMA_ASM[2, 1, "f16"],
                                                      _MMA_ASM[1, 2, "f16"], _MMA_ASM[2, 2, "f16"])
_MMA_C11, _MMA_C21, _MMA_C12, _MMA_C22 = _MMA_C[1, 1], _MMA_C[2, 1], _MMA_C[1, 2], _MMA_C[2, 2]
_THREAD_IDS_ASM = tl.constexpr("mov.u32 $0, %laneid;\nmov.u32 $1, %tid.x;")


@triton.jit
def _thread_ids(t, EMULATE: tl.constexpr):
    """(lane, warp) of the thread that holds each element of t (an int32 tensor of 32 * warps
    elements); with EMULATE (Triton's interpreter, which holds a program's whole tensors at once)
    element i stands for lane i % 32 of warp i // 32."""
    if EMULATE:
        lane, tid = t % 32, t
    else:
        # Not pure: a pure op may be recomputed in another layout (by other threads) instead of
        # having its values moved, which would change the lane ids the values stand for.
        lane, tid = tl.inline_asm_elementwise(_THREAD_IDS_ASM, "=r,=r,r", [t], dtype=(tl.int32, tl.int32),
                                              is_pure=False, pack=1)
    return lane, tid // 32


# Two int64 from 16 bytes at a 16-byte aligned address ($2) where $3 != 0, else zeros: one
# 128-bit load through the read-only path. The mma kernels' lanes read their codes and
# activations 16 bytes at a time with it (`VEC`): a warp's load instruction then covers whole
# 32-byte sectors of each row it touches, where two 8-byte loads each touched the same sectors
# for half their bytes (and the L1 limited the kernels at 16 activation rows).
_LOAD16_ASM = tl.constexpr("""
{
.reg .pred p;
setp.ne.u32 p, $3, 0;
mov.b64 $0, 0;
mov.b64 $1, 0;
@p ld.global.nc.v2.b64 {$0, $1}, [$2];
}
""")


@triton.jit
def _load16(ptr, ok):
    """(ptr[0], ptr[1]) of an int64 pointer 16-byte aligned where ok, else (0, 0) (CUDA only)."""
    return tl.inline_asm_elementwise(_LOAD16_ASM, "=l,=l,l,r", [ptr, ok.to(tl.int32)], dtype=(tl.int64, tl.int64),
                                     is_pure=False, pack=1)


@triton.jit
def _mma_scale_bytes(s_p, ok0, ok1, SCALE_PAIRS: tl.constexpr):
    """A row's two scale bytes of the lane's blocks in an int32: one int16 load with SCALE_PAIRS
    (a half pair past the end is a zero scale over zero codes), else two byte loads; zero where
    masked (ok0 / ok1: the first / second block is before the end of the range)."""
    if SCALE_PAIRS:
        s = tl.load(s_p, mask=ok0, other=0).to(tl.int32)
    else:
        s = tl.load(s_p, mask=ok0, other=0).to(tl.int32) | (tl.load(s_p + 1, mask=ok1, other=0).to(tl.int32) << 8)
    return s


@triton.jit
def _mma_weights(pg, ph, sg_p, sh_p, ok0, ok1, EVEN_K: tl.constexpr, SCALE_PAIRS: tl.constexpr,
                 VEC: tl.constexpr = False):
    """The lane's weights of a K step: codes of its two blocks (int64 each) in rows g (pg) and
    g + 8 (ph), and their two scale bytes per row in an int32 (sg_p, sh_p: one int16 each with
    SCALE_PAIRS, else two bytes). ok0 / ok1: the blocks are before the end of the range (with
    EVEN_K the whole step, the same in every lane; masked blocks read as zero otherwise).
    VEC: each row's two blocks in one 16-byte load (`_load16`; pg, ph 16-byte aligned, and
    K % 32 == 0, so ok1 is ok0)."""
    if VEC:
        wg0, wg1 = _load16(pg, ok0)
        wh0, wh1 = _load16(ph, ok0)
        sg = _mma_scale_bytes(sg_p, ok0, ok0, SCALE_PAIRS)
        sh = _mma_scale_bytes(sh_p, ok0, ok0, SCALE_PAIRS)
    elif EVEN_K:
        wg0 = tl.load(pg, mask=ok0)
        wg1 = tl.load(pg + 1, mask=ok0)
        wh0 = tl.load(ph, mask=ok0)
        wh1 = tl.load(ph + 1, mask=ok0)
        if SCALE_PAIRS:
            sg = tl.load(sg_p, mask=ok0).to(tl.int32)
            sh = tl.load(sh_p, mask=ok0).to(tl.int32)
        else:
            sg = tl.load(sg_p, mask=ok0).to(tl.int32) | (tl.load(sg_p + 1, mask=ok0).to(tl.int32) << 8)
            sh = tl.load(sh_p, mask=ok0).to(tl.int32) | (tl.load(sh_p + 1, mask=ok0).to(tl.int32) << 8)
    else:
        wg0 = tl.load(pg, mask=ok0, other=0)
        wg1 = tl.load(pg + 1, mask=ok1, other=0)
        wh0 = tl.load(ph, mask=ok0, other=0)
        wh1 = tl.load(ph + 1, mask=ok1, other=0)
        sg = _mma_scale_bytes(sg_p, ok0, ok1, SCALE_PAIRS)
        sh = _mma_scale_bytes(sh_p, ok0, ok1, SCALE_PAIRS)
    return wg0, wg1, wh0, wh1, sg, sh


@triton.jit
def _mma_x(q, k, k_end, more, EVEN_K: tl.constexpr, VEC: tl.constexpr = False):
    """The lane's activations of a K step for one tile: 8 int64 (4 16-bit values each) at q + s,
    K offsets k + 4s (k = step start + 32c); zeros past k_end (with EVEN_K a whole step is in or
    out: `more`, the same in every lane). VEC: two at a time (`_load16`; q 16-byte aligned; K is
    a multiple of 16, so a pair is wholly in or out)."""
    if VEC:
        if EVEN_K:
            ok0, ok1, ok2, ok3 = more, more, more, more
        else:
            ok0, ok1, ok2, ok3 = k < k_end, k + 8 < k_end, k + 16 < k_end, k + 24 < k_end
        x0, x1 = _load16(q, ok0)
        x2, x3 = _load16(q + 2, ok1)
        x4, x5 = _load16(q + 4, ok2)
        x6, x7 = _load16(q + 6, ok3)
    elif EVEN_K:
        x0, x1, x2, x3 = tl.load(q, mask=more), tl.load(q + 1, mask=more), tl.load(q + 2, mask=more), tl.load(q + 3, mask=more)
        x4, x5, x6, x7 = tl.load(q + 4, mask=more), tl.load(q + 5, mask=more), tl.load(q + 6, mask=more), tl.load(q + 7, mask=more)
    else:
        x0 = tl.load(q, mask=k < k_end, other=0)
        x1 = tl.load(q + 1, mask=k + 4 < k_end, other=0)
        x2 = tl.load(q + 2, mask=k + 8 < k_end, other=0)
        x3 = tl.load(q + 3, mask=k + 12 < k_end, other=0)
        x4 = tl.load(q + 4, mask=k + 16 < k_end, other=0)
        x5 = tl.load(q + 5, mask=k + 20 < k_end, other=0)
        x6 = tl.load(q + 6, mask=k + 24 < k_end, other=0)
        x7 = tl.load(q + 7, mask=k + 28 < k_end, other=0)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _emu_weights(codes, scales, s: tl.constexpr):
    """[threads, 4]: the A values mma s takes from a lane's two blocks of one row (codes: the
    block s // 4, int64; scales: the two scale bytes), E2M1 * scale * 2^-7 as `mma_asm` makes
    them: codes j, j + 4, j + 1, j + 5 of word s // 2 (j = 2(s % 2))."""
    j = 8 * ((s // 2) % 2) + 2 * (s % 2)
    shift = (4 * (j + tl.arange(0, 4) // 2 + 4 * (tl.arange(0, 4) % 2))).to(tl.int64)
    code = ((codes[:, None] >> shift[None, :]) & 0xF).to(tl.int32)
    scale = _e4m3_decode((scales >> (8 * (s // 4))) & 0xFF)
    return _e2m1_bits(code, 0) * 6.646139978924579e35 * scale[:, None]  # 2^119: E2M1 * 2^-7 exactly


@triton.jit
def _emu_x(qa, qb, half: tl.constexpr, F16: tl.constexpr):
    """[threads, 4]: the activations paired with `_emu_weights`' slots, from the two int64 of a
    word's 8 (qa: values 0-3, qb: 4-7), as fp32: values j, j + 4, j + 1, j + 5 (j = 2 * half)."""
    i = 2 * half + tl.arange(0, 4) // 2
    q = tl.where((tl.arange(0, 4) % 2 == 0)[None, :], qa[:, None], qb[:, None])
    bits = ((q >> (16 * i).to(tl.int64)[None, :]) & 0xFFFF).to(tl.int32)
    if F16:
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        v = (bits << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _emu_mma(d_lo, d_hi, w, x, WARPS: tl.constexpr):
    """One m16n8k16 for 8 of its rows on an emulated warp: D[g][2c + j] += sum over the 4 lanes
    c' of row g's and column 2c + j's operands: w[lane (g, c')] . x[lane (2c + j, c')] (w, x:
    [threads, 4], the lane's 4 K slots)."""
    a = tl.reshape(w, (WARPS, 8, 1, 4, 4))  # [warp, g, -, c', slot]
    b = tl.reshape(x, (WARPS, 1, 8, 4, 4))  # [warp, -, column, c', slot]
    s = tl.sum(tl.sum(a * b, axis=4), axis=3)[:, :, None, :]  # [warp, g, -, column]
    col = tl.arange(0, 8)[None, :]
    c2 = 2 * tl.arange(0, 4)[:, None]
    lo = tl.sum(tl.where((col == c2)[None, None, :, :], s, 0.0), axis=3)  # [warp, g, c]
    hi = tl.sum(tl.where((col == c2 + 1)[None, None, :, :], s, 0.0), axis=3)
    return d_lo + tl.reshape(lo, (32 * WARPS,)), d_hi + tl.reshape(hi, (32 * WARPS,))


@triton.jit
def _emu_tile(a0, a1, a2, a3, wg, wh, xs, WARPS: tl.constexpr):
    """One emulated m16n8k16: the D fragment (a0..a3) += rows g (wg) and g + 8 (wh) times xs."""
    a0, a1 = _emu_mma(a0, a1, wg, xs, WARPS)
    a2, a3 = _emu_mma(a2, a3, wh, xs, WARPS)
    return a0, a1, a2, a3


@triton.jit
def _mma_step_emulated(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, w0, w1, x, y,
                       TILES: tl.constexpr, ROWS: tl.constexpr, F16: tl.constexpr):
    """`_mma_step` in Triton's interpreter: the same operands per lane, the same K order (mma s:
    codes j, j + 4, j + 1, j + 5 of word s // 2 of the lane's four, j = 2(s % 2), and the
    activations at those offsets), the same values (E2M1 * scale * 2^-7), the cross-lane products
    of mma.sync summed in fp32 (the order differs from the matrix units'; exact per-lane values)."""
    g0, g1, k0, k1, sg, sk = w0
    g2, g3, k2, k3, sg2, sk2 = w1
    W: tl.constexpr = d0.shape[0] // 32
    for s in tl.static_range(8):
        wg = _emu_weights(g0 if s < 4 else g1, sg, s)
        wh = _emu_weights(k0 if s < 4 else k1, sk, s)
        xs = _emu_x(x[2 * (s // 2)], x[2 * (s // 2) + 1], s % 2, F16)
        d0, d1, d2, d3 = _emu_tile(d0, d1, d2, d3, wg, wh, xs, W)
        if TILES == 2:
            ys = _emu_x(y[2 * (s // 2)], y[2 * (s // 2) + 1], s % 2, F16)
            e0, e1, e2, e3 = _emu_tile(e0, e1, e2, e3, wg, wh, ys, W)
        if ROWS == 2:
            wg2 = _emu_weights(g2 if s < 4 else g3, sg2, s)
            wh2 = _emu_weights(k2 if s < 4 else k3, sk2, s)
            f0, f1, f2, f3 = _emu_tile(f0, f1, f2, f3, wg2, wh2, xs, W)
            if TILES == 2:
                h0, h1, h2, h3 = _emu_tile(h0, h1, h2, h3, wg2, wh2, ys, W)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _mma_step(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, w0, w1, x, y,
              TILES: tl.constexpr, ROWS: tl.constexpr, F16: tl.constexpr, EMULATE: tl.constexpr):
    """One K step (`mma_asm`): accumulators d (weight tile 0, activation tile 0), e (0, 1), f (1, 0),
    h (1, 1); w0 / w1: the weight tiles' codes and scales (`_mma_weights`);
    x / y: the activation tiles' 8 int64 each. Unused tiles pass through. EMULATE: Triton's
    interpreter (`_mma_step_emulated`)."""
    if EMULATE:
        return _mma_step_emulated(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, w0, w1, x, y,
                                  TILES, ROWS, F16)
    g0, g1, k0, k1, sg, sk = w0
    g2, g3, k2, k3, sg2, sk2 = w1
    x0, x1, x2, x3, x4, x5, x6, x7 = x
    y0, y1, y2, y3, y4, y5, y6, y7 = y
    # operands in `mma_asm`'s order; the dtype picks the asm (a compile-time choice). Not pure:
    # a warp-wide instruction must run in the threads that hold its operands, never be recomputed
    # in another layout (see `_thread_ids`).
    if ROWS == 1:
        if TILES == 1:
            args = [d0, d1, d2, d3, g0, g1, k0, k1, sg, sk, x0, x1, x2, x3, x4, x5, x6, x7]
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                _MMA_F16_11 if F16 else _MMA_BF16_11, _MMA_C11, args, dtype=(tl.float32,) * 4, is_pure=False, pack=1)
        else:
            args = [d0, d1, d2, d3, e0, e1, e2, e3, g0, g1, k0, k1, sg, sk,
                    x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7]
            d0, d1, d2, d3, e0, e1, e2, e3 = tl.inline_asm_elementwise(
                _MMA_F16_21 if F16 else _MMA_BF16_21, _MMA_C21, args, dtype=(tl.float32,) * 8, is_pure=False, pack=1)
    else:
        if TILES == 1:
            args = [d0, d1, d2, d3, f0, f1, f2, f3, g0, g1, k0, k1, g2, g3, k2, k3, sg, sk, sg2, sk2,
                    x0, x1, x2, x3, x4, x5, x6, x7]
            d0, d1, d2, d3, f0, f1, f2, f3 = tl.inline_asm_elementwise(
                _MMA_F16_12 if F16 else _MMA_BF16_12, _MMA_C12, args, dtype=(tl.float32,) * 8, is_pure=False, pack=1)
        else:
            args = [d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3,
                    g0, g1, k0, k1, g2, g3, k2, k3, sg, sk, sg2, sk2,
                    x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7]
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = tl.inline_asm_elementwise(
                _MMA_F16_22 if F16 else _MMA_BF16_22, _MMA_C22, args, dtype=(tl.float32,) * 16, is_pure=False,
                pack=1)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


_PREFETCH_ASM = tl.constexpr("""
{
.reg .pred p;
setp.ne.u32 p, $2, 0;
@p prefetch.global.L2 [$1];
mov.u32 $0, 0;
}
""")


@triton.jit
def _prefetch_l2(ptr, ok):
    """Asks L2 for the line holding each `ptr` where `ok` (a hint: nothing is loaded into
    registers). Returns a dummy 0 per element."""
    return tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [ptr, ok.to(tl.int32)], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _mma_pointers(ws_ptr, wb_ptr, wrow_g, wrow_h, blk, SCALE_PAIRS: tl.constexpr):
    """Code pointers of rows g and g + 8 at block blk, and their scale pointers."""
    pg = wb_ptr + wrow_g + blk
    ph = wb_ptr + wrow_h + blk
    if SCALE_PAIRS:
        sg_p = ws_ptr + (wrow_g + blk) // 2
        sh_p = ws_ptr + (wrow_h + blk) // 2
    else:
        sg_p = ws_ptr + wrow_g + blk
        sh_p = ws_ptr + wrow_h + blk
    return pg, ph, sg_p, sh_p


@triton.jit
def _mma_load(pg, ph, sg_p, sh_p, pg2, ph2, sg2_p, sh2_p, q0, q1, step, c, end, TILES: tl.constexpr,
              ROWS: tl.constexpr, EVEN_K: tl.constexpr, SCALE_PAIRS: tl.constexpr, VEC: tl.constexpr):
    """The lane's operands of the K step starting at `step` (pointers at that step): codes and
    scales of weight tiles 0 and 1 (`_mma_weights`; tile 0's again where ROWS == 1), activations
    of tiles 0 and 1 (`_mma_x`; tile 0's again where TILES == 1). Past `end` they read as zero
    (whole-step masks as per-lane tensors, the same value in every lane of a warp group:
    Triton's interpreter takes no scalar masks)."""
    k = step + 32 * c
    more = step < end
    ok0 = more if EVEN_K else k < end
    ok1 = more if EVEN_K else k + 16 < end
    w0 = _mma_weights(pg, ph, sg_p, sh_p, ok0, ok1, EVEN_K, SCALE_PAIRS, VEC)
    if ROWS == 2:
        w1 = _mma_weights(pg2, ph2, sg2_p, sh2_p, ok0, ok1, EVEN_K, SCALE_PAIRS, VEC)
    else:
        w1 = w0  # unused
    x = _mma_x(q0, k, end, more, EVEN_K, VEC)
    if TILES == 2:
        y = _mma_x(q1, k, end, more, EVEN_K, VEC)
    else:
        y = x  # unused
    return w0, w1, x, y


@triton.jit
def _mma_accumulate(acc, x4_ptr, xrow0, xrow1, wb_ptr, ws_ptr, wrows, c, k_start, k_end,
                    TILES: tl.constexpr, ROWS: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr,
                    SCALE_PAIRS: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr,
                    KWARPS: tl.constexpr = 1, kw=0, VEC: tl.constexpr = False):
    """The 16 accumulators (`_mma_step`) += the K range [k_start, k_end) of W @ x^T, in K steps
    of 128; the next step's weights and activations are loaded before this one is decoded.
    wrows: first block of rows g, g + 8 (weight tile 0) and g + 16, g + 24 (tile 1); xrow0 /
    xrow1: first int64 of the activation tiles' rows g.
    KWARPS > 1: the range is cut into KWARPS runs of whole steps, one per warp group kw (a per-lane
    tensor, 0 to KWARPS - 1); every group loops as many times as the longest run, a shorter run's
    last steps masked (their codes and activations read as zero and add nothing).
    VEC: codes and activations read 16 bytes at a time (`_load16`; see `mma_vec`)."""
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = acc
    wrow_g, wrow_h, wrow_g2, wrow_h2 = wrows
    if SCALE_PAIRS:
        S_STEP: tl.constexpr = 4
    else:
        S_STEP: tl.constexpr = 8
    if KWARPS == 1:
        k_stop = k_end
        base = k_start + 0 * c
        end = k_end + 0 * c
    else:
        run = tl.cdiv(tl.cdiv(k_end - k_start, 128), KWARPS) * 128
        k_stop = k_start + run
        base = k_start + kw * run
        end = tl.minimum(base + run, k_end)
    blk = base // 16 + 2 * c
    pg, ph, sg_p, sh_p = _mma_pointers(ws_ptr, wb_ptr, wrow_g, wrow_h, blk, SCALE_PAIRS)
    pg2, ph2, sg2_p, sh2_p = _mma_pointers(ws_ptr, wb_ptr, wrow_g2, wrow_h2, blk, SCALE_PAIRS)
    q0 = x4_ptr + xrow0 + (base + 32 * c) // 4
    q1 = x4_ptr + xrow1 + (base + 32 * c) // 4
    w0, w1, x, y = _mma_load(pg, ph, sg_p, sh_p, pg2, ph2, sg2_p, sh2_p, q0, q1, base, c, end, TILES, ROWS, EVEN_K,
                             SCALE_PAIRS, VEC)
    for k0 in range(k_start, k_stop, 128):
        pg += 8
        ph += 8
        sg_p += S_STEP
        sh_p += S_STEP
        pg2 += 8
        ph2 += 8
        sg2_p += S_STEP
        sh2_p += S_STEP
        q0 += 32
        q1 += 32
        step = base + (k0 - k_start) + 128  # this group's next step
        nw0, nw1, nx, ny = _mma_load(pg, ph, sg_p, sh_p, pg2, ph2, sg2_p, sh2_p, q0, q1, step, c, end, TILES, ROWS,
                                     EVEN_K, SCALE_PAIRS, VEC)
        if PREFETCH > 0 and not EMULATE:  # L2 prefetch of the weights PREFETCH steps ahead of this load
            ahead = step + 128 * PREFETCH < end
            _prefetch_l2(pg + 8 * PREFETCH, ahead)
            _prefetch_l2(ph + 8 * PREFETCH, ahead)
            if ROWS == 2:
                _prefetch_l2(pg2 + 8 * PREFETCH, ahead)
                _prefetch_l2(ph2 + 8 * PREFETCH, ahead)
        d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _mma_step(
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, w0, w1, x, y, TILES, ROWS, F16,
            EMULATE)
        w0, w1, x, y = nw0, nw1, nx, ny
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _mma_fragments(acc, row, col, TILES: tl.constexpr, ROWS: tl.constexpr):
    """The accumulators (`_mma_accumulate`) as one tensor, with each element's weight row and
    activation column: row is the lane's A row g of weight tile 0, col its D column 2c of
    activation tile 0. D fragment: (d0, d1) = (row g; columns 2c, 2c + 1), (d2, d3) = (row g + 8;
    the same columns); tiles 8 columns and 16 rows apart."""
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = acc
    y = tl.join(tl.join(d0, d1), tl.join(d2, d3))  # [threads, column 2c + i, row g + 8j]
    cols = col[:, None, None] + tl.arange(0, 2)[None, :, None]
    rows = row[:, None, None] + 8 * tl.arange(0, 2)[None, None, :]
    if TILES == 2:  # last axis: activation tile
        y = tl.join(y, tl.join(tl.join(e0, e1), tl.join(e2, e3)))
        cols = cols[:, :, :, None] + 8 * tl.arange(0, 2)[None, None, None, :]
        rows = rows[:, :, :, None] + 0 * tl.arange(0, 2)[None, None, None, :]
        if ROWS == 2:  # then weight tile
            y = tl.join(y, tl.join(tl.join(tl.join(f0, f1), tl.join(f2, f3)),
                                   tl.join(tl.join(h0, h1), tl.join(h2, h3))))
            cols = cols[:, :, :, :, None] + 0 * tl.arange(0, 2)[None, None, None, None, :]
            rows = rows[:, :, :, :, None] + 16 * tl.arange(0, 2)[None, None, None, None, :]
    elif ROWS == 2:
        y = tl.join(y, tl.join(tl.join(f0, f1), tl.join(f2, f3)))
        cols = cols[:, :, :, None] + 0 * tl.arange(0, 2)[None, None, None, :]
        rows = rows[:, :, :, None] + 16 * tl.arange(0, 2)[None, None, None, :]
    return y, rows, cols


@triton.jit
def _mma_lanes(WARPS: tl.constexpr, EMULATE: tl.constexpr):
    """(lane g, lane c, warp, zero accumulators) for `_mma_accumulate`: one element per thread."""
    lane, warp = _thread_ids(tl.arange(0, 32 * WARPS), EMULATE)
    z = tl.zeros((32 * WARPS,), dtype=tl.float32)
    return lane // 4, lane % 4, warp, (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)


@triton.jit
def _mma_rows(row, base, N, K):
    """First 16-block of rows g, g + 8, g + 16, g + 24 (`_mma_accumulate`'s wrows) of a matrix whose
    row 0 is row `base` of the stack, each clamped to the last row N - 1."""
    return ((base + tl.minimum(row, N - 1)).to(tl.int64) * (K // 16),
            (base + tl.minimum(row + 8, N - 1)).to(tl.int64) * (K // 16),
            (base + tl.minimum(row + 16, N - 1)).to(tl.int64) * (K // 16),
            (base + tl.minimum(row + 24, N - 1)).to(tl.int64) * (K // 16))


@triton.jit
def _group_sum(a, KWARPS: tl.constexpr):
    """[32 * warps * KWARPS] per-lane values (warp w of group kw at 32 * (kw * warps + w) + lane) ->
    [32 * warps]: the sum over the KWARPS groups."""
    return tl.sum(tl.reshape(a, (KWARPS, a.shape[0] // KWARPS)), axis=0)


@triton.jit
def _first_group(a, KWARPS: tl.constexpr):
    """Group 0's per-lane values of a tensor that is the same in every group, in `_group_sum`'s
    layout."""
    return tl.max(tl.reshape(a, (KWARPS, a.shape[0] // KWARPS)), axis=0)


@triton.jit
def _group_sum4(a0, a1, a2, a3, KWARPS: tl.constexpr):
    """`_group_sum` of one D fragment's four accumulators."""
    return _group_sum(a0, KWARPS), _group_sum(a1, KWARPS), _group_sum(a2, KWARPS), _group_sum(a3, KWARPS)


@triton.jit
def _sum_groups(acc, KWARPS: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr):
    """`_group_sum` of each accumulator in use (`_mma_fragments` reads only those; the others
    pass through)."""
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = acc
    d0, d1, d2, d3 = _group_sum4(d0, d1, d2, d3, KWARPS)
    if TILES == 2:
        e0, e1, e2, e3 = _group_sum4(e0, e1, e2, e3, KWARPS)
    if ROWS == 2:
        f0, f1, f2, f3 = _group_sum4(f0, f1, f2, f3, KWARPS)
        if TILES == 2:
            h0, h1, h2, h3 = _group_sum4(h0, h1, h2, h3, KWARPS)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _store_unscaled(y, gs_ptr, out_ptr, part_ptr, cnt_ptr, toks, rows, M, N, pid_m, pid_n, pid_s,
                    SPLIT: tl.constexpr):
    """Epilogue of the matrix-unit kernels whose weights are E2M1 * scale * 2^-7: y (fp32 sums, at
    activation rows `toks` and weight rows `rows`) times the global scale and 2^7, stored (out
    [M, N]) or, with SPLIT > 1, summed with the other K splits (`_store_split`)."""
    y = y * (tl.load(gs_ptr) * MMA_UNSCALE)
    off = toks.to(tl.int64) * N + rows
    ok = (toks < M) & (rows < N)
    if SPLIT == 1:
        tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        _store_split(y, part_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, off, ok, M * N, pid_s,
                     SPLIT)


@triton.jit
def _mma_kernel(x4_ptr, wb_ptr, ws_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, stride_x4, k_per_split,
                TILES: tl.constexpr, ROWS: tl.constexpr, WARPS: tl.constexpr, SPLIT: tl.constexpr,
                F16: tl.constexpr, EVEN_K: tl.constexpr, SCALE_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
                EMULATE: tl.constexpr, KWARPS: tl.constexpr = 1, VEC: tl.constexpr = False):
    """y = x @ W^T for up to 8 * TILES activation rows per program on the matrix units, the weight
    decoded in registers into mma.sync's A fragments (`mma_asm`); grid: N tiles of 16 * ROWS *
    WARPS rows (16 * ROWS per warp), activation row tiles, K splits. One element per thread: the
    thread's lane decides which rows, columns and K offsets it loads, decodes and stores. Rows
    past N and activation rows past M read the last one instead (their outputs are not stored: a
    D row or column depends on its own A row or B column only), so only a ragged K needs masks
    (EVEN_K: K is a whole number of steps). ws_ptr: the scale bytes, or with SCALE_PAIRS (K / 16
    even) their int16 view. VEC: 16-byte loads (`mma_vec`)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    g, c, warp, zero = _mma_lanes(WARPS * KWARPS, EMULATE)
    row = pid_n * (16 * ROWS * WARPS) + (warp % WARPS) * (16 * ROWS) + g  # A rows g and g + 8 (+ 16 per tile)
    tok = pid_m * (8 * TILES) + g  # B column g: an activation row
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    wrows = _mma_rows(row, 0, N, K)
    xrow0 = tl.minimum(tok, M - 1).to(tl.int64) * stride_x4
    xrow1 = tl.minimum(tok + 8, M - 1).to(tl.int64) * stride_x4
    acc = _mma_accumulate(zero, x4_ptr, xrow0, xrow1, wb_ptr, ws_ptr, wrows, c, k_start, k_end, TILES, ROWS, F16,
                          EVEN_K, SCALE_PAIRS, PREFETCH, EMULATE, KWARPS, warp // WARPS, VEC)
    col = pid_m * (8 * TILES) + 2 * c
    if KWARPS > 1:  # the warp groups' partial sums added in a fixed order (a reduction over warps)
        acc = _sum_groups(acc, KWARPS, TILES, ROWS)
        row = _first_group(row, KWARPS)
        col = _first_group(col, KWARPS)
    y, rows, toks = _mma_fragments(acc, row, col, TILES, ROWS)
    _store_unscaled(y, gs_ptr, out_ptr, part_ptr, cnt_ptr, toks, rows, M, N, pid_m, pid_n, pid_s, SPLIT)


@triton.jit
def _dequantize_kernel(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K, LUT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Writes the tiles `_w4a16_kernel` feeds to its dot (same loads, same helper, same
    interleave), in the output's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = n < N
    n64 = n.to(tl.int64)
    packed, sc = _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N, BLOCK_K, False, False)
    w = _dequant_tile(packed, sc, tl.load(gs_ptr), out_ptr.dtype.element_ty, LUT, BLOCK_N, BLOCK_K)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n64[:, None] * K + kk[None, :], w, mask=n_ok[:, None] & (kk < K)[None, :])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def check_weight(w: nvfp4.NVFP4Tensor, what: str, batch_dims: int = 0) -> None:
    if not isinstance(w, nvfp4.NVFP4Tensor):
        raise TypeError(f"{what}: expected an NVFP4Tensor, got {type(w).__name__}")
    if w.packed.dim() != 2 + batch_dims:
        raise FormatError(f"{what}: expected a {2 + batch_dims}-d NVFP4 weight, got shape {w.shape}")
    if not (w.packed.is_contiguous() and w.block_scale.is_contiguous() and w.global_scale.is_contiguous()):
        raise FormatError(f"{what}: NVFP4 weight tensors must be contiguous")


def _check_activations(x: torch.Tensor, k: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _ACT_DTYPES:
        raise FormatError(f"{what}: x must be a bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise FormatError(f"{what}: x of shape {tuple(x.shape)} does not end in K={k}")


def activation_rows(x: torch.Tensor, k: int, n: int) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(x's leading shape, x as rows [M, K] with unit stride along K, the output [M, N] to fill
    in x's dtype) for a GEMM launcher."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x.shape[:-1], x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)


# The table dequantization (inline PTX) for 16-bit activations on a GPU; the arithmetic one
# elsewhere (fp32 activations, Triton's interpreter). Both give the reference's values.
DEQUANT = {"lut": True}


def use_lut(dtype: torch.dtype, kernel) -> bool:
    return DEQUANT["lut"] and dtype in (torch.bfloat16, torch.float16) and not interpreted(kernel)


def lut_tile(cfg: dict) -> bool:
    """Launch shapes whose table dequantization tests/gpu checks on an H200 (4 warps, BLOCK_K >=
    128: the decode and M <= 64 tiles); other shapes dequantize arithmetically (the same
    values, more instructions)."""
    return cfg.get("num_warps", 4) == 4 and cfg["BLOCK_K"] >= 128


def _split(m: int, n: int, k: int, cfg: dict, device: torch.device, programs_per_sm: int | None = None,
           balance: tuple[float, int] | None = None) -> dict:
    """Split K until there are about `programs_per_sm` (default DECODE's) programs per
    multiprocessor (never below one K tile); with `balance`, more splits where that evens the
    programs out over the multiprocessors (`split_count`)."""
    tiles = cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"])
    k_blocks = cdiv(k, cfg["BLOCK_K"])
    split = split_count(tiles, k_blocks, _sm_count(device), programs_per_sm or DECODE["programs_per_sm"], balance)
    k_per_split = cdiv(k_blocks, split) * cfg["BLOCK_K"]
    return {"SPLIT": cdiv(k, k_per_split), "k_per_split": k_per_split}


def split_count(tiles: int, k_blocks: int, sms: int, programs_per_sm: int,
                balance: tuple[float, int] | None = None) -> int:
    """K splits for `tiles` output tiles of k_blocks K tiles on `sms` multiprocessors: about
    programs_per_sm programs per multiprocessor. balance = (least share, fewest K tiles per
    split): where the programs fill less than that share of the multiprocessors' slots for them
    (programs / (sms * ceil(programs / sms)): the busiest multiprocessors set the time), the
    next split counts are tried while a split's K range (k_per_split) keeps at least that many
    K tiles, and the first that fills it is taken (else the first count stays)."""
    want = programs_per_sm * sms
    split = max(1, min(k_blocks, want // tiles)) if tiles < want else 1
    if balance is None:
        return split

    def share(s: int) -> float:
        programs = tiles * cdiv(k_blocks, cdiv(k_blocks, s))  # splits as k_per_split rounds them
        return programs / (sms * cdiv(programs, sms))

    least, fewest = balance
    if share(split) >= least:
        return split
    for more in range(split + 1, k_blocks + 1):
        if cdiv(k_blocks, more) < fewest:
            break
        if share(more) >= least:
            return more
    return split


# Decode launch shape (M <= 16), picked on an H200 by `sweep` (scripts/bench_kernels.py --sweep-gemm:
# 8192x8192 and 3712x2688 at M = 1 and 16, CUDA-graph times;
# benchmarks/results/kernels-sweeps-matrix-unit-h200.json).
DECODE = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4}


# Launch shape for 17 to 64 rows, picked on an H200 by `sweep_mid` (scripts/bench_kernels.py
# --sweep-mid: the five bench shapes at M = 64, 12 launch shapes, the smallest summed time;
# benchmarks/results/kernels-sweeps-mid-wide-h200.json): 409 us summed against 418 for 64 x 256
# tiles (faster on 8192 x 8192, 38.6 against 44.0 us, slower on 131072 x 2688, 209.7 against 194.8).
# No swept launch shape reaches bf16's time at 64 rows on any bench shape: the best per shape is
# 0.97x (8192 x 8192), 0.84x (28672 x 8192), 0.49x and 0.70x (Nano), 0.99x (131072 x 2688), bf16 timed
# in the same run.
MID = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2}


# The CUDA-core kernel (`_gemv_kernel`) for up to GEMV["max_m"] rows (0: never). Its launch
# shape per activation rows per program (BLOCK_M = 1, 2, 4: `gemv_block_m`): BLOCK_N weight rows
# per program, BLOCK_K / 16 blocks per K step spread over the program's threads (each holds its
# blocks of all rows), the split-K target, and optionally a register cap. Picked on an H200 by
# `scripts/bench_kernels.py --sweep-gemv` with the loop addressing each row's blocks from the
# program's first row (`KB`): one row 8 x 1024 with 2 warps, 13.3 us on 8192 x 8192 against 14.1
# for 8 x 2048 with 4 warps (the previous pick; that sweep's file is not committed). The GEMV
# with this table in benchmarks/results/kernels-h200.json (one run, bf16 side by side): 13.6 us on
# 8192 x 8192 (2.49x bf16), 43.6 on 28672 x 8192 (2.53x); 13.6 and 44.5 (2.46x, 2.60x) and 13.5
# and 43.6 (2.52x, 2.47x) in earlier runs, 13.6 and 44.1 (2.51x, 2.45x) in packed-gemm-h200.json.
GEMV = {
    "max_m": 2,
    "1": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 2, "programs_per_sm": 4},
    "2": {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 1, "programs_per_sm": 4},
    "4": {"BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 4, "programs_per_sm": 4},
}


def gemv_block_m(m: int) -> int:
    """Activation rows per GEMV program for M rows: 1, 2 or 4."""
    return 1 if m <= 1 else 2 if m == 2 else 4


def _gemv_k_tile(k: int, cfg: dict) -> dict:
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


# The register-fed matrix-unit kernel (`_mma_kernel`) for MMA["min_m"] to MMA["max_m"] rows of
# bf16/fp16 activations on a GPU: weight-row tiles of 16 per warp ("rows"), warps per program,
# the split-K target, the L2 prefetch distance in K steps, the K groups of warps ("kwarps":
# groups that share a program's K range, their sums added in the program) and the split-K
# balance (`split_count`). Picked on an H200 by `sweep_mma` over the five bench shapes at 2, 4
# and 8 rows (scripts/bench_kernels.py --sweep-mma; benchmarks/results/kernels-sweeps-mma-h200.json,
# whose bench ran with the pick), with 16-byte loads (`mma_vec`): on average 1.041 times each
# problem's fastest swept launch shape, against 1.061 for the best with K groups (1 warp, 4
# groups, target 2) and 1.065 for two tiles per warp, two warps and target 4 (the pick with
# 8-byte loads). The balance (0.9, 16) changes none of the bench shapes at target 8 (28672 x 8192
# splits in two by the target itself: 56.0 us at four rows in that run). One row stays on the
# CUDA-core GEMV (15.4 us on 8192 x 8192; the mma kernel took 16.2-18.1 at the launch shapes
# tried) except where `ROW_MMA` sends it here; 9-16 rows: MMA_WIDE.
MMA = {"min_m": 2, "max_m": 8, "rows": 1, "num_warps": 4, "programs_per_sm": 8, "prefetch": 2, "kwarps": 1,
       "balance": (0.9, 16)}


# The same kernel with two activation tiles, for 9 (or MMA["max_m"] + 1) to MMA_WIDE["max_m"] rows of
# 16-bit activations on a GPU, where the weight has at least MMA_WIDE["min_weights"] elements
# (N * K; None: never): its launch shape and that reach picked on an H200 by `sweep_mma_wide` /
# `pick_mma_wide` (scripts/bench_kernels.py --sweep-mma-wide, 8 launch shapes on the five bench
# shapes at 12 and 16 rows; sweep_mma_wide in benchmarks/results/kernels-sweeps-mid-wide-h200.json),
# against the wgmma kernel, which keeps the smaller weights (the Nano shapes). The reach is summed
# over 12 and 16 rows per weight size: 75.2 against 113.8 us at 16 rows on 28672 x 8192, 21.1
# against 30.7 at 12 on 8192 x 8192; 10.5 against 8.1 at 16 rows on 2688 x 3712. K groups (1 warp,
# split-K target 2, 4 groups) reach down to the Nano shapes (7.9-8.4 us there, wgmma 7.7-8.6) but
# take 118-123 us on 131072 x 2688 against 89-93: routed, they are farther from each problem's best.
MMA_WIDE = {"max_m": 16, "min_weights": 8192 * 8192, "rows": 2, "num_warps": 1, "programs_per_sm": 8, "prefetch": 2,
            "kwarps": 1}


# One activation row (16-bit, on a GPU) goes to the register-fed matrix-unit kernel, MMA's launch
# shape, instead of the GEMV where the GEMV's K step does not divide K and the weight has
# ROW_MMA["min_weights"] elements or more (None: never). There the GEMV pads its last K step
# and, with K of 1856-3712, gets one to three steps per program to overlap its loads with; the
# mma kernel's steps of 128 divide every K the bench and the Nano model have. Picked on an H200
# by `sweep_row_mma` / `pick_row_mma` (scripts/bench_kernels.py --sweep-row-mma, sweep_row_mma
# in benchmarks/results/kernels-sweeps-row-mma-h200.json): 16 shapes at one row, the GEMV and the mma kernel
# side by side; from 32768 x 1856 up the mma kernel is faster on every swept shape with a ragged
# GEMV step (16.4 against 20.3 us there, 75.8 against 89.1 on 131072 x 2688, 31.0 against 42.8
# on 65536 x 1856), below it not on all (12.8 against 12.1 on 16384 x 2688; 10.3 against 10.7
# on 16384 x 1856, 6.2 against 4.3 on 3712 x 2688); where the GEMV's step divides K the GEMV
# stays (15.3 against 17.0 on 8192 x 8192, 48.8 against 53.7 on 28672 x 8192, 42.8 against 46.4
# on 24576 x 8192; 60.4 against 58.1 on 65536 x 4096).
ROW_MMA = {"min_weights": 32768 * 1856}


def gemv_pads_k(k: int) -> bool:
    """Whether the one-row GEMV's K step (`_gemv_k_tile`) does not divide K."""
    return k % _gemv_k_tile(k, dict(GEMV["1"]))["BLOCK_K"] != 0


def row_on_mma(n: int, k: int) -> bool:
    """Whether one row of 16-bit activations on a GPU runs on the mma kernel (`ROW_MMA`)."""
    least = ROW_MMA["min_weights"]
    return least is not None and n * k >= least and gemv_pads_k(k)


def mma_config(m: int, n: int, k: int, device: torch.device, num_warps: int | None = None,
               programs_per_sm: int | None = None, rows: int | None = None, prefetch: int | None = None,
               kwarps: int | None = None) -> dict:
    """`_mma_kernel`'s launch shape: 8 or 16 activation rows per program (one or two mma tiles),
    16 or 32 weight rows per warp (`rows` mma tiles), num_warps warps side by side on the weight
    rows, each `kwarps` times over (groups that share the program's K range, their sums added in
    the program), K steps of 128, split-K to about programs_per_sm programs per multiprocessor."""
    nw = num_warps or MMA["num_warps"]
    r = rows or MMA["rows"]
    kw = kwarps or MMA["kwarps"]
    if kw & (kw - 1) or nw & (nw - 1):
        raise ValueError(f"{_WHAT}: warps ({nw}) and K groups ({kw}) must be powers of 2")
    cfg = dict(mma=True, BLOCK_M=8 if m <= 8 else 16, BLOCK_N=16 * r * nw, BLOCK_K=128, num_warps=nw, num_stages=1,
               PREFETCH=MMA["prefetch"] if prefetch is None else prefetch, KWARPS=kw)
    cfg.update(_split(m, n, k, cfg, device, programs_per_sm or MMA["programs_per_sm"], MMA["balance"]))
    return cfg


def config(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile sizes and split-K for one problem: MMA["min_m"] to MMA["max_m"] rows of 16-bit
    activations on a GPU, the register-fed matrix-unit kernel (and up to MMA_WIDE["max_m"] rows
    for weights of MMA_WIDE["min_weights"] elements or more, one row where `row_on_mma`); else
    one to a few rows on the CUDA cores (GEMV);
    decode-sized M streams the weight through many programs on the matrix units; large M uses
    big tiles. Chosen by rule (no autotuning at call time)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        if MMA["min_m"] <= m <= MMA["max_m"] or (m == 1 and row_on_mma(n, k)):
            return mma_config(m, n, k, device)
        wide = MMA_WIDE["min_weights"]
        if max(MMA["max_m"], 8) < m <= MMA_WIDE["max_m"] and wide is not None and n * k >= wide:
            return mma_config(m, n, k, device, MMA_WIDE["num_warps"], MMA_WIDE["programs_per_sm"], MMA_WIDE["rows"],
                              MMA_WIDE["prefetch"], MMA_WIDE["kwarps"])
    if m <= GEMV["max_m"]:
        bm = gemv_block_m(m)
        tile = GEMV[str(bm)]
        cfg = dict(gemv=True, BLOCK_M=bm, num_stages=1, **{key: v for key, v in tile.items() if key != "programs_per_sm"})
        cfg = _gemv_k_tile(k, cfg) if device.type == "cuda" else dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], 64))
        cfg.update(_split(m, n, k, cfg, device, tile["programs_per_sm"]))
        return cfg
    if m <= 16:
        cfg = dict(BLOCK_M=16, **{key: v for key, v in DECODE.items() if key != "programs_per_sm"})
    elif m <= 64:
        cfg = dict(BLOCK_M=64, **{key: v for key, v in MID.items() if key != "programs_per_sm"})
        if device.type != "cuda":
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 64)
        cfg.update(_split(m, n, k, cfg, device, MID["programs_per_sm"]))
        return cfg
    else:
        # BLOCK_K = 64 here gave wrong products on an H200 (Triton 3.6) with int32 weight words.
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if device.type != "cuda":
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 64)
    cfg.update(_split(m, n, k, cfg, device))
    return cfg


# Above this many rows the weight is dequantized once (`dequantize`, the same exact tiles) and
# multiplied by torch's bf16 matmul: the GEMM is then matrix-unit bound, and re-dequantizing
# each weight tile for every row block costs more than writing the bf16 weight once.
LARGE_M = 128


def w4a16_matmul(x: torch.Tensor, w: nvfp4.NVFP4Tensor, *, backend: str = "triton", cfg: dict | None = None):
    """y = x @ W.dequantize(x.dtype)^T, fp32 accumulation, output in x's dtype (bf16 for bf16).

    x: [..., K] bf16 (fp16 / fp32 also accepted); w: NVFP4Tensor [N, K] (ModelOpt layout).
    backend: "triton" (the fused kernel for up to LARGE_M rows; beyond, the Triton dequantize
    kernel then torch.matmul) or "torch" (`W.dequantize()`, then torch's matmul).
    cfg: a `config(...)` dict to force a launch shape (and the fused kernel at any M).
    """
    check_weight(w, _WHAT)
    n, k = w.shape
    _check_activations(x, k, _WHAT)
    check_backend(backend, _w4a16_kernel, x, w.packed, w.block_scale, w.global_scale, what=_WHAT)
    if backend == "torch":
        return torch.nn.functional.linear(x, w.dequantize(x.dtype))
    lead, x2, out = activation_rows(x, k, n)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    if cfg is None and m > LARGE_M:
        return torch.matmul(x2, dequantize(w, x.dtype).T).reshape(*lead, n)
    cfg = dict(cfg or config(m, n, k, x.device, x.dtype))
    split, k_per_split = cfg.pop("SPLIT"), cfg.pop("k_per_split")
    lut = cfg.pop("lut", lut_tile(cfg)) and use_lut(x.dtype, _w4a16_kernel)
    gemv = cfg.pop("gemv", False)
    mma = cfg.pop("mma", False)
    if mma and x.dtype == torch.float32:
        raise ValueError(f"{_WHAT}: the register-fed matrix-unit kernel takes bf16/fp16 activations, got {x.dtype}")
    grid = (cdiv(n, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    part, counters = out, out  # unused unless split > 1
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
    even = dict(EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % cfg["BLOCK_K"] == 0)
    if mma:
        x2, x4 = int64_activations(x2)
        scales, pairs = mma_scales(w)
        kwarps = cfg.get("KWARPS", 1)
        _mma_kernel[grid](x4, w.packed.view(torch.int64), scales,
                          w.global_scale, out, part, counters, m, n, k, x2.stride(0) // 4, k_per_split,
                          VEC=mma_vec(w.packed, x4, x2.stride(0) // 4, k, _mma_kernel),
                          TILES=cfg["BLOCK_M"] // 8, ROWS=cfg["BLOCK_N"] // (16 * cfg["num_warps"]),
                          WARPS=cfg["num_warps"], SPLIT=split,
                          F16=x.dtype == torch.float16, EVEN_K=k % 128 == 0, SCALE_PAIRS=pairs,
                          PREFETCH=cfg["PREFETCH"], EMULATE=interpreted(_mma_kernel), KWARPS=kwarps,
                          num_warps=cfg["num_warps"] * kwarps,
                          num_stages=1, **launch_options())
    elif gemv:
        x2, x4 = int64_activations(x2)
        lut = DEQUANT["lut"] and not interpreted(_gemv_kernel)  # the block-dot PTX takes any dtype
        _gemv_kernel[grid](x2, x4, w.packed.view(torch.int64), w.block_scale.view(torch.uint8), w.global_scale,
                           out, part, counters, m, n, k, x2.stride(0), k_per_split, SPLIT=split, LUT=lut, KB=k // 16,
                           **even, **cfg, **launch_options())
    else:
        _w4a16_kernel[grid](x2, w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.global_scale, out,
                            part, counters, m, n, k, x2.stride(0), k_per_split, SPLIT=split,
                            IEEE=x.dtype == torch.float32, LUT=lut, **even, **cfg, **launch_options())
    return out.reshape(*lead, n)


def mma_scales(w: nvfp4.NVFP4Tensor) -> tuple[torch.Tensor, bool]:
    """A weight's (or stack's) scale bytes as the mma kernels read them, and whether paired: their
    int16 view (two blocks at a time) where K / 16 is even and the bytes start 2-aligned, else
    the bytes."""
    scales = w.block_scale.view(torch.uint8)
    pairs = scales.shape[-1] % 2 == 0 and scales.data_ptr() % 2 == 0
    return (scales.view(torch.int16) if pairs else scales), pairs


def mma_vec(packed: torch.Tensor, x4: torch.Tensor, stride_x4: int, k: int, kernel) -> bool:
    """Whether `kernel` (an mma kernel) may read codes and activations 16 bytes at a time
    (`_load16`): on a GPU (not Triton's interpreter), with K % 32 == 0 (a row's codes a whole
    number of 16-byte pairs of blocks) and the codes, the activations (x4, int64 view) and their
    rows (stride_x4 int64 apart) 16-byte aligned."""
    return (not interpreted(kernel) and k % 32 == 0 and packed.data_ptr() % 16 == 0 and x4.data_ptr() % 16 == 0
            and stride_x4 % 2 == 0)


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
    """Zeroed int32 tile counters for the split-K epilogue (`_store_split`), at least `tiles`.

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


def dequantize(w: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str = "triton"):
    """W.dequantize(dtype) through the GEMM's own in-register dequantization (`_dequant_tile`)."""
    what = "kernels.dequantize"
    check_weight(w, what)
    check_backend(backend, _dequantize_kernel, w.packed, w.block_scale, w.global_scale, what=what)
    if backend == "torch":
        return w.dequantize(dtype)
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype, device=w.packed.device)
    bn, bk = (32, 64) if w.packed.device.type != "cuda" else (64, 256)
    _dequantize_kernel[(cdiv(n, bn), cdiv(k, bk))](
        w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.global_scale, out, n, k,
        LUT=use_lut(dtype, _dequantize_kernel), BLOCK_N=bn, BLOCK_K=bk, **launch_options())
    return out


# --------------------------------------------------------------------------------------------
# Benchmark entry
# --------------------------------------------------------------------------------------------
def time_if_right(fn, ref: torch.Tensor) -> dict:
    """{"ms": CUDA-graph median time of fn()} if fn() is within 1e-2 relative of ref (a launch
    shape must be right before it is fast), else {"ms": None, "error": why}."""
    from triton.testing import do_bench_cudagraph

    try:
        err = float((fn().float() - ref).norm() / ref.norm())
        if not err < 1e-2:
            raise ArithmeticError(f"relative error {err:.3g}")
        return {"ms": do_bench_cudagraph(fn, rep=30, return_mode="median")}
    except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory or registers
        return {"ms": None, "error": f"{type(exc).__name__}: {exc}"[:160]}


def with_maxnreg(cfg: dict, maxnreg) -> dict:
    """cfg with Triton's register cap per thread (more programs per multiprocessor, at the cost
    of spills) when maxnreg is set; unchanged for None (the compiler's choice)."""
    return dict(cfg, maxnreg=maxnreg) if maxnreg else cfg


def sweep(shapes=((8192, 8192), (3712, 2688)), ms=(1, 16),
          tiles=((32, 256), (64, 128), (64, 256), (128, 256)), warps=(4, 8), stages=(3,),
          programs_per_sm=(4, 8), block_m=16, maxnreg=(None,)):
    """CUDA-graph times of decode launch shapes: tile (BLOCK_N, BLOCK_K) x warps x stages x the
    split-K target (programs per multiprocessor) x register cap; each checked against an fp32
    reference first."""
    from .quantize import quantize

    out = []
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            ref = torch.nn.functional.linear(x.float(), wq.dequantize(torch.bfloat16).float())
            for (bn, bk), nw, st, pps, mr in itertools.product(tiles, warps, stages, programs_per_sm, maxnreg):
                cfg = with_maxnreg(dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st), mr)
                cfg.update(_split(m, n, k, cfg, x.device, pps))
                row = {"N": n, "K": k, "M": m, "maxnreg": mr, **cfg, "programs_per_sm": pps}
                row.update(time_if_right(lambda: w4a16_matmul(x, wq, cfg=cfg), ref))
                out.append(row)
    return out


def sweep_mid(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)), ms=(64,)):
    """`sweep` of the 17-64-row launch shapes (BLOCK_M = 64) on the five bench shapes."""
    return sweep(shapes, ms, tiles=((64, 128), (64, 256), (128, 128)), warps=(4, 8), stages=(3,),
                 programs_per_sm=(2, 4), block_m=64)


def pick_decode(rows) -> dict:
    """The launch shape (a DECODE or MID entry) with the smallest summed sweep time over its
    shapes and M."""
    totals = {}
    for r in rows:
        key = (r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["num_stages"], r["programs_per_sm"], r.get("maxnreg"))
        t = r["ms"] if r["ms"] is not None else float("inf")
        totals[key] = totals.get(key, 0.0) + t
    bn, bk, nw, st, pps, mr = min(totals, key=totals.get)
    return with_maxnreg({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st, "programs_per_sm": pps}, mr)


def _sweep_problems(shapes, ms):
    """(N, K, M, NVFP4 weight, bf16 activations, fp32 reference) for each swept problem on the GPU:
    a random weight per shape, quantized by fp4kit, and its product with W.dequantize()."""
    from .quantize import quantize

    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        wdq = wq.dequantize(torch.float32)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            yield n, k, m, wq, x, torch.nn.functional.linear(x.float(), wdq)


def sweep_gemv(shapes=((8192, 8192), (3712, 2688), (2688, 3712)), ms=(1, 2, 4),
               tiles=((1, 4, 2048, 4), (1, 8, 2048, 4), (1, 8, 1024, 2), (1, 16, 1024, 4), (1, 4, 512, 1),
                      (1, 8, 512, 1), (1, 16, 2048, 4), (2, 8, 2048, 4),
                      (2, 8, 512, 1), (4, 8, 2048, 4)),
               programs_per_sm=(4, 8), stages=(1,), maxnreg=(None,)):
    """CUDA-graph times of the CUDA-core kernel's launch shapes (BLOCK_M, BLOCK_N, BLOCK_K, warps)
    x split-K target x stages, and of the matrix-unit kernel's launch shape at the same M, side by
    side; tiles with BLOCK_M < M run several row tiles. Each launch shape is checked against an
    fp32 reference first (a wrong one is not timed)."""
    out = []
    saved, saved_mma = GEMV["max_m"], MMA["max_m"]
    try:
        GEMV["max_m"] = MMA["max_m"] = 0  # config() then gives the wgmma kernel's launch shape at every M
        for n, k, m, wq, x, ref in _sweep_problems(shapes, ms):
            base = config(m, n, k, x.device)
            row = {"N": n, "K": k, "M": m, "kernel": "matrix-unit", **base}
            row.update(time_if_right(lambda: w4a16_matmul(x, wq, cfg=base), ref))
            out.append(row)
            for (bm, bn, bk, nw), pps, st, mr in itertools.product(tiles, programs_per_sm, stages, maxnreg):
                if bm != gemv_block_m(m):
                    continue
                cfg = _gemv_k_tile(k, dict(BLOCK_M=bm, gemv=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st))
                cfg = with_maxnreg(cfg, mr)
                cfg.update(_split(m, n, k, cfg, x.device, pps))
                row = {"N": n, "K": k, "M": m, "kernel": "gemv", "tile": [bm, bn, bk, nw], "maxnreg": mr, **cfg,
                       "programs_per_sm": pps}
                row.update(time_if_right(lambda: w4a16_matmul(x, wq, cfg=cfg), ref))
                out.append(row)
    finally:
        GEMV["max_m"], MMA["max_m"] = saved, saved_mma
    return out


def pick_gemv(rows) -> dict:
    """GEMV's launch shape for each BLOCK_M (1, 2, 4): the swept (tile, split-K target, register
    cap) with the smallest summed time at M = BLOCK_M; and max_m: the largest swept M up to which
    the CUDA-core kernel (with its BLOCK_M's pick) beats the matrix-unit kernel on every swept
    shape (0 if not at M = 1)."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else float("inf")

    def key(r):
        return (*r["tile"], r["programs_per_sm"], r.get("maxnreg"))

    out = {}
    best_time = {}
    for bm in (1, 2, 4):
        totals = {}
        for r in rows:
            if r["kernel"] == "gemv" and r["tile"][0] == bm:
                totals[key(r)] = totals.get(key(r), 0.0) + ms(r) * (r["M"] == bm)
        if not totals:
            continue
        best = min(totals, key=totals.get)
        _, bn, bk, nw, pps, mr = best
        out[str(bm)] = with_maxnreg({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "programs_per_sm": pps}, mr)
        best_time.update({(r["N"], r["M"]): ms(r) for r in rows if r["kernel"] == "gemv" and key(r) == best})
    base = {(r["N"], r["M"]): ms(r) for r in rows if r["kernel"] == "matrix-unit"}
    max_m = 0
    for m in sorted({mm for _, mm in base}):
        keys = [k for k in base if k[1] == m]
        if not all(best_time.get(k, float("inf")) < base[k] for k in keys):
            break
        max_m = m
    out["max_m"] = max_m
    return out


def sweep_mma(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)), ms=(2, 4, 8),
              launch=((2, 4, 2, 2), (4, 4, 2, 2), (8, 2, 2, 2), (2, 8, 2, 2), (4, 8, 1, 2), (4, 2, 1, 2),
                      (2, 4, 2, 0), (1, 1, 2, 2, 4), (2, 1, 2, 2, 4), (1, 2, 2, 2, 4), (1, 1, 2, 2, 8),
                      (1, 2, 2, 2, 2))):
    """CUDA-graph times of `_mma_kernel`'s launch shapes (warps, split-K target, weight-row tiles
    per warp, prefetch distance[, K groups of warps]), each checked against an fp32 reference
    first."""
    out = []
    for n, k, m, wq, x, ref in _sweep_problems(shapes, ms):
        out += _mma_launch_rows(n, k, m, wq, x, ref, launch)
    return out


def _mma_launch_rows(n, k, m, wq, x, ref, launch, **tag) -> list:
    """One sweep row per `_mma_kernel` launch shape (warps, split-K target, weight-row tiles per
    warp, prefetch distance, optionally the K groups of warps: 1 if not given) on one problem, with
    `tag`'s items, each timed if right."""
    out = []
    for nw, pps, rows, pf, *groups in launch:
        kw = groups[0] if groups else 1
        cfg = mma_config(m, n, k, x.device, nw, pps, rows, pf, kw)
        row = {"N": n, "K": k, "M": m, **tag, "num_warps": nw, "programs_per_sm": pps, "rows": rows, "prefetch": pf,
               "kwarps": kw}
        row.update(time_if_right(lambda: w4a16_matmul(x, wq, cfg=cfg), ref))
        out.append(row)
    return out


def sweep_mma_wide(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)), ms=(12, 16),
                   launch=((1, 8, 2, 2), (2, 4, 2, 2), (1, 8, 1, 2), (2, 8, 2, 2), (1, 1, 2, 2, 4), (1, 2, 2, 2, 4),
                           (1, 2, 1, 2, 4), (1, 2, 1, 2, 8))):
    """CUDA-graph times of `_mma_kernel`'s launch shapes with two activation tiles (warps, split-K
    target, weight-row tiles per warp, prefetch distance[, K groups of warps]) and of the wgmma
    kernel's launch shape at the same M, side by side; each checked against an fp32 reference
    first."""
    out = []
    saved = MMA_WIDE["min_weights"]
    try:
        MMA_WIDE["min_weights"] = None  # config() then gives the wgmma kernel's launch shape
        for n, k, m, wq, x, ref in _sweep_problems(shapes, ms):
            base = config(m, n, k, x.device)
            row = {"N": n, "K": k, "M": m, "kernel": "matrix-unit"}
            row.update(time_if_right(lambda: w4a16_matmul(x, wq, cfg=base), ref))
            out.append(row)
            out += _mma_launch_rows(n, k, m, wq, x, ref, launch, kernel="mma")
    finally:
        MMA_WIDE["min_weights"] = saved
    return out


def sweep_row_mma(shapes=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688), (10304, 2688),
                          (16384, 2688), (32768, 2688), (65536, 2688), (32768, 1856), (65536, 1856), (32768, 3712),
                          (65536, 3712), (65536, 4096), (24576, 8192), (16384, 1856))):
    """CUDA-graph times at one activation row of the GEMV and of `_mma_kernel` at MMA's launch shape,
    side by side per shape, each checked against an fp32 reference first; "ragged": the GEMV's K
    step does not divide K."""
    out = []
    saved = ROW_MMA["min_weights"]
    try:
        ROW_MMA["min_weights"] = None  # config() then gives the GEMV
        for n, k, m, wq, x, ref in _sweep_problems(shapes, (1,)):
            gemv = config(m, n, k, x.device)
            for kernel, cfg in (("gemv", gemv), ("mma", mma_config(m, n, k, x.device))):
                row = {"N": n, "K": k, "M": m, "kernel": kernel, "ragged": gemv_pads_k(k)}
                row.update(time_if_right(lambda: w4a16_matmul(x, wq, cfg=dict(cfg)), ref))
                out.append(row)
    finally:
        ROW_MMA["min_weights"] = saved
    return out


def pick_row_mma(rows) -> dict:
    """ROW_MMA from `sweep_row_mma`'s rows: min_weights, the smallest swept N * K from which the mma
    kernel beats the GEMV on every swept shape with a ragged GEMV step at least as large (shapes
    of one size summed together; None if it does not on the largest)."""
    sums = {}  # size -> [gemv, mma] summed over the ragged shapes of that size
    for r in rows:
        if r["ragged"]:
            t = r["ms"] if r["ms"] is not None else float("inf")
            pair = sums.setdefault(r["N"] * r["K"], [0.0, 0.0])
            pair[r["kernel"] == "mma"] += t
    least = None
    for size in sorted(sums, reverse=True):
        gemv, mma = sums[size]
        if not mma < gemv:
            break
        least = size
    return {"min_weights": least}


def pick_mma_wide(rows) -> dict:
    """MMA_WIDE from `sweep_mma_wide`'s rows. Each swept launch shape gets its reach, min_weights:
    the smallest swept N * K from which it beats the wgmma kernel in time summed over the swept
    M, on every swept size at least as large (shapes of one size summed together; None if it
    does not on the largest). The launch shape taken is the one whose routing (it from its reach
    up, the wgmma kernel below) is nearest each problem's best swept time: the smallest sum over
    the problems of the routed time over the problem's best, ties to `pick_mma`'s order. Routed
    times, so that a launch shape is judged only where it would run; relative ones, so that the
    largest weights do not outvote the others."""
    def ms(r):
        return r["ms"] if r["ms"] is not None else float("inf")

    best, base, base_size = {}, {}, {}
    for r in rows:
        p, size = (r["N"], r["K"], r["M"]), r["N"] * r["K"]
        best[p] = min(best.get(p, float("inf")), ms(r))
        if r["kernel"] == "matrix-unit":
            base[p] = ms(r)
            base_size[size] = base_size.get(size, 0.0) + ms(r)
    mma_rows = [r for r in rows if r["kernel"] == "mma"]
    times, size_sums = {}, {}  # per launch shape: its time per problem, and summed per weight size
    for r in mma_rows:
        key, size = _mma_launch_key(r), r["N"] * r["K"]
        times.setdefault(key, {})[r["N"], r["K"], r["M"]] = ms(r)
        sums = size_sums.setdefault(key, {})
        sums[size] = sums.get(size, 0.0) + ms(r)

    def reach(key):
        out = None
        for size in sorted(size_sums[key], reverse=True):
            if not size_sums[key][size] < base_size[size]:
                break
            out = size
        return out

    def routed(key):
        start = reach(key)
        return sum((times[key][p] if start is not None and p[0] * p[1] >= start else base[p]) / best[p]
                   for p in base if best[p] < float("inf"))  # a problem nothing ran on counts for none

    first = _mma_launch_key(pick_mma(mma_rows))  # ties: the launch shape nearest the best over all problems
    key = min(times, key=lambda k: (routed(k), k != first))
    nw, pps, rows_, pf, kw = key
    return {"min_weights": reach(key), "num_warps": nw, "programs_per_sm": pps, "rows": rows_, "prefetch": pf,
            "kwarps": kw}


def _mma_launch_key(r: dict) -> tuple:
    """(warps, split-K target, rows, prefetch, K groups) of a sweep row or launch shape; rows of
    sweeps without K groups have 1."""
    return r["num_warps"], r["programs_per_sm"], r["rows"], r["prefetch"], r.get("kwarps", 1)


def pick_mma(rows) -> dict:
    """The MMA launch shape closest to each problem's fastest: the smallest sum over the swept
    problems (N, K, M) of its time over the problem's best time (a launch shape that failed on
    a problem never wins). Relative times, so that the largest weights do not outvote the
    others."""
    best = {}
    for r in rows:
        if r["ms"] is not None:
            p = (r["N"], r["K"], r["M"])
            best[p] = min(best.get(p, float("inf")), r["ms"])
    totals = {}
    for r in rows:
        key = _mma_launch_key(r)
        t = r["ms"] / best[r["N"], r["K"], r["M"]] if r["ms"] is not None else float("inf")
        totals[key] = totals.get(key, 0.0) + t
    nw, pps, rows_, pf, kw = min(totals, key=totals.get)
    return {"num_warps": nw, "programs_per_sm": pps, "rows": rows_, "prefetch": pf, "kwarps": kw}


def path(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which kernel `w4a16_matmul` runs for this problem."""
    if m > LARGE_M:
        return "dequantize+torch.matmul"
    cfg = config(m, n, k, device, dtype)
    return "mma" if cfg.get("mma") else "gemv" if cfg.get("gemv") else "fused"


def bench(nk=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)),
          ms=(1, 4, 16, 64, 256, 1024)):
    """Median times of this GEMM and of torch.matmul on the bf16 weight, side by side: replayed
    from CUDA graphs (the GPU's time; how decode runs in serving engines) and eager (including
    each call's host-side launch cost); and, from CUDA graphs, `packed_gemm.packed_matmul` on the
    same weight pre-packed (`speedup_vs_bf16_packed`; `speedup_vs_bf16_best`: the faster of the two)."""
    from triton.testing import do_bench, do_bench_cudagraph

    from .packed_gemm import pack, packed_matmul
    from .quantize import quantize

    rows = []
    for n, k in nk:
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        wq = quantize(wb)
        wp = pack(wq)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            fp4 = lambda: w4a16_matmul(x, wq)  # noqa: E731
            bf16 = lambda: torch.matmul(x, wb.T)  # noqa: E731
            t_fp4 = do_bench_cudagraph(fp4, rep=50, return_mode="median")
            t_bf16 = do_bench_cudagraph(bf16, rep=50, return_mode="median")
            DEQUANT["lut"] = False
            try:
                t_arith = do_bench_cudagraph(fp4, rep=50, return_mode="median")
            finally:
                DEQUANT["lut"] = True
            weight_bytes = n * k // 2 + n * k // 16
            row = {
                "N": n, "K": k, "M": m, "ms_w4a16": t_fp4, "ms_bf16": t_bf16,
                "speedup_vs_bf16": t_bf16 / t_fp4, "ms_w4a16_arith_dequant": t_arith,
                "w4a16_weight_tbps": weight_bytes / (t_fp4 * 1e-3) / 1e12,
                "bf16_weight_tbps": 2 * n * k / (t_bf16 * 1e-3) / 1e12,
                "ms_w4a16_eager": do_bench(fp4, warmup=10, rep=50, return_mode="median"),
                "ms_bf16_eager": do_bench(bf16, warmup=10, rep=50, return_mode="median"),
                "path": path(m, n, k, x.device),
            }
            row["speedup_vs_bf16_eager"] = row["ms_bf16_eager"] / row["ms_w4a16_eager"]
            row["ms_packed"] = do_bench_cudagraph(lambda: packed_matmul(x, wp), rep=50, return_mode="median")
            row["speedup_vs_bf16_packed"] = t_bf16 / row["ms_packed"]
            row["speedup_vs_bf16_best"] = t_bf16 / min(t_fp4, row["ms_packed"])
            if m > LARGE_M:  # the fused kernel at this size, for the record
                cfg = config(m, n, k, x.device)
                row["ms_w4a16_fused"] = do_bench_cudagraph(lambda: w4a16_matmul(x, wq, cfg=cfg), rep=50,
                                                           return_mode="median")
            rows.append(row)
        del wb, wq, wp
    return rows


def gemv_limits(shapes=((8192, 8192), (28672, 8192))) -> list:
    """At one activation row, CUDA-graph times side by side: the GEMV (`w4a16_matmul`), its loop
    alone and without one of its parts (`_gemv_probe_kernel`: the weight loads alone, the
    arithmetic alone on cache-resident weights), and torch.matmul on the bf16 weight."""
    from triton.testing import do_bench_cudagraph

    from .quantize import quantize

    rows = []
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        wb = wq.dequantize(torch.bfloat16)
        x = torch.randn((1, k), dtype=torch.bfloat16, device="cuda")
        cfg = config(1, n, k, x.device)
        row = {"N": n, "K": k, "weight_bytes": wq.packed.numel() + wq.block_scale.numel(),
               **{key: cfg[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT")}}
        times = {"ms_gemv": lambda: w4a16_matmul(x, wq), "ms_bf16": lambda: torch.matmul(x, wb.T)}
        if cfg.get("gemv") and cfg["SPLIT"] == 1:
            times.update({f"ms_{name}": functools.partial(gemv_probe, x, wq, part, cfg)
                          for name, part in (("loop", PROBE_ALL), ("loads_only", PROBE_LOADS),
                                             ("arithmetic_only", PROBE_ARITHMETIC))})
        for key, fn in times.items():
            row[key] = do_bench_cudagraph(fn, rep=50, return_mode="median")
        rows.append(row)
    return rows


def host_overhead_us(n=3712, k=2688, calls=200):
    """Host time per eager call (M=1), launch path included, vs torch.matmul's."""
    import time

    from .quantize import quantize

    wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda")
    wq = quantize(wb)
    x = torch.randn((1, k), dtype=torch.bfloat16, device="cuda")
    out = {}
    for name, fn in (("w4a16", lambda: w4a16_matmul(x, wq)), ("bf16", lambda: torch.matmul(x, wb.T))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out[f"{name}_host_us_per_call"] = (t1 - t0) / calls * 1e6
    return out
