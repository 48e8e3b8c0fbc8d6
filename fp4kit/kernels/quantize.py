"""NVFP4 weight quantization on the GPU: plain rule "6" and Four-Over-Six ("4o6") in one kernel.

Reference: `fp4kit.formats.nvfp4.quantize` (the contract). This kernel returns the same bytes for
every input the reference accepts: the same codes, block scales, global scales and 4/6 choices.

Two launches per call, whatever the number of experts:
1. `_amax_kernel`: max|w| per batch member (per expert of an [E, N, K] stack), NaN/Inf flagged.
2. `_quantize_kernel`: each program takes a run of 16-element blocks (the weight is a flat run
   of blocks since K % 16 == 0), computes the block maxima, both 4/6 candidates in registers,
   their squared errors, the choice and the codes, and writes packed bytes and scale bytes.

Why the bytes are the reference's (read with `fp4kit/formats/nvfp4.py` beside this):
- Every fp32 operation is the reference's, in its order (e.g. `6 * global_scale` rounded before
  `block_amax / (...)`; `x / (float(scale) * global_scale)`, a division by the rounded product).
- Division: `tl.math.div_rn` for every division by data, per element too (IEEE round-to-nearest;
  Triton's `/` on fp32 is `div.full.f32`, which is not correctly rounded). Divisions by the
  constants 6, 1536 and 2688 follow `arith` (`_div_const`): a multiplication by the fp32
  reciprocal (arith "cuda", ModelOpt on CUDA, the default) or `div_rn` (arith "cpu"). A reciprocal-multiply shortcut
  with a fallback near E2M1 midpoints was tried and dropped: on bf16 weights about 0.14 % of the
  quotients land exactly on a midpoint (short mantissas), so most programs fell back.
- No fused multiply-add: launched with `enable_fp_fusion=False` (`backend.launch_options`;
  the PTX then holds `mul.rn` / `add.rn`, which ptxas does not contract), so `v * step - x` and
  the error sums are rounded step by step like torch's.
- Reductions: maxima are exact in any order; the 4/6 error sum uses the reference's fixed tree
  (`block_sum16`: pairs (i, i+8), (i, i+4), (i, i+2), (i, i+1)), each level a sum over an axis
  of length 2, i.e. exactly one addition per output.
- E4M3 and E2M1 rounding are written here at bit level (`_e4m3_round`, `_e2m1_round`), not left
  to Triton's float8 cast, so the interpreter and every GPU give the same round-to-nearest-even,
  saturating at 448 (scales are clamped to [2^-9, 448] first, as the reference does).
Measured on an H200 (benchmarks/results/kernels-h200.json, Nano expert stacks, bf16): 1.41 TB/s
plain and 0.71 TB/s 4/6 for the two launches (the amax pass alone runs at 4.45 TB/s). The
quantize kernel is bound by instruction issue: per element and candidate, an IEEE division
(about 10 issue slots incl. the reciprocal and range check), the E2M1 rounding (7) and the
squared error (3-4), against ~20 slots per element that would keep pace with 4.25 TB/s.
Known limit shared with nothing real: an fp32 weight so small that its global scale underflows
(max|w| < ~2e-42) makes the reference produce NaN block scales whose sign bit depends on the
platform's default NaN; this kernel writes 0x7F there.
"""

from __future__ import annotations

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

from .backend import check_backend, launch_options

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
    q = tl.where(q < 8.0, q, 8.0)  # everything above 5 ends at 6; NaN compares false -> 8 -> 6
    # Add and subtract c = 2^(e + 22), e = max(exponent of q, 0): the fp32 spacing at c is the
    # E2M1 quantum of q's binade (0.5 below 2, then 1, then 2), so the addition is the rounding.
    e = tl.maximum(q.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    c = (e + (22 << 23)).to(tl.float32, bitcast=True)
    v = (q + c) - c
    return tl.minimum(v, 6.0)


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
    (the sign of a quotient that underflows to zero is the reference's `x / step < 0`)."""
    q = tl.math.div_rn(a, step)
    return _e2m1_round(q), q > 0.0


@triton.jit
def _sq_error(v, step, a, imp, HAS_IMP: tl.constexpr):
    """(E2M1 value * step - |x|)^2 (* importance): |decode(code) * step - x|, the sign cancels."""
    err = v * step - a
    err = err * err
    if HAS_IMP:
        err = err * imp
    return err


@triton.jit
def _codes(x, pos, v, BLOCKS: tl.constexpr):
    """Packed bytes [BLOCKS, 4] of 8 elements: sign from `x / step < 0` as the reference (a
    negative x whose quotient is -0.0 gets code 0), magnitude index from the E2M1 value."""
    code = _e2m1_index(v) | tl.where((x < 0.0) & pos, 8, 0)
    even, odd = tl.split(tl.reshape(code, (BLOCKS, 4, 2)))
    return (even | (odd << 4)).to(tl.uint8)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _div_const(x, c: tl.constexpr, r, RECIP: tl.constexpr):
    """x / c as fp4kit.formats.arith.div_const: times the fp32 reciprocal r (ModelOpt on CUDA),
    or the correctly rounded quotient (ModelOpt on CPU)."""
    if RECIP:
        return x * r
    else:
        return tl.math.div_rn(x, c)


@triton.jit
def _amax_kernel(w_ptr, part_ptr, per_batch, chunk, n_chunks, BLOCK: tl.constexpr):
    """part[b, c] = max|w| over chunk c of batch member b; NaN counts as +Inf (flags it)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    base = w_ptr + b.to(tl.int64) * per_batch
    start = c * chunk
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(start, start + chunk, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < per_batch, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.where(x == x, tl.abs(x), float("inf")))
    tl.store(part_ptr + b * n_chunks + c, tl.max(acc, axis=0))


@triton.jit
def _quantize_kernel(
    w_ptr, g_ptr, imp_ptr, packed_ptr, scale_ptr, gs_ptr, choice_ptr,
    n_blocks, blocks_per_member, blocks_per_row, imp_stride, r6, r1536, r2688,
    RECIP: tl.constexpr, RULE_4O6: tl.constexpr, HAS_IMP: tl.constexpr, WRITE_CHOICE: tl.constexpr,
    ONE_MEMBER: tl.constexpr, OFFSET_DTYPE: tl.constexpr, BLOCKS: tl.constexpr,
):
    """Quantizes BLOCKS consecutive 16-element blocks of the flattened weight.

    K % 16 == 0, so the weight is a flat run of blocks: block b holds elements 16b..16b+15 and
    owns packed bytes 8b..8b+7 and scale byte b. Each block is held as two rows of 8 (its
    elements 0-7 and 8-15): a thread owns whole blocks, so block maxima, error sums and packing
    never cross threads, and the first level of the error tree (i, i+8) is one vector add.
    Per-block values stay [BLOCKS, 1] so they share the element tiles' register layout.
    """
    pid = tl.program_id(0)
    blk = (pid * BLOCKS + tl.arange(0, BLOCKS)[:, None]).to(OFFSET_DTYPE)  # [BLOCKS, 1]
    ok = blk < n_blocks
    j = tl.arange(0, 8)[None, :]
    x_lo = tl.load(w_ptr + blk * 16 + j, mask=ok, other=0.0).to(tl.float32)
    x_hi = tl.load(w_ptr + blk * 16 + 8 + j, mask=ok, other=0.0).to(tl.float32)
    a_lo = tl.abs(x_lo)
    a_hi = tl.abs(x_hi)
    block_amax = tl.max(tl.maximum(a_lo, a_hi), axis=1, keep_dims=True)  # exact in any order

    if ONE_MEMBER:
        member = blk * 0
    else:
        member = blk // blocks_per_member
    g = tl.load(g_ptr + member, mask=ok, other=1.0)  # global amax of the block's batch member
    zero = g == 0.0  # all-zero tensor/expert: global scale 1, block scales 1, codes 0
    g = tl.where(zero, 1.0, g)

    imp_lo = 0.0
    imp_hi = 0.0
    if HAS_IMP:
        imp_at = imp_ptr + member * imp_stride + (blk % blocks_per_row) * 16 + j
        imp_lo = tl.load(imp_at, mask=ok, other=0.0)
        imp_hi = tl.load(imp_at + 8, mask=ok, other=0.0)

    if RULE_4O6:
        gs = _div_const(g, 1536.0, r1536, RECIP)  # g / (6 * 256)
        g6 = _div_const(g, 6.0, r6, RECIP)
        # static_block_scale(a * mult, g, 256): s = a*mult/6; s==0 -> 1; e4m3(clamp(s*256/(g/6)))
        s6 = _div_const(block_amax, 6.0, r6, RECIP)
        s4 = _div_const(block_amax * 1.5, 6.0, r6, RECIP)
        s6 = tl.where(s6 == 0.0, 1.0, s6)
        s4 = tl.where(s4 == 0.0, 1.0, s4)
        scale6 = _clamped_scale(tl.math.div_rn(s6 * 256.0, g6))
        scale4 = _clamped_scale(tl.math.div_rn(s4 * 256.0, g6))
        step6 = scale6 * gs
        step4 = scale4 * gs
        v6_lo, p6_lo = _e2m1_of_quotient(a_lo, step6)
        v6_hi, p6_hi = _e2m1_of_quotient(a_hi, step6)
        v4_lo, p4_lo = _e2m1_of_quotient(a_lo, step4)
        v4_hi, p4_hi = _e2m1_of_quotient(a_hi, step4)
        err6 = _block_sum16(_sq_error(v6_lo, step6, a_lo, imp_lo, HAS_IMP),
                            _sq_error(v6_hi, step6, a_hi, imp_hi, HAS_IMP), BLOCKS)
        err4 = _block_sum16(_sq_error(v4_lo, step4, a_lo, imp_lo, HAS_IMP),
                            _sq_error(v4_hi, step4, a_hi, imp_hi, HAS_IMP), BLOCKS)
        choose4 = (err4 < err6) & ~zero  # strict: a tie keeps 6
        scale = tl.where(choose4, scale4, scale6)
        pos_lo = tl.where(choose4, p4_lo, p6_lo)
        pos_hi = tl.where(choose4, p4_hi, p6_hi)
        v_lo = tl.where(choose4, v4_lo, v6_lo)
        v_hi = tl.where(choose4, v4_hi, v6_hi)
    else:
        gs = _div_const(g, 2688.0, r2688, RECIP)  # g / (6 * 448)
        s = tl.math.div_rn(block_amax, 6.0 * gs)  # 6 * gs rounded first
        s = tl.where(s == 0.0, 1.0, s)
        scale = _clamped_scale(s)
        step = scale * gs
        v_lo, pos_lo = _e2m1_of_quotient(a_lo, step)
        v_hi, pos_hi = _e2m1_of_quotient(a_hi, step)
        choose4 = zero & ~zero  # all False, one per block
    # All-zero member: scales 1.0 and global scale 1.0; its elements are 0, so the codes are 0
    # whichever step they were divided by.
    scale = tl.where(zero, 1.0, scale)
    gs = tl.where(zero, 1.0, gs)

    out = packed_ptr + blk * 8 + tl.arange(0, 4)[None, :]
    tl.store(out, _codes(x_lo, pos_lo, v_lo, BLOCKS), mask=ok)
    tl.store(out + 4, _codes(x_hi, pos_hi, v_hi, BLOCKS), mask=ok)
    tl.store(scale_ptr + blk, _e4m3_code(scale).to(tl.uint8), mask=ok)
    if WRITE_CHOICE:
        tl.store(choice_ptr + blk, choose4.to(tl.uint8), mask=ok)
    tl.store(gs_ptr + member, gs, mask=ok & (blk % blocks_per_member == 0))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
_AMAX_BLOCK = 4096
_AMAX_CHUNK = 32 * _AMAX_BLOCK
# Launch shape: 16-element blocks per program and warps per program (the bench's sweep tunes these).
TUNING = {"blocks": 128, "num_warps": 4}


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
    n_chunks = triton.cdiv(per_batch, _AMAX_CHUNK)
    part = torch.empty((b, n_chunks), dtype=torch.float32, device=w.device)
    _amax_kernel[(b, n_chunks)](w, part, per_batch, _AMAX_CHUNK, n_chunks, BLOCK=_AMAX_BLOCK,
                                num_warps=8, **launch_options())
    return part.amax(dim=1).reshape(batch)


def launch(w: torch.Tensor, scale_rule: str, global_amax: torch.Tensor | None = None,
           importance: torch.Tensor | None = None, return_choice: bool = False,
           arith: str = DEFAULT_ARITH):
    """The two launches and nothing else: no validation, no host synchronisation.

    w contiguous, already validated; global_amax None or an fp32 tensor of the batch shape;
    importance None or fp32 [1 or batch members, K]. Returns (NVFP4Tensor, choice uint8 or None,
    own max|w| per member). `quantize` is this plus the reference's checks.
    """
    k = w.shape[-1]
    n = w.shape[-2] if w.dim() >= 2 else 1
    batch = tuple(w.shape[:-2])
    own = member_amax(w)
    g = (own if global_amax is None else global_amax).reshape(-1)
    if importance is not None:
        imp, imp_stride = importance, (0 if importance.shape[0] == 1 else k)
    else:
        imp, imp_stride = g, 0  # unused
    packed = torch.empty((*w.shape[:-1], k // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((*w.shape[:-1], k // NVFP4_BLOCK_SIZE), dtype=torch.uint8, device=w.device)
    gs = torch.empty(batch, dtype=torch.float32, device=w.device)
    choice = torch.empty(scale.shape, dtype=torch.uint8, device=w.device) if return_choice else scale
    n_blocks = w.numel() // NVFP4_BLOCK_SIZE
    blocks_per_row = k // NVFP4_BLOCK_SIZE
    blocks = TUNING["blocks"]
    _quantize_kernel[(triton.cdiv(n_blocks, blocks),)](
        w, g, imp, packed, scale, gs, choice, n_blocks, n * blocks_per_row, blocks_per_row, imp_stride,
        fp32_reciprocal(6.0), fp32_reciprocal(1536.0), fp32_reciprocal(2688.0),
        RECIP=arith == "cuda", RULE_4O6=scale_rule == "4o6", HAS_IMP=importance is not None, WRITE_CHOICE=return_choice,
        ONE_MEMBER=len(batch) == 0 or n_blocks == n * blocks_per_row,
        OFFSET_DTYPE=tl.int32 if w.numel() < 2**31 - 2**20 else tl.int64,
        BLOCKS=blocks, num_warps=TUNING["num_warps"], **launch_options(),
    )
    qt = nvfp4.NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs)
    return qt, (choice if return_choice else None), own


def quantize(
    w: torch.Tensor,
    *,
    scale_rule: str = "6",
    global_amax=None,
    importance=None,
    return_choice: bool = False,
    arith: str = DEFAULT_ARITH,
    backend: str = "triton",
):
    """`fp4kit.formats.nvfp4.quantize` on the GPU: same arguments, same errors, same bytes.

    w: [..., N, K] (or [K]) fp32/fp16/bf16, K % 16 == 0; leading dims are batch members (an
    [E, N, K] expert stack is quantized in one launch, one global scale per expert).
    backend: "triton" (this kernel; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or
    "torch" (the reference itself).
    The checks that need the data (finite weights, a given global amax covering max|w|) run
    after both kernels are queued, so the GPU never waits on the host between them.
    """
    check_backend(backend, _quantize_kernel, w, what=_WHAT)
    if backend == "torch":
        return nvfp4.quantize(w, scale_rule=scale_rule, global_amax=global_amax,
                              importance=importance, return_choice=return_choice, arith=arith)
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
        imp = nvfp4._importance_weights(importance, w, _WHAT)  # the reference's validation
        imp = imp.reshape(-1, w.shape[-1]).contiguous()
    qt, choice, own = launch(w, scale_rule, g, imp, return_choice, arith)
    if not bool(torch.isfinite(own).all()):
        check_finite(w, _WHAT)  # raises, naming the count and first position
    if g is not None:
        _check_global_amax(g, own)
    return (qt, choice.bool()) if return_choice else qt


# Constants the kernel spells as literals, tied to their one home here.
assert (E2M1_MAX, FP8_NORM_4O6, NVFP4_GLOBAL_DENOM) == (6.0, 256.0, 2688.0)
assert (BLOCK_SCALE_MIN, BLOCK_SCALE_MAX, E4M3_MIN_NORMAL) == (2.0**-9, 448.0, 2.0**-6)


# --------------------------------------------------------------------------------------------
# Benchmark entry (scripts/bench_kernels.py collects these)
# --------------------------------------------------------------------------------------------
def bench(shapes=((128, 1856, 2688), (128, 2688, 1856), (8192, 8192)), dtype=torch.bfloat16):
    """Median times and achieved bandwidth (weight bytes in + packed bytes out) per shape and
    rule: the whole `quantize` call (eager, with its checks), and its two launches alone
    (`launch`, replayed from a CUDA graph)."""
    from triton.testing import do_bench, do_bench_cudagraph

    rows = []
    for shape in shapes:
        w = torch.randn(shape, dtype=dtype, device="cuda")
        n_el = w.numel()
        n_members = n_el // (shape[-1] * shape[-2])
        traffic = n_el * w.element_size() + n_el // 2 + n_el // 16 + 4 * n_members
        row = {"shape": list(shape), "bytes": traffic}
        for rule in ("6", "4o6"):
            ms = do_bench(lambda: quantize(w, scale_rule=rule), warmup=25, rep=200, return_mode="median")
            row[f"ms_{rule}"] = ms
            row[f"tbps_{rule}"] = traffic / (ms * 1e-3) / 1e12
            ms_k = do_bench_cudagraph(lambda: launch(w, rule), rep=100, return_mode="median")
            row[f"ms_kernels_{rule}"] = ms_k
            row[f"tbps_kernels_{rule}"] = traffic / (ms_k * 1e-3) / 1e12
        # The amax pass alone (it reads the weight once more; the quantize kernel is the rest).
        row["ms_amax_pass"] = do_bench_cudagraph(lambda: member_amax(w), rep=100, return_mode="median")
        row["ratio_4o6_to_plain"] = row["ms_4o6"] / row["ms_6"]
        rows.append(row)
        del w
    return rows


def sweep(shape=(128, 1856, 2688), configs=((64, 2), (128, 4), (128, 2), (256, 8), (256, 4))):
    """Times of the two launches per (blocks per program, warps) launch shape."""
    from triton.testing import do_bench_cudagraph

    w = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    saved = dict(TUNING)
    out = []
    try:
        for blocks, warps in configs:
            TUNING.update(blocks=blocks, num_warps=warps)
            for rule in ("6", "4o6"):
                ms = do_bench_cudagraph(lambda: launch(w, rule), rep=60, return_mode="median")
                out.append({"blocks": blocks, "num_warps": warps, "rule": rule, "ms": ms})
    finally:
        TUNING.clear()
        TUNING.update(saved)
    return out


def pick(rows) -> dict:
    """The TUNING entry with the smallest plain + 4/6 sweep time."""
    totals = {}
    for r in rows:
        key = (r["blocks"], r["num_warps"])
        totals[key] = totals.get(key, 0.0) + r["ms"]
    blocks, warps = min(totals, key=totals.get)
    return {"blocks": blocks, "num_warps": warps}
