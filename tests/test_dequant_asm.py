"""The W4A16 kernels' inline PTX run by a small PTX emulator on the CPU.

The PTX in fp4kit.kernels (tiles, mma, packed_gemm) only runs on a GPU (tests/gpu checks it there, bit for
bit). Here the very strings the kernels compile are executed instruction by instruction with
the PTX ISA's semantics for the few instructions they use (mov, and, or, shl, shr, prmt,
mul.rn.f32, mul.rn.{bf16x2,f16x2}, cvt.rn.{bf16x2,f16x2}.f32, cvt.rn.f16x2.e4m3x2, cvt.f32.f16,
and mma.sync m16n8k16 across a warp's 32 lanes) and compared with fp4kit.formats: the
matrix-unit kernels' table dequantization (every byte value in every position of a word, many
block steps, against NVFP4Tensor.dequantize: table layout, selectors, sign trick, interleave),
the CUDA-core kernels' block decode (every byte value in every position of a 16-code block,
against the E2M1 value table), and the register-fed mma kernel's K step (`mma_asm`: fragment
layout, K order, decoding and block scales, against x @ dequantized W^T; and its A and B
operands one by one for every scale byte and code).
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from fp4kit.formats import nvfp4
from fp4kit.kernels import mma, tiles

MASK32 = 0xFFFFFFFF


def _f32_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


def _bits_f32(b: int) -> np.float32:
    return np.array(b & MASK32, dtype=np.uint32).view(np.float32)[()]


def _half_bits(x: np.float32, dtype: torch.dtype) -> int:
    """Round-to-nearest-even conversion, as cvt.rn (torch's cast is the same rounding)."""
    return int(torch.tensor(float(x), dtype=torch.float32).to(dtype).view(torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 d, a, b, c (default mode): byte i of d from selector nibble i of c; bit 3 of the
    nibble replicates the selected byte's sign bit."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _e4m3_to_half_bits(byte: int) -> int:
    """An E4M3 byte as fp16 bits (exact: every E4M3 value is an fp16 value)."""
    e4m3 = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn)
    return int(e4m3.to(torch.float16).view(torch.int16).item()) & 0xFFFF


def _lines(asm: str) -> list[str]:
    out = []
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line and line not in "{}" and not line.startswith(".reg"):
            out.append(line)
    return out


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Executes `asm` with $n operands given as 32-bit integers; returns all $n afterwards."""
    regs: dict[str, int] = {f"${k}": v for k, v in operands.items()}  # 64-bit operands too
    for line in _lines(asm):
        _execute(regs, line)
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def _half_value(bits: int, kind: str) -> float:
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    return float(torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dtype).float().item())


def _execute(regs: dict[str, int], line: str) -> None:
    """One PTX instruction (not mma.sync, which `run_ptx_warp` executes across lanes)."""
    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0) & MASK32

    if True:
        if (m := re.fullmatch(r"mov\.b(64|32) \{(\w+), (\w+)\}, (\$?\w+)", line)):
            # unpack a 64-bit (32-bit) register into its low and high 32-bit (16-bit) halves
            bits = int(m.group(1)) // 2
            src = regs[m.group(4)] if m.group(4) in regs else val(m.group(4))
            regs[m.group(2)] = src & ((1 << bits) - 1)
            regs[m.group(3)] = (src >> bits) & ((1 << bits) - 1)
            return
        if (m := re.fullmatch(r"mov\.b32 (\w+), \{(\w+), (\w+)\}", line)):
            # pack two 16-bit registers into a 32-bit one (the first in the low half)
            regs[m.group(1)] = (regs[m.group(3)] << 16) | regs[m.group(2)]
            return
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        dst = args[0]
        if op in ("mov.b32", "mov.f32"):
            regs[dst] = val(args[1])
        elif op == "shl.b32":
            regs[dst] = (val(args[1]) << val(args[2])) & MASK32
        elif op == "cvt.rn.f16x2.e4m3x2":
            pair = regs[args[1]]
            lo, hi = (_e4m3_to_half_bits(pair & 0xFF), _e4m3_to_half_bits(pair >> 8))
            regs[dst] = (hi << 16) | lo
        elif op == "cvt.f32.f16":
            half = torch.tensor([regs[args[1]]], dtype=torch.int32).to(torch.int16).view(torch.float16)
            regs[dst] = _f32_bits(np.float32(half.float().item()))

        elif op == "and.b32":
            regs[dst] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            regs[dst] = val(args[1]) | val(args[2])
        elif op == "shf.l.wrap.b32":  # funnel shift of (b:a) left by c mod 32; a == b: a rotate
            hi, lo, c = val(args[2]), val(args[1]), val(args[3]) % 32
            regs[dst] = (((hi << 32 | lo) << c) >> 32) & MASK32
        elif op == "shr.u32":
            regs[dst] = val(args[1]) >> val(args[2])
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "mul.rn.f32":
            prod = np.float32(_bits_f32(val(args[1]))) * np.float32(_bits_f32(val(args[2])))
            regs[dst] = _f32_bits(prod)
        elif (m := re.fullmatch(r"cvt\.rn\.(bf16x2|f16x2)\.f32", op)):
            dtype = torch.bfloat16 if m.group(1) == "bf16x2" else torch.float16
            hi = _half_bits(_bits_f32(val(args[1])), dtype)
            lo = _half_bits(_bits_f32(val(args[2])), dtype)
            regs[dst] = (hi << 16) | lo
        elif (m := re.fullmatch(r"mul\.rn\.(bf16|f16)x2", op)):
            # each half: the exact product rounded once to the 16-bit type
            dtype = torch.bfloat16 if m.group(1) == "bf16" else torch.float16
            a, b = val(args[1]), val(args[2])
            halves = [_half_bits(np.float64(_half_value(a >> sh, m.group(1)) * _half_value(b >> sh, m.group(1))),
                                 dtype) for sh in (0, 16)]
            regs[dst] = (halves[1] << 16) | halves[0]
        else:
            raise AssertionError(f"instruction not emulated: {line}")


_MMA = re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.\1\.f32 "
                  r"\{([^}]*)\}, \{([^}]*)\}, \{([^}]*)\}, \{([^}]*)\}")


def run_ptx_warp(asm: str, operands: list[dict[int, int]], record: list | None = None,
                 exact: bool = True) -> list[dict[int, int]]:
    """Executes `asm` on a warp: operands[l] are lane l's $n; every line runs on all 32 lanes
    before the next. mma.sync m16n8k16 (row A, column B) gathers the fragments by the PTX ISA's
    layout (lane 4g + c: A[g][2c..2c+1], A[g+8][2c..], A[g][2c+8..], A[g+8][2c+8..];
    B[2c..2c+1][g], B[2c+8..][g]; C/D[g][2c..2c+1], C/D[g+8][2c..]) and computes D = A @ B + C
    exactly, which must be an fp32 value (the tests keep every sum exact, so any summation
    order the hardware uses gives the same; exact=False lifts that check, for tests that read
    only the operands). With `record`, each mma's A and B are appended to it."""
    lanes = [{f"${k}": v for k, v in ops.items()} for ops in operands]
    for line in _lines(asm):
        m = _MMA.fullmatch(line)
        if not m:
            for regs in lanes:
                _execute(regs, line)
            continue
        kind = m.group(1)
        d, a, b, c = ([r.strip() for r in grp.split(",")] for grp in m.groups()[1:])
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for lane, regs in enumerate(lanes):
            g, q = lane // 4, lane % 4
            for j in range(2):
                A[g, 2 * q + j] = _half_value(regs[a[0]] >> (16 * j), kind)
                A[g + 8, 2 * q + j] = _half_value(regs[a[1]] >> (16 * j), kind)
                A[g, 2 * q + 8 + j] = _half_value(regs[a[2]] >> (16 * j), kind)
                A[g + 8, 2 * q + 8 + j] = _half_value(regs[a[3]] >> (16 * j), kind)
                B[2 * q + j, g] = _half_value(regs[b[0]] >> (16 * j), kind)
                B[2 * q + 8 + j, g] = _half_value(regs[b[1]] >> (16 * j), kind)
                C[g, 2 * q + j] = _bits_f32(regs[c[j]])
                C[g + 8, 2 * q + j] = _bits_f32(regs[c[2 + j]])
        if record is not None:
            record.append((A, B))
        D = A @ B + C
        assert not exact or np.array_equal(D.astype(np.float32).astype(np.float64), D), "an inexact sum"
        for lane, regs in enumerate(lanes):
            g, q = lane // 4, lane % 4
            for j in range(2):
                regs[d[j]] = _f32_bits(np.float32(D[g, 2 * q + j]))
                regs[d[2 + j]] = _f32_bits(np.float32(D[g + 8, 2 * q + j]))
    return [{int(k[1:]): v for k, v in regs.items() if k.startswith("$")} for regs in lanes]


def _dequant_word(word: int, step: np.float32, dtype: torch.dtype) -> list[int]:
    """The 8 16-bit values (K order) the kernels produce for one packed word in a block."""
    lut = tiles._LUT_ASM_BF16 if dtype == torch.bfloat16 else tiles._LUT_ASM_F16
    t = run_ptx(lut.value, {4: _f32_bits(step)})
    ops = {k: word for k in range(4, 8)}
    for base, reg in ((8, 0), (12, 1), (16, 2), (20, 3)):
        ops.update({base + i: t[reg] for i in range(4)})
    out = run_ptx(tiles._DEQUANT_ASM.value, ops)
    values = []
    for reg in (0, 1, 2, 3):
        values += [out[reg] & 0xFFFF, out[reg] >> 16]
    return values


def _reference(words: np.ndarray, scale: torch.Tensor, gs: float, dtype: torch.dtype) -> np.ndarray:
    """NVFP4Tensor.dequantize bits of one row of words (two words per 16-element block)."""
    packed = torch.from_numpy(words.astype("<u4").view(np.uint8).copy()).reshape(1, -1)
    k = packed.shape[1] * 2
    block_scale = scale.reshape(1, k // 16)
    qt = nvfp4.NVFP4Tensor(packed, block_scale, torch.tensor(gs, dtype=torch.float32))
    return qt.dequantize(dtype).view(torch.int16).numpy().astype(np.int64).ravel() & 0xFFFF


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_table_dequant_every_byte_in_every_position(dtype):
    # Words covering each byte value 0..255 in each of the 4 byte positions (1024 words), paired
    # into blocks, against the reference for several scales and global scales.
    words = []
    for pos in range(4):
        for b in range(256):
            filler = (0x9A3C51E7 >> (8 * ((pos + 1) % 4))) & 0xFF
            w = 0
            for i in range(4):
                w |= (b if i == pos else (filler + 37 * i) & 0xFF) << (8 * i)
            words.append(w)
    words = np.array(words, dtype=np.uint64)
    rng = np.random.default_rng(0)
    cases = [(0x38, 1.0), (0x7E, 2.0 ** -12), (0x01, 0.3), (0x5A, 3.0e-3)]
    for scale_byte, gs in cases:
        n_blocks = len(words) // 2
        codes = torch.tensor(np.full(n_blocks, scale_byte), dtype=torch.uint8)
        codes[rng.integers(0, n_blocks, 64)] = torch.tensor(rng.integers(1, 0x7F, 64), dtype=torch.uint8)
        scale = codes.view(torch.float8_e4m3fn)
        ref = _reference(words, scale, gs, dtype)
        steps = (scale.float() * torch.tensor(gs, dtype=torch.float32)).numpy()
        got = []
        for i, w in enumerate(words):
            got += _dequant_word(int(w), np.float32(steps[i // 2]), dtype)
        assert np.array_equal(np.array(got, dtype=np.int64), ref), (scale_byte, gs)


def test_table_layout_and_sign():
    # Code 8 is -0.0 and code 0 is +0.0; every magnitude lands at its own table entry.
    step = np.float32(0.75)
    word = 0x76543210  # codes 0..7 in K order
    vals = _dequant_word(word, step, torch.bfloat16)
    expect = [float(torch.tensor(v * 0.75).to(torch.bfloat16).float()) for v in (0, .5, 1, 1.5, 2, 3, 4, 6)]
    got = [float(torch.tensor([v], dtype=torch.int16).view(torch.bfloat16).float()) for v in vals]
    assert got == expect
    neg = _dequant_word(0xFEDCBA98, step, torch.bfloat16)
    assert neg[0] == 0x8000 and all(v & 0x8000 for v in neg)



def _codes16(codes: int) -> list[np.float32]:
    """The CUDA-core kernels' block decode PTX on one 16-code block (an int64): its 16 outputs."""
    out = run_ptx(tiles._CODES16_ASM.value, {16: codes})
    return [_bits_f32(out[i]) for i in range(16)]


def test_codes16_every_byte_in_every_position():
    # Blocks with each byte value 0..255 in each of the 8 byte positions (2048 blocks, random
    # fillers): output i is E2M1(code i) * 2^-6 (fp4kit.formats' value table), bit for bit
    # (sign of zero included: code 8 is -0.0).
    from fp4kit.formats.constants import E2M1_VALUES

    rng = np.random.default_rng(1)
    for pos in range(8):
        for b in range(256):
            filler = int(rng.integers(0, 1 << 63, dtype=np.int64)) | (int(rng.integers(0, 2)) << 63)
            codes = (filler & ~(0xFF << (8 * pos))) | (b << (8 * pos))
            got = _codes16(codes)
            want = [np.float32(E2M1_VALUES[(codes >> (4 * i)) & 0xF] / 64) for i in range(16)]
            assert [_f32_bits(v) for v in got] == [_f32_bits(v) for v in want], (hex(codes), pos, b)



def _int64_at(b: np.ndarray, byte: int) -> int:
    return int(b[byte:byte + 8].view("<u8")[0])


def _mma_lane_operands(step, packed, scale, xb, rows, tiles, n_acc, acc):
    """Each lane's operands of `mma_asm` for K step `step`, as `_mma_kernel` loads them."""
    ops = []
    for lane in range(32):
        gg, c = lane // 4, lane % 4
        blk = step * 8 + 2 * c
        o = {n_acc + i: acc[lane][i] for i in range(n_acc)}
        nxt = 2 * n_acc
        codes, scales = [], []
        for r in range(rows):
            for row in (16 * r + gg, 16 * r + gg + 8):
                codes += [_int64_at(packed[row], 8 * blk), _int64_at(packed[row], 8 * blk + 8)]
                scales.append(int(scale[row, blk]) | int(scale[row, blk + 1]) << 8)
        for v in codes + scales:
            o[nxt] = v
            nxt += 1
        for t in range(tiles):
            for s in range(8):
                o[nxt] = _int64_at(xb[8 * t + gg], 2 * (step * 128 + 32 * c + 4 * s))
                nxt += 1
        ops.append(o)
    return ops


@pytest.mark.parametrize("tiles,rows,kind", [(2, 2, "bf16"), (1, 1, "bf16"), (2, 1, "f16"), (1, 2, "f16")])
def test_mma_step_every_byte_in_every_position(tiles, rows, kind):
    # The register-fed matrix-unit kernel's K steps on a warp: 16 * rows weight rows, K = 1024
    # (8 steps), 8 * tiles activation rows, the operands each lane loads in `_mma_kernel`.
    # With rows = 2 the 2048 blocks hold every byte value at every one of their 8 byte positions
    # (random fillers); scales E4M3 in [1, 15] and small integer activations keep every sum exact
    # in fp32, so D must equal x @ (E2M1 * scale)^T exactly.
    n, k, m = 16 * rows, 1024, 8 * tiles
    rng = np.random.default_rng(7 + tiles + rows)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    if rows == 2:
        blocks = packed.reshape(-1, 8)  # 2048 blocks of 8 bytes
        for pos in range(8):
            blocks[pos * 256:(pos + 1) * 256, pos] = np.arange(256, dtype=np.uint8)
    scale = rng.integers(0x38, 0x58, (n, k // 16), dtype=np.uint8)  # E4M3 1.0 .. 15.0
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    x = torch.from_numpy(rng.integers(-4, 5, (m, k)).astype(np.float32)).to(dtype)
    w = nvfp4.NVFP4Tensor(torch.from_numpy(packed.copy()), torch.from_numpy(scale.copy()).view(torch.float8_e4m3fn),
                          torch.tensor(1.0))
    want = x.double() @ w.dequantize(torch.float32).double().T  # exact: E2M1 * scale * 1.0
    xb = x.view(torch.int16).numpy().view(np.uint8)  # [m, 2k] bytes
    asm = mma.mma_asm(tiles, rows, kind)
    n_acc = 4 * tiles * rows
    acc = [[0] * n_acc for _ in range(32)]
    for step in range(k // 128):
        ops = _mma_lane_operands(step, packed, scale, xb, rows, tiles, n_acc, acc)
        out = run_ptx_warp(asm, ops)
        acc = [[out[lane][i] for i in range(n_acc)] for lane in range(32)]
    got = np.zeros((m, n))
    for lane in range(32):
        gg, c = lane // 4, lane % 4
        for r in range(rows):
            for t in range(tiles):
                base = 4 * (r * tiles + t)
                for i in range(4):
                    row = 16 * r + gg + 8 * (i // 2)
                    tok = 8 * t + 2 * c + i % 2
                    got[tok, row] = _bits_f32(acc[lane][base + i]) * mma.MMA_UNSCALE.value
    assert np.array_equal(got, want.numpy())


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_mma_operands_every_scale_and_code(kind):
    # The A and B fragments `mma_asm` hands to each mma.sync, read back from the emulated warp:
    # A must be E2M1(code) * scale * 2^-7 exactly (fp4kit.formats' values) for every E4M3 scale
    # byte 0x00-0x7E (subnormal scales and 448 included) and every code, and B the activations
    # at the K offsets of the documented K order (mma s: codes j, j + 4 | j + 1, j + 5 of word
    # s // 2 of the lane's 32 codes, j = 2(s % 2)).
    from fp4kit.formats.constants import E2M1_VALUES

    n, k, m = 16, 1024, 8
    rng = np.random.default_rng(3)
    nblk = n * k // 16
    codes = np.stack([rng.permutation(16) for _ in range(nblk)]).astype(np.uint8)  # every code per block
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, k // 2)
    scale = (np.arange(nblk) % 127).astype(np.uint8).reshape(n, k // 16)
    rng.shuffle(scale.reshape(-1))
    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    x = torch.from_numpy(rng.integers(-4, 5, (m, k)).astype(np.float32)).to(dtype)
    xb = x.view(torch.int16).numpy().view(np.uint8)
    wq = codes.reshape(n, k).astype(np.int64)
    sv = torch.from_numpy(scale.copy()).view(torch.float8_e4m3fn).double().numpy()
    want_w = np.array(E2M1_VALUES, dtype=np.float64)[wq] * np.repeat(sv, 16, axis=1) * 2.0 ** -7
    asm = mma.mma_asm(1, 1, kind)
    acc = [[0] * 4 for _ in range(32)]
    seen = set()
    for step in range(k // 128):
        record = []
        run_ptx_warp(asm, _mma_lane_operands(step, packed, scale, xb, 1, 1, 4, acc), record, exact=False)
        assert len(record) == 8
        for s, (A, B) in enumerate(record):
            j = 2 * (s % 2)
            for c in range(4):
                base = step * 128 + 32 * c + 8 * (s // 2)
                ks = [base + j, base + j + 4, base + j + 1, base + j + 5]  # slots 2c, 2c+1, 2c+8, 2c+9
                slots = [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]
                for gg in range(8):
                    for row in (gg, gg + 8):
                        assert [A[row, sl] for sl in slots] == [want_w[row, kk] for kk in ks], (kind, step, s, row)
                        seen.update((int(scale[row, kk // 16]), int(wq[row, kk])) for kk in ks)
                    assert [B[sl, gg] for sl in slots] == [float(x[gg, kk]) for kk in ks]
    assert seen == {(sc, cd) for sc in range(127) for cd in range(16)}


_LANE_ID_CHECK = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4kit.kernels import w4a16_gemm as g
out = []
for tiles, rows, kind, even_k, kwarps, vec in json.loads(sys.argv[1]):
    sig = {"x4_ptr": "*i64", "wb_ptr": "*i64", "ws_ptr": "*i16", "gs_ptr": "*fp32", "out_ptr": "*" + {"bf16": "bf16", "f16": "fp16"}[kind],
           "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_x4": "i32",
           "k_per_split": "i32"}
    const = {"TILES": tiles, "ROWS": rows, "WARPS": 2, "SPLIT": 4, "F16": kind == "f16", "EVEN_K": even_k,
             "SCALE_PAIRS": True, "PREFETCH": 2, "EMULATE": False, "KWARPS": kwarps, "VEC": vec}
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=g._mma_kernel, signature=sig, constexprs=const, attrs=attrs)
    ir = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 2 * kwarps, "num_stages": 1, "enable_fp_fusion": False}).asm["ttgir"]
    out.append([ir.count("%laneid"), ir.count("mma.sync.aligned")])
print(json.dumps(out))
"""


def test_mma_kernel_keeps_lane_ids_with_their_threads():
    # The mma kernel's values stand for lanes: the lane ids must be read once, by the threads that
    # hold the operands, and moved where other layouts need them (never recomputed there, where
    # other threads would read other lane ids), and each K step's warp-wide asm must run once;
    # also with the warps in K groups, whose sums are added across warps, and with the 16-byte
    # loads (VEC) or without.
    # Compiled for sm_90 (no GPU needed; in a fresh process, as the tests here decorate the
    # kernels for the interpreter) and read from the Triton GPU IR.
    import json
    import os
    import subprocess
    import sys

    cases = [(1, 2, "bf16", True, 1, True), (2, 2, "f16", False, 1, False), (1, 1, "bf16", False, 1, True),
             (2, 2, "bf16", True, 4, False), (2, 1, "f16", True, 1, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _LANE_ID_CHECK, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for (n_tiles, rows, *_), (lane_ids, n_mma) in zip(cases, json.loads(run.stdout.strip().splitlines()[-1])):
        assert lane_ids == 1
        assert n_mma == 8 * n_tiles * rows  # one asm op per K step: its 8 mma per weight and activation tile


def _packed_case(seed: int) -> nvfp4.NVFP4Tensor:
    """One slab (16 rows) by one K tile (128): random codes, and the block scales of all 254
    non-NaN E4M3 bytes spread over seeds (128 blocks per seed)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.int32)
    scales = finite[(torch.arange(128) + 128 * seed) % len(finite)].to(torch.uint8).reshape(16, 8)
    return nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.tensor(1.0))


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_packed_decode_every_code_and_scale(kind):
    # The pre-packed GEMM's decoding (`decode_asm`) on the words `pack` writes: every lane's four
    # fragment registers of every (group, k half, row half), against E2M1 * scale * 2^-7 of the
    # element each half stands for (row 8 rs + g, K 16 (4 G + t) + 8 kh + 2 c + h), bit for bit
    # (signed zeros too). Two seeds cover every scale byte with both signs of every code.
    from fp4kit.formats import e2m1
    from fp4kit.kernels import packed_gemm as pg

    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = pg.decode_asm(kind)
    seen = set()
    for seed in (0, 1):
        w = _packed_case(seed)
        p = pg.pack(w, dtype)
        want = (e2m1.decode(w.codes()).reshape(16, 8, 16) * w.block_scale.float().unsqueeze(-1) * 2.0 ** -7)
        want = want.reshape(16, 128).to(dtype).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        words = p.words[0, 0].numpy().astype(np.int64) & 0xFFFF  # [lane, 16]
        scales = p.scales[0, 0].view(torch.int16).numpy().astype(np.int64) & 0xFFFF  # [g, 16]
        codes = w.codes().numpy()
        for lane in range(32):
            gg, c = divmod(lane, 4)
            for grp, kh, rs in itertools.product(range(2), range(2), range(2)):
                e = 8 * grp + 4 * kh + 2 * rs
                sv = scales[gg, 8 * grp + 4 * rs: 8 * grp + 4 * rs + 4]  # [t % 2, t // 2]
                ops = {4: words[lane, e] | words[lane, e + 1] << 16, 5: sv[0] | sv[2] << 16, 6: sv[1] | sv[3] << 16}
                regs = run_ptx(asm, ops)
                for t, h in itertools.product(range(4), range(2)):
                    row, k = 8 * rs + gg, 16 * (4 * grp + t) + 8 * kh + 2 * c + h
                    assert (regs[t] >> (16 * h)) & 0xFFFF == want[row, k], (kind, seed, lane, grp, kh, rs, t, h)
                    seen.add((int(codes[row, k]), int(w.block_scale.view(torch.uint8)[row, k // 16])))
    assert {cd for cd, _ in seen} == set(range(16))
    assert {sc for _, sc in seen} == {b for b in range(256) if b not in (0x7F, 0xFF)}
