"""fp4kit's Triton kernels as torch operators (`torch.ops.fp4kit.*`), for code that `torch.compile` traces.

Dynamo cannot see through a launcher (launch tables, checks, host-side routing), so a compiled
model calls these operators instead: each is opaque to the compiler, which fuses the code around
it, and says only what it returns (shape and dtype) to the tracer. Eager code calls the launchers
directly: the dispatcher adds host time to every call.

    w4a16_matmul(x, packed, block_scale, global_scale)           kernels.w4a16_gemm.w4a16_matmul
    packed_matmul(x, words, scales, global_scale, n, k)           kernels.packed_linear.packed_linear
    moe_experts(hidden, top_k_index, top_k_weights, up_packed, up_block_scale, up_global_scale,
                down_packed, down_block_scale, down_global_scale)  kernels.moe_gemm.moe_experts
    moe_experts_and_shared(the same, then the shared expert's up and down packed, block_scale,
                global_scale)                                 kernels.moe_gemm.moe_experts_and_shared
    routed_experts_and_shared(hidden, route_x, router_weight, router_bias, k, norm, scale, then the
                expert and shared expert tensors as above)    kernels.moe_gemm.routed_experts_and_shared
    moe_experts_and_packed_shared, routed_experts_and_packed_shared(the same, the shared expert's
                weights packed: up and down words, scales, global_scale, then its intermediate size)
    topk_gather(scores, bias, k)                                  kernels.router.topk_gather
    route(x, weight, bias, k, norm, scale)                        kernels.router.route
    decode_attention(query, key, value, mask, scale)              kernels.attention.decode_attention
    mamba_step(proj, conv_state!, ssm_state!, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
               eps, groups, out_scale)                            kernels.mamba.mamba_step
    fp8_matmul(xq, weight, input_scale, weight_scale, out_dtype)  kernels.fp8_gemm.fp8_matmul

Each runs the Triton backend (compiled on a GPU, interpreted on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from ..formats import nvfp4


@torch.library.custom_op("fp4kit::w4a16_matmul", mutates_args=())
def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                 global_scale: torch.Tensor) -> torch.Tensor:
    from .w4a16_gemm import w4a16_matmul as launch

    return launch(x, nvfp4.NVFP4Tensor(packed, block_scale, global_scale), backend="triton")


@w4a16_matmul.register_fake
def _(x, packed, block_scale, global_scale):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("fp4kit::packed_matmul", mutates_args=())
def packed_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                  n: int, k: int) -> torch.Tensor:
    from .packed_gemm import PackedNVFP4
    from .packed_linear import packed_linear

    return packed_linear(x, PackedNVFP4(words, scales, global_scale, n, k), backend="triton")


@packed_matmul.register_fake
def _(x, words, scales, global_scale, n, k):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("fp4kit::moe_experts", mutates_args=())
def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                up_packed: torch.Tensor, up_block_scale: torch.Tensor, up_global_scale: torch.Tensor,
                down_packed: torch.Tensor, down_block_scale: torch.Tensor, down_global_scale: torch.Tensor) -> torch.Tensor:
    from .moe_gemm import moe_experts as launch

    return launch(hidden_states, top_k_index, top_k_weights,
                  nvfp4.NVFP4Tensor(up_packed, up_block_scale, up_global_scale),
                  nvfp4.NVFP4Tensor(down_packed, down_block_scale, down_global_scale), backend="triton")


@moe_experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, up_packed, up_block_scale, up_global_scale,
      down_packed, down_block_scale, down_global_scale):
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


@torch.library.custom_op("fp4kit::moe_experts_and_shared", mutates_args=())
def moe_experts_and_shared(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           up_packed: torch.Tensor, up_block_scale: torch.Tensor, up_global_scale: torch.Tensor,
                           down_packed: torch.Tensor, down_block_scale: torch.Tensor, down_global_scale: torch.Tensor,
                           shared_up_packed: torch.Tensor, shared_up_block_scale: torch.Tensor,
                           shared_up_global_scale: torch.Tensor, shared_down_packed: torch.Tensor,
                           shared_down_block_scale: torch.Tensor,
                           shared_down_global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .moe_gemm import moe_experts_and_shared as launch

    return launch(hidden_states, top_k_index, top_k_weights,
                  nvfp4.NVFP4Tensor(up_packed, up_block_scale, up_global_scale),
                  nvfp4.NVFP4Tensor(down_packed, down_block_scale, down_global_scale),
                  nvfp4.NVFP4Tensor(shared_up_packed, shared_up_block_scale, shared_up_global_scale),
                  nvfp4.NVFP4Tensor(shared_down_packed, shared_down_block_scale, shared_down_global_scale))


@moe_experts_and_shared.register_fake
def _(hidden_states, top_k_index, top_k_weights, up_packed, up_block_scale, up_global_scale, down_packed,
      down_block_scale, down_global_scale, shared_up_packed, shared_up_block_scale, shared_up_global_scale,
      shared_down_packed, shared_down_block_scale, shared_down_global_scale):
    return (torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            hidden_states.new_empty((*hidden_states.shape[:-1], shared_down_packed.shape[0])))


@torch.library.custom_op("fp4kit::routed_experts_and_shared", mutates_args=())
def routed_experts_and_shared(hidden_states: torch.Tensor, route_x: torch.Tensor, router_weight: torch.Tensor,
                              router_bias: torch.Tensor, k: int, norm: bool, scale: float,
                              up_packed: torch.Tensor, up_block_scale: torch.Tensor, up_global_scale: torch.Tensor,
                              down_packed: torch.Tensor, down_block_scale: torch.Tensor,
                              down_global_scale: torch.Tensor, shared_up_packed: torch.Tensor,
                              shared_up_block_scale: torch.Tensor, shared_up_global_scale: torch.Tensor,
                              shared_down_packed: torch.Tensor, shared_down_block_scale: torch.Tensor,
                              shared_down_global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .moe_gemm import routed_experts_and_shared as launch

    return launch(hidden_states, route_x, router_weight, router_bias, k,
                  nvfp4.NVFP4Tensor(up_packed, up_block_scale, up_global_scale),
                  nvfp4.NVFP4Tensor(down_packed, down_block_scale, down_global_scale),
                  nvfp4.NVFP4Tensor(shared_up_packed, shared_up_block_scale, shared_up_global_scale),
                  nvfp4.NVFP4Tensor(shared_down_packed, shared_down_block_scale, shared_down_global_scale),
                  norm=norm, scale=scale)


@routed_experts_and_shared.register_fake
def _(hidden_states, route_x, router_weight, router_bias, k, norm, scale, up_packed, up_block_scale,
      up_global_scale, down_packed, down_block_scale, down_global_scale, shared_up_packed, shared_up_block_scale,
      shared_up_global_scale, shared_down_packed, shared_down_block_scale, shared_down_global_scale):
    return (torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            hidden_states.new_empty((*hidden_states.shape[:-1], shared_down_packed.shape[0])))


def _packed_shared(words_up, scales_up, gs_up, words_down, scales_down, gs_down, inter: int, hidden: int) -> tuple:
    """A shared expert's packed up [inter, hidden] and down [hidden, inter] weights."""
    from .packed_gemm import PackedNVFP4

    return (PackedNVFP4(words_up, scales_up, gs_up, inter, hidden),
            PackedNVFP4(words_down, scales_down, gs_down, hidden, inter))


@torch.library.custom_op("fp4kit::moe_experts_and_packed_shared", mutates_args=())
def moe_experts_and_packed_shared(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                                  up_packed: torch.Tensor, up_block_scale: torch.Tensor, up_global_scale: torch.Tensor,
                                  down_packed: torch.Tensor, down_block_scale: torch.Tensor,
                                  down_global_scale: torch.Tensor, shared_up_words: torch.Tensor,
                                  shared_up_scales: torch.Tensor, shared_up_global_scale: torch.Tensor,
                                  shared_down_words: torch.Tensor, shared_down_scales: torch.Tensor,
                                  shared_down_global_scale: torch.Tensor,
                                  shared_inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .moe_gemm import moe_experts_and_shared as launch

    return launch(hidden_states, top_k_index, top_k_weights,
                  nvfp4.NVFP4Tensor(up_packed, up_block_scale, up_global_scale),
                  nvfp4.NVFP4Tensor(down_packed, down_block_scale, down_global_scale),
                  *_packed_shared(shared_up_words, shared_up_scales, shared_up_global_scale, shared_down_words,
                                  shared_down_scales, shared_down_global_scale, shared_inter,
                                  hidden_states.shape[-1]))


@moe_experts_and_packed_shared.register_fake
def _(hidden_states, top_k_index, top_k_weights, up_packed, up_block_scale, up_global_scale, down_packed,
      down_block_scale, down_global_scale, shared_up_words, shared_up_scales, shared_up_global_scale,
      shared_down_words, shared_down_scales, shared_down_global_scale, shared_inter):
    return (torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            hidden_states.new_empty(hidden_states.shape))


@torch.library.custom_op("fp4kit::routed_experts_and_packed_shared", mutates_args=())
def routed_experts_and_packed_shared(hidden_states: torch.Tensor, route_x: torch.Tensor, router_weight: torch.Tensor,
                                     router_bias: torch.Tensor, k: int, norm: bool, scale: float,
                                     up_packed: torch.Tensor, up_block_scale: torch.Tensor,
                                     up_global_scale: torch.Tensor, down_packed: torch.Tensor,
                                     down_block_scale: torch.Tensor, down_global_scale: torch.Tensor,
                                     shared_up_words: torch.Tensor, shared_up_scales: torch.Tensor,
                                     shared_up_global_scale: torch.Tensor, shared_down_words: torch.Tensor,
                                     shared_down_scales: torch.Tensor, shared_down_global_scale: torch.Tensor,
                                     shared_inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .moe_gemm import routed_experts_and_shared as launch

    return launch(hidden_states, route_x, router_weight, router_bias, k,
                  nvfp4.NVFP4Tensor(up_packed, up_block_scale, up_global_scale),
                  nvfp4.NVFP4Tensor(down_packed, down_block_scale, down_global_scale),
                  *_packed_shared(shared_up_words, shared_up_scales, shared_up_global_scale, shared_down_words,
                                  shared_down_scales, shared_down_global_scale, shared_inter,
                                  hidden_states.shape[-1]),
                  norm=norm, scale=scale)


@routed_experts_and_packed_shared.register_fake
def _(hidden_states, route_x, router_weight, router_bias, k, norm, scale, up_packed, up_block_scale,
      up_global_scale, down_packed, down_block_scale, down_global_scale, shared_up_words, shared_up_scales,
      shared_up_global_scale, shared_down_words, shared_down_scales, shared_down_global_scale, shared_inter):
    return (torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
            hidden_states.new_empty(hidden_states.shape))


@torch.library.custom_op("fp4kit::fp8_matmul", mutates_args=())
def fp8_matmul(xq: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor, weight_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    from .fp8_gemm import fp8_matmul as launch

    return launch(xq, weight, input_scale, weight_scale, out_dtype, backend="triton")


@fp8_matmul.register_fake
def _(xq, weight, input_scale, weight_scale, out_dtype):
    return xq.new_empty((*xq.shape[:-1], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("fp4kit::topk_gather", mutates_args=())
def topk_gather(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .router import topk_gather as launch

    return launch(scores, bias, k, backend="triton")


@topk_gather.register_fake
def _(scores, bias, k):
    t = scores.shape[0]
    return scores.new_empty((t, k), dtype=torch.int64), scores.new_empty((t, k))


def _topk_gather_context(ctx, inputs, output):
    scores, _, _ = inputs
    chosen, _ = output
    ctx.mark_non_differentiable(chosen)
    ctx.save_for_backward(chosen)
    ctx.scores_shape = scores.shape


def _topk_gather_backward(ctx, grad_chosen, grad_gathered):
    # as scores.gather(1, chosen)'s: each gathered gradient back to the score it came from
    (chosen,) = ctx.saved_tensors
    grad = grad_gathered.new_zeros(ctx.scores_shape).scatter_add_(1, chosen, grad_gathered)
    return grad, None, None


topk_gather.register_autograd(_topk_gather_backward, setup_context=_topk_gather_context)


@torch.library.custom_op("fp4kit::route", mutates_args=())
def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, norm: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .router import route as launch

    return launch(x, weight, bias, k, norm=norm, scale=scale, backend="triton")


@route.register_fake
def _(x, weight, bias, k, norm, scale):
    t, e = x.shape[0], weight.shape[0]
    return (x.new_empty((t, e), dtype=torch.float32), x.new_empty((t, k), dtype=torch.float32),
            x.new_empty((t, k), dtype=torch.int64))


@torch.library.custom_op("fp4kit::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    from .attention import decode_attention as launch

    return launch(query, key, value, mask, scale, backend="triton")


@decode_attention.register_fake
def _(query, key, value, mask, scale):
    b, heads, _, d = query.shape
    return query.new_empty((b, 1, heads, d))


@torch.library.custom_op("fp4kit::mamba_step", mutates_args=("conv_state", "ssm_state"))
def mamba_step(proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, conv_weight: torch.Tensor,
               conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
               norm_weight: torch.Tensor, eps: float, groups: int, out_scale: torch.Tensor | None = None) -> torch.Tensor:
    from .mamba import mamba_step as launch

    return launch(proj, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, eps, groups,
                  out_scale, backend="triton")


@mamba_step.register_fake
def _(proj, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, eps, groups, out_scale=None):
    return proj.new_empty((proj.shape[0], ssm_state.shape[1] * ssm_state.shape[2]),
                          dtype=proj.dtype if out_scale is None else torch.float8_e4m3fn)
