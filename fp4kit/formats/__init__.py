"""Bit-exact number formats: E2M1, E4M3, NVFP4 (plain and Four-Over-Six), FP8 per-tensor;
and the SQNR that measures them.

Pure torch, CPU and GPU alike. This is the contract every kernel and every export is checked
against.
"""

from . import constants, e2m1, e4m3, fp8, metrics, nvfp4
from .errors import FormatError
from .nvfp4 import NVFP4Tensor
from .pack import pack_nibbles, unpack_nibbles

__all__ = [
    "FormatError",
    "NVFP4Tensor",
    "constants",
    "e2m1",
    "e4m3",
    "fp8",
    "metrics",
    "nvfp4",
    "pack_nibbles",
    "unpack_nibbles",
]
