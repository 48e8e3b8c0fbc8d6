"""Benchmark of the pre-packed W4A16 GEMM (fp4kit.kernels.packed_gemm) on a GPU, for
scripts/bench_packed.py: side by side with torch.matmul and the checkpoint layout's GEMM."""

from __future__ import annotations

import torch

from fp4kit.kernels.packed_gemm import config, pack, packed_matmul
from fp4kit.kernels.quantize import quantize
from fp4kit.kernels.w4a16_gemm import path, w4a16_matmul
from sweeps.packed import SHAPES, time_graph


def bench(shapes=SHAPES, ms=(1, 4, 16, 64, 256, 1024), tables=None) -> list:
    """CUDA-graph times side by side: torch.matmul on the bf16 weight, `w4a16_matmul` on the
    checkpoint layout, and `packed_matmul` (with the launch table `tables`, default the
    device's) on the packed weight."""
    rows = []
    for n, k in shapes:
        wb = torch.randn((n, k), dtype=torch.bfloat16, device="cuda") * 0.02
        wq = quantize(wb)
        wp = pack(wq)
        for m in ms:
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            row = {"N": n, "K": k, "M": m, "ms_bf16": time_graph(lambda: torch.matmul(x, wb.T)),
                   "ms_w4a16": time_graph(lambda: w4a16_matmul(x, wq)), "path_w4a16": path(m, n, k, x.device),
                   "ms_packed": time_graph(lambda: packed_matmul(x, wp, tables=tables)),
                   "packed_launch": config(m, n, k, x.device, tables=tables)}
            row["speedup_vs_bf16"] = row["ms_bf16"] / row["ms_w4a16"]
            row["speedup_vs_bf16_packed"] = row["ms_bf16"] / row["ms_packed"]
            row["speedup_vs_bf16_best"] = row["ms_bf16"] / min(row["ms_w4a16"], row["ms_packed"])
            rows.append(row)
        del wb, wq, wp
    return rows
