"""W4A16 GEMM on a pre-packed NVFP4 weight: y = x @ dequant(W)^T, the weight decoded in registers
straight into the matrix units' A operand (wgmma with A from registers).

Reference: `PackedNVFP4.unpack()` (the checkpoint layout back, byte for byte), then
`NVFP4Tensor.dequantize` and a matmul (backend="torch").

The checkpoint layout (`w4a16_gemm`) makes a kernel either pay for a trip of every decoded
weight tile through shared memory (the wgmma kernel there) or keep the activations in registers
too (the mma.sync kernel there, which tops out at 16 rows). `pack` re-lays the weight out once
so that each thread loads, as two 16-byte words per 128-wide K tile, exactly the codes of its own
wgmma A fragments, bit-arranged so that a fragment register is a mask and at most a rotate away:

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
  float(scale) * 2^7 (fp16), exact for every E4M3 byte, [slab, K tile, g, G, rs, t % 2, t // 2]: each
  fragment register is multiplied by its row's scale (one paired multiply, the scale's half
  broadcast by the multiply itself), giving E2M1 * scale * 2^-7 exactly (at most 6 significant
  bits, at least 2^-17: a bf16 normal, an fp16 subnormal, which the matrix units take as it is);
  the epilogue multiplies by the global scale times 2^7.

The weights the matrix units see are thus E2M1 * scale * 2^-7 exactly, W.dequantize()'s fp32
values up to one rounding, as in `w4a16_gemm`'s mma kernel; the sums are the matrix units'
fp32 accumulation. Packed bytes: 0.5 per weight for the codes and 0.125 for the scales (0.5625
in the checkpoint layout).

Split-K spreads the K tiles over programs where N / (16 * W) * M / BLOCK_M alone is too few;
the partials are fp32 and summed in a fixed order in the same launch (`w4a16_gemm._store_split`,
through the mma kernel's epilogue `_store_unscaled`).
In Triton's interpreter the same kernel runs with the decoding done by Triton arithmetic on the
same words (`_decode_emulated`), so CPU CI covers the layout, loads, masks and epilogue.

Measured on an H200 (scripts/bench_packed.py: benchmarks/results/packed-gemm-h200.json, CUDA
graphs, side by side with torch.matmul on the bf16 weight and `w4a16_matmul` on the checkpoint
layout): 16 rows 1.96x bf16 on 8192 x 8192 (17.1 us; 1.54x on the checkpoint layout), 1.93x on
28672 x 8192, 1.28x and 1.27x on the Nano shapes (0.92x and 0.94x), 2.24x on 131072 x 2688; 64
rows 1.23x, 1.38x, 0.71x and 0.86x, 1.55x (0.52-0.94x). One row: 1.43-2.50x, where the checkpoint
layout's GEMV is faster except on 131072 x 2688 (2.50x against 2.20x). That run's split-K
times include a clearing of the tile counters per launch, which CUDA graphs now pay once per
replay (`split_counters`): about 1 us less per split launch in the runs since (3712 x 2688:
6.0-6.2 against 6.9 us at 16 rows, 9.0-9.1 against 9.8 at 64; 1.25x and 0.72x bf16 in
kernels-h200.json). From 256
rows the kernel is matrix-unit bound at 0.41-0.61x bf16: `w4a16_matmul` (dequantize once, then torch.matmul) is the
faster path there. Two K tiles per loop step (UNROLL) pay on the large weights at up to 32 rows
(8192 x 8192, 16 rows: 17.8 against 19.3 us in the sweep). On the Nano shapes at 64 rows the
kernel is latency bound: under Nsight Compute (scripts/profile_kernels.py, kernels-pipes-h200.json,
3712 x 2688) issue is 28% busy, DRAM 12% and L2 38% of their peaks, 19% of the warp slots
occupied, and each instruction issued waits 4.3 cycles on global loads and 2.3 at barriers; two
tiles per step shorten the waits on loads but not each tile's chain of decoding, barrier and
wgmma (11.3 against 12.5 us without split-K, none at the picked split of 4). The loop spends
about 3 SASS instructions per weight and thread (1.9 of them
decoding, the rest the activation tile's loads and shared-memory stores and the addresses).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

from .backend import cdiv, check_backend, interpreted, launch_options, next_power_of_2
from .backend import sm_count as _sm_count
from .w4a16_gemm import _check_activations, _prefetch_l2, _store_unscaled, activation_rows, check_weight, split_counters

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

    Per chunk the code bits that move by the same rotation are rotated once and masked (the mask
    covers a bit in both halves), the groups or-ed together, then one paired multiply by the
    scale (`mov {l, l}` names the half twice; the assembler folds that into the multiply)."""
    target = TARGET_BITS[kind]
    lines = ["{", ".reg .b32 r, m, acc, s;", ".reg .b16 l, h;"]
    for t, src in enumerate(CODE_BITS):
        groups: dict[int, int] = {}
        for s_bit, d_bit in zip(src, target):
            rot = (d_bit - s_bit) % 32
            groups[rot] = groups.get(rot, 0) | (1 << d_bit) | (1 << (d_bit + 16))
        first = True
        for rot, mask in sorted(groups.items()):
            src_reg = "$4"
            if rot:
                lines.append(f"shf.l.wrap.b32 r, $4, $4, {rot};")
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
    _prefetch_l2(w_ptr + poff + kt * 512, ahead)
    _prefetch_l2(s_ptr + psoff + kt * 128, ahead)


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
    for kt in range(kt0, kt1, UNROLL):  # software-pipelined only with num_stages > 1: see PACKED
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
    _store_unscaled(acc, gs_ptr, out_ptr, part_ptr, cnt_ptr, m[None, :], n[:, None], M, N, pid_m, pid_n, pid_s, SPLIT)


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


# Launch shapes per row class (`row_class`: M rounded up to a power of two, 16 to 128) and weight
# size (LARGE_WEIGHTS elements or more): activation rows per program (BLOCK_M, at most the class),
# warps per program (16 weight rows each; 4 = one warpgroup), and the split-K target (programs
# per multiprocessor the K split aims for), and K tiles per loop step (UNROLL: with 2, both
# tiles' loads are issued before the first is decoded, for two loads' latencies in one wait), and
# PREFETCH: the L2 prefetch distance in K tiles (0: none; an entry without it has none). A
# prefetch writes no register, so the wgmma fences do not wait for it as they wait for loads
# issued ahead into registers; tests/gpu check that it changes no output byte.
# The loop is not software-pipelined by default (num_stages 1): Triton's pipeliner copies the
# next tile's words to shared memory ahead, but gives each K-16 slice of the dot its own wgmma
# fence, interleaved with the next slice's decoding; unpipelined, a K tile's eight wgmma are
# issued back to back. `num_stages` 2-4 and `TMA` (the activation tile read by the tensor-memory
# accelerator straight into shared memory, in place of loads into registers and a store) are
# launch keys, byte-identical in output (tests/gpu), and measured slower where it matters
# (scripts/bench_packed.py --pipeline, benchmarks/results/packed-gemm-pipeline-h200.json, best
# over BLOCK_M and split for each): 3712 x 2688 at 64 rows 9.8-12.7 us against 9.3 unpipelined,
# at 16 rows 7.8-8.3 against 6.0 (2688 x 3712 alike); 8192 x 8192 at 16 rows 24.4-25.8 against
# 18.1, at 64 rows 31.8 (3 stages with TMA) against 37.4, within that shape's spread across runs
# (PACKED's own entry: 30.3 in kernels-h200.json). Launch shapes picked by `sweep` / `pick`
# (scripts/bench_packed.py). Swept again on the two Nano shapes once split-K launches stopped
# clearing their counters each time, with up to 8 programs per multiprocessor (bench_packed.py
# --shapes 3712x2688,2688x3712: benchmarks/results/packed-gemm-nano-h200.json): more split-K
# does not help there, and no launch shape is clearly faster than the entries below: at 64 rows
# the best took 9.1 and 9.2 us, the entries 9.1 and 9.7 in that sweep and 9.0 and 9.2 in
# kernels-h200.json's bench; at 16 rows 5.9 against 6.1 and 5.9. So the entries stay.
LARGE_WEIGHTS = 8192 * 8192
PACKED = {
    "16": {"small": {"BLOCK_M": 16, "num_warps": 4, "programs_per_sm": 2, "UNROLL": 1},
           "large": {"BLOCK_M": 16, "num_warps": 4, "programs_per_sm": 4, "UNROLL": 2}},
    "32": {"small": {"BLOCK_M": 16, "num_warps": 4, "programs_per_sm": 4, "UNROLL": 1},
           "large": {"BLOCK_M": 32, "num_warps": 8, "programs_per_sm": 2, "UNROLL": 2}},
    "64": {"small": {"BLOCK_M": 32, "num_warps": 4, "programs_per_sm": 4, "UNROLL": 1},
           "large": {"BLOCK_M": 64, "num_warps": 8, "programs_per_sm": 2, "UNROLL": 1}},
    "128": {"small": {"BLOCK_M": 128, "num_warps": 8, "programs_per_sm": 1, "UNROLL": 1},
            "large": {"BLOCK_M": 128, "num_warps": 8, "programs_per_sm": 1, "UNROLL": 1}},
}
LAUNCH_KEYS = ("BLOCK_M", "num_warps", "programs_per_sm", "SPLIT", "UNROLL", "PREFETCH", "TMA", "num_stages")


def tma_ready(x2: torch.Tensor) -> bool:
    """Whether the activations [M, K] can be read by the tensor-memory accelerator: rows of
    contiguous elements, the base and the row stride multiples of 16 bytes."""
    size = x2.element_size()
    return x2.stride(1) == 1 and x2.data_ptr() % 16 == 0 and (x2.stride(0) * size) % 16 == 0


def row_class(m: int) -> int:
    """M rounded up to a power of two, 16 to 128 (the key of `PACKED`)."""
    return min(max(16, next_power_of_2(m)), 128)


def config(m: int, n: int, k: int, device: torch.device, cfg: dict | None = None) -> dict:
    """Launch shape and split-K for one problem: `PACKED`'s entry, overridden by cfg (any of
    LAUNCH_KEYS). By rule; no autotuning at call time."""
    unknown = set(cfg or {}) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    c = dict(PACKED[str(row_class(m))]["large" if n * k >= LARGE_WEIGHTS else "small"])
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
    split = c.get("SPLIT") or max(1, min(kt, _sm_count(device) * c["programs_per_sm"] // tiles))
    per = cdiv(kt, split)
    return {"num_warps": w, "BLOCK_M": bm, "SPLIT": cdiv(kt, per), "kt_per_split": per, "UNROLL": unroll,
            "PREFETCH": ahead, "TMA": bool(c.get("TMA", False)), "num_stages": stages}


def packed_matmul(x: torch.Tensor, w: PackedNVFP4, *, backend: str = "triton", cfg: dict | None = None):
    """y = x @ W.unpack().dequantize(x.dtype)^T, fp32 accumulation, output in x's dtype.

    x: [..., K] bf16 / fp16 (the dtype `w` was packed for); w: a `PackedNVFP4` (`pack`).
    backend: "triton" (`_packed_kernel`) or "torch" (the checkpoint layout back, dequantized,
    then torch's matmul). cfg: launch-shape overrides (any of LAUNCH_KEYS)."""
    if not isinstance(w, PackedNVFP4):
        raise TypeError(f"{_WHAT}: w must be a PackedNVFP4 (kernels.packed_gemm.pack), got {type(w).__name__}")
    n, k = w.shape
    _check_activations(x, k, _WHAT)
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
    c = config(m, n, k, x.device, cfg)
    n16, kt = w.words.shape[:2]
    grid = (cdiv(n16, c["num_warps"]), cdiv(m, c["BLOCK_M"]), c["SPLIT"])
    part, counters = out, out  # unused unless split
    if c["SPLIT"] > 1:
        part = torch.empty((c["SPLIT"], m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
    emulate = interpreted(_packed_kernel)
    tma = c["TMA"] and not emulate and tma_ready(x2)
    x_desc = TensorDescriptor.from_tensor(x2, [c["BLOCK_M"], TILE_K]) if tma else x2
    _packed_kernel[grid](x2, x_desc, w.words, w.scales, w.global_scale, out, part, counters, m, n, k, n16, kt,
                         x2.stride(0), c["kt_per_split"], BLOCK_M=c["BLOCK_M"], W=c["num_warps"], SPLIT=c["SPLIT"],
                         UNROLL=c["UNROLL"], PREFETCH=c["PREFETCH"], F16=x.dtype == torch.float16, EVEN_K=k % TILE_K == 0,
                         EMULATE=emulate, TMA=tma, num_warps=c["num_warps"], num_stages=c["num_stages"],
                         **launch_options())
    return out.reshape(*lead, n)


def time_graph(fn) -> float:
    """Median ms of `fn` replayed from a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=30, return_mode="median")


SWEEP_SHAPES = ((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688))
SWEEP_PREFETCH = (0, 4)


def _sweep_problems(shapes, classes):
    """(N, K, M, BLOCK_M, packed weight, activations) for each shape (a random weight, quantized
    and packed once), each row class M and BLOCK_M the class or half of it (two row programs)."""
    from .quantize import quantize

    for n, k in shapes:
        w = pack(quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02))
        for m in classes:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            for bm in sorted({m, max(16, m // 2)}):
                yield n, k, m, bm, w, x
        del w


def _timed(n, k, m, x, w, cfg, **extra) -> dict:
    """A sweep row: the problem, the launch keys, the split they give, `extra`, the graph time."""
    split = config(m, n, k, x.device, cfg)["SPLIT"]
    return {"N": n, "K": k, "M": m, **cfg, "SPLIT": split, **extra,
            "ms": time_graph(lambda: packed_matmul(x, w, cfg=cfg))}


def sweep(shapes=SWEEP_SHAPES, classes=(16, 32, 64), warps=(4, 8), programs_per_sm=(1, 2, 4, 8), unroll=(1, 2),
          prefetch=SWEEP_PREFETCH) -> list:
    """CUDA-graph times of the launch shapes for each row class (M = the class) on each shape:
    BLOCK_M the class or half of it (two row programs), every warp count, split-K target, number
    of K tiles per loop step and L2 prefetch distance."""
    rows = []
    for n, k, m, bm, w, x in _sweep_problems(shapes, classes):
        for nw, pps, u, ahead in itertools.product(warps, programs_per_sm, unroll, prefetch):
            cfg = {"BLOCK_M": bm, "num_warps": nw, "programs_per_sm": pps, "UNROLL": u, "PREFETCH": ahead}
            rows.append(_timed(n, k, m, x, w, cfg))
    return rows


PIPELINE_SHAPES = ((3712, 2688), (2688, 3712), (8192, 8192))


def sweep_pipeline(shapes=PIPELINE_SHAPES, classes=(16, 64), programs_per_sm=(1, 2, 4), stages=(1, 2, 3),
                   tma=(False, True)) -> list:
    """CUDA-graph times of the software-pipelined loop (num_stages > 1: the next K tile's weights
    copied to shared memory while this one is decoded and multiplied) and of the activations read
    by the tensor-memory accelerator (TMA), against the unpipelined loop, 4 warps, one K tile per
    step, for each row class on each shape (BLOCK_M the class or half of it). Each row records
    whether its output equals the unpipelined pointer-load launch's byte for byte."""
    rows = []
    for n, k, m, bm, w, x in _sweep_problems(shapes, classes):
        for pps in programs_per_sm:
            base = {"BLOCK_M": bm, "num_warps": 4, "programs_per_sm": pps, "UNROLL": 1}
            want = packed_matmul(x, w, cfg=base)
            for st, t in itertools.product(stages, tma):
                cfg = {**base, "num_stages": st, "TMA": t}
                rows.append(_timed(n, k, m, x, w, cfg, equal=bool(torch.equal(packed_matmul(x, w, cfg=cfg), want))))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def pick(rows) -> dict:
    """Per row class and weight size, the launch shape with the smallest sum over the swept
    problems of its time over the problem's best (relative, so that large weights do not outvote
    the others). Classes and sizes the sweep did not cover keep their entry."""
    best = {}
    for r in rows:
        p = (r["N"], r["K"], r["M"])
        best[p] = min(best.get(p, float("inf")), r["ms"])
    totals: dict = {}
    for r in rows:
        size = "large" if r["N"] * r["K"] >= LARGE_WEIGHTS else "small"
        key = (str(row_class(r["M"])), size, r["BLOCK_M"], r["num_warps"], r["programs_per_sm"], r.get("UNROLL", 1),
               r.get("PREFETCH", 0))
        totals[key] = totals.get(key, 0.0) + r["ms"] / best[r["N"], r["K"], r["M"]]
    table = {cls: dict(entry) for cls, entry in PACKED.items()}
    for cls, size in {key[:2] for key in totals}:
        keys = [key for key in totals if key[:2] == (cls, size)]
        _, _, bm, nw, pps, u, ahead = min(keys, key=totals.get)
        table[cls] = dict(table[cls], **{size: {"BLOCK_M": bm, "num_warps": nw, "programs_per_sm": pps, "UNROLL": u,
                                                "PREFETCH": ahead}})
    return table


def bench(shapes=SWEEP_SHAPES, ms=(1, 4, 16, 64, 256, 1024)) -> list:
    """CUDA-graph times side by side: torch.matmul on the bf16 weight, `w4a16_matmul` on the
    checkpoint layout, and `packed_matmul` (with `PACKED`'s launch shapes) on the packed weight."""
    from .quantize import quantize
    from .w4a16_gemm import path, w4a16_matmul

    rows = []
    for n, k in shapes:
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        wq = quantize(wb)
        wp = pack(wq)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            row = {"N": n, "K": k, "M": m, "ms_bf16": time_graph(lambda: torch.matmul(x, wb.T)),
                   "ms_w4a16": time_graph(lambda: w4a16_matmul(x, wq)), "path_w4a16": path(m, n, k, x.device),
                   "ms_packed": time_graph(lambda: packed_matmul(x, wp)),
                   "packed_launch": config(m, n, k, x.device)}
            row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_w4a16"]
            row["speedup_vs_bf16_packed"] = row["ms_bf16"] / row["ms_packed"]
            row["speedup_vs_bf16_best"] = row["ms_bf16"] / min(row["ms_w4a16"], row["ms_packed"])
            rows.append(row)
        del wb, wq, wp
    return rows
