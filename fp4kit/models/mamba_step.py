"""The Mamba-2 mixer's one-token decode step written element-wise, for `fp4kit.generate`.

transformers' plain-torch decode step for a Mamba-2 mixer (`causal_conv1d_update` and
`mamba2_selective_state_update` in its modeling module, the code it runs where neither
mamba-ssm nor causal-conv1d is installed) convolves the conv state and the new column with
`F.conv1d`, copies B and C once per head (`expand(...).contiguous()`), and contracts the new
state with C by `torch.bmm` on a bf16 copy of the state. Under `torch.compile` the convolution
and the bmm stay library kernels of their own between the fused ones, and the copies stay
copies.

`conv_update` and `state_update` (defined in `kernels.mamba`, whose one-launch step computes
them) take the same arguments and do the same arithmetic with the same roundings, written as
element-wise operations and one sum, with B and C broadcast over the heads of their group
instead of copied:

- the convolution: fp32 sums of the bias and the K taps' products, in tap order (PyTorch's CUDA
  depthwise kernel's order; a product of two bf16 values is exact in fp32), rounded once to the
  weight's dtype, then the activation. The conv state is transformers', bit for bit.
- the state update: transformers' operations in its order and dtypes (dt + bias and softplus in
  dt's dtype, exp(dt * A) in fp32, dt * B and its product with x rounded to B's dtype, the new
  state in fp32), so the new state is transformers', bit for bit; the output contracts the state
  rounded to C's dtype with C as exact fp32 products summed in fp32 (bmm's arithmetic, in another
  order), then the D skip and the gate as transformers applies them.

`elementwise_mamba_step(model)` puts the two in place of transformers' functions for the
model's Mamba mixers within the block (`switched(mixer_modules(model))`, the modules found once). Mixers whose modeling module resolves those functions to
mamba-ssm's or causal-conv1d's kernels (installed and importable) keep them.

`one_launch(one_launch_mixers(model))` goes further on a GPU: within the block each Nemotron-H
mixer runs a one-token cached step as in_proj, one launch for everything between the two
projections (`kernels.mamba.mamba_step`: the convolution, the state update and the gated norm,
the conv and SSM states updated in place) and out_proj (`_one_launch_forward`).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from ..kernels import mamba as mamba_kernels, ops as kernel_ops
from ..kernels.backend import interpreted
from ..kernels.mamba import conv_update, state_update

# Whether the step kernel runs compiled (not in Triton's interpreter): fixed at import, and a
# constant to code that torch.compile traces (dynamo cannot take the type of a compiled Triton
# kernel, and asking it that at trace time broke the graph at every mixer).
_STEP_KERNEL = not interpreted(mamba_kernels._mamba_step_kernel)
# transformers' names of the two functions, in the mixer's modeling module.
CONV_UPDATE = "causal_conv1d_update"
STATE_UPDATE = "mamba2_selective_state_update"


def mixer_modules(model: nn.Module) -> list:
    """The modeling modules of the model's Mamba mixers that define both decode functions, where
    transformers runs its own torch code for them (neither kernel package imports)."""
    from .nemotron_h import mamba_kernels

    if any(version is not None for version in mamba_kernels().values()):
        return []
    out = []
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if (module is not None and module not in out and type(m).__name__.endswith("Mamba2Mixer")
                and all(callable(getattr(module, name, None)) for name in (CONV_UPDATE, STATE_UPDATE))):
            out.append(module)
    return out


@contextlib.contextmanager
def elementwise_mamba_step(model: nn.Module):
    """Within the block, the model's Mamba mixers run `conv_update` and `state_update` in place of
    transformers' plain-torch functions. Yields how many modeling modules were switched."""
    with switched(mixer_modules(model)) as count:
        yield count


@contextlib.contextmanager
def switched(modules: list):
    """Within the block, `modules` (`mixer_modules`' list) hold `conv_update` and `state_update`
    under transformers' names. Yields how many there are."""
    saved = [(module, getattr(module, CONV_UPDATE), getattr(module, STATE_UPDATE)) for module in modules]
    for module in modules:
        setattr(module, CONV_UPDATE, conv_update)
        setattr(module, STATE_UPDATE, state_update)
    try:
        yield len(modules)
    finally:
        for module, conv, step in saved:
            setattr(module, CONV_UPDATE, conv)
            setattr(module, STATE_UPDATE, step)


# Each mixer class's subclass with the one-launch decode step (one per class, so code compiled for
# it stays valid from one block to the next).
_ONE_LAUNCH_CLASSES: dict[type, type] = {}
MIXER_CLASS = "NemotronHMamba2Mixer"


def one_launch_mixers(model: nn.Module) -> list:
    """The model's mixers that `one_launch` switches: transformers' own Nemotron-H Mamba-2 mixers
    with a SiLU convolution and no forward set on the instance (accelerate's hooks)."""
    return [m for m in model.modules()
            if type(m).__name__ == MIXER_CLASS and type(m).__module__.startswith("transformers.")
            and getattr(m, "activation", None) == "silu" and "forward" not in m.__dict__]


@contextlib.contextmanager
def one_launch(mixers: list):
    """Within the block, `mixers` (`one_launch_mixers`' list) run one-token cached steps on a GPU
    through `_one_launch_forward`; each is its own class again at the end. Yields how many."""
    from .nemotron_h import _with_forward

    bases = [type(m) for m in mixers]
    for m, base in zip(mixers, bases):
        m.__class__ = _with_forward(_ONE_LAUNCH_CLASSES, base, "OneLaunch", _one_launch_forward)
    try:
        yield len(mixers)
    finally:
        for m, base in zip(mixers, bases):
            m.__class__ = base


def step_backend(hidden_states: torch.Tensor) -> str | None:
    """The backend `_one_launch_forward` runs `kernels.mamba.mamba_step` on for these rows: "triton"
    on a GPU (compiled kernels), else None (the mixer's own forward)."""
    return "triton" if hidden_states.is_cuda and _STEP_KERNEL else None


def decode_states(cache, layer_idx: int) -> tuple | None:
    """(conv state, SSM state, whether the cache counts the step) of a Mamba layer whose one-token
    step updates both in place, as transformers' own forward would: the layer has a previous state
    and does not record its past. transformers 5.2x: the cache's accessors (its token count goes up
    by one per step); 5.18: the layer's state lists."""
    if cache is None:
        return None
    if hasattr(cache, "get_conv_state"):
        conv = cache.get_conv_state(layer_idx)
        if conv is None or cache.is_recording_past(layer_idx):
            return None
        return conv, cache.get_recurrent_state(layer_idx, state_idx=0), True
    if not cache.has_previous_state(layer_idx):
        return None
    layer = cache.layers[layer_idx]
    if getattr(layer, "record_past", False):
        return None
    return layer.conv_states[0], layer.recurrent_states[0], False


def _fits(mixer: nn.Module, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
    """Whether `kernels.mamba.mamba_step` computes this mixer's step (its checks would pass)."""
    dtype = hidden_states.dtype
    inter = mixer.num_heads * mixer.head_dim
    params = (mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight) + (
        () if mixer.conv1d.bias is None else (mixer.conv1d.bias,))
    return (dtype in (torch.bfloat16, torch.float16) and mixer.conv1d.weight.dtype == dtype
            and isinstance(conv_state, torch.Tensor) and conv_state.dtype == dtype and conv_state.is_contiguous()
            and isinstance(ssm_state, torch.Tensor) and ssm_state.dtype == torch.float32 and ssm_state.is_contiguous()
            and getattr(mixer.norm, "group_size", None) == inter // mixer.n_groups
            and all(p.dtype in (torch.bfloat16, torch.float16, torch.float32) for p in params))


def _one_launch_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A Nemotron-H Mamba-2 mixer's forward whose one-token cached step (no padding mask, not
    training, on a GPU: `step_backend`) is in_proj, `kernels.mamba.mamba_step` (one launch: the
    convolution, the state update and the gated norm, and an FP8 out_proj's input quantization;
    the cache's conv and SSM states updated in place) and out_proj. Other calls run the mixer's
    own forward."""
    base = type(self).__bases__[0]
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    backend = step_backend(hidden_states) if hidden_states.shape[1] == 1 and mask is None and not self.training else None
    states = decode_states(cache, self.layer_idx) if backend else None
    if states is None or not _fits(self, hidden_states, states[0], states[1]):
        return base.forward(self, hidden_states, *args, **kwargs)
    conv_state, ssm_state, counted = states
    batch = hidden_states.shape[0]
    proj = self.in_proj(hidden_states).view(batch, -1)
    if proj.dtype != hidden_states.dtype:  # a projection that changes the dtype: the mixer's own step
        return base.forward(self, hidden_states, *args, **kwargs)
    # An FP8 out_proj (fp4kit.modules.FP8Linear) takes its input quantized by the same launch.
    fp8 = callable(getattr(self.out_proj, "forward_fp8", None))
    step = (proj, conv_state, ssm_state, self.conv1d.weight.view(self.conv1d.weight.shape[0], -1), self.conv1d.bias,
            self.dt_bias, self.A_log, self.D, self.norm.weight, float(self.norm.variance_epsilon), self.n_groups,
            self.out_proj.input_scale.float().reshape(1) if fp8 else None)
    if backend == "triton" and torch.compiler.is_compiling():
        out = kernel_ops.mamba_step(*step)
    else:
        out = mamba_kernels.mamba_step(*step, backend=backend)
    if counted:
        cache.increase_count(self.layer_idx, 0)
    out = out.view(batch, 1, -1)
    return self.out_proj.forward_fp8(out, hidden_states.dtype) if fp8 else self.out_proj(out)
