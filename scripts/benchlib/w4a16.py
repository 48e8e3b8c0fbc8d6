"""Benchmarks of the checkpoint-layout W4A16 GEMM (fp4kit.kernels.w4a16_gemm) on a GPU, for
scripts/bench_kernels.py: CUDA-graph and eager times against torch.matmul on the bf16 weight,
the GEMV's loop taken apart (`gemv_limits`), and the host-side cost of a call."""

from __future__ import annotations

import functools

import torch

from fp4kit.kernels import launch, w4a16_gemm as wg
from fp4kit.kernels.packed_gemm import pack, packed_matmul
from fp4kit.kernels.quantize import quantize
from fp4kit.kernels.w4a16_gemm import w4a16_matmul

from .gemv_probe import PROBE_ALL, PROBE_ARITHMETIC, PROBE_LOADS, gemv_probe


def bench(nk=((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688)),
          ms=(1, 4, 16, 64, 256, 1024)):
    """Median times of this GEMM and of torch.matmul on the bf16 weight, side by side: replayed
    from CUDA graphs (the GPU's time; how decode runs in serving engines) and eager (including
    each call's host-side launch cost); and, from CUDA graphs, `packed_gemm.packed_matmul` on the
    same weight pre-packed (`speedup_vs_bf16_packed`; `speedup_vs_bf16_best`: the faster of the two)."""
    from triton.testing import do_bench, do_bench_cudagraph

    tables = launch.table("w4a16")
    arith = launch.override(tables, DEQUANT={"lut": False})
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
            t_arith = do_bench_cudagraph(lambda: w4a16_matmul(x, wq, tables=arith), rep=50, return_mode="median")
            weight_bytes = n * k // 2 + n * k // 16
            row = {
                "N": n, "K": k, "M": m, "ms_w4a16": t_fp4, "ms_bf16": t_bf16,
                "speedup_vs_bf16": t_bf16 / t_fp4, "ms_w4a16_arith_dequant": t_arith,
                "w4a16_weight_tbps": weight_bytes / (t_fp4 * 1e-3) / 1e12,
                "bf16_weight_tbps": 2 * n * k / (t_bf16 * 1e-3) / 1e12,
                "ms_w4a16_eager": do_bench(fp4, warmup=10, rep=50, return_mode="median"),
                "ms_bf16_eager": do_bench(bf16, warmup=10, rep=50, return_mode="median"),
                "path": wg.path(m, n, k, x.device),
            }
            row["speedup_vs_bf16_eager"] = row["ms_bf16_eager"] / row["ms_w4a16_eager"]
            row["ms_packed"] = do_bench_cudagraph(lambda: packed_matmul(x, wp), rep=50, return_mode="median")
            row["speedup_vs_bf16_packed"] = t_bf16 / row["ms_packed"]
            row["speedup_vs_bf16_best"] = t_bf16 / min(t_fp4, row["ms_packed"])
            if m > tables["LARGE_M"]:  # the fused kernel at this size, for the record
                cfg = wg.config(m, n, k, x.device)
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

    lut = launch.table("w4a16")["DEQUANT"]["lut"]
    rows = []
    for n, k in shapes:
        wq = quantize(torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02)
        wb = wq.dequantize(torch.bfloat16)
        x = torch.randn((1, k), dtype=torch.bfloat16, device="cuda")
        cfg = wg.config(1, n, k, x.device)
        row = {"N": n, "K": k, "weight_bytes": wq.packed.numel() + wq.block_scale.numel(),
               **{key: cfg[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT")}}
        times = {"ms_gemv": lambda: w4a16_matmul(x, wq), "ms_bf16": lambda: torch.matmul(x, wb.T)}
        if cfg.get("gemv") and cfg["SPLIT"] == 1:
            times.update({f"ms_{name}": functools.partial(gemv_probe, x, wq, part, cfg, lut)
                          for name, part in (("loop", PROBE_ALL), ("loads_only", PROBE_LOADS),
                                             ("arithmetic_only", PROBE_ARITHMETIC))})
        for key, fn in times.items():
            row[key] = do_bench_cudagraph(fn, rep=50, return_mode="median")
        rows.append(row)
    return rows


def host_overhead_us(n=3712, k=2688, calls=200):
    """Host time per eager call (M=1), launch path included, vs torch.matmul's; and, taken apart,
    the kept binary's launch alone (`backend.launch_kept`) with the tensors passed by address as
    w4a16_matmul passes them, and with the tensors themselves (Triton's launcher then asks the
    driver about each pointer), and the output's allocation alone."""
    from fp4kit.kernels import backend

    wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda")
    wq = quantize(wb)
    x = torch.randn((1, k), dtype=torch.bfloat16, device="cuda")
    w4a16_matmul(x, wq)
    ops = wg.weight_operands(wq)
    (kept,) = ops.launches.values()
    split, k_per_split, gemv, mma, grid, consts = wg._default_plan(1, n, k, x.device, x.dtype)
    out = x.new_empty((1, n))
    tensors = (x, x.view(torch.int64), ops.packed64, ops.scales, wq.global_scale, out, out, out, 1, n, k, k,
               k_per_split)
    addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tensors)
    timed = (("w4a16", lambda: w4a16_matmul(x, wq)), ("bf16", lambda: torch.matmul(x, wb.T)),
             ("launch_kept_addresses", lambda: backend.launch_kept(kept, grid, *addresses)),
             ("launch_kept_tensors", lambda: backend.launch_kept(kept, grid, *tensors)),
             ("output_alloc", lambda: x.new_empty((1, n))))
    if not gemv:  # the parts are the one-row GEMV's arguments
        timed = timed[:2]
    return _host_us(timed, calls)


def cluster_host_us(n=3712, k=2688, m=32, calls=500):
    """Host time per eager call at `m` rows on a weight of `n` x `k` pre-packed: `packed_linear`
    (where its dispatch picks `packed_cluster`, the driver launch of the CUDA C++ kernel), the same
    launch through `packed_matmul_cluster` with its default launch shape (kept per problem shape), with
    PDL 1 and PDL 0 given as overrides (each call then runs `config`'s checks; PDL 0: cuLaunchKernel
    instead of cuLaunchKernelEx), and torch.matmul on the bf16 weight."""
    from fp4kit.kernels.packed_cluster import packed_matmul_cluster
    from fp4kit.kernels.packed_linear import packed_linear, uses_cluster

    wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
    wp = pack(quantize(wb))
    x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
    timed = (("packed_linear", lambda: packed_linear(x, wp)),
             ("packed_cluster_pdl", lambda: packed_matmul_cluster(x, wp)),
             ("packed_cluster_cfg_pdl", lambda: packed_matmul_cluster(x, wp, cfg={"PDL": 1})),
             ("packed_cluster_cfg_no_pdl", lambda: packed_matmul_cluster(x, wp, cfg={"PDL": 0})),
             ("bf16", lambda: torch.matmul(x, wb.T)))
    return {"packed_linear_uses_cluster": bool(uses_cluster(m, n, k, x.device)), **_host_us(timed, calls)}


def _host_us(timed, calls: int) -> dict:
    """{"<name>_host_us_per_call": host time per call} for each (name, fn) of `timed`: `calls` eager
    calls timed on the host clock after 20 warm-up calls, the GPU idle before and after."""
    import time

    out = {}
    for name, fn in timed:
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
