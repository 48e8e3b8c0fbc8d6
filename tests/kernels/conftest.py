"""fp4kit.kernels against the fp4kit.formats reference, on small shapes, in Triton's interpreter.

The kernels run in Triton's interpreter, on CPU tensors, on every machine: TRITON_INTERPRET=1
is set here before triton is imported (Triton reads it when `triton.language` and the kernels
are decorated; tests/conftest.py sets it first on a machine without CUDA). Where that cannot
hold in this process (some earlier module imported triton without it, or a CUDA machine, whose
kernels in this process are compiled for the GPU that tests/gpu uses),
`test_fresh_process.py` runs this folder in a subprocess with TRITON_INTERPRET=1.
tests/gpu runs the kernels compiled, on bf16 and real shapes. Quantized bytes and dequantized
weights must be identical; GEMM and MoE outputs within the tolerances stated at each test.
fp32 / fp16 activations only: bf16 arithmetic is not reliable in the interpreter.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Not interpreting already, and triton imported without it or a GPU here (whose tests need
# compiled kernels in this process): the interpreter runs in a subprocess instead.
IN_SUBPROCESS_ONLY = (os.environ.get("TRITON_INTERPRET") != "1"
                      and ("triton" in sys.modules or torch.cuda.is_available()))
if not IN_SUBPROCESS_ONLY:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _in_this_process(request):
    if IN_SUBPROCESS_ONLY and request.node.name != "test_in_fresh_process":
        pytest.skip("the interpreter cannot run in this process (triton imported without "
                    "TRITON_INTERPRET=1, or a GPU here); see test_fresh_process.py")


# Parametrized cases that repeat a code path another case in the quick run already takes, on
# larger problems: they run with the slow tests (`-m slow`).
SLOW_CASES = (
    "test_moe.py::test_moe_matches_transformers_experts[gemv-split-13-dtype0-",
    "test_moe.py::test_moe_matches_transformers_experts[gemv-13-dtype0-",
    "test_w4a16.py::test_w4a16_mma[launch0-nk1-",
    "test_w4a16.py::test_w4a16_mma[launch1-nk1-",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(case in item.nodeid for case in SLOW_CASES):
            item.add_marker(pytest.mark.slow)
