"""W8A8 FP8 GEMV for a few activation rows: y = (xq @ wq^T) * (input_scale * weight_scale), on the
CUDA cores or on the FP8 matrix units.

xq [M, K] and wq [N, K] are float8_e4m3fn (the activations already quantized with the static input
scale, the weight as stored); input_scale and weight_scale are the per-tensor fp32 scales. Every
product of two E4M3 values is exact in fp32 (4 significant bits each, exponents far inside fp32's
range), so the kernel's only roundings are those of its fp32 sums and of the scaling: the values
`torch._scaled_mm` computes up to summation order. At decode (one to a few rows) the library's
kernels for Nemotron-H's Mamba projections read the weight well below the memory bandwidth
(benchmarks/results/decode-profile-compiled-h200.json); `_fp8_gemv_kernel` streams it, one program
per BLOCK_N weight rows (and up to four activation rows) over the whole of K, each thread holding
per (activation row, weight row, column) an fp32 partial sum that one fma per weight extends.
With a table entry's "pdl" on Hopper it is launched as a programmatic dependent of the launch
before it: its programs request their first weight tile while that launch (a projection's input
norm and quantization) finishes, and let the launch after them start once their loads are done.

`_fp8_mma_kernel` runs the same product on Hopper's FP8 matrix units for up to 16 activation rows:
the weight rows are the wgmma's 64-row side and the activation rows its 16-column side, the
weight streamed through shared memory in num_stages tiles, split-K where the weight's rows fill too
few programs (fp32 partials added in a fixed order in the same launch). The units sum an
instruction's 32 products with fewer bits than fp32 (as `torch._scaled_mm`'s do), so each
instruction's sums are added to an fp32 accumulator before the next; on integer operands whose
32-product sums fit 10 bits the result is exact (tests/gpu/test_fp8_gemm_gpu.py). The launch
table's MMA entry (`mma_config`) gives its launch shape and the rows up to which it runs
(`use_mma`; 0: never), which `python scripts/tune_kernels.py fp8.mma` picks from timings beside
`torch._scaled_mm`.

Reference (`fp8_matmul(..., backend="torch")`): both operands decoded to fp64, one matmul (the
exact sums of the exact products, up to fp64 rounding, which 53 bits leave far below fp32's), the
scales applied in fp32 as the kernel applies them, rounded once to the output dtype. Launch shapes
and the row count up to which the GEMV runs at all come from the launch table ("fp8" in
tuning/<gpu>.json, `GEMV`): per weight shape the sweep timed ("shapes", {"NxK": rows}), else
`max_m` (0: never; FP8Linear then calls the library), which `python scripts/tune_kernels.py
fp8.gemv` picks from timings beside `torch._scaled_mm`; `use_gemv` tells a caller whether a
problem is one for it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import backend, launch
from .backend import Constants, cdiv, check_backend, interpreted, launch_cached, launch_options, next_power_of_2
from .tiles import e4m3_decode, split_counters, store_split

_WHAT = "kernels.fp8_matmul"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAUNCH_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "pdl")
MMA_ROWS = 16  # the matrix-unit kernel's activation rows: the N side of its dot
MMA_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "programs_per_sm", "max_parts")


@triton.jit
def _e4m3(b, NATIVE: tl.constexpr):
    """E4M3 bytes (uint8) -> their fp32 values, exactly: the hardware conversion on a GPU, the
    arithmetic decoder in Triton's interpreter."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return e4m3_decode(b.to(tl.int32))


@triton.jit
def _row_fma(acc, x_ptr, row, k, wv, K, EVEN_K: tl.constexpr, NATIVE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] + x[row, k] * wv (exact products, so the fma rounds once, as the sum
    alone would)."""
    if EVEN_K:
        xb = tl.load(x_ptr + row + k)
    else:
        xb = tl.load(x_ptr + row + k, mask=k < K, other=0)
    return tl.fma(tl.broadcast_to(_e4m3(xb, NATIVE)[None, :], acc.shape), wv, acc)


@triton.jit
def _w_tile(w_ptr, w_rows, k, K, EVEN_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k (columns past K read as zeros)."""
    if EVEN_K:
        return tl.load(w_ptr + w_rows[:, None] + k[None, :])
    return tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=(k < K)[None, :], other=0)


@triton.jit
def _tile_fma(acc0, acc1, acc2, acc3, wb, x_ptr, r0, r1, r2, r3, k, K, BLOCK_M: tl.constexpr,
              EVEN_K: tl.constexpr, NATIVE: tl.constexpr):
    """The BLOCK_M accumulators extended by one weight tile (decoded once for all rows)."""
    wv = _e4m3(wb, NATIVE)
    acc0 = _row_fma(acc0, x_ptr, r0, k, wv, K, EVEN_K, NATIVE)
    if BLOCK_M > 1:
        acc1 = _row_fma(acc1, x_ptr, r1, k, wv, K, EVEN_K, NATIVE)
    if BLOCK_M > 2:
        acc2 = _row_fma(acc2, x_ptr, r2, k, wv, K, EVEN_K, NATIVE)
        acc3 = _row_fma(acc3, x_ptr, r3, k, wv, K, EVEN_K, NATIVE)
    return acc0, acc1, acc2, acc3


@triton.jit
def _row_out(acc, scale, out_ptr, row, n, N):
    tl.store(out_ptr + row + n, (tl.sum(acc, axis=1) * scale).to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     NATIVE: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = sum_k x[m, k] * w[n, k] (fp32) * (xs * ws), for this program's BLOCK_M (1, 2 or 4)
    activation rows and BLOCK_N weight rows (grid: N / BLOCK_N, M / BLOCK_M). Each thread keeps,
    per activation row, one fp32 partial sum per (weight row, column of the tile), summed across
    the tile once at the end; a weight tile is decoded once for all rows. Weight rows past N read row N - 1 and
    activation rows past M row M - 1 (neither stored); columns past K read as zeros.

    PDL: the launch is a programmatic dependent of the one before it (`backend.pdl`), which may
    still be writing x: the first K tile of the weight (which nothing in the step writes) is
    requested first, then the program waits for that launch to complete (`gdc_wait`) before it
    reads x or the scales; after its last load it lets the launch after it start
    (`gdc_launch_dependents`), which waits for this one in turn before it reads the output. The
    same tiles summed in the same order: the plain launch's values bit for bit. In Triton's
    interpreter (NATIVE false) only the first tile's early load is taken."""
    pid = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M  # this program's activation rows: first .. first + BLOCK_M - 1
    x_ptr += first.to(tl.int64) * stride_xm
    out_ptr += first.to(tl.int64) * stride_om
    M = tl.minimum(M - first, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(n, N - 1).to(tl.int64) * K
    r0 = 0
    r1 = tl.minimum(1, M - 1).to(tl.int64) * stride_xm
    r2 = tl.minimum(2, M - 1).to(tl.int64) * stride_xm
    r3 = tl.minimum(3, M - 1).to(tl.int64) * stride_xm
    kk = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_loop = 0
    if PDL:
        wb = _w_tile(w_ptr, w_rows, kk, K, EVEN_K)
        if NATIVE:
            gdc_wait()
        acc0, acc1, acc2, acc3 = _tile_fma(acc0, acc1, acc2, acc3, wb, x_ptr, r0, r1, r2, r3, kk, K, BLOCK_M,
                                           EVEN_K, NATIVE)
        k_loop = BLOCK_K
    for k0 in range(k_loop, K, BLOCK_K):
        k = k0 + kk
        wb = _w_tile(w_ptr, w_rows, k, K, EVEN_K)
        acc0, acc1, acc2, acc3 = _tile_fma(acc0, acc1, acc2, acc3, wb, x_ptr, r0, r1, r2, r3, k, K, BLOCK_M,
                                           EVEN_K, NATIVE)
    scale = tl.load(xs_ptr) * tl.load(ws_ptr)
    if PDL and NATIVE:
        gdc_launch_dependents()
    _row_out(acc0, scale, out_ptr, 0, n, N)
    if BLOCK_M > 1 and M > 1:
        _row_out(acc1, scale, out_ptr, stride_om, n, N)
    if BLOCK_M > 2 and M > 2:
        _row_out(acc2, scale, out_ptr, 2 * stride_om, n, N)
    if BLOCK_M > 2 and M > 3:
        _row_out(acc3, scale, out_ptr, 3 * stride_om, n, N)


@triton.jit
def _fp8_mma_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_om,
                    k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * w[n, k] (fp32) * (xs * ws) on the matrix units, for up to
    BLOCK_M activation rows (grid: N / BLOCK_N, SPLIT). acc [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T:
    the weight rows are the dot's M side, so BLOCK_N fills the 64 rows of a warpgroup's wgmma and
    the few activation rows its N side. The E4M3 products are exact and each wgmma's (K 32) sums
    are added to the fp32 accumulator before the next (max_num_imprecise_acc=32: Hopper's FP8
    matrix units sum with fewer bits than fp32 within an instruction's K). With SPLIT > 1, each
    program sums its K slice and `tiles.store_split` adds the slices in order, then scales.
    Weight rows past N read row N - 1 (not stored); activation rows past M and columns past K
    read as zeros. EMULATE (the interpreter): both operands decoded to fp32, an fp32 dot."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(n, N - 1).to(tl.int64) * K
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    x_rows = m.to(tl.int64) * stride_xm
    kk = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            wb = tl.load(w_ptr + w_rows[:, None] + k[None, :])
            xb = tl.load(x_ptr + x_rows[None, :] + k[:, None], mask=m_ok[None, :], other=0)
        else:
            wb = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=(k < k_end)[None, :], other=0)
            xb = tl.load(x_ptr + x_rows[None, :] + k[:, None], mask=m_ok[None, :] & (k < k_end)[:, None], other=0)
        if EMULATE:
            acc = tl.dot(_e4m3(wb, False), _e4m3(xb, False), acc, input_precision="ieee")
        else:
            acc = tl.dot(wb.to(tl.float8e4nv, bitcast=True), xb.to(tl.float8e4nv, bitcast=True), acc,
                         max_num_imprecise_acc=32)
    scale = tl.load(xs_ptr) * tl.load(ws_ptr)
    off = m[None, :].to(tl.int64) * stride_om + n[:, None]
    ok = m_ok[None, :] & (n < N)[:, None]
    if SPLIT == 1:
        tl.store(out_ptr + off, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        store_split(acc, part_ptr, out_ptr, cnt_ptr, pid_n, off, ok, M * stride_om, pid_s, SPLIT, scale)


def row_class(m: int) -> int:
    """M rounded up to a power of two, at most 4: the activation rows of one program (BLOCK_M) and
    the key of the GEMV table's launch shapes."""
    return min(4, next_power_of_2(max(1, m)))


@torch.compiler.assume_constant_result
def _table_max_m(n: int | None = None, k: int | None = None) -> int:
    """The launch table's reach for an [n, k] weight (`_max_m`; one table for every device,
    `launch.gpu_of`). A constant to code that torch.compile traces: the table is read here, not
    traced (reading it is a file read dynamo cannot follow, which broke the compiled graph at every
    FP8 linear)."""
    return _max_m(launch.table("fp8"), n, k)


def shape_key(n: int, k: int) -> str:
    """The GEMV table's name for an [n, k] weight in its "shapes" entry."""
    return f"{n}x{k}"


def _max_m(tables: Mapping, n: int | None = None, k: int | None = None) -> int:
    """The most rows `fp8_matmul` takes in place of the library for an [n, k] weight: the larger of
    the GEMV's reach and the matrix-unit kernel's max_m (a table without an MMA entry has only the
    GEMV). The GEMV's reach is its "shapes" entry for the weight's shape where it has one (the
    sweep's own shapes), else its max_m (the rows up to which it won on every swept shape)."""
    gemv = tables["GEMV"]
    reach = int(gemv["max_m"])
    if n is not None and k is not None:
        reach = int(gemv.get("shapes", {}).get(shape_key(n, k), reach))
    return max(reach, int(tables.get("MMA", {}).get("max_m", 0)))


def use_gemv(m: int, device: torch.device, tables: Mapping | None = None, n: int | None = None,
             k: int | None = None) -> bool:
    """Whether `fp8_matmul` is the launch for M activation rows of an [n, k] weight (up to the
    table's reach for that shape, of either kernel; without n and k, up to its max_m)."""
    max_m = _table_max_m(n, k) if tables is None else _max_m(tables, n, k)
    return 1 <= m <= max_m


def use_mma(m: int, tables: Mapping) -> bool:
    """Whether M rows run on the matrix units (`_fp8_mma_kernel`, up to the table's MMA max_m, at
    most MMA_ROWS) rather than the CUDA cores (`_fp8_gemv_kernel`)."""
    return 1 <= m <= min(MMA_ROWS, int(tables.get("MMA", {}).get("max_m", 0)))


def _classes(gemv: Mapping) -> list[int]:
    """The row classes the GEMV table has launch shapes for."""
    return sorted(int(c) for c in gemv if c.isdigit())


def config(m: int, k: int, device: torch.device, cfg: dict | None = None, tables: Mapping | None = None) -> dict:
    """The launch shape for M rows: the GEMV table's entry for `row_class(M)` (or the next larger
    one it has, else its largest), overridden by cfg (any of LAUNCH_KEYS), BLOCK_K at most K
    rounded up to a power of two; "pdl" (default off) where `backend.pdl` allows it on `device`
    (and in Triton's interpreter, which takes the first tile's early load alone). By rule; no
    autotuning at call time."""
    unknown = set(cfg or {}) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    t = (launch.table("fp8", device) if tables is None else tables)["GEMV"]
    classes = _classes(t)
    pick = next((c for c in classes if c >= row_class(m)), classes[-1])
    c = {**t[str(pick)], **(cfg or {})}
    bn, bk, nw = c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]
    if any(v < 1 or v & (v - 1) for v in (bn, bk, nw)) or bk < 16 or nw > 16:
        raise ValueError(f"{_WHAT}: BLOCK_N, BLOCK_K (>= 16) and num_warps (<= 16) must be powers of two, got "
                         f"BLOCK_N={bn}, BLOCK_K={bk}, num_warps={nw}")
    pdl = backend.dependent_launch(c.get("pdl", False), device, _fp8_gemv_kernel)
    return {"BLOCK_N": bn, "BLOCK_K": min(bk, max(16, next_power_of_2(k))), "num_warps": nw, "pdl": pdl}


def mma_config(m: int, n: int, k: int, device: torch.device, cfg: dict | None = None,
               tables: Mapping | None = None) -> dict:
    """The matrix-unit kernel's launch for an [m, k] @ [n, k]^T problem: the table's MMA entry
    overridden by cfg (any of MMA_KEYS), BLOCK_K at most K rounded up to a power of two (and at
    least 32, one FP8 wgmma), and split-K while there are fewer than programs_per_sm programs per
    multiprocessor, at most max_parts ways, never below one K tile. By rule; no autotuning."""
    unknown = set(cfg or {}) - set(MMA_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {MMA_KEYS}")
    t = (launch.table("fp8", device) if tables is None else tables).get("MMA")
    if t is None:
        raise ValueError(f"{_WHAT}: the launch table has no MMA entry")
    c = {key: t[key] for key in MMA_KEYS} | dict(cfg or {})
    bn, bk, nw = c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]
    if any(v < 1 or v & (v - 1) for v in (bn, bk, nw)) or bn < 16 or bk < 32 or nw > 8:
        raise ValueError(f"{_WHAT}: BLOCK_N (>= 16), BLOCK_K (>= 32) and num_warps (<= 8) must be powers of two, "
                         f"got BLOCK_N={bn}, BLOCK_K={bk}, num_warps={nw}")
    if c["num_stages"] < 1 or c["programs_per_sm"] < 1 or c["max_parts"] < 1:
        raise ValueError(f"{_WHAT}: num_stages, programs_per_sm and max_parts must be >= 1, got {c}")
    bk = min(bk, max(32, next_power_of_2(k)))
    split, k_per_split = backend.split_k(cdiv(n, bn), k, bk, device, c)
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": c["num_stages"], "SPLIT": split,
            "k_per_split": k_per_split}


def _check(xq, weight, input_scale, weight_scale, out_dtype) -> None:
    for name, t in (("xq", xq), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{_WHAT}: {name} must be a float8_e4m3fn tensor, got {getattr(t, 'dtype', type(t))}")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"{_WHAT}: weight must be a contiguous [N, K] tensor, got shape {tuple(weight.shape)}")
    if xq.dim() < 1 or xq.shape[-1] != weight.shape[1]:
        raise ValueError(f"{_WHAT}: xq of shape {tuple(xq.shape)} does not end in K={weight.shape[1]}")
    for name, s in (("input_scale", input_scale), ("weight_scale", weight_scale)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{_WHAT}: {name} must be a one-element fp32 tensor, got "
                             f"{getattr(s, 'dtype', type(s))} {tuple(getattr(s, 'shape', ()))}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{_WHAT}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def fp8_matmul_reference(xq: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor,
                         weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_matmul`'s values on any device: exact products summed in fp64, rounded to fp32, times
    the scales' fp32 product, rounded to out_dtype."""
    sums = xq.double() @ weight.double().t()
    scale = input_scale.float().reshape(()) * weight_scale.float().reshape(())
    return (sums.float() * scale).to(out_dtype)


def fp8_matmul(xq: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor, weight_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, *, backend: str = "triton", cfg: dict | None = None,
               tables: Mapping | None = None) -> torch.Tensor:
    """y[..., N] = (xq @ weight^T) * (input_scale * weight_scale) in out_dtype: fp32 sums of the
    exact E4M3 products, then one fp32 product with the scales' product, rounded once.

    xq: [..., K] float8_e4m3fn; weight: [N, K] float8_e4m3fn (contiguous); scales: one-element
    fp32. backend: "triton" (`_fp8_mma_kernel` up to the table's MMA max_m, `use_mma`, else
    `_fp8_gemv_kernel`, any M; they are the fast launch up to the tables' max_m, see `use_gemv`)
    or "torch" (`fp8_matmul_reference`). cfg: launch-shape overrides (any
    of LAUNCH_KEYS for the GEMV, of MMA_KEYS for the matrix units); tables: the launch table (default: the device's)."""
    _check(xq, weight, input_scale, weight_scale, out_dtype)
    check_backend(backend, _fp8_gemv_kernel, xq, weight, input_scale, weight_scale, what=_WHAT)
    n, k = weight.shape
    if backend == "torch":
        return fp8_matmul_reference(xq, weight, input_scale, weight_scale, out_dtype)
    lead = xq.shape[:-1]
    if k == 0 or xq.numel() == 0 or n == 0:  # nothing to sum: zeros (or nothing)
        return torch.zeros((*lead, n), dtype=out_dtype, device=xq.device)
    x2 = xq.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if cfg is None and tables is None:
        kernel, grid, consts, per = _default_plan(m, n, k, xq.device)
    else:
        kernel, grid, consts, per = _plan(m, n, k, xq.device, cfg, tables)
    if kernel is _fp8_mma_kernel:
        split = grid[1]
        part = torch.empty((split, m, n), dtype=torch.float32, device=xq.device) if split > 1 else out
        counters = split_counters(xq.device, grid[0]) if split > 1 else out
        launch_cached(_fp8_mma_kernel, grid, x2.view(torch.uint8), weight.view(torch.uint8), input_scale,
                      weight_scale, out, part, counters, m, n, k, x2.stride(0), out.stride(0), per, constants=consts)
    else:
        launch_cached(_fp8_gemv_kernel, grid, x2.view(torch.uint8), weight.view(torch.uint8),
                      input_scale, weight_scale, out, m, n, k, x2.stride(0), out.stride(0), constants=consts)
    return out.reshape(*lead, n)


def _plan(m: int, n: int, k: int, device: torch.device, cfg: dict | None, tables: Mapping | None) -> tuple:
    """(kernel, grid, constants, K per split): the matrix-unit kernel up to the table's MMA max_m
    (`use_mma`), else the GEMV (any M)."""
    t = launch.table("fp8", device) if tables is None else tables
    if use_mma(m, t):
        c = mma_config(m, n, k, device, cfg, t)
        consts = Constants(BLOCK_M=MMA_ROWS, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], SPLIT=c["SPLIT"],
                           EVEN_K=k % c["BLOCK_K"] == 0, EMULATE=interpreted(_fp8_mma_kernel), num_warps=c["num_warps"],
                           num_stages=c["num_stages"], **launch_options())
        return _fp8_mma_kernel, (cdiv(n, c["BLOCK_N"]), c["SPLIT"]), consts, c["k_per_split"]
    c = config(m, k, device, cfg, t)
    native = not interpreted(_fp8_gemv_kernel)
    consts = Constants(BLOCK_M=row_class(m), BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], EVEN_K=k % c["BLOCK_K"] == 0,
                       NATIVE=native, PDL=c["pdl"], num_warps=c["num_warps"],
                       **({"launch_pdl": True} if c["pdl"] and native else {}), **launch_options())
    return _fp8_gemv_kernel, (cdiv(n, c["BLOCK_N"]), cdiv(m, row_class(m))), consts, 0


@functools.lru_cache(maxsize=4096)
def _default_plan(m: int, n: int, k: int, device: torch.device) -> tuple:
    """`_plan` under the device's own launch table (frozen for the process), kept per shape."""
    return _plan(m, n, k, device, None, None)
