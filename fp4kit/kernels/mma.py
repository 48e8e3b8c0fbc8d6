"""The matrix-unit pieces fed from registers: mma.sync m16n8k16 with the NVFP4 weight decoded by
inline PTX straight into the A fragment (no shared memory, no layout conversion).

`mma_accumulate` runs a K range in steps of 128 for one or two weight tiles (16 rows each) and
one or two activation tiles (8 rows each) per warp; `mma_fragments` maps the accumulators back to
output rows and columns, `store_unscaled` applies the global scale and stores (or sums split-K
partials). The weights the matrix units see are E2M1 * scale * 2^-7 exactly: W.dequantize()'s
fp32 values up to one rounding (the global scale and 2^7 are applied to the fp32 sums).

In Triton's interpreter the same code runs with each warp's mma.sync emulated
(`_mma_step_emulated`: the same per-lane operands and K order), so CPU tests cover the loads,
masks and epilogue; tests/test_dequant_asm.py runs the PTX itself in a PTX emulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4

from .backend import interpreted
from .tiles import e2m1_bits, e4m3_decode, store_split


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
    scale = e4m3_decode((scales >> (8 * (s // 4))) & 0xFF)
    return e2m1_bits(code, 0) * 6.646139978924579e35 * scale[:, None]  # 2^119: E2M1 * 2^-7 exactly


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
def prefetch_l2(ptr, ok):
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
def mma_accumulate(acc, x4_ptr, xrow0, xrow1, wb_ptr, ws_ptr, wrows, c, k_start, k_end,
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
            prefetch_l2(pg + 8 * PREFETCH, ahead)
            prefetch_l2(ph + 8 * PREFETCH, ahead)
            if ROWS == 2:
                prefetch_l2(pg2 + 8 * PREFETCH, ahead)
                prefetch_l2(ph2 + 8 * PREFETCH, ahead)
        d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _mma_step(
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, w0, w1, x, y, TILES, ROWS, F16,
            EMULATE)
        w0, w1, x, y = nw0, nw1, nx, ny
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def mma_fragments(acc, row, col, TILES: tl.constexpr, ROWS: tl.constexpr):
    """The accumulators (`mma_accumulate`) as one tensor, with each element's weight row and
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
def mma_lanes(WARPS: tl.constexpr, EMULATE: tl.constexpr):
    """(lane g, lane c, warp, zero accumulators) for `mma_accumulate`: one element per thread."""
    lane, warp = _thread_ids(tl.arange(0, 32 * WARPS), EMULATE)
    z = tl.zeros((32 * WARPS,), dtype=tl.float32)
    return lane // 4, lane % 4, warp, (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)


@triton.jit
def mma_rows(row, base, N, K):
    """First 16-block of rows g, g + 8, g + 16, g + 24 (`mma_accumulate`'s wrows) of a matrix whose
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
def first_group(a, KWARPS: tl.constexpr):
    """Group 0's per-lane values of a tensor that is the same in every group, in `_group_sum`'s
    layout."""
    return tl.max(tl.reshape(a, (KWARPS, a.shape[0] // KWARPS)), axis=0)


@triton.jit
def _group_sum4(a0, a1, a2, a3, KWARPS: tl.constexpr):
    """`_group_sum` of one D fragment's four accumulators."""
    return _group_sum(a0, KWARPS), _group_sum(a1, KWARPS), _group_sum(a2, KWARPS), _group_sum(a3, KWARPS)


@triton.jit
def sum_groups(acc, KWARPS: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr):
    """`_group_sum` of each accumulator in use (`mma_fragments` reads only those; the others
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
def store_unscaled(y, gs_ptr, out_ptr, part_ptr, cnt_ptr, toks, rows, M, N, pid_m, pid_n, pid_s,
                    SPLIT: tl.constexpr):
    """Epilogue of the matrix-unit kernels whose weights are E2M1 * scale * 2^-7: y (fp32 sums, at
    activation rows `toks` and weight rows `rows`) times the global scale and 2^7, stored (out
    [M, N]) or, with SPLIT > 1, summed with the other K splits (`store_split`)."""
    y = y * (tl.load(gs_ptr) * MMA_UNSCALE)
    off = toks.to(tl.int64) * N + rows
    ok = (toks < M) & (rows < N)
    if SPLIT == 1:
        tl.store(out_ptr + off, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        store_split(y, part_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, off, ok, M * N, pid_s,
                     SPLIT)


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
