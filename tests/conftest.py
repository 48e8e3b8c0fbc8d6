"""Without a GPU, every Triton kernel in this test session runs in Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel module is imported, so it is set here, before any
test module imports fp4kit.kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
