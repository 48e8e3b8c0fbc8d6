"""W4A16 GEMM: y = x @ dequant(W)^T with W an NVFP4Tensor [N, K] in ModelOpt's checkpoint layout.

Reference: `fp4kit.formats.nvfp4.NVFP4Tensor.dequantize` followed by a matmul (backend="torch").

The weight is read as stored (packed uint8 [N, K/2], E4M3 block scales [N, K/16], fp32 global
scale): no re-layout, so a checkpoint tensor is used as loaded. Dequantization happens in
registers and is the reference's arithmetic exactly (see `_dequant_tile`): every weight the dot
sees is `W.dequantize()` rounded to the activation dtype; `dequantize(..., backend="triton")` runs
the same helper and writes the tile out, so tests compare it bit for bit.

The dot is computed transposed, acc[N, M] = W_tile @ x_tile^T: at decode sizes (M = 1..16) the
weight fills the matrix unit's 64-row side (wgmma with A in registers on Hopper) and the few
tokens its narrow side, instead of padding M to 64. The next weight tile is loaded while the
current one is dequantized. Split-K (partials in fp32, summed in a fixed order by a second
kernel) keeps the GPU full when N / BLOCK_N alone is too few programs. Above LARGE_M rows the
weight is dequantized once by the same helper and multiplied by torch.matmul.

Measured on an H200 (benchmarks/results/kernels-h200.json): the fused kernel is bound by
instruction issue, not memory: about 11 SASS instructions per weight in its main loop (nibble
to fp32 bits, two fp32 multiplies for the exact product, the bf16 conversion), i.e. >= 22 us of
issue for an 8192 x 8192 weight against 9 us of memory traffic; M = 1 runs at 0.84x bf16.
A per-block lookup table applied with byte permutes (4 weights per instruction, inline PTX)
is the known way past this; it needs a GPU to develop and is not done.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fp4kit.formats import nvfp4
from fp4kit.formats.constants import NVFP4_BLOCK_SIZE
from fp4kit.formats.errors import FormatError

from .backend import check_backend, launch_options

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
def _dequant_tile(packed, scale_code, gs, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/2] packed bytes + [BLOCK_N, BLOCK_K/16] scale bytes -> fp32 weights.

    Returns (even, odd): the elements at K offsets 0, 2, 4, ... and 1, 3, 5, ... of the tile.
    Each value is RN(e2m1 * (float(scale) * gs)), the reference's fp32 product: (bits * 2^126)
    is the E2M1 value exactly (scaling by a power of two; subnormals are kept, no flush-to-zero
    in these kernels), then one rounded multiply by the block's step.
    """
    p = packed.to(tl.int32)
    step = _e4m3_decode(scale_code.to(tl.int32)) * gs  # float(scale) * global_scale, fp32
    step = tl.reshape(step, (BLOCK_N, BLOCK_K // 16, 1))
    lo = tl.reshape(_e2m1_bits(p, 0) * 8.507059173023462e37, (BLOCK_N, BLOCK_K // 16, 8))  # 2^126
    hi = tl.reshape(_e2m1_bits(p, 4) * 8.507059173023462e37, (BLOCK_N, BLOCK_K // 16, 8))
    even = tl.reshape(lo * step, (BLOCK_N, BLOCK_K // 2))
    odd = tl.reshape(hi * step, (BLOCK_N, BLOCK_K // 2))
    return even, odd


@triton.jit
def _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes [BLOCK_N, BLOCK_K/2] and scale bytes [BLOCK_N, BLOCK_K/16] at K offset k0;
    zeros past K. The mask is on K (a multiple of 16), so whole 16-blocks are in or out and the
    loads stay vectorized."""
    half = tl.arange(0, BLOCK_K // 2)
    grp = tl.arange(0, BLOCK_K // 16)
    col = k0 // 2 + half  # contiguous, compared with K/2: the mask is constant over 8-byte runs
    packed = tl.load(wq_ptr + n64[:, None] * (K // 2) + col[None, :],
                     mask=n_ok[:, None] & (col < K // 2)[None, :], other=0)
    sc = tl.load(ws_ptr + n64[:, None] * (K // 16) + (k0 // 16 + grp)[None, :],
                 mask=n_ok[:, None] & ((k0 // 16 + grp) < K // 16)[None, :], other=0)
    return packed, sc


@triton.jit
def _accumulate(acc, x_ptr, x_row, m_ok, wq_ptr, ws_ptr, gs, n64, n_ok, K, k_start, k_end,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """acc[BLOCK_N, BLOCK_M] += W[n, k_start:k_end] @ x[rows, k_start:k_end]^T.

    x_row: [BLOCK_M] int64 element offsets of the activation rows (gathered rows for MoE);
    wq_ptr / ws_ptr: packed bytes [*, K/2] and scale bytes [*, K/16] of the weight matrix.
    The next weight tile is loaded before the current one is dequantized (register double
    buffering: the weight stream is what decode sizes wait on); the last prefetch reads a tile
    past k_end that is never used. k_end - k_start is a multiple of BLOCK_K or ends at K.
    """
    kk = tl.arange(0, BLOCK_K)
    packed, sc = _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k_start, K, BLOCK_N, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        packed_next, sc_next = _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0 + BLOCK_K, K,
                                                 BLOCK_N, BLOCK_K)
        x = tl.load(x_ptr + x_row[None, :] + (k0 + kk)[:, None],
                    mask=m_ok[None, :] & ((k0 + kk) < K)[:, None], other=0.0)  # [BLOCK_K, BLOCK_M]
        even, odd = _dequant_tile(packed, sc, gs, BLOCK_N, BLOCK_K)
        # Interleave back to K order: each byte's two values sit in the same thread.
        w = tl.reshape(tl.join(even.to(x.dtype), odd.to(x.dtype)), (BLOCK_N, BLOCK_K))
        if IEEE:
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        packed = packed_next
        sc = sc_next
    return acc


@triton.jit
def _w4a16_kernel(
    x_ptr, wq_ptr, ws_ptr, gs_ptr, out_ptr,
    M, N, K, stride_xm, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
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
                      n64, n_ok, K, k_start, k_end, BLOCK_N, BLOCK_K, IEEE)
    out_off = m[None, :].to(tl.int64) * N + n64[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + pid_s.to(tl.int64) * M * N + out_off, acc, mask=ok)


@triton.jit
def _splitk_sum_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over s = 0, 1, ... of part[s] (fp32, this fixed order), cast to out's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(wq_ptr, ws_ptr, gs_ptr, out_ptr, N, K,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Writes the tiles `_w4a16_kernel` feeds to its dot (same loads, same helper, same
    interleave), in the output's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = n < N
    n64 = n.to(tl.int64)
    packed, sc = _load_weight_tile(wq_ptr, ws_ptr, n64, n_ok, k0, K, BLOCK_N, BLOCK_K)
    even, odd = _dequant_tile(packed, sc, tl.load(gs_ptr), BLOCK_N, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    w = tl.reshape(tl.join(even.to(dt), odd.to(dt)), (BLOCK_N, BLOCK_K))
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


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # interpreter: small grids


def _split(m: int, n: int, k: int, cfg: dict, device: torch.device) -> dict:
    """Split K until there are about 4 programs per multiprocessor (never below one K tile)."""
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
    k_blocks = triton.cdiv(k, cfg["BLOCK_K"])
    want = 4 * _sm_count(device)
    split = max(1, min(k_blocks, want // tiles)) if tiles < want else 1
    k_per_split = triton.cdiv(k_blocks, split) * cfg["BLOCK_K"]
    return {"SPLIT": triton.cdiv(k, k_per_split), "k_per_split": k_per_split}


# Decode launch shape (M <= 16), picked on an H200 by `sweep` (scripts/bench_kernels.py --sweep:
# 8192x8192 and 3712x2688 at M = 1 and 16, CUDA-graph times; benchmarks/results/kernels-h200.json).
DECODE = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Tile sizes and split-K for one problem: decode-sized M streams the weight through many
    programs; large M uses big tiles. Chosen by rule (no autotuning at call time)."""
    if m <= 16:
        cfg = dict(BLOCK_M=16, **DECODE)
    elif m <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
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
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    if cfg is None and m > LARGE_M:
        return torch.matmul(x2, dequantize(w, x.dtype).T).reshape(*lead, n)
    cfg = dict(cfg or config(m, n, k, x.device))
    split, k_per_split = cfg.pop("SPLIT"), cfg.pop("k_per_split")
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _w4a16_kernel[grid](
        x2, w.packed, w.block_scale.view(torch.uint8), w.global_scale, dst,
        m, n, k, x2.stride(0), k_per_split, SPLIT=split, IEEE=x.dtype == torch.float32,
        **cfg, **launch_options(),
    )
    if split > 1:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(m * n, block),)](dst, out, m * n, SPLIT=split, BLOCK=block,
                                                          **launch_options())
    return out.reshape(*lead, n)


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
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.packed, w.block_scale.view(torch.uint8), w.global_scale, out, n, k,
        BLOCK_N=bn, BLOCK_K=bk, **launch_options())
    return out


# --------------------------------------------------------------------------------------------
# Benchmark entry
# --------------------------------------------------------------------------------------------
def sweep(shapes=((8192, 8192), (3712, 2688)), ms=(1, 16),
          tiles=((32, 256), (64, 128), (64, 256), (128, 128), (128, 256)), warps=(4, 8), stages=(3,)):
    """CUDA-graph times of decode tile shapes (BLOCK_N, BLOCK_K) x warps x stages, split-K by rule."""
    from triton.testing import do_bench_cudagraph

    from .quantize import quantize

    out = []
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            for bn, bk in tiles:
                for nw in warps:
                    for st in stages:
                        cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st)
                        cfg.update(_split(m, n, k, cfg, x.device))
                        try:
                            t = do_bench_cudagraph(lambda: w4a16_matmul(x, wq, cfg=cfg), rep=30,
                                                   return_mode="median")
                        except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory
                            t = None
                            cfg["error"] = type(exc).__name__
                        out.append({"N": n, "K": k, "M": m, **cfg, "ms": t})
    return out


def pick_decode(rows) -> dict:
    """The DECODE entry with the smallest summed sweep time over its shapes and M."""
    totals = {}
    for r in rows:
        key = (r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["num_stages"])
        t = r["ms"] if r["ms"] is not None else float("inf")
        totals[key] = totals.get(key, 0.0) + t
    bn, bk, nw, st = min(totals, key=totals.get)
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": st}


def bench(nk=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)),
          ms=(1, 4, 16, 64, 256, 1024)):
    """Median times of this GEMM and of torch.matmul on the bf16 weight, side by side: replayed
    from CUDA graphs (the GPU's time; how decode runs in serving engines) and eager (including
    each call's host-side launch cost)."""
    from triton.testing import do_bench, do_bench_cudagraph

    from .quantize import quantize

    rows = []
    for n, k in nk:
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        wq = quantize(wb)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            fp4 = lambda: w4a16_matmul(x, wq)  # noqa: E731
            bf16 = lambda: torch.matmul(x, wb.T)  # noqa: E731
            t_fp4 = do_bench_cudagraph(fp4, rep=50, return_mode="median")
            t_bf16 = do_bench_cudagraph(bf16, rep=50, return_mode="median")
            weight_bytes = n * k // 2 + n * k // 16
            row = {
                "N": n, "K": k, "M": m, "ms_w4a16": t_fp4, "ms_bf16": t_bf16,
                "speedup_vs_bf16": t_bf16 / t_fp4,
                "w4a16_weight_tbps": weight_bytes / (t_fp4 * 1e-3) / 1e12,
                "bf16_weight_tbps": 2 * n * k / (t_bf16 * 1e-3) / 1e12,
                "ms_w4a16_eager": do_bench(fp4, warmup=10, rep=50, return_mode="median"),
                "ms_bf16_eager": do_bench(bf16, warmup=10, rep=50, return_mode="median"),
                "path": "fused" if m <= LARGE_M else "dequantize+torch.matmul",
            }
            row["speedup_vs_bf16_eager"] = row["ms_bf16_eager"] / row["ms_w4a16_eager"]
            if m > LARGE_M:  # the fused kernel at this size, for the record
                cfg = config(m, n, k, x.device)
                row["ms_w4a16_fused"] = do_bench_cudagraph(lambda: w4a16_matmul(x, wq, cfg=cfg), rep=50,
                                                           return_mode="median")
            rows.append(row)
        del wb, wq
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
