"""The two places where nvidia-modelopt's bytes depend on the device torch runs it on.

1. Division by a constant. ModelOpt writes `amax.float() / 2688`, `block_amax / 6`,
   `amax / 448` ... with a Python number as divisor. On CUDA torch turns a division by a CPU
   scalar into a multiplication by its fp32 reciprocal, `x * fp32(1 / c)`, which differs from
   the correctly rounded quotient in the last bit for a large share of inputs (half of them for
   c = 6); on the CPU it is the correctly rounded `x / c`.
2. A 0-d tensor operand. ModelOpt's FP8 export writes `(W / weight_scale)` with W in bf16/fp16
   and a 0-d fp32 scale. On the CPU the scale enters the division at full precision; on CUDA it
   is first cast to W's dtype (the kernel's common dtype), so the divisor is bf16(scale).

fp4kit computes either on any device: arith="cuda" (ModelOpt as it runs on a GPU, where its
production exports and its 4/6 calibration run; fp4kit's default) or arith="cpu".
"""

from __future__ import annotations

import functools

import torch

ARITH_MODES = ("cuda", "cpu")
DEFAULT_ARITH = "cuda"


def check_mode(mode: str) -> str:
    if mode not in ARITH_MODES:
        raise ValueError(f"arith must be one of {ARITH_MODES}, got {mode!r}")
    return mode


@functools.lru_cache(maxsize=64)
def fp32_reciprocal(c: float) -> float:
    """fp32(1 / c) rounded once in fp32, as torch's CUDA kernel forms it (cached: the callers'
    constants are few, and the kernels' launchers ask on every call)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(c, dtype=torch.float32))


def div_const(x: torch.Tensor, c: float, mode: str) -> torch.Tensor:
    """fp32 `x / c` with c a Python number, as torch computes it on `mode`'s device."""
    x = x.float()
    # 0-d tensors made on x's own device by `full` (a fill, not a copy from the host, so no wait
    # for the device); a 0-d tensor there is not a "CPU scalar", so CUDA divides exactly too.
    if check_mode(mode) == "cuda":
        return x * torch.full((), fp32_reciprocal(c), dtype=torch.float32, device=x.device)
    return x / torch.full((), c, dtype=torch.float32, device=x.device)


def div_by_scale(w: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """`w / scale` (scale a 0-d fp32 tensor) in w's dtype, as torch computes it on `mode`'s device."""
    s = scale.float().reshape(())
    if check_mode(mode) == "cuda":
        s = s.to(w.dtype).float()  # CUDA casts the 0-d operand to the common dtype first
    return (w.float() / s).to(w.dtype)  # the quotient is computed in fp32 and rounded to w's dtype
