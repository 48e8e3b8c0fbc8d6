"""The runtime modules that run a quantized checkpoint's layers as stored.

Each holds the checkpoint's tensors unchanged (buffers named as in the checkpoint) and computes
with them; `export.load.load_quantized` puts them into a transformers model.

- `NVFP4Linear` (quant_algo NVFP4 or W4A16_NVFP4): weight = an NVFP4Tensor.
  W4A16 (and NVFP4 with act_quant=False, which is what the engines run on Hopper, where
  `input_scale` is dropped): y = F.linear(x, W.dequantize(x.dtype), bias), i.e. the weight
  dequantized to the activation dtype; backend "triton" runs `kernels.w4a16_matmul`, whose
  dequantized tiles are the same values, or with layout "packed" `kernels.packed_linear` on
  the weight re-laid out once at load.
  W4A4 (NVFP4 with act_quant=True, the engines on Blackwell): the activation is quantized too,
  per 16-element block along K with a dynamic E4M3 block scale and the stored `input_scale` as
  global scale (`formats.nvfp4.quantize_activations`), and y = F.linear(x_q, W) in fp32
  (products of two FP4 operands, scales applied in fp32 as the FP4 GEMMs' fp32 epilogue does),
  rounded once to the activation dtype.
- `FP8Linear` (FP8): W8A8 with the static `input_scale`: x_q = e4m3(x / input_scale), saturating
  at +-448; y = F.linear(x_q * input_scale, w_q * weight_scale) in fp32, rounded once to the
  activation dtype. Backend "triton" runs `kernels.fp8_matmul` (the CUDA-core GEMV, fp32 sums of
  the exact products, both scales after) for the few rows of a decode step (up to the launch
  table's max_m) and `torch._scaled_mm` (fp8 x fp8, fp32 accumulation, both scales in its
  epilogue) beyond: the same values up to summation order.
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
  there this is an approximation of the cache. s is the stored fp32 scale rounded to the
  activation dtype, the value vLLM computes with (see `FP8KVProjection`).

backend "torch" (the default on CPU) is the reference: exact emulation, any device. "triton"
(the default on CUDA) is the fast path; a layer it cannot serve raises, nothing falls back.
Under `torch.compile` the Triton kernels are called as the operators of `kernels.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .export.checkpoint import CheckpointError
from .formats import e4m3, nvfp4
from .kernels import ops as kernel_ops
from .kernels.backend import BACKENDS

# How an NVFP4Linear holds its weight: as stored, or re-laid out for `kernels.packed_linear`.
LAYOUTS = ("checkpoint", "packed")


def fake_quant_nvfp4(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x -> its NVFP4 activation values (fp32, x's shape), as the FP4 GEMM sees them."""
    return nvfp4.quantize_activations(x, input_scale).dequantize(torch.float32).reshape(x.shape)


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


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend asked for, or the default for the device: "triton" on CUDA, "torch" elsewhere."""
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


class NVFP4Linear(nn.Module):
    """A Linear whose weight is stored in NVFP4; buffers carry the checkpoint's tensor names.

    weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 [],
    input_scale fp32 [] (W4A4 checkpoints only). `act_quant` says whether activations are
    quantized (W4A4 as on Blackwell) or kept in the activation dtype (W4A16, or W4A4 as on Hopper).
    layout "packed" (W4A16 only) holds the weight re-laid out once by `kernels.packed_gemm.pack`
    for `act_dtype` activations (packed_words, packed_scales instead of weight, weight_scale) and
    runs `kernels.packed_linear`; other activation dtypes raise.
    """

    def __init__(self, qweight: nvfp4.NVFP4Tensor, bias: torch.Tensor | None, *, input_scale: torch.Tensor | None,
                 act_quant: bool, backend: str, name: str = "", algo: str = "W4A16_NVFP4",
                 layout: str = "checkpoint", act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if act_quant and input_scale is None:
            raise CheckpointError(f"{name}: activation quantization needs an input_scale")
        if layout not in LAYOUTS:
            raise ValueError(f"{name}: layout must be one of {LAYOUTS}, got {layout!r}")
        self.out_features, self.in_features = qweight.shape
        if layout == "packed":
            if act_quant:
                raise CheckpointError(
                    f"{name}: layout 'packed' runs NVFP4 weights with 16-bit activations (W4A16); this {algo} layer "
                    "quantizes its activations (W4A4): load with act_quant=False or layout='checkpoint'"
                )
            from .kernels.packed_gemm import ACT_DTYPES, pack

            if act_dtype not in ACT_DTYPES:
                raise CheckpointError(f"{name}: layout 'packed' serves {ACT_DTYPES} activations, not {act_dtype}")
            p = pack(qweight, act_dtype)
            self.register_buffer("packed_words", p.words)
            self.register_buffer("packed_scales", p.scales)
        else:
            self.register_buffer("weight", qweight.packed)
            self.register_buffer("weight_scale", qweight.block_scale)
        self.register_buffer("weight_scale_2", qweight.global_scale)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.act_quant = act_quant
        self.backend = backend
        self.name = name
        self.algo = algo
        self.layout = layout

    def packed(self):
        """The weight as `kernels.packed_gemm` holds it (layout "packed" only)."""
        from .kernels.packed_gemm import PackedNVFP4

        return PackedNVFP4(self.packed_words, self.packed_scales, self.weight_scale_2, self.out_features, self.in_features)

    @property
    def qweight(self) -> nvfp4.NVFP4Tensor:
        if self.layout == "packed":
            return self.packed().unpack()
        return nvfp4.NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "packed":
            return self._packed_forward(x)
        if self.act_quant:
            xq = fake_quant_nvfp4(x, self.input_scale)
            if self.backend == "triton":
                y = self._w4a16(xq)
            else:
                y = F.linear(xq, self.qweight.dequantize(torch.float32))
            if self.bias is not None:
                y = y + self.bias.float()
            return y.to(x.dtype)
        if self.backend == "triton":
            y = self._w4a16(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.qweight.dequantize(x.dtype), self.bias)

    def _w4a16(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an operator the compiler sees as one opaque call
            return kernel_ops.w4a16_matmul(x, self.weight, self.weight_scale, self.weight_scale_2)
        from .kernels.w4a16_gemm import w4a16_matmul

        return w4a16_matmul(x, self.qweight, backend="triton")

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        from .kernels.packed_linear import packed_linear

        if x.dtype != self.packed_scales.dtype:
            raise ValueError(
                f"{self.name}: the weight was packed for {self.packed_scales.dtype} activations, got {x.dtype}; "
                "load with layout='checkpoint' to run other activation dtypes"
            )
        if self.backend == "triton" and torch.compiler.is_compiling():
            y = kernel_ops.packed_matmul(x, self.packed_words, self.packed_scales, self.weight_scale_2,
                                         self.out_features, self.in_features)
        else:
            y = packed_linear(x, self.packed(), backend=self.backend)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        mode = "W4A4" if self.act_quant else "W4A16"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.algo} run as {mode}, "
                f"backend={self.backend}, layout={self.layout}")


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
        xq = e4m3_cast(x.float() / self.input_scale.float())  # the quotient in fp32, saturating at +-448
        return self.forward_fp8(xq, x.dtype)

    def forward_fp8(self, xq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`forward` from its input already quantized (xq = e4m3(clamp(x / input_scale, +-448)),
        float8_e4m3fn), the output in `dtype` (x's)."""
        if self.backend == "triton":
            y = self._scaled_mm(xq, dtype)
            return y if self.bias is None else y + self.bias
        # Both operands dequantized to fp32, one fp32 linear, rounded once to the activation dtype.
        y = F.linear(xq.float() * self.input_scale.float(), self.dequantized_weight(),
                     None if self.bias is None else self.bias.float())
        return y.to(dtype)

    def _scaled_mm(self, xq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from .kernels.fp8_gemm import fp8_matmul, use_gemv

        if use_gemv(xq.numel() // max(1, self.in_features), xq.device, n=self.out_features, k=self.in_features):
            xs, ws = self.input_scale.float(), self.weight_scale.float()
            if torch.compiler.is_compiling():  # an operator the compiler sees as one opaque call
                return kernel_ops.fp8_matmul(xq, self.weight, xs, ws, dtype)
            return fp8_matmul(xq, self.weight, xs, ws, dtype)
        lead = xq.shape[:-1]
        a = xq.reshape(-1, self.in_features)
        b = self.weight
        k, n = self.in_features, self.out_features
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


def hf_experts_accumulate_in_routing_dtype() -> bool:
    """Whether the installed transformers' eager NemotronHExperts adds the experts' outputs into a
    buffer of the routing weights' dtype (fp32; transformers <= 5.24) rather than of the hidden
    states' (5.25: `torch.zeros_like(hidden_states)`). The loop below follows it, so that a loaded
    checkpoint computes what transformers computes with the dequantized weights."""
    import inspect

    try:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        source = inspect.getsource(inspect.unwrap(NemotronHExperts.forward))
    except (ImportError, OSError, TypeError):
        return False
    return "zeros_like(hidden_states, dtype=top_k_weights.dtype)" in source


def _expert_weights(stack: nvfp4.NVFP4Tensor, dtype: torch.dtype):
    """expert index -> stack[expert].dequantize(dtype): only the experts a call routes to are
    dequantized (the values of the whole stack's dequantize at that index, bit for bit)."""
    def weight(e: int) -> torch.Tensor:
        return nvfp4.NVFP4Tensor(stack.packed[e], stack.block_scale[e], stack.global_scale[e]).dequantize(dtype)
    return weight


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
        self.accumulate_in_routing_dtype = hf_experts_accumulate_in_routing_dtype()

    def stack(self, proj: str) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(getattr(self, f"{proj}_weight"), getattr(self, f"{proj}_weight_scale"),
                                 getattr(self, f"{proj}_weight_scale_2"))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton" and torch.compiler.is_compiling():  # one opaque operator to the compiler
            return kernel_ops.moe_experts(hidden_states, top_k_index, top_k_weights, self.up_proj_weight,
                                          self.up_proj_weight_scale, self.up_proj_weight_scale_2, self.down_proj_weight,
                                          self.down_proj_weight_scale, self.down_proj_weight_scale_2)
        up, down = self.stack("up_proj"), self.stack("down_proj")
        if self.backend == "triton":
            from .kernels.moe_gemm import moe_experts

            return moe_experts(hidden_states, top_k_index, top_k_weights, up, down, backend="triton")
        if self.act_quant:
            return self._loop(hidden_states, top_k_index, top_k_weights, _expert_weights(up, torch.float32),
                              _expert_weights(down, torch.float32), self.up_proj_input_scale.max(),
                              self.down_proj_input_scale.max())
        dtype = hidden_states.dtype
        return self._loop(hidden_states, top_k_index, top_k_weights, _expert_weights(up, dtype),
                          _expert_weights(down, dtype))

    def with_shared(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    shared: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(hidden_states, top_k_index, top_k_weights), shared(hidden_states)) for a shared
        expert of two W4A16 NVFP4Linear (one layout, no bias) around relu^2, by
        `kernels.moe_gemm.moe_experts_and_shared` (Triton backend): the same launches, on a GPU
        the shared expert's on a second stream."""
        up, down = shared.up_proj, shared.down_proj
        if torch.compiler.is_compiling():  # one opaque operator to the compiler
            experts = (self.up_proj_weight, self.up_proj_weight_scale, self.up_proj_weight_scale_2,
                       self.down_proj_weight, self.down_proj_weight_scale, self.down_proj_weight_scale_2)
            if up.layout == "packed":
                return kernel_ops.moe_experts_and_packed_shared(hidden_states, top_k_index, top_k_weights, *experts,
                                                                *_packed_shared_args(up, down))
            return kernel_ops.moe_experts_and_shared(hidden_states, top_k_index, top_k_weights, *experts,
                                                     up.weight, up.weight_scale, up.weight_scale_2, down.weight,
                                                     down.weight_scale, down.weight_scale_2)
        from .kernels.moe_gemm import moe_experts_and_shared

        return moe_experts_and_shared(hidden_states, top_k_index, top_k_weights, self.stack("up_proj"),
                                      self.stack("down_proj"), *_shared_weights(up, down))

    def routed_with_shared(self, hidden_states: torch.Tensor, route_x: torch.Tensor, router_weight: torch.Tensor,
                           router_bias: torch.Tensor, top_k: int, norm: bool, scale: float,
                           shared: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """`with_shared` with the experts picked in the same call by the one-launch router
        (`kernels.router.route(route_x, router_weight, router_bias, top_k, norm=norm,
        scale=scale)`), by `kernels.moe_gemm.routed_experts_and_shared`: on a GPU the shared
        expert's launches go to the second stream before the router's."""
        up, down = shared.up_proj, shared.down_proj
        if torch.compiler.is_compiling():  # one opaque operator to the compiler
            head = (hidden_states, route_x, router_weight, router_bias, top_k, norm, scale, self.up_proj_weight,
                    self.up_proj_weight_scale, self.up_proj_weight_scale_2, self.down_proj_weight,
                    self.down_proj_weight_scale, self.down_proj_weight_scale_2)
            if up.layout == "packed":
                return kernel_ops.routed_experts_and_packed_shared(*head, *_packed_shared_args(up, down))
            return kernel_ops.routed_experts_and_shared(*head, up.weight, up.weight_scale, up.weight_scale_2,
                                                        down.weight, down.weight_scale, down.weight_scale_2)
        from .kernels.moe_gemm import routed_experts_and_shared

        return routed_experts_and_shared(hidden_states, route_x, router_weight, router_bias, top_k,
                                         self.stack("up_proj"), self.stack("down_proj"), *_shared_weights(up, down),
                                         norm=norm, scale=scale)

    def _loop(self, hidden_states, top_k_index, top_k_weights, up_w, down_w, up_scale=None, down_scale=None):
        # transformers' eager NemotronHExperts.forward, statement for statement (up_w / down_w:
        # expert index -> its dequantized weight); with input scales, each linear takes NVFP4
        # activations and computes in fp32 (see NVFP4Linear).
        def linear(x, w, scale):
            if scale is None:
                return F.linear(x, w)
            return F.linear(fake_quant_nvfp4(x, scale), w).to(x.dtype)

        acc = top_k_weights.dtype if self.accumulate_in_routing_dtype else hidden_states.dtype
        final_hidden_states = torch.zeros_like(hidden_states, dtype=acc)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        for expert_idx in expert_hit.tolist():
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.numel() == 0:
                continue
            h = linear(hidden_states[token_idx], up_w(expert_idx), up_scale)
            h = self.act_fn(h)
            h = linear(h, down_w(expert_idx), down_scale)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
        return final_hidden_states.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        mode = "W4A4" if self.act_quant else "W4A16"
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"{self.algo} run as {mode}, backend={self.backend}")


def _shared_weights(up: NVFP4Linear, down: NVFP4Linear) -> tuple:
    """A shared expert's up and down weights as its layout holds them: `PackedNVFP4` (layout
    "packed") or `nvfp4.NVFP4Tensor` (the checkpoint's)."""
    return (up.packed(), down.packed()) if up.layout == "packed" else (up.qweight, down.qweight)


def _packed_shared_args(up: NVFP4Linear, down: NVFP4Linear) -> tuple:
    """The packed shared expert's tensors and intermediate size as the `*_packed_shared` operators
    take them."""
    return (up.packed_words, up.packed_scales, up.weight_scale_2, down.packed_words, down.packed_scales,
            down.weight_scale_2, up.out_features)


class FP8KVProjection(nn.Module):
    """An attention's k_proj or v_proj whose output is rounded to E4M3 with the KV-cache scale.

    The buffer keeps the checkpoint's fp32 scale; the forward uses `engine_scale`, that value
    rounded to the activation (model) dtype, because vLLM does: its `k_scale` / `v_scale`
    parameters are created under the model's default dtype, so loading copies the fp32 scale
    into a bf16 parameter, and `BaseKVCacheMethod.process_weights_after_loading` passes that
    rounded value on to the fp32 `_k_scale` / `_v_scale` the attention kernels read
    (benchmarks/results/engines.json lists the scales it rounds). SGLang creates these
    parameters in fp32 and keeps the stored value: `model_dtype_scale=False` emulates it.
    """

    def __init__(self, proj: nn.Module, scale: torch.Tensor, kind: str, name: str = "", *,
                 model_dtype_scale: bool = True) -> None:
        super().__init__()
        self.proj = proj
        self.register_buffer(f"{kind}_scale", scale)
        self.kind = kind
        self.name = name
        self.model_dtype_scale = model_dtype_scale

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, f"{self.kind}_scale")

    def engine_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """The scale the KV cache is quantized with for activations of `dtype` (fp32)."""
        return (self.scale.to(dtype) if self.model_dtype_scale else self.scale).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return fake_quant_fp8(y, self.engine_scale(y.dtype))

    def extra_repr(self) -> str:
        held = "in the model dtype, as vLLM" if self.model_dtype_scale else "fp32, as SGLang"
        return f"FP8 KV cache ({self.kind}_scale={self.scale.item():.6g}, computed with {held})"


FP4KIT_MODULES = (NVFP4Linear, FP8Linear, NVFP4Experts, FP8KVProjection)
