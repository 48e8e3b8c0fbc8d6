"""The one backend switch of fp4kit.kernels: "triton" (the kernels) or "torch" (the reference),
and what every launcher shares: input checks, grid arithmetic, compile options.

A request that cannot be served raises; nothing falls back silently. Triton runs either on a
CUDA device, or on the CPU through Triton's interpreter, which Triton reads from the environment
variable TRITON_INTERPRET=1 when the `@triton.jit` decorators run (at import of a kernel module).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping

import torch

from fp4kit.formats import nvfp4
from fp4kit.formats.errors import FormatError

BACKENDS = ("triton", "torch")
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the GEMM-family kernels' activations


def interpreted(kernel) -> bool:
    """True if `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def exact_dot(dtype: torch.dtype, kernel) -> bool:
    """Whether `kernel`'s `tl.dot` runs on fp32 operands with IEEE fp32 sums (`tiles.accumulate`'s
    IEEE): for fp32 activations; and in the interpreter for 16-bit ones too, whose products are
    exact in fp32 as on the matrix units (the interpreter's own bf16 dot returns wrong values)."""
    return dtype == torch.float32 or (interpreted(kernel) and dtype in (torch.bfloat16, torch.float16))


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


def pdl(device: torch.device, kernel) -> bool:
    """Whether `kernel` can be launched as a programmatic dependent of the kernel before it on
    `device`'s stream (CUDA's programmatic dependent launch, Hopper onwards): a launch with
    launch_pdl=True may start while its predecessor still runs, so it must wait (`gdc_wait`)
    before reading what the predecessor writes and before writing anything. Never under Triton's
    interpreter, which has no grid dependencies."""
    if device.type != "cuda" or interpreted(kernel):
        return False
    return capability(device) >= (9, 0)


def dependent_launch(want, device: torch.device, kernel, native: bool | None = None) -> bool:
    """Whether a launch of `kernel` asked to be a programmatic dependent (`want`) takes its
    dependent code path: natively (native None: `kernel` not interpreted) only where `pdl` allows
    it on `device`; in Triton's interpreter whenever asked, as the same loads in the dependent
    order (there is no launch to wait for)."""
    native = not interpreted(kernel) if native is None else native
    return bool(want) and (not native or pdl(device, kernel))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked of the driver once per GPU."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def split_k(programs: int, k: int, block_k: int, device: torch.device, rule: Mapping) -> tuple[int, int]:
    """(splits, K per split) for a launch of `programs` programs over K: split K while there are
    fewer than rule["programs_per_sm"] programs per multiprocessor, at most rule["max_parts"] ways,
    never below one K tile of block_k."""
    k_blocks = cdiv(k, block_k)
    want = rule["programs_per_sm"] * sm_count(device)
    split = 1 if programs >= want else max(1, min(k_blocks, want // max(programs, 1), rule["max_parts"]))
    k_per_split = cdiv(k_blocks, split) * block_k
    return cdiv(k, k_per_split), k_per_split


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


# --- launching a compiled kernel without Triton's per-call dispatch ---------------------------

_COMPILED: dict = {}  # (kernel, device, constants, argument classes) -> (compiled kernel, constant tail)
_TOKENS = itertools.count()


class Constants(dict):
    """A kernel's constexprs and launch options, made once for many launches (a launch plan keeps
    them): `launch_cached` keys them by a number of their own instead of by their items."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.token = ("constants", next(_TOKENS))

    def _fixed(self, *args, **kwargs):
        raise TypeError("Constants are fixed once made")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = __ior__ = _fixed


def _arg_class(a):
    """What Triton's specialisation can tell apart in a runtime argument, or a finer class: a
    tensor's dtype, 16-byte alignment and whether it is on a GPU; an int's equality to 1,
    divisibility by 16 and width; a bool's value; a float or None as such. Unknown kinds give
    None (no cached launch)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0, a.is_cuda
    if isinstance(a, bool) or a is None:
        return a, 0
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63
    if isinstance(a, float):
        return float
    return None


def _classify(args: tuple, tensor=torch.Tensor) -> tuple[tuple, tuple]:
    """(tuple(map(_arg_class, args)), the arguments as a kept launch passes them: each tensor by
    its data pointer, an int). The tensors and plain ints of a launch are classified inline (a
    launch's host time is counted in microseconds). Triton's launcher takes an int for a pointer
    as the address itself; given a tensor it asks the driver about the pointer on every launch
    (cuPointerGetAttribute), which the class's `is_cuda` makes needless here."""
    classes, flat = [], []
    for a in args:
        if isinstance(a, tensor):
            p = a.data_ptr()
            classes.append((a.dtype, p % 16 == 0, a.is_cuda))
            flat.append(p)
        elif type(a) is int:
            classes.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63))
            flat.append(a)
        else:
            classes.append(_arg_class(a))
            flat.append(a)
    return tuple(classes), tuple(flat)


def _arg_classes(args: tuple) -> tuple:
    """tuple(map(_arg_class, args)), as a launch classifies them (`_classify`)."""
    return _classify(args)[0]


@functools.cache
def _runtime():
    """(current CUDA device, current raw stream of a device, Triton's launch hooks)."""
    from triton import knobs
    from triton.runtime import driver

    active = driver.active
    device = active.get_current_device
    if device is torch.cuda.current_device and torch.cuda.is_initialized() and hasattr(torch._C, "_cuda_getDevice"):
        device = torch._C._cuda_getDevice  # the same answer without torch's lazy-initialisation check
    return device, active.get_current_stream, knobs.runtime


def launch_cached(kernel, grid: tuple, *args, constants: Constants | None = None, **consts) -> tuple | None:
    """`kernel[grid](*args, **consts)`, with Triton's per-call dispatch done once per class of call.

    args: the kernel's runtime arguments, in order; consts: its constexprs and launch options, by
    name, or all of them as one `Constants` (`constants=`). A call's class is the kernel, the
    current device, the constants, and each argument's `_arg_class`, which separates at least
    what Triton specialises a compiled binary on (dtypes, 16-byte alignment of pointers, integers
    equal to 1 or divisible by 16, integer widths). The
    first call of a class goes through Triton (compiling if it must) and keeps the compiled
    kernel; later calls of that class launch it directly with the argument list Triton would
    pass (the constexprs in the kernel's order, defaults filled in; each tensor by its address),
    skipping Triton's argument binding and cache key. Under Triton's interpreter, or for an argument of another
    kind, every call goes through Triton.

    Returns the kept (compiled kernel, constexpr tail) of the call's class, for `launch_kept`
    (None where nothing is kept: the interpreter, an argument of another kind)."""
    if constants is not None:
        consts, which = constants, constants.token
    else:
        which = None
    if interpreted(kernel):
        kernel[grid](*args, **consts)
        return None
    classes, flat = _classify(args)
    current_device, current_stream, hooks = _runtime()
    device = current_device()
    key = None
    if None not in classes:
        try:
            key = (kernel, device, which or tuple(consts.items()), classes)
            hit = _COMPILED.get(key)
        except TypeError:  # an unhashable constant
            key = None
    if key is None or hit is None:
        compiled = kernel[grid](*args, **consts)
        if key is not None and compiled is not None:
            if hasattr(compiled, "result"):  # a compile future
                compiled = compiled.result()
            params = kernel.signature.parameters
            tail = tuple(consts[name] if name in consts else params[name].default
                         for name in list(params)[len(args):])
            compiled.run  # loads the binary (sets `function`) if the launch above did not
            _COMPILED[key] = (compiled, tail)
            return _COMPILED[key]
        return None
    _launch(hit, grid, current_stream(device), hooks, flat)
    return hit


def current_device() -> int:
    """The current CUDA device's index, as Triton launches on it."""
    return _runtime()[0]()


def current_stream(index: int) -> int:
    """The raw handle of GPU `index`'s current CUDA stream, the one Triton launches on."""
    return _runtime()[1](index)


def launch_kept(kept: tuple, grid: tuple, *args, device: int | None = None) -> None:
    """Launches `kept` (what `launch_cached` returned) on `args` without classifying them: the
    caller vouches that they are of the class of that call (the same kernel, constants, current
    device, dtypes, 16-byte alignments and integer classes), as a launcher that keys its kept
    launches by all of these does, and passes its tensors on the current GPU or their addresses
    (ints; `_classify`). device: the current device, where the caller has it."""
    _, current_stream, hooks = _runtime()
    _launch(kept, grid, current_stream(current_device() if device is None else device), hooks, args)


def _launch(kept: tuple, grid: tuple, stream, hooks, args: tuple) -> None:
    compiled, tail = kept
    g = (*grid, 1, 1)
    full = (*args, *tail)
    enter = hooks.launch_enter_hook
    meta = compiled.launch_metadata(grid, stream, *full) if enter is not None else None
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta, enter,
                 hooks.launch_exit_hook, *full)
