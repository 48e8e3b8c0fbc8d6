"""The Mamba-2 mixer's one-token decode step written element-wise, for `fp4kit.generate`.

transformers' plain-torch decode step for a Mamba-2 mixer (`causal_conv1d_update` and
`mamba2_selective_state_update` in its modeling module, the code it runs where neither
mamba-ssm nor causal-conv1d is installed) convolves the conv state and the new column with
`F.conv1d`, copies B and C once per head (`expand(...).contiguous()`), and contracts the new
state with C by `torch.bmm` on a bf16 copy of the state. Under `torch.compile` the convolution
and the bmm stay library kernels of their own between the fused ones, and the copies stay
copies.

`conv_update` and `state_update` take the same arguments and do the same arithmetic with the
same roundings, written as element-wise operations and one sum, with B and C broadcast over the
heads of their group instead of copied:

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
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

# transformers' names of the two functions, in the mixer's modeling module.
CONV_UPDATE = "causal_conv1d_update"
STATE_UPDATE = "mamba2_selective_state_update"


def conv_update(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """transformers' `causal_conv1d_update` for one new column: hidden_states [B, C, 1],
    conv_state [B, C, S] (updated in place), weight [C, K] (K <= S + 1); returns [B, C, 1] in
    hidden_states' dtype."""
    from transformers.activations import ACT2FN

    if hidden_states.shape[-1] != 1:
        raise ValueError(f"conv_update takes one new column, got {hidden_states.shape[-1]}")
    state_len, taps = conv_state.shape[-1], weight.shape[-1]
    columns = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)  # [B, C, S + 1]
    conv_state.copy_(columns[:, :, -state_len:])
    window = columns[:, :, -taps:].float()
    w = weight.float()
    acc = bias.float().expand(window.shape[:-1]) if bias is not None else torch.zeros_like(window[:, :, 0])
    for j in range(taps):
        acc = acc + window[:, :, j] * w[:, j]
    out = acc.to(weight.dtype)[:, :, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def state_update(state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                 dt_softplus: bool = False, z: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' `mamba2_selective_state_update`: state [batch, H, P, N] (updated in place),
    hidden_states / dt [batch, H, P], A [H, P, N], B / C [batch, G, N], D / dt_bias [H, P];
    returns [batch, H, P] in hidden_states' dtype. Heads h = g * H / G + r belong to group g."""
    batch, heads, head_dim = hidden_states.shape
    groups, size = B.shape[1], B.shape[-1]
    per = heads // groups
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt[..., None]  # [batch, H, P, 1]
    dA = torch.exp(dt.float() * A.float())
    by_group = (batch, groups, per, head_dim, size)
    dB = dt.reshape(batch, groups, per, head_dim, 1) * B.reshape(batch, groups, 1, 1, size)
    dBx = dB * hidden_states.reshape(batch, groups, per, head_dim, 1)
    new = state.reshape(by_group) * dA.reshape(by_group) + dBx  # fp32: dBx promoted, as in transformers
    state.copy_(new.view(state.shape).to(state.dtype))
    rounded = new.to(C.dtype).float()
    out = (rounded * C.reshape(batch, groups, 1, 1, size).float()).sum(-1).to(C.dtype).view(batch, heads, head_dim)
    if D is not None:
        out = (out + hidden_states * D).to(out.dtype)
    if z is not None:
        out = out * F.silu(z)
    return out.to(hidden_states.dtype)


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
