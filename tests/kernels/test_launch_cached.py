"""backend.launch_cached: the first call of a class goes through Triton, later ones launch the kept
binary with the argument list Triton would pass; a class never joins calls that Triton compiles
apart. A stand-in kernel records what it is asked to do (no GPU needed); the compiled launches
themselves are compared with Triton's on a GPU in tests/gpu/test_kernels_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from fp4kit.kernels import backend


class Compiled:
    """What Triton's launch returns: a binary with a raw launcher."""

    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.launches: list[tuple] = []
        self.metadata_calls: list[tuple] = []

    def run(self, *launch):  # grid0, grid1, grid2, stream, function, metadata, launch metadata, hooks, *args
        self.launches.append(launch)

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls.append((grid, stream, args))
        return {"meta": True}


def kernel_fn(x_ptr, y_ptr, n, stride, BLOCK, FLAG=False, MODE=3):
    pass


class Kernel:
    """Stands in for a @triton.jit function: `kernel[grid](...)` compiles (counts) and launches."""

    def __init__(self):
        import inspect

        self.signature = inspect.signature(kernel_fn)
        self.jit_calls: list[tuple] = []
        self.compiled: list[Compiled] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            self.compiled.append(Compiled())
            return self.compiled[-1]

        return launch


class Hooks:
    launch_enter_hook = None
    launch_exit_hook = None


@pytest.fixture
def runtime(monkeypatch):
    state = {"device": 0, "hooks": Hooks()}
    monkeypatch.setattr(backend, "_runtime", lambda: (lambda: state["device"], lambda d: 1000 + d, state["hooks"]))
    monkeypatch.setattr(backend, "_COMPILED", {})
    return state


class OnGPU(torch.Tensor):
    """A CPU tensor that says it is on a GPU: a class apart from the CPU's, whose address a kept
    launch would pass unchecked."""

    @property
    def is_cuda(self):
        return True


def tensors():
    buf = torch.zeros(256, dtype=torch.float32)
    return buf[:64], buf[64:128]  # both 16-byte aligned (256-byte offset)


def test_the_first_call_compiles_and_later_ones_launch_the_kept_binary(runtime):
    k = Kernel()
    x, y = tensors()
    backend.launch_cached(k, (4, 2), x, y, 64, 32, BLOCK=16, num_warps=4)
    assert len(k.jit_calls) == 1
    assert k.jit_calls[0] == ((4, 2), (x, y, 64, 32), {"BLOCK": 16, "num_warps": 4})
    assert k.compiled[0].launches == []  # Triton's own launch did the first one
    x2, y2 = torch.zeros(64), torch.zeros(64)
    backend.launch_cached(k, (8,), x2, y2, 48, 16, BLOCK=16, num_warps=4)
    assert len(k.jit_calls) == 1
    (launch,) = k.compiled[0].launches
    grid, stream, meta, hooks, args = launch[:3], launch[3], launch[4:7], launch[7:9], launch[9:]
    assert grid == (8, 1, 1) and stream == 1000
    assert meta == ("fn-handle", "packed", None) and hooks == (None, None)
    # the runtime arguments (tensors by their addresses), then every constexpr in the kernel's
    # order, defaults filled in
    assert args[:4] == (x2.data_ptr(), y2.data_ptr(), 48, 16) and args[4:] == (16, False, 3)


def test_a_call_triton_would_compile_apart_goes_through_triton(runtime):
    k = Kernel()
    x, y = tensors()
    base = dict(BLOCK=16, num_warps=4)
    backend.launch_cached(k, (1,), x, y, 64, 32, **base)
    variants = [
        ((x[1:], y, 64, 32), base),  # misaligned pointer
        ((x.double(), y, 64, 32), base),  # another dtype
        ((x, y, 1, 32), base),  # an int equal to 1
        ((x, y, 65, 32), base),  # an int not divisible by 16
        ((x, y, 2**31, 32), base),  # a 64-bit int
        ((x, y, 64, 32), dict(base, BLOCK=32)),  # another constexpr
        ((x, y, 64, 32), dict(base, num_warps=8)),  # another launch option
        ((x, y, 64, 32), dict(base, MODE=4)),  # a default overridden
        ((x.as_subclass(OnGPU), y, 64, 32), base),  # a tensor on a GPU where the kept one was not
    ]
    for i, (args, consts) in enumerate(variants):
        backend.launch_cached(k, (1,), *args, **consts)
        assert len(k.jit_calls) == 2 + i, f"variant {i} reused another class's binary"
        backend.launch_cached(k, (1,), *args, **consts)
        assert len(k.jit_calls) == 2 + i, f"variant {i} was not kept"
    runtime["device"] = 1  # the binary is loaded per device
    backend.launch_cached(k, (1,), x, y, 64, 32, **base)
    assert len(k.jit_calls) == len(variants) + 2


def test_an_argument_of_an_unknown_kind_always_goes_through_triton(runtime):
    k = Kernel()
    x, _ = tensors()
    for _ in range(3):
        backend.launch_cached(k, (1,), x, object(), 64, 32, BLOCK=16)
    assert len(k.jit_calls) == 3


def test_a_launch_hook_gets_its_metadata(runtime):
    k = Kernel()
    x, y = tensors()
    backend.launch_cached(k, (2,), x, y, 64, 32, BLOCK=16)
    enter, leave = object(), object()
    runtime["hooks"].launch_enter_hook, runtime["hooks"].launch_exit_hook = enter, leave
    backend.launch_cached(k, (2,), x, y, 64, 32, BLOCK=16)
    (launch,) = k.compiled[0].launches
    assert launch[6] == {"meta": True} and launch[7:9] == (enter, leave)
    assert k.compiled[0].metadata_calls == [((2,), 1000, (x.data_ptr(), y.data_ptr(), 64, 32, 16, False, 3))]


def test_the_interpreter_is_never_bypassed(runtime, monkeypatch):
    k = Kernel()
    monkeypatch.setattr(backend, "interpreted", lambda kernel: True)
    x, y = tensors()
    for _ in range(2):
        backend.launch_cached(k, (1,), x, y, 64, 32, BLOCK=16)
    assert len(k.jit_calls) == 2 and k.compiled[0].launches == []


def _samples():
    buf = torch.zeros(1024, dtype=torch.uint8)
    out = [buf[i:].view(torch.uint8) for i in (0, 1, 2, 4, 8, 16, 32)]
    out += [buf[i: i + 512].view(torch.bfloat16) for i in (0, 2, 8, 16)]
    out += [buf[i: i + 512].view(torch.float32) for i in (0, 4, 16)]
    out += [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31, 2**32, -(2**31), -(2**31) - 16, 2**63, 2**64 - 16]
    out += [True, False, 0.5, 1.0, None]
    return out


def test_the_classes_are_at_least_as_fine_as_tritons_specialisation():
    """Two arguments of one class get the same specialisation from the installed Triton, so a kept
    binary is never launched on an argument Triton would have compiled for differently."""
    samples = _samples()
    for a, b in itertools.combinations(samples, 2):
        if backend._arg_class(a) == backend._arg_class(b):
            ta = native_specialize_impl(BaseBackend, a, False, True, True)
            tb = native_specialize_impl(BaseBackend, b, False, True, True)
            assert ta == tb, (a, b)
    # and the classes do separate what they must (a class for everything would pass the above
    # only if Triton specialised nothing)
    assert len({backend._arg_class(a) for a in samples}) >= 10


def test_a_launch_classifies_its_arguments_as_the_one_argument_rule_does():
    samples = [*_samples(), torch.nn.Parameter(torch.zeros(4)), 7, -(2**31) - 1, torch.zeros(4).as_subclass(OnGPU)]
    classes, passed = backend._classify(tuple(samples))
    assert classes == backend._arg_classes(tuple(samples)) == tuple(map(backend._arg_class, samples))
    # what a kept launch passes: each tensor's address, everything else as it is
    assert passed == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in samples)
    assert all(type(p) is int for a, p in zip(samples, passed) if isinstance(a, torch.Tensor))


def test_constants_made_once_are_keyed_by_their_own_number(runtime):
    k = Kernel()
    x, y = tensors()
    plan = backend.Constants(BLOCK=16, num_warps=4)
    for change in (lambda: plan.__setitem__("BLOCK", 32), lambda: plan.update(BLOCK=32), lambda: plan.pop("BLOCK"),
                   lambda: plan.setdefault("MODE", 4), plan.clear, plan.popitem, lambda: plan.__delitem__("BLOCK")):
        with pytest.raises(TypeError):
            change()  # a kept plan's constants cannot drift from the binary kept for them
    assert plan == {"BLOCK": 16, "num_warps": 4}
    backend.launch_cached(k, (1,), x, y, 64, 32, constants=plan)
    assert k.jit_calls[0][2] == {"BLOCK": 16, "num_warps": 4}
    backend.launch_cached(k, (1,), x, y, 64, 32, constants=plan)
    assert len(k.jit_calls) == 1 and len(k.compiled[0].launches) == 1
    assert k.compiled[0].launches[0][9:] == (x.data_ptr(), y.data_ptr(), 64, 32, 16, False, 3)
    backend.launch_cached(k, (1,), x, y, 64, 32, constants=backend.Constants(BLOCK=32, num_warps=4))
    assert len(k.jit_calls) == 2 and k.jit_calls[1][2]["BLOCK"] == 32
