"""W4A16 GEMM on a pre-packed NVFP4 weight: y = x @ dequant(W)^T, the weight decoded in registers
straight into the matrix units' A operand (wgmma with A from registers).

Reference: `PackedNVFP4.unpack()` (the checkpoint layout back, byte for byte), then
`NVFP4Tensor.dequantize` and a matmul (backend="torch").

The checkpoint layout makes a kernel either send every decoded weight tile through shared memory
(`w4a16_gemm`'s wgmma kernel) or keep the activations in registers too (its mma.sync kernel, up to
16 rows). `pack` re-lays the weight out once so that each thread loads, as two 16-byte words per
128-wide K tile, exactly the codes of its own wgmma A fragments, bit-arranged so that a fragment
register is a mask and at most a rotate away:

- rows in slabs of 16, one slab per warp (a program's W warps cover 16 * W rows, a warpgroup
  64); the lane l = 4g + c of a slab holds rows g and g + 8 at K offsets 16j + 2c + {0, 1} and
  16j + 8 + 2c + {0, 1} of each 16-wide chunk j (the wgmma A fragment of bf16/f16);
- per K tile of 128 (8 chunks, in two groups G of 4) and per (k half kh, row half rs) one 32-bit
  word: the low 16 bits hold the even-K codes, the high 16 bits the odd-K codes, of chunks
  4G + t, t = 0..3, at the bit positions of `CODE_BITS`. A bf16 value E2M1 * 2^-126 has the
  code's sign at bit 15 and its three magnitude bits at bits 8..6 (exponent 0 is bf16's
  subnormal range, mirroring E2M1's); chunk t = 0 is stored there, t = 1 and 2 at those
  positions rotated right by 3 and 6, and t = 3 in the four bits left over. Decoding a word's
  four fragment registers takes 11 logic instructions (`decode_asm`).
- block scales as 16-bit floats of the activation dtype, float(scale) * 2^119 (bf16) or
  float(scale) * 2^7 (fp16), exact for every E4M3 byte, [slab, K tile, g, G, rs, t % 2, t // 2]:
  each fragment register is multiplied by its row's scale (one paired multiply), giving
  E2M1 * scale * 2^-7 exactly; the epilogue multiplies by the global scale times 2^7.

The weights the matrix units see are thus W.dequantize()'s fp32 values up to one rounding, as in
`w4a16_gemm`'s mma kernel; packed bytes: 0.5625 per weight, as in the checkpoint layout. Split-K
partials are summed in a fixed order in the same launch (`mma.store_unscaled`). In Triton's
interpreter the decoding runs as Triton arithmetic on the same words (`_decode_emulated`), so CPU
tests cover the layout, loads, masks and epilogue. Measured times: benchmarks/README.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

from . import backend, launch
from .backend import (Constants, cdiv, check_activations, check_backend, check_weight, interpreted, launch_cached,
                      launch_options, next_power_of_2)
from .mma import prefetch_l2, store_unscaled
from .tiles import activation_rows, split_counters

_WHAT = "kernels.packed_matmul"
SLAB = 16  # weight rows per warp
TILE_K = 128  # K per tile: 8 chunks of 16, two groups of 4
ACT_DTYPES = (torch.bfloat16, torch.float16)

# Where each code's bits sit in a word, per chunk t of the group: (sign, magnitude bit 2, 1, 0)
# in the low 16 bits (the even-K code; the odd-K code at the same positions + 16).
CODE_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (10, 14, 13, 11))
# Where a fragment register wants them: bf16 E2M1 * 2^-126, fp16 E2M1 * 2^-14.
TARGET_BITS = {"bf16": (15, 8, 7, 6), "f16": (15, 11, 10, 9)}
# The 16-bit scale's bias: A = (E2M1 * 2^-126) * (scale * 2^119) or (E2M1 * 2^-14) * (scale * 2^7).
SCALE_BIAS = {"bf16": 2.0 ** 119, "f16": 2.0 ** 7}


def decode_asm(kind: str) -> str:
    """The PTX that turns one word ($4) and its row's four scales ($5: chunks 0, 1; $6: chunks 2,
    3; 16-bit floats of `kind`) into the four fragment registers $0..$3 (chunks t = 0..3: the
    even-K value in the low half, the odd-K value in the high half).

    Per chunk the code bits that move by the same distance are shifted once and masked (the mask
    covers a bit in both halves: a bit and its twin 16 higher move together, and neither crosses
    into the other half), the groups or-ed together, then one paired multiply by the scale
    (`mov {l, l}` names the half twice; the assembler folds that into the multiply). The shifts
    are plain ones, not rotations: a left shift by a constant may run as an integer multiply,
    off the pipe the masks use."""
    target = TARGET_BITS[kind]
    lines = ["{", ".reg .b32 r, m, acc, s;", ".reg .b16 l, h;"]
    for t, src in enumerate(CODE_BITS):
        groups: dict[int, int] = {}
        for s_bit, d_bit in zip(src, target):
            groups[d_bit - s_bit] = groups.get(d_bit - s_bit, 0) | (1 << d_bit) | (1 << (d_bit + 16))
        first = True
        for shift, mask in sorted(groups.items()):
            src_reg = "$4"
            if shift:
                lines.append(f"shl.b32 r, $4, {shift};" if shift > 0 else f"shr.u32 r, $4, {-shift};")
                src_reg = "r"
            if first:
                lines.append(f"and.b32 acc, {src_reg}, {mask:#010x};")
                first = False
            else:
                lines += [f"and.b32 m, {src_reg}, {mask:#010x};", "or.b32 acc, acc, m;"]
        lines.append(f"mov.b32 ${t}, acc;")
    for t in range(4):
        lines += [f"mov.b32 {{l, h}}, ${5 + t // 2};", f"mov.b32 s, {{{'l, l' if t % 2 == 0 else 'h, h'}}};",
                  f"mul.rn.{kind}x2 ${t}, ${t}, s;"]
    lines.append("}")
    return "\n".join(lines)


_DECODE_BF16 = tl.constexpr(decode_asm("bf16"))
_CODE_BITS = tl.constexpr(CODE_BITS)
_DECODE_F16 = tl.constexpr(decode_asm("f16"))


@dataclass(frozen=True)
class PackedNVFP4:
    """An NVFP4 weight [N, K] re-laid out for `packed_matmul` (`pack` makes it, `unpack` inverts).

    words:        int16 [N16, KT, 32, 16]   N16 = ceil(N / 16) slabs, KT = ceil(K / 128) tiles;
                  per lane 16 halves [G, kh, rs, half] (see the module docstring)
    scales:       bf16 / fp16 [N16, KT, 8, 16]  per slab, tile and lane row g: [G, rs, t % 2, t // 2]
    global_scale: float32 0-d, the checkpoint's weight_scale_2
    n, k:         the weight's shape (rows past N and columns past K are zero padding)
    """

    words: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    n: int
    k: int

    def __post_init__(self) -> None:
        n16, kt = cdiv(self.n, SLAB), cdiv(self.k, TILE_K)
        if self.words.dtype != torch.int16 or tuple(self.words.shape) != (n16, kt, 32, 16):
            raise FormatError(f"PackedNVFP4.words must be int16 {(n16, kt, 32, 16)}, got "
                              f"{self.words.dtype} {tuple(self.words.shape)}")
        if self.scales.dtype not in ACT_DTYPES or tuple(self.scales.shape) != (n16, kt, 8, 16):
            raise FormatError(f"PackedNVFP4.scales must be bf16/fp16 {(n16, kt, 8, 16)}, got "
                              f"{self.scales.dtype} {tuple(self.scales.shape)}")
        if self.global_scale.dtype != torch.float32 or self.global_scale.dim() != 0:
            raise FormatError("PackedNVFP4.global_scale must be a 0-d float32 tensor")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the scales (and so the kernel's weight values) are in."""
        return self.scales.dtype

    def unpack(self) -> nvfp4.NVFP4Tensor:
        """The checkpoint layout back, byte for byte (a NaN block scale comes back as a NaN byte,
        not necessarily the same one)."""
        return unpack(self)


def _code_layout(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N16 * 16, KT * 128] -> [N16, KT, g, c, G, kh, rs, t, h] (h: even/odd K)."""
    n16, kt = codes.shape[0] // SLAB, codes.shape[1] // TILE_K
    c = codes.reshape(n16, 2, 8, kt, 2, 4, 2, 4, 2)  # [s, rs, g, kt, G, t, kh, c, h]
    return c.permute(0, 3, 2, 7, 4, 6, 1, 5, 8)


def pack(w: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> PackedNVFP4:
    """Re-lay a 2-D NVFP4 weight out for `packed_matmul` with `dtype` activations (bf16 / fp16),
    on its own device (exact: torch integer ops and exact float products)."""
    check_weight(w, "kernels.pack")
    if dtype not in ACT_DTYPES:
        raise ValueError(f"kernels.pack: dtype must be one of {ACT_DTYPES}, got {dtype}")
    n, k = w.shape
    n16, kt = cdiv(n, SLAB), cdiv(k, TILE_K)
    codes = torch.zeros((n16 * SLAB, kt * TILE_K), dtype=torch.uint8, device=w.packed.device)
    codes[:n, :k] = w.codes()
    c = _code_layout(codes).to(torch.int32)  # [s, kt, g, c, G, kh, rs, t, h]
    word = torch.zeros(c.shape[:-2] + (2,), dtype=torch.int32, device=c.device)  # [..., h]
    for t, bits in enumerate(CODE_BITS):
        code = c[..., t, :]
        for b, pos in zip((3, 2, 1, 0), bits):
            word |= ((code >> b) & 1) << pos
    word = word.reshape(n16, kt, 32, 16)
    words = (word - ((word & 0x8000) << 1)).to(torch.int16)  # the 16-bit patterns as int16
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    sc = torch.zeros((n16 * SLAB, kt * (TILE_K // 16)), dtype=torch.float32, device=w.packed.device)
    sc[:n, : k // 16] = w.block_scale.float() * SCALE_BIAS[kind]  # exact: a power of two, in range
    sc = sc.reshape(n16, 2, 8, kt, 2, 2, 2).permute(0, 3, 2, 4, 1, 6, 5)  # [s, kt, g, G, rs, t % 2, t // 2]
    scales = sc.reshape(n16, kt, 8, 16).to(dtype)
    return PackedNVFP4(words.contiguous(), scales.contiguous(), w.global_scale.reshape(()).clone(), n, k)


def unpack(p: PackedNVFP4) -> nvfp4.NVFP4Tensor:
    """`pack`'s inverse: the checkpoint layout (packed codes, E4M3 block scales, global scale)."""
    n16, kt = p.words.shape[:2]
    word = p.words.to(torch.int32) & 0xFFFF  # [s, kt, lane, 16]: [G, kh, rs, h]
    word = word.reshape(n16, kt, 8, 4, 2, 2, 2, 2)  # [s, kt, g, c, G, kh, rs, h]
    codes = torch.zeros(word.shape[:-1] + (4, 2), dtype=torch.int32, device=word.device)  # [..., t, h]
    for t, bits in enumerate(CODE_BITS):
        for b, pos in zip((3, 2, 1, 0), bits):
            codes[..., t, :] |= ((word >> pos) & 1) << b
    # [s, kt, g, c, G, kh, rs, t, h] -> [s, rs, g, kt, G, t, kh, c, h]
    codes = codes.permute(0, 6, 2, 1, 4, 7, 5, 3, 8).reshape(n16 * SLAB, kt * TILE_K)[: p.n, : p.k]
    kind = "bf16" if p.dtype == torch.bfloat16 else "f16"
    sc = p.scales.float().reshape(n16, kt, 8, 2, 2, 2, 2).permute(0, 4, 2, 1, 3, 6, 5)  # [s, rs, g, kt, G, t]
    sc = (sc.reshape(n16 * SLAB, kt * (TILE_K // 16)) / SCALE_BIAS[kind])[: p.n, : p.k // 16]
    packed = nvfp4.pack_nibbles(codes.to(torch.uint8))
    return nvfp4.NVFP4Tensor(packed, sc.to(torch.float8_e4m3fn), p.global_scale.clone())


@triton.jit
def _decode_emulated(word, s0, s1, s2, s3, F16: tl.constexpr):
    """`decode_asm` in Triton arithmetic (Triton's interpreter): each int16 half of a word
    (word: [..., h] int16, h = even/odd K) -> the four chunks' values E2M1 * scale * 2^-7, with
    s0..s3 the chunks' scales (16-bit floats, the same shape)."""
    w = word.to(tl.int32) & 0xFFFF
    outs = []
    for t in tl.static_range(4):
        sign, m2, m1, m0 = _CODE_BITS[t]
        mag = ((w >> m2) & 1) * 4 + ((w >> m1) & 1) * 2 + ((w >> m0) & 1)
        if F16:
            bits = (((w >> sign) & 1) << 15) | (mag << 9)  # E2M1 * 2^-14 as fp16 bits
            v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            bits = (((w >> sign) & 1) << 31) | (mag << 22)  # E2M1 * 2^-126 as fp32 (= bf16) bits
            v = bits.to(tl.float32, bitcast=True)
        outs.append(v)
    return (outs[0] * s0.to(tl.float32), outs[1] * s1.to(tl.float32), outs[2] * s2.to(tl.float32),
            outs[3] * s3.to(tl.float32))


@triton.jit
def _group_load(w_ptr, s_ptr, woff, soff, W: tl.constexpr):
    """One group's words [W, g, c, kh, rs, h] and scales [W, g, c, -, rs, t % 2, t // 2], as loaded.

    woff / soff: [32 * W, 8] offsets, thread 32 w + 4 g + c: its 8 halves of the group's words
    ([kh, rs, h]) and its row pair's 8 scales ([rs, t % 2, t // 2]; the lanes c of a row read the
    same ones). One 16-byte vector per thread each, laid out as the fragments want them."""
    words = tl.reshape(tl.load(w_ptr + woff), (W, 8, 4, 2, 2, 2))
    sc = tl.reshape(tl.load(s_ptr + soff), (W, 8, 4, 1, 2, 2, 2))
    return words, sc


@triton.jit
def _group(words, sc, W: tl.constexpr, F16: tl.constexpr, EMULATE: tl.constexpr):
    """The values of one group's four chunks t, [W, g, c, kh, rs, h, t % 2, t // 2] in the
    activation dtype: those of row 16 w + 8 rs + g at K 16 t + 8 kh + 2 c + h of the group
    (words, sc: `_group_load`'s)."""
    s01, s23 = tl.split(sc)  # [w, g, c, -, rs, t % 2]
    if EMULATE:
        s0, s1 = tl.split(s01)
        s2, s3 = tl.split(s23)
        shape: tl.constexpr = (W, 8, 4, 2, 2, 2)
        o0, o1, o2, o3 = _decode_emulated(words, tl.broadcast_to(s0[:, :, :, :, :, None], shape),
                                          tl.broadcast_to(s1[:, :, :, :, :, None], shape),
                                          tl.broadcast_to(s2[:, :, :, :, :, None], shape),
                                          tl.broadcast_to(s3[:, :, :, :, :, None], shape), F16)
        if F16:
            o0, o1, o2, o3 = o0.to(tl.float16), o1.to(tl.float16), o2.to(tl.float16), o3.to(tl.float16)
        else:
            o0, o1, o2, o3 = o0.to(tl.bfloat16), o1.to(tl.bfloat16), o2.to(tl.bfloat16), o3.to(tl.bfloat16)
    else:
        s01 = tl.broadcast_to(s01, (W, 8, 4, 2, 2, 2))
        s23 = tl.broadcast_to(s23, (W, 8, 4, 2, 2, 2))
        if F16:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(_DECODE_F16, "=r,=r,=r,=r,r,r,r", [words, s01, s23],
                                                       dtype=(tl.float16,) * 4, is_pure=True, pack=2)
        else:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(_DECODE_BF16, "=r,=r,=r,=r,r,r,r", [words, s01, s23],
                                                       dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
    return tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [w, g, c, kh, rs, h, t % 2, t // 2]


@triton.jit
def _line_offsets(pid_n, N16, KT, W: tl.constexpr):
    """Per thread ([32 * W]), the first word and scale offsets of its 32 bytes of words and 16 of
    scales at K tile 0 (+ 512 kt and + 128 kt): what `_prefetch_tile` asks L2 for."""
    t = tl.arange(0, 32 * W)
    slab = tl.minimum(pid_n * W + t // 32, N16 - 1).to(tl.int64) * KT
    return (slab * 32 + t % 32) * 16, (slab * 8 + (t % 32) // 4) * 16


@triton.jit
def _offsets(pid_n, N16, KT, W: tl.constexpr):
    """`_group_load`'s word and scale offsets at K tile 0, group 0 (+ 512 kt + 8 G and 128 kt + 8 G):
    each thread's `_line_offsets` and the 8 halves after them."""
    wline, sline = _line_offsets(pid_n, N16, KT, W)
    e = tl.arange(0, 8)[None, :]
    return wline[:, None] + e, sline[:, None] + e


@triton.jit
def _prefetch_tile(w_ptr, s_ptr, poff, psoff, kt, kt1):
    """L2 prefetch of K tile kt's words and scales where kt < kt1: no registers written, so the
    wgmma fences do not wait for it, unlike a load issued ahead into registers."""
    ahead = (tl.arange(0, poff.shape[0]) * 0 + kt) < kt1
    prefetch_l2(w_ptr + poff + kt * 512, ahead)
    prefetch_l2(s_ptr + psoff + kt * 128, ahead)


@triton.jit
def _tile_load(w_ptr, s_ptr, woff, soff, W: tl.constexpr):
    """A K tile's words and scales (both groups), as loaded: `_tile_decode`'s input."""
    w0, s0 = _group_load(w_ptr, s_ptr, woff, soff, W)
    w1, s1 = _group_load(w_ptr, s_ptr, woff + 8, soff + 8, W)
    return w0, s0, w1, s1


@triton.jit
def _tile_decode(w0, s0, w1, s1, W: tl.constexpr, F16: tl.constexpr, EMULATE: tl.constexpr):
    """A K tile's weights as the matrix units' A operand, [16 * W, 128]. The chunk and group
    axes are joined in as the lowest register axes, so the tile's eight K-16 slices keep every
    fragment register whole (no data moves between the decoding and the wgmma)."""
    q = tl.join(_group(w0, s0, W, F16, EMULATE), _group(w1, s1, W, F16, EMULATE))  # [.., h, t % 2, t // 2, G]
    q = tl.permute(q, (0, 4, 1, 8, 7, 6, 3, 2, 5))  # [w, rs, g, G, t // 2, t % 2, kh, c, h]
    return tl.reshape(q, (16 * W, 128))


@triton.jit
def _x_load(x_ptr, xoff, xmask, k0, K, EVEN_K: tl.constexpr):
    """x[rows, k0:k0 + 128]^T, [128, BLOCK_M] (zero where xmask is false or past K)."""
    if EVEN_K:
        return tl.load(x_ptr + xoff + k0, mask=xmask, other=0.0)
    kk = k0 + tl.arange(0, 128)[:, None]
    return tl.load(x_ptr + xoff + k0, mask=xmask & (kk < K), other=0.0)


@triton.jit
def _x_tile(x_ptr, x_desc, xoff, xmask, row0, kt, K, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """K tile kt of the activations, transposed ([128, BLOCK_M]): by TMA from rows row0 on (zeros
    past M and K), or `_x_load` (zeros where xmask is false or past K)."""
    if TMA:
        return tl.trans(x_desc.load([row0, kt * 128]))
    return _x_load(x_ptr, xoff, xmask, kt * 128, K, EVEN_K)


@triton.jit
def _dot(acc, a, xt, EMULATE: tl.constexpr):
    """acc += a [BN, 128] @ xt [128, BLOCK_M]."""
    if EMULATE:  # exact products, fp32 sums: the interpreter's 16-bit dot would round them
        return tl.dot(a.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, xt, acc)


@triton.jit
def _packed_kernel(x_ptr, x_desc, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, N16, KT, stride_xm,
                   kt_per_split, BLOCK_M: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr, UNROLL: tl.constexpr,
                   PREFETCH: tl.constexpr, F16: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr,
                   TMA: tl.constexpr):
    """out[M, N] = x @ W^T for W a `PackedNVFP4`; grid: (N16 / W programs of W slabs, M / BLOCK_M,
    SPLIT). acc [16 * W, BLOCK_M] = W_tile @ x_tile^T in fp32, per K tile one dot (eight wgmma of
    K 16, issued back to back) with the weight from registers and x from shared memory.
    Slabs past N16 read the last one (their rows are not stored); rows past M read as zero."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    woff, soff = _offsets(pid_n, N16, KT, W)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    xoff = m[None, :].to(tl.int64) * stride_xm + tl.arange(0, 128)[:, None]  # [128, BLOCK_M]
    xmask = (m < M)[None, :]
    kt0 = pid_s * kt_per_split
    kt1 = tl.minimum(kt0 + kt_per_split, KT)
    acc = tl.zeros((16 * W, BLOCK_M), dtype=tl.float32)
    poff, psoff = _line_offsets(pid_n, N16, KT, W)
    if PREFETCH > 0 and not EMULATE:  # the tiles the loop's prefetches (PREFETCH ahead) do not cover
        for j in tl.static_range(UNROLL, PREFETCH):
            _prefetch_tile(w_ptr, s_ptr, poff, psoff, kt0 + j, kt1)
    for kt in range(kt0, kt1, UNROLL):  # software-pipelined only with num_stages > 1 (see `config`)
        if PREFETCH > 0 and not EMULATE:
            for j in tl.static_range(UNROLL):
                _prefetch_tile(w_ptr, s_ptr, poff, psoff, kt + PREFETCH + j, kt1)
        if UNROLL == 1:
            w0, s0, w1, s1 = _tile_load(w_ptr, s_ptr, woff + kt * 512, soff + kt * 128, W)
            xt = _x_tile(x_ptr, x_desc, xoff, xmask, pid_m * BLOCK_M, kt, K, EVEN_K, TMA)
            acc = _dot(acc, _tile_decode(w0, s0, w1, s1, W, F16, EMULATE), xt, EMULATE)
        else:
            # Both tiles' loads are issued before the first is decoded, so that their latencies
            # overlap (written in this order: with the first tile's loads and x shared with the
            # branch above, the sm_90 assembler places the second tile's weight loads after the
            # first tile's decoding). Past kt1 the second tile is the first again with zero
            # activations: its products are zeros (a NaN scale makes NaNs, as the first tile's
            # own products do).
            kb = tl.minimum(kt + 1, kt1 - 1)
            w0, s0, w1, s1 = _tile_load(w_ptr, s_ptr, woff + kt * 512, soff + kt * 128, W)
            w2, s2, w3, s3 = _tile_load(w_ptr, s_ptr, woff + kb * 512, soff + kb * 128, W)
            kx = kb
            if TMA:  # past kt1 TMA reads the second tile's activations past K: zeros
                kx = tl.where(kt + 1 < kt1, kb, KT)
            xt = _x_tile(x_ptr, x_desc, xoff, xmask, pid_m * BLOCK_M, kt, K, EVEN_K, TMA)
            xb = _x_tile(x_ptr, x_desc, xoff, (m < tl.where(kt + 1 < kt1, M, 0))[None, :], pid_m * BLOCK_M, kx, K,
                         EVEN_K, TMA)
            acc = _dot(acc, _tile_decode(w0, s0, w1, s1, W, F16, EMULATE), xt, EMULATE)
            acc = _dot(acc, _tile_decode(w2, s2, w3, s3, W, F16, EMULATE), xb, EMULATE)
    n = pid_n * (16 * W) + tl.arange(0, 16 * W)
    store_unscaled(acc, gs_ptr, out_ptr, part_ptr, cnt_ptr, m[None, :], n[:, None], M, N, pid_m, pid_n, pid_s, SPLIT)


@triton.jit
def _unpacked_kernel(w_ptr, s_ptr, out_ptr, N16, KT, W: tl.constexpr, F16: tl.constexpr, EMULATE: tl.constexpr):
    """The A tiles `_packed_kernel` multiplies, written out: out [N16 * 16, KT * 128] of E2M1 * scale
    * 2^-7 in the activation dtype (grid: N16 / W, KT). For tests of the in-register decoding."""
    pid_n = tl.program_id(0)
    kt = tl.program_id(1)
    woff, soff = _offsets(pid_n, N16, KT, W)
    w0, s0, w1, s1 = _tile_load(w_ptr, s_ptr, woff + kt * 512, soff + kt * 128, W)
    rows = pid_n * (16 * W) + tl.arange(0, 16 * W)[:, None]
    cols = kt * 128 + tl.arange(0, 128)[None, :]
    tl.store(out_ptr + rows.to(tl.int64) * (KT * 128) + cols, _tile_decode(w0, s0, w1, s1, W, F16, EMULATE))


def fragments(p: PackedNVFP4, *, warps: int = 4) -> torch.Tensor:
    """The weight values the kernel's matrix units see, [N16 * 16, KT * 128] in p.dtype:
    E2M1 * scale * 2^-7 (zero in the padding), decoded by the kernel's own code path."""
    n16, kt = p.words.shape[:2]
    if n16 % warps:
        raise ValueError(f"kernels.fragments: {n16} slabs do not split into programs of {warps}")
    out = torch.empty((n16 * SLAB, kt * TILE_K), dtype=p.dtype, device=p.words.device)
    _unpacked_kernel[(n16 // warps, kt)](p.words, p.scales, out, n16, kt, W=warps, F16=p.dtype == torch.float16,
                                        EMULATE=interpreted(_unpacked_kernel), num_warps=warps,
                                        **launch_options())
    return out


# The launch table ("packed"): PACKED[row class][weight size], row class `row_class(M)` and size
# "large" for weights of LARGE_WEIGHTS elements or more, else "small". Per entry: activation rows
# per program (BLOCK_M, at most the class), warps per program (16 weight rows each; 4 = one
# warpgroup), the split-K target (programs per multiprocessor), K tiles per loop step (UNROLL: with
# 2 both tiles' loads are issued before the first is decoded, two latencies in one wait), and
# PREFETCH, the L2 prefetch distance in K tiles (0 or absent: none; a prefetch writes no register,
# so the wgmma fences do not wait for it). The loop is not software-pipelined by default
# (num_stages 1): Triton's pipeliner gives each K-16 slice of the dot its own wgmma fence,
# interleaved with the next slice's decoding, where unpipelined a K tile's eight wgmma issue back
# to back. `num_stages` 2-4 and `TMA` (the activation tile read by the tensor-memory accelerator)
# are launch keys, byte-identical in output (tests/gpu), measured slower where it matters.
LAUNCH_KEYS = ("BLOCK_M", "num_warps", "programs_per_sm", "SPLIT", "UNROLL", "PREFETCH", "TMA", "num_stages")


def tma_ready(x2: torch.Tensor) -> bool:
    """Whether the activations [M, K] can be read by the tensor-memory accelerator: rows of
    contiguous elements, the base and the row stride multiples of 16 bytes."""
    size = x2.element_size()
    return x2.stride(1) == 1 and x2.data_ptr() % 16 == 0 and (x2.stride(0) * size) % 16 == 0


def row_class(m: int) -> int:
    """M rounded up to a power of two, 16 to 128 (the key of the launch table's PACKED)."""
    return min(max(16, next_power_of_2(m)), 128)


def config(m: int, n: int, k: int, device: torch.device, cfg: dict | None = None,
           tables: Mapping | None = None) -> dict:
    """Launch shape and split-K for one problem: the launch table's PACKED entry (`tables`,
    default the device's "packed" table), overridden by cfg (any of LAUNCH_KEYS). By rule; no
    autotuning at call time."""
    unknown = set(cfg or {}) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    t = launch.table("packed", device) if tables is None else tables
    c = dict(t["PACKED"][str(row_class(m))]["large" if n * k >= t["LARGE_WEIGHTS"] else "small"])
    c.update(cfg or {})
    w, bm, unroll, ahead = c["num_warps"], c["BLOCK_M"], c.get("UNROLL", 1), c.get("PREFETCH", 0)
    stages = c.get("num_stages", 1)
    if (bm not in (16, 32, 64, 128, 256) or w not in (4, 8) or unroll not in (1, 2) or ahead not in range(17)
            or stages not in (1, 2, 3, 4)):
        raise ValueError(f"{_WHAT}: BLOCK_M must be a power of two from 16 to 256, num_warps 4 or 8, "
                         f"UNROLL 1 or 2, PREFETCH 0 to 16 and num_stages 1 to 4, got BLOCK_M={bm}, num_warps={w}, "
                         f"UNROLL={unroll}, PREFETCH={ahead}, num_stages={stages}")
    kt = cdiv(k, TILE_K)
    tiles = cdiv(cdiv(n, SLAB), w) * cdiv(m, bm)
    split = c.get("SPLIT") or max(1, min(kt, backend.sm_count(device) * c["programs_per_sm"] // tiles))
    per = cdiv(kt, split)
    return {"num_warps": w, "BLOCK_M": bm, "SPLIT": cdiv(kt, per), "kt_per_split": per, "UNROLL": unroll,
            "PREFETCH": ahead, "TMA": bool(c.get("TMA", False)), "num_stages": stages}


def packed_matmul(x: torch.Tensor, w: PackedNVFP4, *, backend: str = "triton", cfg: dict | None = None,
                  tables: Mapping | None = None):
    """y = x @ W.unpack().dequantize(x.dtype)^T, fp32 accumulation, output in x's dtype.

    x: [..., K] bf16 / fp16 (the dtype `w` was packed for); w: a `PackedNVFP4` (`pack`).
    backend: "triton" (`_packed_kernel`) or "torch" (the checkpoint layout back, dequantized,
    then torch's matmul). cfg: launch-shape overrides (any of LAUNCH_KEYS). tables: the launch
    table (default: the device's, `launch.table("packed", x.device)`). The modules call
    `packed_linear.packed_linear`, which hands some rows to `packed_ws` instead."""
    if not isinstance(w, PackedNVFP4):
        raise TypeError(f"{_WHAT}: w must be a PackedNVFP4 (kernels.packed_gemm.pack), got {type(w).__name__}")
    n, k = w.shape
    check_activations(x, k, _WHAT)
    if x.dtype != w.dtype:
        raise ValueError(f"{_WHAT}: activations are {x.dtype} but the weight was packed for {w.dtype} "
                         f"(pack(w, dtype={x.dtype}))")
    check_backend(backend, _packed_kernel, x, w.words, w.scales, w.global_scale, what=_WHAT)
    if backend == "torch":
        return torch.nn.functional.linear(x, w.unpack().dequantize(x.dtype))
    lead, x2, out = activation_rows(x, k, n)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    if cfg is None and tables is None:
        grid, split, kt_per_split, consts = _default_plan(m, n, k, x.device, x.dtype)  # once per problem shape
    else:
        grid, split, kt_per_split, consts = _plan(m, n, k, x.device, x.dtype, cfg, tables)
    part, counters = out, out  # unused unless split
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
    tma = consts[True] is not None and tma_ready(x2)
    x_desc = TensorDescriptor.from_tensor(x2, [consts[True]["BLOCK_M"], TILE_K]) if tma else x2
    launch_cached(_packed_kernel, grid, x2, x_desc, w.words, w.scales, w.global_scale, out, part, counters, m, n, k,
                  *w.words.shape[:2], x2.stride(0), kt_per_split, constants=consts[tma])
    return out.reshape(*lead, n)


def _plan(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype, cfg: dict | None,
          tables: Mapping | None) -> tuple:
    """One problem's launch: (grid, SPLIT, K tiles per split, {tma: the kernel's `Constants`}),
    the TMA entry None where the launch shape or the interpreter rules the TMA read out (whether
    it is used also depends on the activations' alignment, `tma_ready`)."""
    c = config(m, n, k, device, cfg, tables)
    grid = (cdiv(cdiv(n, SLAB), c["num_warps"]), cdiv(m, c["BLOCK_M"]), c["SPLIT"])
    emulate = interpreted(_packed_kernel)
    fixed = dict(BLOCK_M=c["BLOCK_M"], W=c["num_warps"], SPLIT=c["SPLIT"], UNROLL=c["UNROLL"], PREFETCH=c["PREFETCH"],
                 F16=dtype == torch.float16, EVEN_K=k % TILE_K == 0, EMULATE=emulate, num_warps=c["num_warps"],
                 num_stages=c["num_stages"], **launch_options())
    consts = {False: Constants(TMA=False, **fixed), True: None}
    if c["TMA"] and not emulate:
        consts[True] = Constants(TMA=True, **fixed)
    return grid, c["SPLIT"], c["kt_per_split"], consts


@functools.lru_cache(maxsize=4096)
def _default_plan(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """`_plan` under the device's own launch table (frozen for the process), kept per shape."""
    return _plan(m, n, k, device, dtype, None, None)
