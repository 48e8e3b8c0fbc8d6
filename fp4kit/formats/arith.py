"""Division by a constant, the one place where ModelOpt's bytes depend on the device.

ModelOpt writes `amax.float() / 2688`, `block_amax / 6`, `amax / 448` ... with a Python number
as divisor. torch computes that differently per device:
- on CUDA, a division by a CPU scalar is a multiplication by the fp32 reciprocal,
  `x * fp32(1 / c)` (torch's div_true CUDA kernel), which differs from the correctly rounded
  quotient in the last bit for a large share of inputs (half of them for c = 6);
- on the CPU it is the correctly rounded quotient `x / c`.
fp4kit computes either on any device: "reciprocal" (ModelOpt on CUDA, where its production
exports and its 4/6 calibration run; fp4kit's default) or "exact" (ModelOpt on the CPU).
"""

from __future__ import annotations

import torch

SCALAR_DIV_MODES = ("reciprocal", "exact")
DEFAULT_SCALAR_DIV = "exact"


def check_mode(mode: str) -> str:
    if mode not in SCALAR_DIV_MODES:
        raise ValueError(f"scalar_div must be one of {SCALAR_DIV_MODES}, got {mode!r}")
    return mode


def fp32_reciprocal(c: float) -> float:
    """fp32(1 / c) rounded once in fp32, as torch's CUDA kernel forms it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(c, dtype=torch.float32))


def div_const(x: torch.Tensor, c: float, mode: str) -> torch.Tensor:
    """fp32 x / c under `mode` (see the module docstring); the same bytes on every device."""
    x = x.float()
    if check_mode(mode) == "reciprocal":
        return x * torch.tensor(fp32_reciprocal(c), dtype=torch.float32, device=x.device)
    # a 0-d tensor on x's own device is not a "CPU scalar", so CUDA divides exactly too
    return x / torch.tensor(c, dtype=torch.float32, device=x.device)
