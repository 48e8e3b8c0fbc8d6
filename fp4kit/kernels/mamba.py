"""A Nemotron-H Mamba-2 mixer's one-token decode step between its two projections, in one launch.

Between `in_proj` and `out_proj` a decode step of a Mamba-2 mixer runs three things on the
projection's row [gate (I) | x, B, C (the conv channels, CD) | dt (H)]:

1. the depthwise causal convolution's update: each conv channel's state (S columns) shifted by
   the new column, K taps summed, SiLU;
2. the selective state update per head h of group g: dt + dt_bias and softplus, dA = exp(dt * A)
   with A = -exp(A_log), the state [P, N] times dA plus dt * B * x, the output contracted with C,
   the D skip;
3. the gated RMS norm over each group of heads: y * silu(gate), the group's mean square, the norm
   weight.

transformers runs these as a few dozen torch operators, Inductor as seven kernels per layer.
`mamba_step` runs them as one (`_mamba_step_kernel`): program (h, p-block, b) convolves its
BLOCK_P channels of x (and shifts their rows of the conv state, which are its own), convolves its
group's B and C channels, updates its [BLOCK_P, N] rows of the SSM state, writes y * silu(gate)
to an fp32 scratch row and counts itself in at its group's counter. The last of the group's
programs to arrive reads the group's scratch back (through L2), takes the mean square in fp32,
writes the normalised, weighted output in the activation dtype, shifts the group's B and C rows
of the conv state (every program of the group has read them by then) and puts the counter back
to 0 for the next launch. With the launch table's "mamba" STEP "pdl" (or `pdl=True`) on Hopper it
is a programmatic dependent of in_proj's launch: its programs request their state rows while
in_proj finishes and read proj only after it.

Arithmetic: `mamba_step_reference`, which is `conv_update` and `state_update` (transformers'
decode functions written element-wise, with its roundings: every product and sum of 16-bit values
rounded to their dtype where torch rounds it, the state in fp32, no multiply-add contraction;
`models.mamba_step` runs them in place of transformers') and transformers' NemotronHRMSNormGated.
On a GPU exp, log1p and rsqrt are libdevice's, the functions torch's CUDA operators call, so the
conv state and the SSM state equal the reference's bit for bit; the two fp32 sums (y over N, the
mean square over the group) run in another order than torch's, so y and the output can differ in
the last bit. Triton's interpreter has no libdevice: there exp is
numpy's float32 exp, log1p(v) is log(1 + v) and rsqrt(v) is 1 / sqrt(v) (`INTERPRETED_MATH`
gives the reference the same functions).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import backend, launch
from .backend import check_backend, current_device, interpreted, launch_cached, launch_options, next_power_of_2
from .fp8 import _e4m3_signed, _round_half, cast_e4m3
from .tiles import split_counters

_WHAT = "kernels.mamba_step"
BLOCK_P = 16  # head channels per program (on a GPU)
_HALF = {torch.bfloat16: 1, torch.float16: 2}
_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


EXP, LOG1P, RSQRT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _fn(v, FN: tl.constexpr, LIBDEVICE: tl.constexpr):
    """exp, log1p or rsqrt (FN) of fp32 v: libdevice's on a GPU, else the interpreter's stand-ins
    (module docstring)."""
    if LIBDEVICE:
        if FN == 0:
            out = libdevice.exp(v)
        elif FN == 1:
            out = libdevice.log1p(v)
        else:
            out = libdevice.rsqrt(v)
    else:
        if FN == 0:
            out = tl.exp(v)
        elif FN == 1:
            out = tl.log(1.0 + v)
        else:
            out = tl.math.rsqrt(v)
    return out


@triton.jit
def _silu(v, LIBDEVICE: tl.constexpr):
    """fp32 v / (1 + exp(-v)), IEEE division (torch's SiLU in fp32)."""
    return tl.math.div_rn(v, 1.0 + _fn(-v, EXP, LIBDEVICE))


@triton.jit
def _conv(new, conv_row, w_ptr, b_ptr, c, ok, S: tl.constexpr, K: tl.constexpr, BIAS: tl.constexpr,
          HALF: tl.constexpr, LIBDEVICE: tl.constexpr):
    """SiLU of conv channels `c`'s new output, as fp32 values of the activation dtype: the bias,
    then the K taps' products over the last K of (the state's S columns, `new`), added in tap
    order in fp32, rounded once; SiLU in fp32, rounded."""
    acc = tl.zeros_like(new.to(tl.float32))
    if BIAS:
        acc = tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        if S + 1 - K + j < S:
            v = tl.load(conv_row + c * S + (S + 1 - K + j), mask=ok, other=0.0).to(tl.float32)
        else:
            v = new.to(tl.float32)
        acc = acc + v * tl.load(w_ptr + c * K + j, mask=ok, other=0.0).to(tl.float32)
    return _round_half(_silu(_round_half(acc, HALF), LIBDEVICE), HALF)


@triton.jit
def _shifted(new, conv_row, c, ok, S: tl.constexpr, S_PAD: tl.constexpr):
    """(pointers, values, mask) of channels `c`'s conv-state rows shifted by one column, `new` in
    the last: load before any program stores into these rows."""
    i = tl.arange(0, S_PAD)
    ptrs = conv_row + c[:, None] * S + i[None, :]
    nxt = tl.load(ptrs + 1, mask=ok[:, None] & (i[None, :] + 1 < S), other=0.0)
    return ptrs, tl.where(i[None, :] == S - 1, new[:, None], nxt), ok[:, None] & (i[None, :] < S)


@triton.jit
def _mamba_step_kernel(proj_ptr, conv_ptr, ssm_ptr, cw_ptr, cb_ptr, dtb_ptr, alog_ptr, d_ptr, nw_ptr,
                       scale_ptr, gated_ptr, out_ptr, cnt_ptr, stride_proj, eps, inv_group,
                       H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                       K: tl.constexpr, HALF: tl.constexpr, BIAS: tl.constexpr, D_WIDE: tl.constexpr,
                       OUT_FP8: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_GS: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """Program (h * PB + p-block, b); see the module docstring. PDL: a programmatic dependent
    launch (`backend.pdl`) behind the launch that writes proj (in_proj): the SSM state rows and the
    head's parameters, which that launch does not write, are requested first, then the program
    waits for it (`gdc_wait`) before it reads proj or writes anything; once its own state update is
    counted in it lets the launch after it (out_proj) start, which waits for this one in turn. The
    same loads and arithmetic: the plain launch's bytes. LIBDEVICE false (Triton's interpreter):
    no grid-dependency instructions."""
    PB: tl.constexpr = (P + BLOCK_P - 1) // BLOCK_P
    HG: tl.constexpr = H // G
    I: tl.constexpr = H * P
    CD: tl.constexpr = I + 2 * G * N
    GS: tl.constexpr = HG * P
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = pid // PB
    g = h // HG
    row = proj_ptr + b * stride_proj
    conv_row = conv_ptr + b * (CD * S)
    p = (pid % PB) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < P
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    # Loads that depend on nothing computed here first: their round trips overlap the others'.
    offs = ((b * H + h) * P + p[:, None]) * N + n[None, :]
    st_ok = p_ok[:, None] & n_ok[None, :]
    state = tl.load(ssm_ptr + offs, mask=st_ok, other=0.0)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    a = -_fn(tl.load(alog_ptr + h).to(tl.float32), EXP, LIBDEVICE)
    skip = tl.load(d_ptr + h).to(tl.float32)
    if PDL and LIBDEVICE:
        gdc_wait()
    dt = tl.load(row + I + CD + h).to(tl.float32)
    gate = tl.load(row + h * P + p, mask=p_ok, other=0.0).to(tl.float32)
    # 1. the convolution: this block's x channels, the group's B and C channels
    cx = h * P + p
    cb = I + g * N + n
    x_new = tl.load(row + I + cx, mask=p_ok, other=0.0)
    x = _conv(x_new, conv_row, cw_ptr, cb_ptr, cx, p_ok, S, K, BIAS, HALF, LIBDEVICE)
    b_new = tl.load(row + I + cb, mask=n_ok, other=0.0)
    c_new = tl.load(row + I + G * N + cb, mask=n_ok, other=0.0)
    bv = _conv(b_new, conv_row, cw_ptr, cb_ptr, cb, n_ok, S, K, BIAS, HALF, LIBDEVICE)
    cv = _conv(c_new, conv_row, cw_ptr, cb_ptr, cb + G * N, n_ok, S, K, BIAS, HALF, LIBDEVICE)
    ptrs, shifted, s_ok = _shifted(x_new, conv_row, cx, p_ok, S, S_PAD)
    tl.debug_barrier()  # every thread's reads of these rows come before any thread's writes
    tl.store(ptrs, shifted, mask=s_ok)
    # 2. the state update
    dt = _round_half(dt + _round_half(dt_bias, HALF), HALF)
    dt = _round_half(tl.where(dt > 20.0, dt, _fn(_fn(dt, EXP, LIBDEVICE), LOG1P, LIBDEVICE)), HALF)
    da = _fn(dt * a, EXP, LIBDEVICE)
    dbx = _round_half(_round_half(dt * bv, HALF)[None, :] * x[:, None], HALF)
    state = state * da + dbx
    tl.store(ssm_ptr + offs, state, mask=st_ok)
    y = _round_half(tl.sum(_round_half(state, HALF) * cv[None, :], axis=1), HALF)
    if D_WIDE:
        y = _round_half(y + x * skip, HALF)
    else:
        y = _round_half(y + _round_half(x * skip, HALF), HALF)
    # 3. the gate; the group's last program normalises the group
    gated = y * _silu(gate, LIBDEVICE)
    tl.store(gated_ptr + b * I + cx, gated, mask=p_ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + b * G + g, 1, sem="acq_rel", scope="gpu")
    if PDL and LIBDEVICE:
        gdc_launch_dependents()
    if arrived == HG * PB - 1:
        q = tl.arange(0, BLOCK_GS)
        q_ok = q < GS
        v = tl.load(gated_ptr + b * I + g * GS + q, mask=q_ok, other=0.0, cache_modifier=".cg")
        r = _fn(tl.sum(v * v, axis=0) * inv_group + eps, RSQRT, LIBDEVICE)
        w = tl.load(nw_ptr + g * GS + q, mask=q_ok, other=0.0).to(tl.float32)
        normed = _round_half(w * _round_half(v * r, HALF), HALF)
        if OUT_FP8:  # e4m3(clamp(normed / scale, +-448)), as FP8Linear quantizes its input
            fp8 = tl.clamp(tl.math.div_rn(normed, tl.load(scale_ptr).to(tl.float32)), -448.0, 448.0,
                           propagate_nan=tl.PropagateNan.ALL)
            tl.store(out_ptr + b * I + g * GS + q, _e4m3_signed(fp8)[1].to(tl.uint8), mask=q_ok)
        else:
            tl.store(out_ptr + b * I + g * GS + q, normed.to(out_ptr.dtype.element_ty), mask=q_ok)
        b_ptrs, b_rows, b_ok = _shifted(b_new, conv_row, cb, n_ok, S, S_PAD)
        c_ptrs, c_rows, c_ok = _shifted(c_new, conv_row, cb + G * N, n_ok, S, S_PAD)
        tl.debug_barrier()
        tl.store(b_ptrs, b_rows, mask=b_ok)
        tl.store(c_ptrs, c_rows, mask=c_ok)
        tl.store(cnt_ptr + b * G + g, 0)


def conv_update(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None, activation: str | None = None, *, act=None) -> torch.Tensor:
    """transformers' `causal_conv1d_update` for one new column: hidden_states [B, C, 1],
    conv_state [B, C, S] (updated in place), weight [C, K] (K <= S + 1); returns [B, C, 1] in
    hidden_states' dtype. act: the activation's function in place of transformers' for the name
    `activation` (`mamba_step_reference` passes the functions its kernel computes)."""
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
        out = (act or ACT2FN[activation])(out)
    return out.to(hidden_states.dtype)


def state_update(state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                 dt_softplus: bool = False, z: torch.Tensor | None = None, *, exp=torch.exp, softplus=F.softplus,
                 **kwargs) -> torch.Tensor:
    """transformers' `mamba2_selective_state_update`: state [batch, H, P, N] (updated in place),
    hidden_states / dt [batch, H, P], A [H, P, N], B / C [batch, G, N], D / dt_bias [H, P];
    returns [batch, H, P] in hidden_states' dtype. Heads h = g * H / G + r belong to group g.
    exp, softplus: the functions used for dA and dt (torch's; see `conv_update`'s act)."""
    batch, heads, head_dim = hidden_states.shape
    groups, size = B.shape[1], B.shape[-1]
    per = heads // groups
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = softplus(dt)
    dt = dt[..., None]  # [batch, H, P, 1]
    dA = exp(dt.float() * A.float())
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


@dataclass(frozen=True)
class Math:
    """The transcendental functions of a Mamba step, as torch functions on tensors: SiLU and
    softplus on a tensor of any float dtype (computed in fp32, rounded to its dtype), exp and
    rsqrt on fp32."""

    silu: object
    softplus: object
    exp: object
    rsqrt: object


TORCH_MATH = Math(silu=F.silu, softplus=F.softplus, exp=torch.exp, rsqrt=torch.rsqrt)


def _numpy(fn):
    import numpy as np

    def run(t: torch.Tensor) -> torch.Tensor:
        with np.errstate(over="ignore", divide="ignore"):  # to inf, as torch's functions go
            out = np.asarray(fn(t.detach().float().cpu().numpy()), dtype=np.float32)
        return torch.from_numpy(out).to(t.device)
    return run


def _interpreted_math() -> Math:
    import numpy as np

    exp = _numpy(np.exp)

    def silu(t):
        v = t.float()
        return (v / (1.0 + exp(-v))).to(t.dtype)

    def softplus(t):
        v = t.float()
        return torch.where(v > 20.0, v, _numpy(np.log)(1.0 + exp(v))).to(t.dtype)

    return Math(silu=silu, softplus=softplus, exp=exp, rsqrt=_numpy(lambda a: 1 / np.sqrt(a)))


# The functions the kernel computes in Triton's interpreter (module docstring).
INTERPRETED_MATH = _interpreted_math()


def _sizes(proj, conv_state, ssm_state, conv_weight, groups):
    """(batch, heads, head_dim, state size, conv channels, state columns, taps) after the checks."""
    if not isinstance(proj, torch.Tensor) or proj.dim() != 2 or proj.dtype not in _HALF:
        raise ValueError(f"{_WHAT}: proj must be a bf16 or fp16 [batch, I + CD + H] tensor, got "
                         f"{getattr(proj, 'dtype', type(proj))} {tuple(getattr(proj, 'shape', ()))}")
    if not isinstance(ssm_state, torch.Tensor) or ssm_state.dim() != 4 or ssm_state.dtype != torch.float32 \
            or not ssm_state.is_contiguous():
        raise ValueError(f"{_WHAT}: ssm_state must be a contiguous fp32 [batch, H, P, N] tensor, got "
                         f"{getattr(ssm_state, 'dtype', None)} {tuple(getattr(ssm_state, 'shape', ()))}")
    batch, heads, head_dim, size = ssm_state.shape
    if not isinstance(groups, int) or groups < 1 or heads % groups:
        raise ValueError(f"{_WHAT}: groups must divide the {heads} heads, got {groups!r}")
    channels = heads * head_dim + 2 * groups * size
    if proj.shape != (batch, heads * head_dim + channels + heads):
        raise ValueError(f"{_WHAT}: proj must be [{batch}, {heads * head_dim + channels + heads}] (gate, x, B, C, dt), "
                         f"got {tuple(proj.shape)}")
    if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3 or conv_state.shape[:2] != (batch, channels) \
            or conv_state.dtype != proj.dtype or not conv_state.is_contiguous():
        raise ValueError(f"{_WHAT}: conv_state must be a contiguous {proj.dtype} [{batch}, {channels}, S] tensor, got "
                         f"{getattr(conv_state, 'dtype', None)} {tuple(getattr(conv_state, 'shape', ()))}")
    if not isinstance(conv_weight, torch.Tensor) or conv_weight.dim() != 2 or conv_weight.shape[0] != channels \
            or conv_weight.dtype != proj.dtype or not 1 <= conv_weight.shape[1] <= conv_state.shape[2] + 1:
        raise ValueError(f"{_WHAT}: conv_weight must be a {proj.dtype} [{channels}, K] tensor with K <= "
                         f"{conv_state.shape[2] + 1}, got {getattr(conv_weight, 'dtype', None)} "
                         f"{tuple(getattr(conv_weight, 'shape', ()))}")
    return batch, heads, head_dim, size, channels, conv_state.shape[2], conv_weight.shape[1]


def _check_vector(name: str, t, n: int, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype not in _PARAM_DTYPES:
        raise ValueError(f"{_WHAT}: {name} must be a bf16, fp16 or fp32 [{n}] tensor, got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def mamba_step_reference(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                         conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                         A_log: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor, eps: float, groups: int,
                         out_scale: torch.Tensor | None = None, *, math: Math = TORCH_MATH) -> torch.Tensor:
    """`mamba_step` in torch: `conv_update` and `state_update` with transformers' arguments, then
    transformers' NemotronHRMSNormGated (`math`: the functions used for SiLU, softplus, exp and
    rsqrt); with `out_scale`, that quantized as FP8Linear quantizes its input."""
    batch, heads, head_dim, size, channels, _, _ = _sizes(proj, conv_state, ssm_state, conv_weight, groups)
    inter = heads * head_dim
    gate, xbc, dt = proj.split([inter, channels, heads], dim=-1)
    xbc = conv_update(xbc[:, :, None], conv_state, conv_weight, conv_bias, "silu", act=math.silu)[:, :, 0]
    x, B, C = xbc.split([inter, groups * size, groups * size], dim=-1)
    A = -math.exp(A_log.float())
    y = state_update(ssm_state, x.reshape(batch, heads, head_dim), dt[:, :, None].expand(-1, -1, head_dim),
                     A[:, None, None].expand(-1, head_dim, size), B.reshape(batch, groups, size),
                     C.reshape(batch, groups, size), D[:, None].expand(-1, head_dim),
                     dt_bias=dt_bias[:, None].expand(-1, head_dim), dt_softplus=True, exp=math.exp,
                     softplus=math.softplus).reshape(batch, inter)
    hidden = y.to(torch.float32) * math.silu(gate.to(torch.float32))
    hidden = hidden.view(batch, groups, inter // groups)
    hidden = hidden * math.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    out = (norm_weight * hidden.view(batch, inter).to(y.dtype)).to(proj.dtype)
    return out if out_scale is None else cast_e4m3(out.float() / out_scale.float())


def mamba_step(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, conv_weight: torch.Tensor,
               conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
               norm_weight: torch.Tensor, eps: float, groups: int, out_scale: torch.Tensor | None = None, *,
               backend: str = "triton", pdl: bool | None = None) -> torch.Tensor:
    """One decode step of a Nemotron-H Mamba-2 mixer between in_proj and out_proj: out_proj's
    input [batch, I] in proj's dtype, or with `out_scale` (FP8Linear's fp32 input_scale, one
    element) quantized to float8_e4m3fn as FP8Linear quantizes it (e4m3(clamp(x / scale, +-448)));
    conv_state and ssm_state are updated in place.

    proj: in_proj's output rows [batch, I + CD + H] (gate, x, B, C, dt; bf16 or fp16, unit stride
    along the row); conv_state: [batch, CD, S] in proj's dtype, contiguous; ssm_state: [batch, H,
    P, N] fp32, contiguous; conv_weight: [CD, K] in proj's dtype (K <= S + 1); conv_bias: [CD] or
    None; dt_bias, A_log, D: [H]; norm_weight: [I] (these bf16, fp16 or fp32); eps: the norm's
    epsilon; groups: G, with I = H * P and CD = I + 2 * G * N. backend: "triton"
    (`_mamba_step_kernel`) or "torch" (`mamba_step_reference`). pdl: launch the kernel as a
    programmatic dependent of the launch before it (None: the launch table's "mamba" STEP "pdl");
    where `backend.pdl` allows it, and in Triton's interpreter as the same loads in that order."""
    if isinstance(conv_weight, torch.Tensor) and conv_weight.dim() == 3 and conv_weight.shape[1] == 1:
        conv_weight = conv_weight.view(conv_weight.shape[0], conv_weight.shape[2])  # nn.Conv1d's [CD, 1, K]
    batch, heads, head_dim, size, channels, columns, taps = _sizes(proj, conv_state, ssm_state, conv_weight, groups)
    inter = heads * head_dim
    _check_vector("conv_bias", conv_bias, channels, optional=True)
    for name, t, n in (("dt_bias", dt_bias, heads), ("A_log", A_log, heads), ("D", D, heads),
                       ("norm_weight", norm_weight, inter)):
        _check_vector(name, t, n)
    if not isinstance(eps, float) or not eps >= 0:
        raise ValueError(f"{_WHAT}: eps must be a float >= 0, got {eps!r}")
    if out_scale is not None and (not isinstance(out_scale, torch.Tensor) or out_scale.numel() != 1
                                  or out_scale.dtype != torch.float32):
        raise ValueError(f"{_WHAT}: out_scale must be a one-element fp32 tensor, got "
                         f"{getattr(out_scale, 'dtype', type(out_scale))} {tuple(getattr(out_scale, 'shape', ()))}")
    check_backend(backend, _mamba_step_kernel, proj, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                  norm_weight, out_scale, what=_WHAT)
    if backend == "torch":
        return mamba_step_reference(proj, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                                    norm_weight, eps, groups, out_scale)
    if proj.stride(1) != 1:
        proj = proj.contiguous()
    conv_weight = conv_weight.contiguous()
    out = torch.empty((batch, inter), dtype=proj.dtype if out_scale is None else torch.float8_e4m3fn,
                      device=proj.device)
    if batch == 0:
        return out
    gated = torch.empty((batch, inter), dtype=torch.float32, device=proj.device)
    group = inter // groups
    gpu = proj.get_device()
    with torch.cuda.device(gpu) if gpu >= 0 and gpu != current_device() else contextlib.nullcontext():
        counters = split_counters(proj.device, batch * groups)
        native = not interpreted(_mamba_step_kernel)
        block_p = min(BLOCK_P if native else 64, next_power_of_2(head_dim))
        args = (proj, conv_state, ssm_state, conv_weight, conv_weight if conv_bias is None else conv_bias,
                dt_bias, A_log, D, norm_weight, dt_bias if out_scale is None else out_scale, gated,
                out if out_scale is None else out.view(torch.uint8), counters, proj.stride(0), float(eps), 1.0 / group)
        pdl = _launch_pdl(pdl, proj.device, native)
        consts = dict(H=heads, P=head_dim, N=size, G=groups, S=columns, K=taps, HALF=_HALF[proj.dtype],
                      BIAS=conv_bias is not None, D_WIDE=D.dtype != proj.dtype, OUT_FP8=out_scale is not None,
                      LIBDEVICE=native, BLOCK_P=block_p,
                      BLOCK_N=next_power_of_2(size), BLOCK_GS=next_power_of_2(group),
                      S_PAD=max(next_power_of_2(columns), 2), PDL=pdl, **({"launch_pdl": True} if pdl and native else {}),
                      num_warps=4, **launch_options())
        launch_cached(_mamba_step_kernel, (heads * -(-head_dim // block_p), batch), *args, **consts)
    return out


def _launch_pdl(pdl: bool | None, device: torch.device, native: bool) -> bool:
    """Whether the step goes as a programmatic dependent launch: `pdl`, or where None the launch
    table's "mamba" STEP "pdl" (False where the tuning file has no such entry); natively only where
    `backend.pdl` allows it on `device`, in Triton's interpreter as the same loads in that order."""
    want = launch.tables().get("mamba", {}).get("STEP", {}).get("pdl", False) if pdl is None else pdl
    return backend.dependent_launch(want, device, _mamba_step_kernel, native)
