"""scripts/benchlib/split_epilogue.py under Triton's interpreter: the library's split-K epilogue and
the two-launch one give `packed_matmul`'s bytes, the parts-left-out ones do not claim to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib.split_epilogue import EPILOGUES, RIGHT, epilogue_matmul  # noqa: E402

from fp4kit.kernels.packed_gemm import pack, packed_matmul  # noqa: E402
from fp4kit.kernels.quantize import quantize  # noqa: E402


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    w = pack(quantize(torch.randn((128, 512), generator=g, dtype=torch.float32).to(torch.bfloat16) * 0.02, backend="torch"))
    x = torch.randn((5, 512), generator=g, dtype=torch.float32).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("epi", RIGHT)
@pytest.mark.parametrize("split", [1, 2, 4])
def test_the_epilogues_that_sum_give_packed_matmuls_bytes(problem, epi, split):
    x, w = problem
    cfg = {"BLOCK_M": 16, "num_warps": 4, "SPLIT": split}
    assert torch.equal(epilogue_matmul(x, w, epi, cfg), packed_matmul(x, w, cfg=dict(cfg, UNROLL=1, PREFETCH=0)))


def test_a_split_epilogue_without_its_sums_is_not_the_product(problem):
    x, w = problem
    cfg = {"BLOCK_M": 16, "num_warps": 4, "SPLIT": 2}
    want = packed_matmul(x, w, cfg=dict(cfg, UNROLL=1, PREFETCH=0))
    for epi in set(EPILOGUES) - set(RIGHT):
        assert not torch.equal(epilogue_matmul(x, w, epi, cfg), want), epi
    with pytest.raises(ValueError, match="epi must be one of"):
        epilogue_matmul(x, w, 6, cfg)
