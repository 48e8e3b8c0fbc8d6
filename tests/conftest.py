"""Without a GPU, every Triton kernel in this test session runs in Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel module is imported, so it is set here, before any
test module imports fp4kit.kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def op_counter():
    """A torch dispatch mode that counts the operations run under it, views not counted:
    `with op_counter() as count: ...`, then `count.ops`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    return Count
