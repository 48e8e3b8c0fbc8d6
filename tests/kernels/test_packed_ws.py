"""`kernels.packed_ws`'s launch rule and refusals, on the CPU (the kernel itself: tests/gpu, and its
sm_90 compile: tests/test_sass_loop.py)."""

from __future__ import annotations

import pytest
import torch

from fp4kit.kernels import packed_gemm as pg
from fp4kit.kernels import packed_linear as pl
from fp4kit.kernels import packed_ws as ws
from fp4kit.kernels.quantize import quantize


def test_config_rounds_rows():
    assert ws.config(5, 3712, 2688) == {"BLOCK_M": 16, "P": 4, "SPLIT": 1, "kt_per_split": 21, "XS": 2,
                                        "WORKER_REGS": 128}
    # without the GPU's size: two programs along M at 32 and 64 rows
    assert [ws.config(m, 3712, 2688)["BLOCK_M"] for m in (1, 16, 17, 32, 33, 64, 100)] == [16, 16, 16, 16, 32, 32, 32]


def test_config_puts_the_grid_in_one_wave():
    # 132 multiprocessors (an H100 SXM): 58 tiles of 64 weight rows on 3712 x 2688, 42 on 2688 x 3712
    def launch(m, n, k):
        c = ws.config(m, n, k, sms=132)
        return c["BLOCK_M"], c["SPLIT"]

    assert [launch(m, 3712, 2688) for m in (1, 16, 17, 32, 33, 48, 64)] == [
        (16, 2), (16, 2), (16, 1), (16, 1), (32, 1), (32, 1), (32, 1)]
    assert [launch(m, 2688, 3712) for m in (16, 17, 32, 33, 48, 49, 64)] == [
        (16, 2), (16, 1), (16, 1), (16, 1), (16, 1), (32, 1), (32, 1)]
    # more tiles than multiprocessors at any BLOCK_M: 32 rows a program, unsplit
    assert launch(64, 131072, 2688) == (32, 1) and launch(8, 131072, 2688) == (32, 1)
    # overrides win over the rule
    assert ws.config(48, 2688, 3712, {"BLOCK_M": 32, "SPLIT": 2}, sms=132)["SPLIT"] == 2
    assert ws.config(48, 2688, 3712, {"BLOCK_M": 64}, sms=132)["BLOCK_M"] == 64


def test_config_checks_and_fits_the_register_file():
    assert ws.config(64, 3712, 2688, {"P": 2, "BLOCK_M": 32, "SPLIT": 2, "XS": 3}) == {
        "BLOCK_M": 32, "P": 2, "SPLIT": 2, "kt_per_split": 11, "XS": 3, "WORKER_REGS": 168}
    assert ws.config(100, 128, 128, {"SPLIT": 4})["SPLIT"] == 1  # one K tile: no split
    for p in (2, 4):  # every partition's registers, all warps of a program: within 64 K
        assert ws.config(16, 64, 128, {"P": p})["WORKER_REGS"] * 32 * 4 * p <= 65536
    for bad in ({"P": 3}, {"BLOCK_M": 128}, {"WORKER_REGS": 100}, {"SPLIT": 0}):
        with pytest.raises(ValueError, match="P 2 or 4"):
            ws.config(16, 64, 128, bad)
    for bad in (1, 9):
        with pytest.raises(ValueError, match="XS must be 2 to 8"):
            ws.config(16, 64, 128, {"XS": bad})
    # shared memory: XS activation tiles per warpgroup and the workers' sums, within 227 KiB
    assert ws.smem_bytes(64, 4, 2) == 2 * 4 * 64 * 128 * 2 + 3 * 64 * 64 * 4 + 8 * 9
    assert ws.config(64, 3712, 2688, {"BLOCK_M": 32, "XS": 6})["XS"] == 6
    for cfg in ({"BLOCK_M": 64, "XS": 3}, {"BLOCK_M": 32, "XS": 7}):
        with pytest.raises(ValueError, match="bytes of shared memory"):
            ws.config(64, 3712, 2688, cfg)
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


def test_packed_linear_keeps_packed_matmul_off_sm90():
    # the launch table's WS rows apply on an sm_90 GPU only: on the CPU (the interpreter) never
    tables = pg.launch.table("packed")
    assert tables["WS"]["min_rows"] <= 32 <= tables["WS"]["max_rows"]
    assert not pl.uses_ws(32, 3712, 2688, torch.device("cpu"))
    w = pg.pack(quantize(torch.randn(64, 256, dtype=torch.bfloat16) * 0.02, backend="torch"))
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    assert torch.equal(pl.packed_linear(x, w), pg.packed_matmul(x, w))
    assert torch.equal(pl.packed_linear(x, w, backend="torch"), pg.packed_matmul(x, w, backend="torch"))


def test_ws_rows_leaves_packed_matmul_the_rows_where_packed_ws_would_idle_multiprocessors():
    # on 132 multiprocessors: Nano's 3712 x 2688 fills 116 with packed_ws's one-wave launch at
    # 16-32 rows, 2688 x 3712 only 84 (< 0.75 * 132), where packed_matmul runs 16-row blocks;
    # above 32 rows packed_matmul's blocks are 32 rows and packed_ws takes every shape
    t = pg.launch.table("packed")
    assert t["WS"]["min_fill"] == 0.75
    assert [pl.ws_rows(m, 3712, 2688, 132, t) for m in (1, 15, 16, 20, 32, 33, 64, 65)] == [
        False, False, True, True, True, True, True, False]
    assert [pl.ws_rows(m, 2688, 3712, 132, t) for m in (15, 16, 20, 32, 33, 48, 64, 65)] == [
        False, False, False, False, True, True, True, False]
    assert not pl.ws_rows(64, 131072, 2688, 132, t)  # a large weight: packed_matmul
    assert pl.ws_rows(20, 2688, 3712, 112, t)  # 84 programs fill 0.75 of 112
    bare = pg.launch.thaw(t)
    del bare["WS"]["min_fill"]
    assert all(pl.ws_rows(m, 2688, 3712, 132, bare) for m in (16, 20, 32))  # no min_fill: WS's every row
    del bare["WS"]
    assert not any(pl.ws_rows(m, 3712, 2688, 132, bare) for m in (16, 32, 64))  # no WS entry: never


def test_packed_linear_hands_the_rows_uses_ws_names_to_packed_ws(monkeypatch):
    # the wiring, with the GPU's answer stood in: every row of a [2, 3, K] input counted, the
    # weight's shape and the input's device asked about, the call handed over as it came
    w = pg.pack(quantize(torch.randn(64, 256, dtype=torch.bfloat16) * 0.02, backend="torch"))
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    asked, handed = [], []
    monkeypatch.setattr(pl, "_default_ws", lambda *a: asked.append(a) or True)
    monkeypatch.setattr(ws, "packed_matmul_ws", lambda x_, w_: handed.append((x_, w_)) or "ws")
    assert pl.packed_linear(x, w) == "ws" and handed[0][0] is x and handed[0][1] is w
    assert asked == [(6, 64, 256, x.device)]
    assert pl.packed_linear(x, w, backend="torch").shape == (2, 3, 64)  # the emulation: never handed over
    assert len(handed) == 1
