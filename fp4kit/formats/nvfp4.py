"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements along K, one fp32 global scale.

The arithmetic is nvidia-modelopt 0.47's export arithmetic, in its order (all fp32):

plain rule "6" (ModelOpt's dynamic path, presets `nvfp4` / `w4a16_nvfp4`):
    A = max|W| (per expert for [E, N, K] stacks; or the `global_amax` shared by fused siblings)
    global_scale = A / 2688                                   (weight_scale_2)
    s = block_amax / (6 * global_scale); s[s == 0] = 1        (6 * global_scale rounded first)
    block_scale = e4m3(clamp(s, 2^-9, 448))
static path (presets `nvfp4_static`, `nvfp4_four_over_six`), with normalisation m = 448 or 256:
    global_scale = g / (6 * m)
    s = a_b / 6; s[s == 0] = 1; block_scale = e4m3(clamp(s * m / (g / 6), 2^-9, 448))
both:
    codes = E2M1(W / (float(block_scale) * global_scale))     (a division by the product)
    dequantized = E2M1_value * (float(block_scale) * global_scale)

Four-Over-Six (rule "4o6") is the static path with m = 256 and a per-block amax multiplier of
1.0 (block max -> 6) or 1.5 (block max -> 4), whichever reconstructs the block with the smaller
squared error; a tie keeps 1.0. The error is that of the exported bytes (dequantized as above,
minus W in fp32), optionally weighted per input channel by `importance`, summed over the 16
elements in a fixed pairwise order (see `block_sum16`) so that any kernel can reproduce the
choice bit for bit. ModelOpt's `mse` calibration takes the decision on its fake-quant kernel
instead (fp32, block scales without the 2^-9 floor, and sometimes rounded to another E4M3 code
or step than its own export writes), so the two choices can differ there: on 187 of 622,592
blocks of the embedded model (scripts/compare_modelopt_mse.py).

Every division by a constant (/2688, /1536, /6) follows `arith` (see arith.py): ModelOpt's
own bytes differ between CUDA and CPU there, and fp4kit reproduces either on any device.

One intentional divergence from ModelOpt: an all-zero tensor (or expert) is stored with global
scale 1.0, block scales 1.0 and codes 0, where ModelOpt writes NaN scales and 0x77 codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import e2m1, e4m3
from .arith import DEFAULT_ARITH, check_mode, div_const
from .constants import (
    BLOCK_SCALE_MAX,
    BLOCK_SCALE_MIN,
    E2M1_MAX,
    FOUR_OVER_SIX_MULTIPLIERS,
    FP8_NORM_4O6,
    FP8_NORM_PLAIN,
    NVFP4_BLOCK_SIZE,
    NVFP4_GLOBAL_DENOM,
)
from .errors import FormatError, check_finite, check_float_tensor
from .pack import pack_nibbles, unpack_nibbles

SCALE_RULES = ("6", "4o6")


@dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor in ModelOpt's checkpoint layout.

    packed:       uint8 [..., K/2]          two E2M1 codes per byte, low nibble = even element
    block_scale:  float8_e4m3fn [..., K/16] row-major, one per 16 elements along K
    global_scale: float32, shape = the leading batch dims ([] for a 2-D weight, [E] for an
                  expert stack): ModelOpt's `weight_scale_2`
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8:
            raise FormatError(f"NVFP4Tensor.packed must be uint8, got {self.packed.dtype}")
        if self.block_scale.dtype != torch.float8_e4m3fn:
            raise FormatError(f"NVFP4Tensor.block_scale must be float8_e4m3fn, got {self.block_scale.dtype}")
        if self.global_scale.dtype != torch.float32:
            raise FormatError(f"NVFP4Tensor.global_scale must be float32, got {self.global_scale.dtype}")
        k = self.packed.shape[-1] * 2
        expected = (*self.packed.shape[:-1], k // NVFP4_BLOCK_SIZE)
        if k % NVFP4_BLOCK_SIZE or tuple(self.block_scale.shape) != expected:
            raise FormatError(
                f"NVFP4Tensor: block_scale shape {tuple(self.block_scale.shape)} does not fit "
                f"packed shape {tuple(self.packed.shape)} (expected {expected})"
            )
        batch = tuple(self.packed.shape[:-2])
        if tuple(self.global_scale.shape) != batch:
            raise FormatError(
                f"NVFP4Tensor: global_scale shape {tuple(self.global_scale.shape)} should be {batch}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def codes(self) -> torch.Tensor:
        """The E2M1 codes, uint8 [..., K]."""
        return unpack_nibbles(self.packed)

    def block_multiplier(self) -> torch.Tensor:
        """float(block_scale) * global_scale in fp32, [..., K/16]: the per-block step."""
        return _block_step(self.block_scale, _expand_global(self.global_scale, self.block_scale))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = e2m1.decode_packed(self.packed).view(*self.shape[:-1], -1, NVFP4_BLOCK_SIZE)
        return (values * self.block_multiplier().unsqueeze(-1)).reshape(self.shape).to(dtype)

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        return NVFP4Tensor(self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device))


def _expand_global(global_scale: torch.Tensor, per_block: torch.Tensor) -> torch.Tensor:
    """Reshape a batch-shaped global tensor to broadcast against [..., N, K/16]."""
    return global_scale.reshape(*global_scale.shape, *([1] * (per_block.dim() - global_scale.dim())))


def _block_step(block_scale: torch.Tensor, global_b: torch.Tensor) -> torch.Tensor:
    return block_scale.float() * global_b  # one fp32 rounding, as ModelOpt's dequantize/quantize


def _cast_block_scale(s: torch.Tensor) -> torch.Tensor:
    return e4m3.cast(s.clamp(min=BLOCK_SCALE_MIN, max=BLOCK_SCALE_MAX))


def _encode_blocks(blocks: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    # A division by the product (not a multiply by its reciprocal), in fp32, as the export does.
    return e2m1.encode(blocks.float() / step.unsqueeze(-1))


def block_sum16(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) in a fixed pairwise order: (i, i+8), (i, i+4), (i, i+2), (i, i+1).

    Every step adds exactly two numbers, so the result does not depend on how a reduction is
    scheduled; kernels reproduce it with the same halvings (and no fused multiply-add).
    """
    for half in (8, 4, 2, 1):
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(*w.shape[:-1], w.shape[-1] // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)


def _check_weight(w: torch.Tensor, what: str) -> None:
    check_float_tensor(w, what)
    if w.shape[-1] % NVFP4_BLOCK_SIZE:
        raise FormatError(
            f"{what}: last dim K={w.shape[-1]} of shape {tuple(w.shape)} is not a multiple of "
            f"the {NVFP4_BLOCK_SIZE}-element block"
        )
    check_finite(w, what)


def _tensor_amax(w: torch.Tensor) -> torch.Tensor:
    dims = (-2, -1) if w.dim() >= 2 else (-1,)
    return w.abs().amax(dim=dims).float()  # max in the weight dtype is exact; then fp32


def _resolve_global_amax(global_amax, w: torch.Tensor, what: str) -> torch.Tensor:
    own = _tensor_amax(w)
    if global_amax is None:
        return own
    g = torch.as_tensor(global_amax, dtype=torch.float32, device=w.device)
    try:
        g = torch.broadcast_to(g, own.shape).clone()
    except RuntimeError:
        raise FormatError(
            f"{what}: global_amax of shape {tuple(g.shape)} does not broadcast to the batch "
            f"shape {tuple(own.shape)}"
        ) from None
    if not bool(torch.isfinite(g).all()):
        raise FormatError(f"{what}: global_amax must be finite")
    if bool((g < own).any()):
        raise FormatError(
            f"{what}: global_amax {g.min().item():.6g} is below the tensor's own max|w| "
            f"{own.max().item():.6g}; a shared global amax must cover every member"
        )
    return g


def _importance_weights(importance, w: torch.Tensor, what: str) -> torch.Tensor:
    """Per-input-channel weights as [..., 1, K/16, 16] broadcasting against the blocks."""
    imp = torch.as_tensor(importance, device=w.device).float()
    k = w.shape[-1]
    if imp.dim() == 0 or imp.shape[-1] != k:
        raise FormatError(f"{what}: importance shape {tuple(imp.shape)} must end in K={k}")
    if imp.dim() > 1:
        if tuple(imp.shape[:-1]) != tuple(w.shape[:-2]):
            raise FormatError(
                f"{what}: importance shape {tuple(imp.shape)} must be [K] or "
                f"{(*w.shape[:-2], k)} for a weight of shape {tuple(w.shape)}"
            )
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise FormatError(f"{what}: importance must be finite and >= 0")
    imp = imp.reshape(*imp.shape[:-1], k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    if w.dim() >= 2:
        imp = imp.unsqueeze(-3)  # the N dim
    return imp


def static_block_scale(
    block_amax: torch.Tensor, global_amax_b: torch.Tensor, fp8_norm: float, arith: str = DEFAULT_ARITH
) -> torch.Tensor:
    """ModelOpt's static export block scale: e4m3(clamp((a/6 or 1) * m / (g/6), 2^-9, 448))."""
    s = div_const(block_amax, E2M1_MAX, arith)
    s = torch.where(s == 0, torch.ones_like(s), s)
    return _cast_block_scale(s * fp8_norm / div_const(global_amax_b, E2M1_MAX, arith))


def global_scale_of(global_amax: torch.Tensor, scale_rule: str, arith: str = DEFAULT_ARITH) -> torch.Tensor:
    """weight_scale_2 of a rule: amax / 2688 (rule "6") or amax / 1536 (rule "4o6", the static
    path with normalisation 256), the division as `arith` computes it."""
    denom = NVFP4_GLOBAL_DENOM if scale_rule == "6" else E2M1_MAX * FP8_NORM_4O6
    return div_const(global_amax, denom, arith)


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """max|w| of every 16-element block along K, fp32 [..., K/16]."""
    return _blocks(w).abs().amax(dim=-1).float()


def four_over_six_candidates(
    block_amax: torch.Tensor, global_amax_b: torch.Tensor, arith: str = DEFAULT_ARITH
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two block scales Four-Over-Six chooses between: (x1.0, block max -> 6; x1.5 -> 4)."""
    six, four = (static_block_scale(block_amax * m, global_amax_b, FP8_NORM_4O6, arith) for m in FOUR_OVER_SIX_MULTIPLIERS)
    return six, four


def four_over_six_choice(
    block_scale: torch.Tensor, block_amax: torch.Tensor, global_amax_b: torch.Tensor, arith: str = DEFAULT_ARITH
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which candidate each stored 4/6 block scale is, from the weight it was made of.

    Returns bool masks [..., K/16]: `chose4`, the byte equals the x1.5 candidate and differs
    from the x1.0 one (where the two are one byte the choice is moot and counts as 6), and
    `explained`, the byte equals one of the two. Bytes are compared, so NaN scales compare too.
    """
    six, four = (c.view(torch.uint8) for c in four_over_six_candidates(block_amax, global_amax_b, arith))
    stored = block_scale.view(torch.uint8)
    return (stored == four) & (four != six), (stored == four) | (stored == six)


def _assemble(w, block_scale, global_scale, zero) -> tuple[NVFP4Tensor, torch.Tensor]:
    """Apply the all-zero-tensor rule, encode the elements, pack."""
    one = e4m3.cast(torch.ones((), device=w.device))
    zero_b = _expand_global(zero, block_scale)
    block_scale = torch.where(zero_b, one, block_scale)
    global_scale = torch.where(zero, torch.ones_like(global_scale), global_scale)
    step = _block_step(block_scale, _expand_global(global_scale, block_scale))
    codes = _encode_blocks(_blocks(w), step).reshape(w.shape)
    return NVFP4Tensor(pack_nibbles(codes), block_scale, global_scale), codes


def quantize_static(
    w: torch.Tensor, block_amax: torch.Tensor, global_amax, *, fp8_norm: float = FP8_NORM_PLAIN,
    arith: str = DEFAULT_ARITH,
) -> NVFP4Tensor:
    """ModelOpt's static export: given per-block amax (multipliers already applied) and global amax."""
    what = "nvfp4.quantize_static"
    _check_weight(w, what)
    expected = (*w.shape[:-1], w.shape[-1] // NVFP4_BLOCK_SIZE)
    if tuple(block_amax.shape) != expected:
        raise FormatError(f"{what}: block_amax shape {tuple(block_amax.shape)} should be {expected}")
    if fp8_norm not in (FP8_NORM_PLAIN, FP8_NORM_4O6):
        raise FormatError(f"{what}: fp8_norm must be {FP8_NORM_PLAIN} or {FP8_NORM_4O6}, got {fp8_norm}")
    g = torch.as_tensor(global_amax, dtype=torch.float32, device=w.device)
    g = torch.broadcast_to(g, _tensor_amax(w).shape).clone()
    zero = g == 0
    g_safe = torch.where(zero, torch.ones_like(g), g)
    g_b = _expand_global(g_safe, block_amax)
    block_scale = static_block_scale(block_amax, g_b, fp8_norm, check_mode(arith))
    global_scale = div_const(g_safe, E2M1_MAX * fp8_norm, arith)
    return _assemble(w, block_scale, global_scale, zero)[0]


def _quantize(w, scale_rule, global_amax, importance, what, arith):
    if scale_rule not in SCALE_RULES:
        raise FormatError(f"{what}: scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    _check_weight(w, what)
    check_mode(arith)
    if importance is not None and scale_rule != "4o6":
        raise FormatError(f"{what}: importance only applies to scale_rule='4o6'")
    g = _resolve_global_amax(global_amax, w, what)
    zero = g == 0
    g_safe = torch.where(zero, torch.ones_like(g), g)
    blocks = _blocks(w)
    block_amax = blocks.abs().amax(dim=-1).float()
    g_b = _expand_global(g_safe, block_amax)

    if scale_rule == "6":
        global_scale = global_scale_of(g_safe, "6", arith)
        s = block_amax / (E2M1_MAX * _expand_global(global_scale, block_amax))
        s = torch.where(s == 0, torch.ones_like(s), s)
        qt, _ = _assemble(w, _cast_block_scale(s), global_scale, zero)
        return qt, torch.zeros_like(block_amax, dtype=torch.bool)

    global_scale = global_scale_of(g_safe, "4o6", arith)
    gs_b = _expand_global(global_scale, block_amax)
    x = blocks.float()
    weights = None if importance is None else _importance_weights(importance, w, what)
    candidates = []
    for scale in four_over_six_candidates(block_amax, g_b, arith):
        step = _block_step(scale, gs_b)
        codes = e2m1.encode(x / step.unsqueeze(-1))
        err = e2m1.decode(codes) * step.unsqueeze(-1) - x
        err = err * err
        if weights is not None:
            err = err * weights
        candidates.append((scale, block_sum16(err)))
    (scale6, err6), (scale4, err4) = candidates
    choose4 = (err4 < err6) & ~_expand_global(zero, block_amax)  # strict: a tie keeps 6
    qt, _ = _assemble(w, torch.where(choose4, scale4, scale6), global_scale, zero)
    return qt, choose4


def quantize(
    w: torch.Tensor,
    *,
    scale_rule: str = "6",
    global_amax=None,
    importance=None,
    return_choice: bool = False,
    arith: str = DEFAULT_ARITH,
):
    """Quantize a weight [..., K] (K % 16 == 0; fp32/fp16/bf16) to NVFP4.

    scale_rule:  "6" = ModelOpt's plain dynamic rule; "4o6" = Four-Over-Six, ModelOpt's static
                 normalisation 256 with a per-block choice of 6 or 4 by squared error.
    global_amax: max|W| to use instead of the tensor's own (a float, or one per expert), so that
                 fused siblings share one global scale; must be >= the tensor's own max|W|.
    importance:  optional per-input-channel weights ([K], or [..batch, K] for expert stacks),
                 e.g. E[x^2] from calibration: the 4/6 choice then minimises sum(imp * err^2).
    Leading dims quantize independently ([E, N, K] -> one global scale per expert).
    With return_choice, also returns a bool [..., K/16] mask: True where the block chose 4.
    arith:  "cuda" (ModelOpt on CUDA, default) or "cpu" (ModelOpt on CPU): see arith.
    """
    qt, choice = _quantize(w, scale_rule, global_amax, importance, "nvfp4.quantize", arith)
    return (qt, choice) if return_choice else qt


def input_scale_from_amax(amax, arith: str = DEFAULT_ARITH) -> torch.Tensor:
    """W4A4 activation global scale as ModelOpt exports it: amax / 2688 (fp32)."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    if not bool(torch.isfinite(a).all()) or bool((a <= 0).any()):
        raise FormatError(f"nvfp4.input_scale_from_amax: activation amax must be finite and > 0, got {a}")
    return div_const(a, NVFP4_GLOBAL_DENOM, arith)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor) -> NVFP4Tensor:
    """NVFP4 activations: x [..., K] viewed as [M, K], with the static global scale `input_scale`.

    The plain rule "6" with global_scale = input_scale, in its order (all fp32):
        s = block_amax / (6 * input_scale); s[s == 0] = 1; block_scale = e4m3(clamp(s, 2^-9, 448))
        codes = E2M1(x / (float(block_scale) * input_scale))
    It equals `quantize(x, global_amax=input_scale * 2688)` whenever that round-trips to
    input_scale, but never refuses a block above the calibrated amax: its scale saturates at 448
    and its elements at +-6, as the engines' activation quantizers do. (Their CUDA kernels
    multiply by approximate reciprocals where this divides, and flush block scales below 2^-9
    to zero, so a rare element can round the other way.)
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK_SIZE:
        raise FormatError(f"NVFP4 activations: K={k} is not a multiple of {NVFP4_BLOCK_SIZE}")
    blocks = x.reshape(-1, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE).float()
    gs = input_scale.float().reshape(())
    s = blocks.abs().amax(dim=-1) / (E2M1_MAX * gs)
    s = torch.where(s == 0, torch.ones_like(s), s)
    block_scale = _cast_block_scale(s)
    step = _block_step(block_scale, gs)
    codes = _encode_blocks(blocks, step).reshape(-1, k)
    return NVFP4Tensor(pack_nibbles(codes), block_scale, gs.clone())
