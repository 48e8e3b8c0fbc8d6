"""Load a ModelOpt-format checkpoint back into transformers, every quantized layer run as stored.

`load_quantized(path)` builds the model from its config.json (transformers' own classes, never
code from the checkpoint), loads every BF16 tensor by name, and replaces each quantized module
with an fp4kit module that holds the checkpoint's tensors unchanged and computes with them:

- `NVFP4Linear` (quant_algo NVFP4 or W4A16_NVFP4): weight = an NVFP4Tensor.
  W4A16 (and NVFP4 with act_quant=False, which is what the engines run on Hopper, where
  `input_scale` is dropped): y = F.linear(x, W.dequantize(x.dtype), bias), i.e. the weight
  dequantized to the activation dtype; backend "triton" runs `kernels.w4a16_matmul`, whose
  dequantized tiles are the same values.
  W4A4 (NVFP4 with act_quant=True, the engines on Blackwell): the activation is quantized too,
  per 16-element block along K with a dynamic E4M3 block scale and the stored `input_scale` as
  global scale (`quantize_activations`: fp4kit's plain rule "6" arithmetic, saturating), and
  y = F.linear(x_q, W) in fp32 (products of two FP4 operands, scales applied in fp32 as the
  FP4 GEMMs' fp32 epilogue does), rounded once to the activation dtype.
- `FP8Linear` (FP8): W8A8 with the static `input_scale`: x_q = e4m3(x / input_scale), saturating
  at +-448; y = F.linear(x_q * input_scale, w_q * weight_scale) in fp32, rounded once to the
  activation dtype. Backend "triton" on CUDA runs `torch._scaled_mm` (fp8 x fp8, fp32
  accumulation, both scales in its epilogue): the same values up to summation order.
- `NVFP4Experts` (Nemotron-H routed experts, stored one module per expert): the per-expert
  tensors stacked into [E, ...] NVFP4Tensors; the forward is transformers' eager
  `NemotronHExperts.forward` (same loop, same dtypes) on the stacks dequantized to the activation
  dtype; backend "triton" runs `kernels.moe_experts`. W4A4 experts quantize each expert's input
  with the layer's largest `input_scale` (the engines' FP4 MoE paths share one activation scale
  per layer, the max over experts); they have no Triton kernel, so backend "triton" refuses them.
- `FP8KVProjection` (kv_cache_quant_algo FP8): wraps an attention's k_proj / v_proj and rounds
  its output to E4M3 with the stored k_scale / v_scale (y -> e4m3(y / s) * s, saturating): the
  FP8 KV cache, emulated where the keys and values are produced. For Nemotron-H (no RoPE) that
  is exactly what the cache holds; for RoPE models the engines quantize the keys after RoPE, so
  there this is an approximation of the cache.

backend "torch" (the default on CPU) is the reference: exact emulation, any device. "triton"
(the default on CUDA) is the fast path; a layer it cannot serve raises, nothing falls back.

A checkpoint the loader cannot run completely is refused with an error naming the problem: a
quant_algo it does not implement, a quantized tensor it cannot place, a module listed as
quantized without its tensors, a weight that is missing. Only safetensors are read.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import e2m1, e4m3, nvfp4
from ..formats.constants import BLOCK_SCALE_MAX, BLOCK_SCALE_MIN, E2M1_MAX, NVFP4_BLOCK_SIZE
from ..formats.pack import pack_nibbles

NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
LAYER_ALGOS = NVFP4_ALGOS + ("FP8",)
KV_ALGOS = ("FP8",)
BACKENDS = ("torch", "triton")
# Suffixes of tensors that exist only in quantized modules.
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
_KV_SUFFIXES = ("k_scale", "v_scale")


class CheckpointError(ValueError):
    """A checkpoint the loader refuses: unknown format, unplaceable or missing tensors."""


# --------------------------------------------------------------------------------------------
# Activation quantization (W4A4) and FP8 rounding, from the formats
# --------------------------------------------------------------------------------------------
def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor) -> nvfp4.NVFP4Tensor:
    """NVFP4 activations: x [..., K] viewed as [M, K], with the static global scale `input_scale`.

    fp4kit's plain rule "6" with global_scale = input_scale, in its order (all fp32):
        s = block_amax / (6 * input_scale); s[s == 0] = 1; block_scale = e4m3(clamp(s, 2^-9, 448))
        codes = E2M1(x / (float(block_scale) * input_scale))
    It equals `nvfp4.quantize(x, global_amax=input_scale * 2688)` whenever that round-trips to
    input_scale, but never refuses a block above the calibrated amax: its scale saturates at 448
    and its elements at +-6, as the engines' activation quantizers do. (Their CUDA kernels
    multiply by approximate reciprocals where this divides, and flush block scales below 2^-9
    to zero, so a rare element can round the other way.)
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK_SIZE:
        raise CheckpointError(f"NVFP4 activations: K={k} is not a multiple of {NVFP4_BLOCK_SIZE}")
    blocks = x.reshape(-1, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE).float()
    gs = input_scale.float().reshape(())
    s = blocks.abs().amax(dim=-1) / (E2M1_MAX * gs)
    s = torch.where(s == 0, torch.ones_like(s), s)
    block_scale = e4m3.cast(s.clamp(min=BLOCK_SCALE_MIN, max=BLOCK_SCALE_MAX))
    step = block_scale.float() * gs
    codes = e2m1.encode(blocks / step.unsqueeze(-1)).reshape(-1, k)  # a division by the product
    return nvfp4.NVFP4Tensor(pack_nibbles(codes), block_scale, gs.clone())


def fake_quant_nvfp4(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x -> its NVFP4 activation values (fp32, x's shape), as the FP4 GEMM sees them."""
    return quantize_activations(x, input_scale).dequantize(torch.float32).reshape(x.shape)


def native_e4m3(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn by a clamp to +-448 and torch's own cast (round to nearest even):
    the bytes of fp4kit.formats.e4m3.cast for every fp32 input, NaN included (checked on the CPU
    in tests/export/test_load.py and on a GPU in tests/gpu)."""
    return q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def e4m3_cast(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, saturating at +-448: `native_e4m3` on a GPU (two kernel launches
    where the bit-level emulator takes over a dozen, which a decode step of FP8 layers waits
    on), the emulator itself elsewhere."""
    return native_e4m3(q) if q.is_cuda else e4m3.cast(q)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x -> e4m3(x / scale) * scale in x's dtype; the quotient in fp32, saturating at +-448."""
    s = scale.float()
    return (e4m3_cast(x.float() / s).float() * s).to(x.dtype)


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------
class NVFP4Linear(nn.Module):
    """A Linear whose weight is stored in NVFP4; buffers carry the checkpoint's tensor names.

    weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 [],
    input_scale fp32 [] (W4A4 checkpoints only). `act_quant` says whether activations are
    quantized (W4A4 as on Blackwell) or kept in the activation dtype (W4A16, or W4A4 as on Hopper).
    """

    def __init__(self, qweight: nvfp4.NVFP4Tensor, bias: torch.Tensor | None, *, input_scale: torch.Tensor | None,
                 act_quant: bool, backend: str, name: str = "", algo: str = "W4A16_NVFP4") -> None:
        super().__init__()
        if act_quant and input_scale is None:
            raise CheckpointError(f"{name}: activation quantization needs an input_scale")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("weight", qweight.packed)
        self.register_buffer("weight_scale", qweight.block_scale)
        self.register_buffer("weight_scale_2", qweight.global_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.backend = backend
        self.name = name
        self.algo = algo

    @property
    def qweight(self) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight
        if self.act_quant:
            xq = fake_quant_nvfp4(x, self.input_scale)
            if self.backend == "triton":
                from ..kernels.w4a16_gemm import w4a16_matmul

                y = w4a16_matmul(xq, w, backend="triton")
            else:
                y = F.linear(xq, w.dequantize(torch.float32))
            if self.bias is not None:
                y = y + self.bias.float()
            return y.to(x.dtype)
        if self.backend == "triton":
            from ..kernels.w4a16_gemm import w4a16_matmul

            y = w4a16_matmul(x, w, backend="triton")
            return y if self.bias is None else y + self.bias
        return F.linear(x, w.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        mode = "W4A4" if self.act_quant else "W4A16"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.algo} run as {mode}, backend={self.backend}"


class FP8Linear(nn.Module):
    """A Linear stored in FP8 per-tensor with a static input scale, run as W8A8."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                 bias: torch.Tensor | None, *, backend: str, name: str = "") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.backend = backend
        self.name = name
        self.algo = "FP8"

    def dequantized_weight(self) -> torch.Tensor:
        return e4m3.decode(self.weight) * self.weight_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.input_scale.float()
        xq = e4m3_cast(x.float() / xs)  # the quotient in fp32, saturating at +-448
        if self.backend == "triton":
            y = self._scaled_mm(xq, x.dtype)
            return y if self.bias is None else y + self.bias
        # Both operands dequantized to fp32, one fp32 linear, rounded once to the activation dtype.
        y = F.linear(xq.float() * xs, self.dequantized_weight(), None if self.bias is None else self.bias.float())
        return y.to(x.dtype)

    def _scaled_mm(self, xq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lead = xq.shape[:-1]
        a = xq.reshape(-1, self.in_features)
        b = self.weight
        m, k, n = a.shape[0], self.in_features, self.out_features
        # _scaled_mm needs K and N multiples of 16, `a` row-major, `b` column-major.
        pk, pn = -k % 16, -n % 16
        if pk:
            a = F.pad(a.view(torch.uint8), (0, pk)).view(torch.float8_e4m3fn)
            b = F.pad(b.view(torch.uint8), (0, pk)).view(torch.float8_e4m3fn)
        if pn:
            b = F.pad(b.view(torch.uint8), (0, 0, 0, pn)).view(torch.float8_e4m3fn)
        y = torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=self.input_scale.float().reshape(()),
                             scale_b=self.weight_scale.float().reshape(()), out_dtype=dtype)
        return y[:, :n].reshape(*lead, n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, FP8 W8A8, backend={self.backend}"


class NVFP4Experts(nn.Module):
    """Nemotron-H routed experts (not gated: up, relu^2, down) with NVFP4 [E, N, K] stacks.

    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) as transformers'
    NemotronHExperts. Buffers: up_proj_weight / up_proj_weight_scale / up_proj_weight_scale_2
    (and up_proj_input_scale [E] for W4A4), the same for down_proj.
    """

    def __init__(self, up: nvfp4.NVFP4Tensor, down: nvfp4.NVFP4Tensor, act_fn: nn.Module, *,
                 up_input_scale: torch.Tensor | None, down_input_scale: torch.Tensor | None,
                 act_quant: bool, backend: str, name: str = "", algo: str = "W4A16_NVFP4") -> None:
        super().__init__()
        e, i, h = up.shape
        if tuple(down.shape) != (e, h, i):
            raise CheckpointError(f"{name}: down_proj stack {down.shape} does not fit up_proj stack {up.shape}")
        if act_quant and (up_input_scale is None or down_input_scale is None):
            raise CheckpointError(f"{name}: activation quantization needs input scales")
        if act_quant and backend == "triton":
            raise CheckpointError(
                f"{name}: backend 'triton' has no W4A4 MoE kernel; load with act_quant=False (the engines' "
                "Hopper behaviour, W4A16) or backend='torch'"
            )
        self.num_experts, self.intermediate_dim, self.hidden_dim = e, i, h
        for proj, qt, s in (("up_proj", up, up_input_scale), ("down_proj", down, down_input_scale)):
            self.register_buffer(f"{proj}_weight", qt.packed)
            self.register_buffer(f"{proj}_weight_scale", qt.block_scale)
            self.register_buffer(f"{proj}_weight_scale_2", qt.global_scale)
            self.register_buffer(f"{proj}_input_scale", s)
        self.act_fn = act_fn
        self.act_quant = act_quant
        self.backend = backend
        self.name = name
        self.algo = algo

    def stack(self, proj: str) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(getattr(self, f"{proj}_weight"), getattr(self, f"{proj}_weight_scale"),
                                 getattr(self, f"{proj}_weight_scale_2"))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        up, down = self.stack("up_proj"), self.stack("down_proj")
        if self.backend == "triton":
            from ..kernels.moe_gemm import moe_experts

            return moe_experts(hidden_states, top_k_index, top_k_weights, up, down, backend="triton")
        if self.act_quant:
            return self._loop(hidden_states, top_k_index, top_k_weights, up.dequantize(torch.float32),
                              down.dequantize(torch.float32), self.up_proj_input_scale.max(), self.down_proj_input_scale.max())
        dtype = hidden_states.dtype
        return self._loop(hidden_states, top_k_index, top_k_weights, up.dequantize(dtype), down.dequantize(dtype))

    def _loop(self, hidden_states, top_k_index, top_k_weights, up_w, down_w, up_scale=None, down_scale=None):
        # transformers' eager NemotronHExperts.forward, statement for statement; with input
        # scales, each linear takes NVFP4 activations and computes in fp32 (see NVFP4Linear).
        def linear(x, w, scale):
            if scale is None:
                return F.linear(x, w)
            return F.linear(fake_quant_nvfp4(x, scale), w).to(x.dtype)

        final_hidden_states = torch.zeros_like(hidden_states, dtype=top_k_weights.dtype)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        for expert_idx in expert_hit.tolist():
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.numel() == 0:
                continue
            h = linear(hidden_states[token_idx], up_w[expert_idx], up_scale)
            h = self.act_fn(h)
            h = linear(h, down_w[expert_idx], down_scale)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
        return final_hidden_states.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        mode = "W4A4" if self.act_quant else "W4A16"
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"{self.algo} run as {mode}, backend={self.backend}")


class FP8KVProjection(nn.Module):
    """An attention's k_proj or v_proj whose output is rounded to E4M3 with the KV-cache scale."""

    def __init__(self, proj: nn.Module, scale: torch.Tensor, kind: str, name: str = "") -> None:
        super().__init__()
        self.proj = proj
        self.register_buffer(f"{kind}_scale", scale)
        self.kind = kind
        self.name = name

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, f"{self.kind}_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp8(self.proj(x), self.scale)

    def extra_repr(self) -> str:
        return f"FP8 KV cache ({self.kind}_scale={self.scale.item():.6g})"


FP4KIT_MODULES = (NVFP4Linear, FP8Linear, NVFP4Experts, FP8KVProjection)


# --------------------------------------------------------------------------------------------
# What the checkpoint says it is
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantScheme:
    """The quantization a checkpoint declares, from config.json (flat) or hf_quant_config.json.

    quant_algo: one algo for every quantized module, or MIXED_PRECISION with `layers` naming
    each quantized module (checkpoint names) and its algo. `ignore`: the exclusion list of the
    single-algo form.
    """

    quant_algo: str
    kv_cache_algo: str | None
    layers: dict[str, str] | None
    ignore: tuple[str, ...]
    source: str

    def algo_for(self, disk_module: str) -> str | None:
        """The algo a checkpoint module is stored in, or None (unquantized)."""
        if self.layers is not None:
            return self.layers.get(disk_module)
        return None if excluded(disk_module, self.ignore) else self.quant_algo


def excluded(disk_module: str, patterns) -> bool:
    """True if an exclusion entry names the module, a module above it, or matches it as a glob."""
    return any(disk_module == p or disk_module.startswith(p + ".") or fnmatch.fnmatchcase(disk_module, p) for p in patterns)


def _parse_scheme(q: dict, where: str, exclusion_key: str) -> QuantScheme:
    method = q.get("quant_method", "modelopt")
    if method != "modelopt":
        raise CheckpointError(f"{where}: quant_method {method!r} is not ModelOpt's; fp4kit loads quant_method 'modelopt' only")
    algo = q.get("quant_algo")
    group = q.get("group_size", 16)
    layers = None
    if algo == "MIXED_PRECISION":
        raw = q.get("quantized_layers")
        if not isinstance(raw, dict) or not raw:
            raise CheckpointError(f"{where}: MIXED_PRECISION without a `quantized_layers` mapping")
        layers = {}
        for name, entry in raw.items():
            a = entry.get("quant_algo") if isinstance(entry, dict) else None
            if a not in LAYER_ALGOS:
                raise CheckpointError(f"{where}: layer {name!r} has quant_algo {a!r}, which fp4kit's loader does not implement (it runs {list(LAYER_ALGOS)})")
            if a in NVFP4_ALGOS and entry.get("group_size", 16) != NVFP4_BLOCK_SIZE:
                raise CheckpointError(f"{where}: layer {name!r} has group_size {entry.get('group_size')}; NVFP4 uses {NVFP4_BLOCK_SIZE}")
            layers[name] = a
    elif algo not in LAYER_ALGOS:
        raise CheckpointError(
            f"{where}: quant_algo {algo!r} is not implemented by fp4kit's loader (it runs {list(LAYER_ALGOS)} and MIXED_PRECISION of these)"
        )
    elif algo in NVFP4_ALGOS and group != NVFP4_BLOCK_SIZE:
        raise CheckpointError(f"{where}: group_size {group}; NVFP4 uses {NVFP4_BLOCK_SIZE}")
    kv = q.get("kv_cache_quant_algo")
    if kv is None and isinstance(q.get("kv_cache_scheme"), dict):
        s = q["kv_cache_scheme"]
        if s.get("type") == "float" and s.get("num_bits") == 8 and not s.get("dynamic", False):
            kv = "FP8"
        else:
            raise CheckpointError(f"{where}: kv_cache_scheme {s} is not implemented (static FP8 is)")
    if kv is not None and kv not in KV_ALGOS:
        raise CheckpointError(f"{where}: kv_cache_quant_algo {kv!r} is not implemented by fp4kit's loader (it runs {list(KV_ALGOS)})")
    ignore = q.get(exclusion_key) or ()
    return QuantScheme(algo, kv, layers, tuple(ignore), where)


def read_quant_scheme(path: str | Path) -> QuantScheme:
    """config.json's flat `quantization_config` first, else hf_quant_config.json; both must agree."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    flat = json.loads(cfg_file.read_text()).get("quantization_config")
    nested_file = path / "hf_quant_config.json"
    nested = json.loads(nested_file.read_text()).get("quantization") if nested_file.is_file() else None
    if flat is None and nested is None:
        raise CheckpointError(f"{path}: not a quantized checkpoint (config.json has no quantization_config and there is no hf_quant_config.json)")
    schemes = []
    if flat is not None:
        schemes.append(_parse_scheme(flat, f"{cfg_file} quantization_config", "ignore"))
    if nested is not None:
        schemes.append(_parse_scheme(nested, str(nested_file), "exclude_modules"))
    first = schemes[0]
    for other in schemes[1:]:
        a = (first.quant_algo, first.kv_cache_algo, first.layers, sorted(first.ignore))
        b = (other.quant_algo, other.kv_cache_algo, other.layers, sorted(other.ignore))
        if a != b:
            raise CheckpointError(
                f"{path}: config.json's quantization_config and hf_quant_config.json disagree "
                f"(quant_algo {first.quant_algo} vs {other.quant_algo}, kv {first.kv_cache_algo} vs {other.kv_cache_algo}, "
                "or their layer / exclusion lists); engines read one or the other"
            )
    return first


class _Tensors:
    """The checkpoint's safetensors, read by name; remembers what was taken."""

    def __init__(self, folder: Path, device: torch.device) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            if pickles:
                raise CheckpointError(f"{folder}: only pickle files ({', '.join(pickles)}); fp4kit reads safetensors only, never pickles")
            raise CheckpointError(f"{folder}: no .safetensors files")
        self.handles = {}
        self.where: dict[str, str] = {}
        for f in files:
            if not (folder / f).is_file():
                raise CheckpointError(f"{folder}: shard {f} named in the index is missing")
            try:
                h = safe_open(str(folder / f), framework="pt", device=str(device))
            except Exception as exc:  # safetensors' own error type is not a ValueError
                raise CheckpointError(f"{folder / f}: not a readable safetensors file: {exc}") from None
            self.handles[f] = h
            for k in h.keys():
                if k in self.where:
                    raise CheckpointError(f"{folder}: tensor {k} is stored twice ({self.where[k]} and {f})")
                self.where[k] = f
        self.taken: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def take(self, name: str) -> torch.Tensor:
        self.taken.add(name)
        return self.handles[self.where[name]].get_tensor(name)

    def left(self) -> list[str]:
        return sorted(set(self.where) - self.taken)


def _scalar(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.numel() != 1:
        raise CheckpointError(f"{name}: expected one float32 value, got {t.dtype} of shape {tuple(t.shape)}")
    return t.reshape(())


class _Builder:
    """Reads each quantized module's tensors by checkpoint name and checks their form."""

    def __init__(self, tensors: _Tensors) -> None:
        self.tensors = tensors

    def need(self, module: str, suffix: str, algo: str) -> torch.Tensor:
        name = f"{module}.{suffix}"
        if name not in self.tensors:
            raise CheckpointError(f"{module} is listed as {algo} but its tensor {name} is not in the checkpoint")
        return self.tensors.take(name)

    def nvfp4(self, module: str, algo: str, shape: tuple[int, int]) -> tuple[nvfp4.NVFP4Tensor, torch.Tensor | None]:
        n, k = shape
        packed = self.need(module, "weight", algo)
        scale = self.need(module, "weight_scale", algo)
        scale2 = _scalar(self.need(module, "weight_scale_2", algo), f"{module}.weight_scale_2")
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
            raise CheckpointError(f"{module}.weight: {algo} expects uint8 {(n, k // 2)} for a [{n}, {k}] layer, got {packed.dtype} {tuple(packed.shape)}")
        if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // NVFP4_BLOCK_SIZE):
            raise CheckpointError(f"{module}.weight_scale: expected float8_e4m3fn {(n, k // NVFP4_BLOCK_SIZE)}, got {scale.dtype} {tuple(scale.shape)}")
        input_scale = None
        if algo == "NVFP4":
            input_scale = _scalar(self.need(module, "input_scale", algo), f"{module}.input_scale")
        elif f"{module}.input_scale" in self.tensors:
            raise CheckpointError(f"{module}.input_scale: {module} is listed as {algo} (weight-only), which has no input scale")
        return nvfp4.NVFP4Tensor(packed, scale, scale2), input_scale

    def fp8(self, module: str, shape: tuple[int, int]):
        w = self.need(module, "weight", "FP8")
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != tuple(shape):
            raise CheckpointError(f"{module}.weight: FP8 expects float8_e4m3fn {tuple(shape)}, got {w.dtype} {tuple(w.shape)}")
        ws = _scalar(self.need(module, "weight_scale", "FP8"), f"{module}.weight_scale")
        xs = _scalar(self.need(module, "input_scale", "FP8"), f"{module}.input_scale")
        return w, ws, xs

    def bias(self, module: str, like: torch.Tensor | None) -> torch.Tensor | None:
        if like is None:
            return None
        name = f"{module}.bias"
        if name not in self.tensors:
            raise CheckpointError(f"{name} is not in the checkpoint")
        return self.tensors.take(name).to(like.dtype)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def load_quantized(path: str | Path, device: str | torch.device = "cpu", *, backend: str | None = None,
                   act_quant: bool = True) -> nn.Module:
    """A ModelOpt-format checkpoint folder -> a transformers model (eval mode) that runs it.

    backend: "torch" (exact emulation, the default on CPU) or "triton" (the default on CUDA).
    act_quant: for NVFP4 (W4A4) checkpoints, quantize activations as the engines do on
    Blackwell (True) or keep them in BF16 as the engines do on Hopper (False). W4A16 and FP8
    layers are not affected.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ..models import adapter_for

    path = Path(path)
    device = torch.device(device)
    backend = _resolve_backend(backend, device)
    scheme = read_quant_scheme(path)
    tensors = _Tensors(path, device)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, trust_remote_code=False)
    adapter = adapter_for(model)
    build = _Builder(tensors)
    placed: set[str] = set()  # checkpoint module names that became fp4kit modules

    # Look everything up before any module is replaced (the adapters find roles by module type).
    stacks: dict[str, dict[str, list[str]]] = {}
    for t in adapter.targets(model):
        if t.is_stack:
            stacks.setdefault(t.name, {})[t.param] = t.disk_names
    kv_layers = adapter.attention_kv(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    for name, projs in stacks.items():
        module = model.get_submodule(name)
        disk = adapter.disk_name(name)
        algos = {a for names in projs.values() for a in map(scheme.algo_for, names)}
        if algos == {None}:
            for proj, names in projs.items():
                _load_stack(module, proj, names, tensors)
            continue
        if len(algos) > 1 or set(projs) != {"up_proj", "down_proj"}:
            raise CheckpointError(f"{disk}: the experts of one MoE layer are stored in different formats {sorted(map(str, algos))}")
        algo = algos.pop()
        if algo not in NVFP4_ALGOS:
            raise CheckpointError(f"{disk}: routed experts stored as {algo} are not implemented by the loader (NVFP4 and W4A16_NVFP4 are)")
        stacked, scales = {}, {}
        for proj, names in projs.items():
            shape = tuple(getattr(module, proj).shape[1:])
            parts = [build.nvfp4(d, algo, shape) for d in names]
            stacked[proj] = nvfp4.NVFP4Tensor(
                torch.stack([q.packed for q, _ in parts]), torch.stack([q.block_scale for q, _ in parts]),
                torch.stack([q.global_scale for q, _ in parts]),
            )
            scales[proj] = torch.stack([s for _, s in parts]) if algo == "NVFP4" else None
            placed.update(names)
        quant_act = act_quant and algo == "NVFP4"
        new = NVFP4Experts(stacked["up_proj"], stacked["down_proj"], module.act_fn, up_input_scale=scales["up_proj"],
                           down_input_scale=scales["down_proj"], act_quant=quant_act, backend=backend, name=name, algo=algo)
        _set_module(model, name, new)

    # An output head tied to the input embeddings is the embedding table, which no engine
    # quantizes; exporters need not list it as excluded.
    tied_head = model.get_output_embeddings() if getattr(config.get_text_config(), "tie_word_embeddings", False) else None
    for name, module in linears:
        disk = adapter.disk_name(name)
        algo = scheme.algo_for(disk)
        if algo is None or (module is tied_head and scheme.layers is None):
            continue
        shape = tuple(module.weight.shape)
        bias = build.bias(disk, module.bias)
        if algo == "FP8":
            w, ws, xs = build.fp8(disk, shape)
            new = FP8Linear(w, ws, xs, bias, backend=backend, name=name)
        else:
            qt, xs = build.nvfp4(disk, algo, shape)
            new = NVFP4Linear(qt, bias, input_scale=xs, act_quant=act_quant and algo == "NVFP4", backend=backend, name=name, algo=algo)
        _set_module(model, name, new)
        placed.add(disk)

    if scheme.layers is not None:
        unknown = sorted(set(scheme.layers) - placed)
        if unknown:
            raise CheckpointError(f"{scheme.source}: quantized_layers names modules this model does not have or cannot quantize: {unknown[:8]}")

    _load_plain_tensors(model, adapter, tensors, tied_head)
    if tied_head is not None and type(tied_head) is nn.Linear:
        tied_head.weight = model.get_input_embeddings().weight

    for kv in kv_layers:
        attn = model.get_submodule(kv.name)
        for kind in ("k", "v"):
            key = f"{kv.disk_name}.{kind}_proj.{kind}_scale"
            if scheme.kv_cache_algo is None:
                continue  # a stray scale is reported below as a tensor that cannot be placed
            if key not in tensors:
                raise CheckpointError(f"kv_cache_quant_algo is {scheme.kv_cache_algo} but {key} is not in the checkpoint")
            scale = _scalar(tensors.take(key), key)
            proj = f"{kind}_proj"
            setattr(attn, proj, FP8KVProjection(getattr(attn, proj), scale, kind, name=f"{kv.name}.{proj}"))

    # Subtrees the model class itself skips on load (Nemotron-H: the `mtp.*` layers it has no
    # module for), whatever their format, as from_pretrained does.
    skip = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    left = [k for k in tensors.left() if not any(p.search(k) for p in skip)]
    if left:
        quantized = [k for k in left if k.rsplit(".", 1)[-1] in _SCALE_SUFFIXES + _KV_SUFFIXES]
        hint = " (quantization scales of modules the config does not list as quantized)" if quantized else ""
        raise CheckpointError(f"{path}: {len(left)} tensor(s) the loader cannot place{hint}: {left[:8]}")
    on_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if on_meta:
        raise CheckpointError(f"{path}: no tensor in the checkpoint for {on_meta[:8]}")

    model.to(device).eval()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _load_stack(module: nn.Module, proj: str, names: list[str], tensors: _Tensors) -> None:
    """A BF16 expert stack: one checkpoint tensor per expert -> the fused [E, N, K] parameter."""
    param = getattr(module, proj)
    parts = []
    for d in names:
        key = f"{d}.weight"
        if key not in tensors:
            raise CheckpointError(f"weight {key} is not in the checkpoint")
        parts.append(_plain(tensors.take(key), key, tuple(param.shape[1:])))
    module._parameters[proj] = nn.Parameter(torch.stack(parts).to(param.dtype), requires_grad=False)


def _plain(t: torch.Tensor, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"{key} is stored as {t.dtype}, but the config does not list its module as quantized")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{key}: shape {tuple(t.shape)} does not match the model's {shape}")
    return t


def _load_plain_tensors(model: nn.Module, adapter, tensors: _Tensors, tied_head: nn.Module | None) -> None:
    """Every parameter and persistent buffer still unloaded, by name; tied parameters once."""
    loaded: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            key = f"{mod_name}.{pname}" if mod_name else pname
            disk = adapter.disk_name(key)
            if id(param) in loaded:  # tied to a parameter already loaded
                module._parameters[pname] = loaded[id(param)]
                if disk in tensors:
                    tensors.take(disk)
                continue
            if disk not in tensors:
                if module is tied_head and pname == "weight":
                    continue  # the input embeddings' table, tied after loading
                raise CheckpointError(f"weight {disk} ({key}) is not in the checkpoint")
            t = _plain(tensors.take(disk), disk, tuple(param.shape))
            new = nn.Parameter(t.to(param.dtype), requires_grad=False)
            loaded[id(param)] = new
            module._parameters[pname] = new
        for bname, buf in list(module._buffers.items()):
            if buf is None or bname in module._non_persistent_buffers_set or isinstance(module, FP4KIT_MODULES):
                continue
            key = f"{mod_name}.{bname}" if mod_name else bname
            disk = adapter.disk_name(key)
            if disk in tensors:
                module._buffers[bname] = _plain(tensors.take(disk), disk, tuple(buf.shape)).to(buf.dtype)
