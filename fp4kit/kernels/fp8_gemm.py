"""W8A8 FP8 GEMV for a few activation rows: y = (xq @ wq^T) * (input_scale * weight_scale), on the
CUDA cores.

xq [M, K] and wq [N, K] are float8_e4m3fn (the activations already quantized with the static input
scale, the weight as stored); input_scale and weight_scale are the per-tensor fp32 scales. Every
product of two E4M3 values is exact in fp32 (4 significant bits each, exponents far inside fp32's
range), so the kernel's only roundings are those of its fp32 sums and of the scaling: the values
`torch._scaled_mm` computes up to summation order. At decode (one to a few rows) the library's
kernels for Nemotron-H's Mamba projections read the weight well below the memory bandwidth
(benchmarks/results/decode-profile-compiled-h200.json); `_fp8_gemv_kernel` streams it, one program
per BLOCK_N weight rows (and up to four activation rows) over the whole of K, each thread holding
per (activation row, weight row, column) an fp32 partial sum that one fma per weight extends.

Reference (`fp8_matmul(..., backend="torch")`): both operands decoded to fp64, one matmul (the
exact sums of the exact products, up to fp64 rounding, which 53 bits leave far below fp32's), the
scales applied in fp32 as the kernel applies them, rounded once to the output dtype. Launch shapes
and the row count up to which the GEMV runs at all (`max_m`; 0: never, FP8Linear then always calls
the library) come from the launch table ("fp8" in tuning/<gpu>.json, `GEMV`), which
`python scripts/tune_kernels.py fp8.gemv` picks from timings beside `torch._scaled_mm`; `use_gemv`
tells a caller whether a problem is one for it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from . import launch
from .backend import Constants, cdiv, check_backend, interpreted, launch_cached, launch_options, next_power_of_2
from .tiles import e4m3_decode

_WHAT = "kernels.fp8_matmul"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAUNCH_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps")


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
def _row_out(acc, scale, out_ptr, row, n, N):
    tl.store(out_ptr + row + n, (tl.sum(acc, axis=1) * scale).to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     NATIVE: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * w[n, k] (fp32) * (xs * ws), for this program's BLOCK_M (1, 2 or 4)
    activation rows and BLOCK_N weight rows (grid: N / BLOCK_N, M / BLOCK_M). Each thread keeps,
    per activation row, one fp32 partial sum per (weight row, column of the tile), summed across
    the tile once at the end; a weight tile is decoded once for all rows. Weight rows past N read row N - 1 and
    activation rows past M row M - 1 (neither stored); columns past K read as zeros."""
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
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            wb = tl.load(w_ptr + w_rows[:, None] + k[None, :])
        else:
            wb = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=(k < K)[None, :], other=0)
        wv = _e4m3(wb, NATIVE)
        acc0 = _row_fma(acc0, x_ptr, r0, k, wv, K, EVEN_K, NATIVE)
        if BLOCK_M > 1:
            acc1 = _row_fma(acc1, x_ptr, r1, k, wv, K, EVEN_K, NATIVE)
        if BLOCK_M > 2:
            acc2 = _row_fma(acc2, x_ptr, r2, k, wv, K, EVEN_K, NATIVE)
            acc3 = _row_fma(acc3, x_ptr, r3, k, wv, K, EVEN_K, NATIVE)
    scale = tl.load(xs_ptr) * tl.load(ws_ptr)
    _row_out(acc0, scale, out_ptr, 0, n, N)
    if BLOCK_M > 1 and M > 1:
        _row_out(acc1, scale, out_ptr, stride_om, n, N)
    if BLOCK_M > 2 and M > 2:
        _row_out(acc2, scale, out_ptr, 2 * stride_om, n, N)
    if BLOCK_M > 2 and M > 3:
        _row_out(acc3, scale, out_ptr, 3 * stride_om, n, N)


def row_class(m: int) -> int:
    """M rounded up to a power of two, at most 4: the activation rows of one program (BLOCK_M) and
    the key of the GEMV table's launch shapes."""
    return min(4, next_power_of_2(max(1, m)))


@torch.compiler.assume_constant_result
def _table_max_m() -> int:
    """The launch table's GEMV max_m (one table for every device, `launch.gpu_of`). A constant to
    code that torch.compile traces: the table is read here, not traced (reading it is a file read
    dynamo cannot follow, which broke the compiled graph at every FP8 linear)."""
    return int(launch.table("fp8")["GEMV"]["max_m"])


def use_gemv(m: int, device: torch.device, tables: Mapping | None = None) -> bool:
    """Whether `fp8_matmul` is the launch for M activation rows (up to the table's max_m)."""
    max_m = _table_max_m() if tables is None else tables["GEMV"]["max_m"]
    return 1 <= m <= max_m


def config(m: int, k: int, device: torch.device, cfg: dict | None = None, tables: Mapping | None = None) -> dict:
    """The launch shape for M rows: the GEMV table's entry for `row_class(M)` (or the next larger
    one it has, else its largest), overridden by cfg (any of LAUNCH_KEYS), BLOCK_K at most K
    rounded up to a power of two. By rule; no autotuning at call time."""
    unknown = set(cfg or {}) - set(LAUNCH_KEYS)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown launch keys {sorted(unknown)}; expected some of {LAUNCH_KEYS}")
    t = (launch.table("fp8", device) if tables is None else tables)["GEMV"]
    classes = sorted(int(c) for c in t if c != "max_m")
    pick = next((c for c in classes if c >= row_class(m)), classes[-1])
    c = {**t[str(pick)], **(cfg or {})}
    bn, bk, nw = c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]
    if any(v < 1 or v & (v - 1) for v in (bn, bk, nw)) or bk < 16 or nw > 16:
        raise ValueError(f"{_WHAT}: BLOCK_N, BLOCK_K (>= 16) and num_warps (<= 16) must be powers of two, got "
                         f"BLOCK_N={bn}, BLOCK_K={bk}, num_warps={nw}")
    return {"BLOCK_N": bn, "BLOCK_K": min(bk, max(16, next_power_of_2(k))), "num_warps": nw}


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
    fp32. backend: "triton" (`_fp8_gemv_kernel`, any M; it is the fast launch up to the table's
    max_m, see `use_gemv`) or "torch" (`fp8_matmul_reference`). cfg: launch-shape overrides (any
    of LAUNCH_KEYS); tables: the launch table (default: the device's)."""
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
        grid, consts = _default_plan(m, n, k, xq.device)
    else:
        grid, consts = _plan(m, n, k, xq.device, cfg, tables)
    launch_cached(_fp8_gemv_kernel, grid, x2.view(torch.uint8), weight.view(torch.uint8),
                  input_scale, weight_scale, out, m, n, k, x2.stride(0), out.stride(0), constants=consts)
    return out.reshape(*lead, n)


def _plan(m: int, n: int, k: int, device: torch.device, cfg: dict | None, tables: Mapping | None) -> tuple:
    c = config(m, k, device, cfg, tables)
    consts = Constants(BLOCK_M=row_class(m), BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], EVEN_K=k % c["BLOCK_K"] == 0,
                       NATIVE=not interpreted(_fp8_gemv_kernel), num_warps=c["num_warps"], **launch_options())
    return (cdiv(n, c["BLOCK_N"]), cdiv(m, row_class(m))), consts


@functools.lru_cache(maxsize=4096)
def _default_plan(m: int, n: int, k: int, device: torch.device) -> tuple:
    """`_plan` under the device's own launch table (frozen for the process), kept per shape."""
    return _plan(m, n, k, device, None, None)
