"""W4A16 GEMM: y = x @ dequant(W)^T with W an NVFP4Tensor [N, K] in ModelOpt's checkpoint layout.

Reference: `fp4kit.formats.nvfp4.NVFP4Tensor.dequantize` followed by a matmul (backend="torch").
The weight is read as stored (packed uint8 [N, K/2], E4M3 block scales [N, K/16], fp32 global
scale), so a checkpoint tensor is used as loaded. `config` picks the kernel by rule from the
launch table ("w4a16" in tuning/<gpu>.json, read by `fp4kit.kernels.launch`):

- up to GEMV["max_m"] rows, the CUDA cores (`_gemv_kernel`, `tiles.gemv_accumulate`): the
  weights are W.dequantize()'s fp32 values, one fp32 fma per weight and row, the block scale
  applied once per 16-block;
- MMA["min_m"] to MMA["max_m"] rows of 16-bit activations on a GPU, up to MMA_WIDE["max_m"] rows
  on weights of MMA_WIDE["min_weights"] elements or more, and one row where `row_on_mma`: the
  matrix units fed from registers (`_mma_kernel`, `fp4kit.kernels.mma`), weights E2M1 * scale *
  2^-7 exactly, the global scale applied to the fp32 sums;
- other rows up to LARGE_M: the matrix units through shared memory (`_w4a16_kernel`), each
  weight W.dequantize() rounded to the activation dtype (`tiles.dequant_tile`), the dot computed
  transposed (acc[N, M] = W_tile @ x_tile^T) so that the weight fills the wgmma's 64-row side;
- above LARGE_M rows: the weight dequantized once by the same tiles (`dequantize`), then
  torch.matmul.

Split-K partials are fp32 and summed in a fixed order in the same launch (`tiles.store_split`),
so a result does not depend on which program finishes last. In Triton's interpreter the same
kernels run on CPU tensors (the mma kernel with its warps' mma.sync emulated). Measured times:
benchmarks/README.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4

from . import backend, launch
from .backend import (Constants, cdiv, check_activations, check_backend, check_weight, current_device, exact_dot,
                      interpreted, launch_cached, launch_kept, launch_options)
from .mma import (first_group, mma_accumulate, mma_fragments, mma_lanes, mma_rows, mma_scales, mma_vec,
                  store_unscaled, sum_groups)
from .tiles import (accumulate, activation_rows, as_leading, dequant_tile, gemv_accumulate, gemv_k_tile, int64_activations,
                    load_weight_tile, lut_tile, split_counters, store_split, use_lut)

_WHAT = "kernels.w4a16_matmul"
_KEPT_PER_WEIGHT = 64  # kept launches per weight: a decode's batch buckets, not every prefill length


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
    acc = accumulate(acc, x_ptr, m.to(tl.int64) * stride_xm, m_ok, wq_ptr, ws_ptr, tl.load(gs_ptr),
                      n64, n_ok, K, k_start, k_end, BLOCK_N, BLOCK_K, IEEE, LUT, EVEN_N, EVEN_K)
    out_off = m[None, :].to(tl.int64) * N + n64[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        store_split(acc, part_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, out_off, ok,
                     M * N, pid_s, SPLIT)



@triton.jit
def _gemv_kernel(
    x_ptr, x4_ptr, wb_ptr, ws_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    LUT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, KB: tl.constexpr, AHEAD: tl.constexpr = 1,
):
    """y = x @ W^T for a few activation rows on the CUDA cores (grid: N tiles, row tiles, K
    splits), the block scale factored out of each 16-block (`gemv_accumulate`, AHEAD K tiles in
    flight). KB: K / 16 (a compile-time constant: the rows' blocks are addressed from the
    program's first row). Its grid
    and epilogue mirror `_w4a16_kernel`'s, with the accumulator [M, N] where that one is [N, M]."""
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
    acc = gemv_accumulate(acc, x_ptr, x4_ptr, m.to(tl.int64)[:, None] * stride_xm, m_ok, wb_ptr + first,
                           ws_ptr + first, tl.load(gs_ptr), tl.arange(0, BLOCK_N), n_ok, K, k_start, k_end,
                           BLOCK_N, BLOCK_K, LUT, EVEN_N, EVEN_K, KB=KB, AHEAD=AHEAD)
    n64 = n.to(tl.int64)
    y = tl.sum(acc, axis=2) * 64.0  # [BLOCK_M, BLOCK_N]; 64: the block values are E2M1 * 2^-6
    out_off = m.to(tl.int64)[:, None] * N + n64[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        store_split(y, part_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, out_off, ok,
                     M * N, pid_s, SPLIT)


# Parts of the GEMV's loop for `_gemv_probe_kernel`.
PROBE_ALL, PROBE_LOADS, PROBE_ARITHMETIC = 0, 1, 2



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
    g, c, warp, zero = mma_lanes(WARPS * KWARPS, EMULATE)
    row = pid_n * (16 * ROWS * WARPS) + (warp % WARPS) * (16 * ROWS) + g  # A rows g and g + 8 (+ 16 per tile)
    tok = pid_m * (8 * TILES) + g  # B column g: an activation row
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    wrows = mma_rows(row, 0, N, K)
    xrow0 = tl.minimum(tok, M - 1).to(tl.int64) * stride_x4
    xrow1 = tl.minimum(tok + 8, M - 1).to(tl.int64) * stride_x4
    acc = mma_accumulate(zero, x4_ptr, xrow0, xrow1, wb_ptr, ws_ptr, wrows, c, k_start, k_end, TILES, ROWS, F16,
                          EVEN_K, SCALE_PAIRS, PREFETCH, EMULATE, KWARPS, warp // WARPS, VEC)
    col = pid_m * (8 * TILES) + 2 * c
    if KWARPS > 1:  # the warp groups' partial sums added in a fixed order (a reduction over warps)
        acc = sum_groups(acc, KWARPS, TILES, ROWS)
        row = first_group(row, KWARPS)
        col = first_group(col, KWARPS)
    y, rows, toks = mma_fragments(acc, row, col, TILES, ROWS)
    store_unscaled(y, gs_ptr, out_ptr, part_ptr, cnt_ptr, toks, rows, M, N, pid_m, pid_n, pid_s, SPLIT)


@triton.jit
def _dequantize_kernel(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K, LUT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Writes the tiles `_w4a16_kernel` feeds to its dot (same loads, same helper, same
    interleave), in the output's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = n < N
    n64 = n.to(tl.int64)
    packed, sc = load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N, BLOCK_K, False, False)
    w = dequant_tile(packed, sc, tl.load(gs_ptr), out_ptr.dtype.element_ty, LUT, BLOCK_N, BLOCK_K)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + n64[:, None] * K + kk[None, :], w, mask=n_ok[:, None] & (kk < K)[None, :])



# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
# The launch table ("w4a16"), by entry:
#   DEQUANT   {"lut"}: the table dequantization's inline PTX for 16-bit activations on a GPU
#             (off: the arithmetic form everywhere; the same values, for tests and benchmarks);
#   GEMV      max_m, and per activation rows per program ("1", "2", "4": `gemv_block_m`) BLOCK_N,
#             BLOCK_K (blocks per K step spread over the program's threads), warps, split-K target,
#             optionally AHEAD (K tiles in flight per thread, `tiles.gemv_accumulate`; 1 if absent);
#   MMA       the register-fed kernel's rows (min_m..max_m), weight-row tiles of 16 per warp
#             (rows), warps, split-K target, L2 prefetch distance in K steps, K groups of warps
#             (kwarps: groups sharing a program's K range) and the split-K balance (`split_count`);
#   MMA_WIDE  the same kernel with two activation tiles up to max_m rows, for weights of
#             min_weights elements or more (None: never);
#   ROW_MMA   min_weights: from this weight size one row runs on the mma kernel where the GEMV's
#             K step does not divide K (None: never);
#   DECODE, MID  the wgmma kernel's launch shapes for up to 16 and up to 64 rows;
#   LARGE_M   above this many rows the weight is dequantized once and torch.matmul multiplies.
# Each entry's "chosen_by" in the tuning file names the sweep that picked it.


def _table(tables: Mapping | None, device: torch.device | None) -> Mapping:
    return launch.table("w4a16", device) if tables is None else tables


def split_k(m: int, n: int, k: int, cfg: Mapping, device: torch.device, programs_per_sm: int,
            balance: tuple[float, int] | None = None) -> dict:
    """{"SPLIT", "k_per_split"}: K split until there are about `programs_per_sm` programs per
    multiprocessor (never below one K tile); with `balance`, more splits where that evens the
    programs out over the multiprocessors (`split_count`)."""
    tiles = cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"])
    k_blocks = cdiv(k, cfg["BLOCK_K"])
    split = split_count(tiles, k_blocks, backend.sm_count(device), programs_per_sm, balance)
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


def gemv_block_m(m: int) -> int:
    """Activation rows per GEMV program for M rows: 1, 2 or 4."""
    return 1 if m <= 1 else 2 if m == 2 else 4


def gemv_pads_k(k: int, tables: Mapping | None = None) -> bool:
    """Whether the one-row GEMV's K step (`tiles.gemv_k_tile`) does not divide K."""
    return k % gemv_k_tile(k, _table(tables, None)["GEMV"]["1"])["BLOCK_K"] != 0


def row_on_mma(n: int, k: int, tables: Mapping | None = None) -> bool:
    """Whether one row of 16-bit activations on a GPU runs on the mma kernel (ROW_MMA): a weight
    of ROW_MMA["min_weights"] elements or more whose K the GEMV's K step does not divide (the
    GEMV would pad its last step; the mma kernel's steps of 128 divide every K it serves)."""
    t = _table(tables, None)
    least = t["ROW_MMA"]["min_weights"]
    return least is not None and n * k >= least and gemv_pads_k(k, t)


def mma_config(m: int, n: int, k: int, device: torch.device, num_warps: int | None = None,
               programs_per_sm: int | None = None, rows: int | None = None, prefetch: int | None = None,
               kwarps: int | None = None, *, tables: Mapping | None = None) -> dict:
    """`_mma_kernel`'s launch shape: 8 or 16 activation rows per program (one or two mma tiles),
    16 or 32 weight rows per warp (`rows` mma tiles), num_warps warps side by side on the weight
    rows, each `kwarps` times over (groups that share the program's K range, their sums added in
    the program), K steps of 128, split-K to about programs_per_sm programs per multiprocessor.
    Arguments left None take MMA's entries."""
    mma = _table(tables, device)["MMA"]
    nw = num_warps or mma["num_warps"]
    r = rows or mma["rows"]
    kw = kwarps or mma["kwarps"]
    if kw & (kw - 1) or nw & (nw - 1):
        raise ValueError(f"{_WHAT}: warps ({nw}) and K groups ({kw}) must be powers of 2")
    cfg = dict(mma=True, BLOCK_M=8 if m <= 8 else 16, BLOCK_N=16 * r * nw, BLOCK_K=128, num_warps=nw, num_stages=1,
               PREFETCH=mma["prefetch"] if prefetch is None else prefetch, KWARPS=kw)
    cfg.update(split_k(m, n, k, cfg, device, programs_per_sm or mma["programs_per_sm"], mma["balance"]))
    return cfg


def config(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
           tables: Mapping | None = None) -> dict:
    """Kernel, tile sizes and split-K for one problem, by rule from the launch table (`tables`,
    default the device's): the register-fed matrix units (MMA, MMA_WIDE, ROW_MMA) for 16-bit
    activations on a GPU, else the CUDA cores (GEMV) for a few rows, else the wgmma kernel
    (DECODE up to 16 rows, MID up to 64, large tiles beyond). No autotuning at call time."""
    t = _table(tables, device)
    mma, wide, gemv = t["MMA"], t["MMA_WIDE"], t["GEMV"]
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        if mma["min_m"] <= m <= mma["max_m"] or (m == 1 and row_on_mma(n, k, t)):
            return mma_config(m, n, k, device, tables=t)
        least = wide["min_weights"]
        if max(mma["max_m"], 8) < m <= wide["max_m"] and least is not None and n * k >= least:
            return mma_config(m, n, k, device, wide["num_warps"], wide["programs_per_sm"], wide["rows"],
                              wide["prefetch"], wide["kwarps"], tables=t)
    if m <= gemv["max_m"]:
        bm = gemv_block_m(m)
        tile = gemv[str(bm)]
        cfg = dict(gemv=True, BLOCK_M=bm, num_stages=1, **{key: v for key, v in tile.items() if key != "programs_per_sm"})
        cfg = gemv_k_tile(k, cfg) if device.type == "cuda" else dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], 64))
        cfg.update(split_k(m, n, k, cfg, device, tile["programs_per_sm"]))
        return cfg
    if m <= 16:
        cfg = dict(BLOCK_M=16, **{key: v for key, v in t["DECODE"].items() if key != "programs_per_sm"})
    elif m <= 64:
        mid = t["MID"]
        cfg = dict(BLOCK_M=64, **{key: v for key, v in mid.items() if key != "programs_per_sm"})
        if device.type != "cuda":
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 64)
        cfg.update(split_k(m, n, k, cfg, device, mid["programs_per_sm"]))
        return cfg
    else:
        # BLOCK_K = 64 here gave wrong products on an H200 (Triton 3.6) with int32 weight words.
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    if device.type != "cuda":
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 64)
    cfg.update(split_k(m, n, k, cfg, device, t["DECODE"]["programs_per_sm"]))
    return cfg


def path(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
         tables: Mapping | None = None) -> str:
    """Which kernel `w4a16_matmul` runs for this problem."""
    t = _table(tables, device)
    if m > t["LARGE_M"]:
        return "dequantize+torch.matmul"
    cfg = config(m, n, k, device, dtype, t)
    return "mma" if cfg.get("mma") else "gemv" if cfg.get("gemv") else "fused"


def _plan(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype, t: Mapping, cfg: Mapping | None):
    """One problem's launch: (SPLIT, k_per_split, gemv, mma, grid, the kernel's `Constants`: for
    the mma kernel one per (VEC, SCALE_PAIRS), which depend on the operands' alignment), or None
    where the rows are past LARGE_M (dequantize, then torch.matmul)."""
    if cfg is None and m > t["LARGE_M"]:
        return None
    cfg = dict(cfg or config(m, n, k, device, dtype, t))
    split, k_per_split = cfg.pop("SPLIT"), cfg.pop("k_per_split")
    lut = cfg.pop("lut", lut_tile(cfg)) and use_lut(dtype, _w4a16_kernel, t["DEQUANT"]["lut"])
    gemv = cfg.pop("gemv", False)
    if gemv:
        lut = t["DEQUANT"]["lut"] and not interpreted(_gemv_kernel)  # the block-dot PTX takes any dtype
    mma = cfg.pop("mma", False)
    if mma and dtype == torch.float32:
        raise ValueError(f"{_WHAT}: the register-fed matrix-unit kernel takes bf16/fp16 activations, got {dtype}")
    grid = (cdiv(n, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    even = dict(EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % cfg["BLOCK_K"] == 0)
    if mma:
        kwarps = cfg.get("KWARPS", 1)
        consts = {(vec, pairs): Constants(
            VEC=vec, TILES=cfg["BLOCK_M"] // 8, ROWS=cfg["BLOCK_N"] // (16 * cfg["num_warps"]), WARPS=cfg["num_warps"],
            SPLIT=split, F16=dtype == torch.float16, EVEN_K=k % 128 == 0, SCALE_PAIRS=pairs, PREFETCH=cfg["PREFETCH"],
            EMULATE=interpreted(_mma_kernel), KWARPS=kwarps, num_warps=cfg["num_warps"] * kwarps, num_stages=1,
            **launch_options()) for vec in (False, True) for pairs in (False, True)}
    elif gemv:
        consts = Constants(SPLIT=split, LUT=lut, KB=k // 16, **even, **cfg, **launch_options())
    else:
        consts = Constants(SPLIT=split, IEEE=exact_dot(dtype, _w4a16_kernel), LUT=lut, **even, **cfg, **launch_options())
    return split, k_per_split, gemv, mma, grid, consts


@functools.lru_cache(maxsize=4096)
def _default_plan(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype):
    """`_plan` under the device's own launch table (frozen for the process), kept per shape."""
    return _plan(m, n, k, device, dtype, _table(None, device), None)


def w4a16_matmul(x: torch.Tensor, w: nvfp4.NVFP4Tensor, *, backend: str = "triton", cfg: dict | None = None,
                 tables: Mapping | None = None):
    """y = x @ W.dequantize(x.dtype)^T, fp32 accumulation, output in x's dtype (bf16 for bf16).

    x: [..., K] bf16 (fp16 / fp32 also accepted); w: NVFP4Tensor [N, K] (ModelOpt layout).
    backend: "triton" (the fused kernels up to LARGE_M rows; beyond, the Triton dequantize
    kernel then torch.matmul) or "torch" (`W.dequantize()`, then torch's matmul).
    cfg: a `config(...)` dict to force a launch shape (and the fused kernels at any M).
    tables: the launch table (default: the device's, `launch.table("w4a16", x.device)`).
    """
    ops = weight_operands(w)
    n, k = ops.n, ops.k
    check_activations(x, k, _WHAT)
    # On the weight's own device a "triton" call needs no other check (the weight's were made once).
    own = backend == "triton" and ops.triton_ready and (
        x.get_device() == ops.device_index if x.is_cuda else x.device == ops.device)
    if not own:
        check_backend(backend, _w4a16_kernel, x, w.packed, w.block_scale, w.global_scale, what=_WHAT)
    if backend == "torch":
        return torch.nn.functional.linear(x, w.dequantize(x.dtype))
    lead, x2, out = activation_rows(x, k, n)
    m = x2.shape[0]
    if m == 0:
        return as_leading(out, lead, n)
    default = cfg is None and tables is None
    if default:  # computed once per problem shape; the weight's device is x's and needs no making
        plan = _default_plan(m, n, k, ops.device if own else x.device, x.dtype)
    else:
        plan = _plan(m, n, k, x.device, x.dtype, _table(tables, x.device), cfg)
    if plan is None:
        return torch.matmul(x2, dequantize(w, x.dtype, tables=tables).T).reshape(*lead, n)
    split, k_per_split, gemv, mma, grid, consts = plan
    part, counters = out, out  # unused unless split > 1
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
    stride = x2.stride(0)
    px = x2.data_ptr()
    if (mma or gemv) and x2.dtype != torch.float32 and (stride % 4 or px % 8):
        # 16-bit activations are read 8 bytes at a time (`int64_activations`): rows 8-byte aligned
        x2 = x2.clone(memory_format=torch.contiguous_format)
        stride, px = x2.stride(0), x2.data_ptr()
    # Under the default plan every argument's class is fixed by the weight but for these, so a
    # launch kept under this key needs no classifying (backend.launch_kept); its tensors are
    # passed by their addresses (backend._classify says why).
    key = None
    kernel = _mma_kernel if mma else _gemv_kernel if gemv else _w4a16_kernel
    if default and own and not interpreted(kernel):
        device = current_device()
        po, pp, pc = out.data_ptr(), part.data_ptr(), counters.data_ptr()
        key = (m, x2.dtype, px % 16 == 0, po % 16 == 0, pp % 16 == 0, pc % 16 == 0, stride, device)
        kept = ops.launches.get(key)
        if kept is not None:
            p64, p32, psc, pmma, pgs = ops.pointers
            if mma:
                args = (px, p64, pmma, pgs, po, pp, pc, m, n, k, stride // 4, k_per_split)
            elif gemv:
                args = (px, px, p64, psc, pgs, po, pp, pc, m, n, k, stride, k_per_split)
            else:
                args = (px, p32, psc, pgs, po, pp, pc, m, n, k, stride, k_per_split)
            launch_kept(kept, grid, *args, device=device)
            return as_leading(out, lead, n)
    if mma or gemv:
        x2, x4 = int64_activations(x2)
    if mma:
        args = (x4, _need(ops.packed64, w, torch.int64), ops.mma_scales, w.global_scale, out, part, counters,
                m, n, k, stride // 4, k_per_split)
        consts = consts[mma_vec(w.packed, x4, stride // 4, k, _mma_kernel), ops.mma_pairs]
    elif gemv:
        args = (x2, x4, _need(ops.packed64, w, torch.int64), ops.scales, w.global_scale, out, part, counters,
                m, n, k, stride, k_per_split)
    else:
        args = (x2, _need(ops.packed32, w, torch.int32), ops.scales, w.global_scale, out, part, counters,
                m, n, k, stride, k_per_split)
    kept = launch_cached(kernel, grid, *args, constants=consts)
    if key is not None and kept is not None and len(ops.launches) < _KEPT_PER_WEIGHT:
        ops.launches[key] = kept
    return as_leading(out, lead, n)


class _Operands:
    """A 2-D NVFP4 weight checked for the kernels, and the views of its tensors they take: made
    once per weight (`weight_operands`), since an NVFP4Tensor is frozen and its tensors' dtypes,
    shapes, strides and device do not change."""

    __slots__ = ("n", "k", "device", "device_index", "triton_ready", "packed64", "packed32", "scales", "mma_scales",
                 "mma_pairs", "launches", "pointers")

    def __init__(self, w: nvfp4.NVFP4Tensor) -> None:
        check_weight(w, _WHAT)
        self.n, self.k = w.shape
        self.device = w.packed.device
        self.device_index = self.device.index if self.device.type == "cuda" else -1
        try:  # one device, and one the kernels run on: a "triton" call on it needs no other check
            check_backend("triton", _w4a16_kernel, w.packed, w.block_scale, w.global_scale, what=_WHAT)
            self.triton_ready = True
        except (RuntimeError, ValueError):
            self.triton_ready = False
        self.packed64, self.packed32 = (_view(w.packed, dtype) for dtype in (torch.int64, torch.int32))
        self.scales = w.block_scale.view(torch.uint8)
        self.mma_scales, self.mma_pairs = mma_scales(w)
        self.launches: dict = {}  # kept launches (backend.launch_cached) by the call's key in w4a16_matmul
        # the views' and the global scale's addresses, as kept launches pass them
        self.pointers = tuple(t.data_ptr() if t is not None else None
                              for t in (self.packed64, self.packed32, self.scales, self.mma_scales, w.global_scale))

    def __reduce__(self):
        # A copied or pickled weight makes its own at its first call: the views would not follow
        # the copy's tensors, and a compiled kernel does not pickle.
        return type(None), ()


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    try:
        return t.view(dtype)
    except RuntimeError:  # not viewable so (offset or shape): the launch that needs it says so
        return None


def _need(view: torch.Tensor | None, w: nvfp4.NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    return view if view is not None else w.packed.view(dtype)  # raises torch's own error


def weight_operands(w: nvfp4.NVFP4Tensor) -> _Operands:
    """`w`'s `_Operands`, made at its first launch and kept on the (frozen) weight object."""
    got = getattr(w, "_w4a16_operands", None) if isinstance(w, nvfp4.NVFP4Tensor) else None
    if got is None:
        got = _Operands(w)
        object.__setattr__(w, "_w4a16_operands", got)
    return got


def dequantize(w: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str = "triton",
               tables: Mapping | None = None):
    """W.dequantize(dtype) through the GEMM's own in-register dequantization (`tiles.dequant_tile`)."""
    what = "kernels.dequantize"
    check_weight(w, what)
    check_backend(backend, _dequantize_kernel, w.packed, w.block_scale, w.global_scale, what=what)
    if backend == "torch":
        return w.dequantize(dtype)
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype, device=w.packed.device)
    bn, bk = (32, 64) if w.packed.device.type != "cuda" else (64, 256)
    lut = use_lut(dtype, _dequantize_kernel, _table(tables, w.packed.device)["DEQUANT"]["lut"])
    _dequantize_kernel[(cdiv(n, bn), cdiv(k, bk))](
        w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.global_scale, out, n, k,
        LUT=lut, BLOCK_N=bn, BLOCK_K=bk, **launch_options())
    return out
