"""`kernels.packed_ws`'s launch rule and refusals, on the CPU (the kernel itself: tests/gpu, and its
sm_90 compile: tests/test_sass_loop.py)."""

from __future__ import annotations

import pytest
import torch

from fp4kit.kernels import packed_gemm as pg
from fp4kit.kernels import packed_ws as ws
from fp4kit.kernels.quantize import quantize


def test_config_rounds_rows_and_fits_the_register_file():
    assert ws.config(5, 3712, 2688) == {"BLOCK_M": 16, "P": 4, "SPLIT": 1, "kt_per_split": 21, "WORKER_REGS": 128}
    assert ws.config(64, 3712, 2688, {"P": 2, "BLOCK_M": 32, "SPLIT": 2}) == {
        "BLOCK_M": 32, "P": 2, "SPLIT": 2, "kt_per_split": 11, "WORKER_REGS": 168}
    assert ws.config(100, 128, 128, {"SPLIT": 4})["SPLIT"] == 1  # one K tile: no split
    for p in (2, 4):  # every partition's registers, all warps of a program: within 64 K
        assert ws.config(16, 64, 128, {"P": p})["WORKER_REGS"] * 32 * 4 * p <= 65536
    for bad in ({"P": 3}, {"BLOCK_M": 128}, {"WORKER_REGS": 100}, {"SPLIT": 0}):
        with pytest.raises(ValueError, match="P 2 or 4"):
            ws.config(16, 64, 128, bad)
    with pytest.raises(ValueError, match="unknown launch keys"):
        ws.config(16, 64, 128, {"STAGES": 2})


def test_the_launcher_refuses_the_cpu_and_other_weights():
    w = pg.pack(quantize(torch.randn(64, 128, dtype=torch.bfloat16) * 0.02, backend="torch"))
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="runs on one CUDA device"):
        ws.packed_matmul_ws(x, w)
    with pytest.raises(TypeError, match="must be a PackedNVFP4"):
        ws.packed_matmul_ws(x, w.unpack())
    with pytest.raises(ValueError, match="packed for"):
        ws.packed_matmul_ws(x.half(), w)
