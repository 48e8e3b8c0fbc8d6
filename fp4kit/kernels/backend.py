"""The one backend switch of fp4kit.kernels: "triton" (the kernels) or "torch" (the reference),
and what every launcher shares: input checks, grid arithmetic, compile options.

A request that cannot be served raises; nothing falls back silently. Triton runs either on a
CUDA device, or on the CPU through Triton's interpreter, which Triton reads from the environment
variable TRITON_INTERPRET=1 when the `@triton.jit` decorators run (at import of a kernel module).
"""

from __future__ import annotations

import functools

import torch

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

BACKENDS = ("triton", "torch")
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the GEMM-family kernels' activations


def interpreted(kernel) -> bool:
    """True if `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_backend(backend: str, kernel, *tensors: torch.Tensor, what: str) -> None:
    """Raise unless `backend` is known and, for "triton", `kernel` can run on `tensors`' device."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if not devices:
        return  # nothing to place; the caller's own checks name what is wrong
    if len(devices) != 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if interpreted(kernel):
        if device.type != "cpu":
            raise RuntimeError(
                f"{what}: Triton's interpreter (TRITON_INTERPRET=1) runs on CPU tensors, got {device}"
            )
        return
    if device.type != "cuda":
        raise RuntimeError(
            f"{what}: backend='triton' needs CUDA tensors (got {device}); on a machine without a "
            "GPU set TRITON_INTERPRET=1 before importing fp4kit.kernels, or pass backend='torch'"
        )


def check_weight(w: nvfp4.NVFP4Tensor, what: str, batch_dims: int = 0) -> None:
    if not isinstance(w, nvfp4.NVFP4Tensor):
        raise TypeError(f"{what}: expected an NVFP4Tensor, got {type(w).__name__}")
    if w.packed.dim() != 2 + batch_dims:
        raise FormatError(f"{what}: expected a {2 + batch_dims}-d NVFP4 weight, got shape {w.shape}")
    if not (w.packed.is_contiguous() and w.block_scale.is_contiguous() and w.global_scale.is_contiguous()):
        raise FormatError(f"{what}: NVFP4 weight tensors must be contiguous")


def check_activations(x: torch.Tensor, k: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in ACT_DTYPES:
        raise FormatError(f"{what}: x must be a bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise FormatError(f"{what}: x of shape {tuple(x.shape)} does not end in K={k}")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid and split arithmetic (plain Python: `triton.cdiv` is a
    jit function, whose call from Python costs microseconds per launch)."""
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (cached per GPU); 4 on the CPU, where the interpreter runs
    small grids."""
    if device.type == "cuda":
        return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def make_current(device: str | torch.device) -> None:
    """Makes the GPU that `device` names (cuda:N) the current one: Triton launches its kernels on
    the current GPU, and CUDA graphs and events take its streams, so a job on cuda:1 runs with
    cuda:1 current. Other devices ("cpu", "auto", "cuda" without an index) leave it as it is."""
    if isinstance(device, str):
        if not device.startswith("cuda:"):
            return
        device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in plain Python for the same reason as `cdiv`."""
    return 1 << (n - 1).bit_length()


def launch_options() -> dict:
    """Compile options every fp4kit kernel is launched with.

    enable_fp_fusion=False: no multiply-add contraction, so every fp32 product and sum is rounded
    on its own, in the order the source states, exactly as the torch reference does.
    """
    return {"enable_fp_fusion": False}
