"""Nemotron-H (transformers' native `nemotron_h`): hybrid Mamba-2 / MoE / attention.

In memory the tree is `model.layers.L.mixer`; on disk it is `backbone.layers.L.mixer`, with the
routed experts stored one module per expert (`...mixer.experts.E.up_proj.weight`) while
transformers holds them fused as [E, N, K] parameters.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import ops as kernel_ops, router as router_kernels
from ..kernels.backend import interpreted
from .roles import AttentionKV, Role, Target

MODEL_TYPE = "nemotron_h"

# NemotronHConfig arguments with Nemotron-3-Nano-30B-A3B's widths (from its published config.json):
# benchmarks build slices of the real model from these with a shorter layer pattern.
NANO_WIDTHS = dict(
    vocab_size=131072, hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
    mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
    n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, intermediate_size=1856,
    tie_word_embeddings=False, max_position_embeddings=65536,
)


# The packages transformers runs Nemotron-H's Mamba mixers with when they import (causal_conv1d_fn
# and _update from causal-conv1d; the chunked scan and the single-step state update from
# mamba-ssm); each part whose package is missing runs in transformers' plain-torch reference code.
MAMBA_KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d")


def mamba_kernels() -> dict[str, str | None]:
    """{package: version} for the Mamba kernel packages, None for one that does not import here
    (missing, or built for another torch), as transformers decides."""
    import importlib
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in MAMBA_KERNEL_PACKAGES:
        try:
            importlib.import_module(name)
            out[name] = metadata.version(name.replace("_", "-"))
        except Exception:  # transformers falls back on any import failure, so this reports any as None
            out[name] = None
    return out


def _classes():
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    return m


def disk_name(name: str) -> str:
    """In-memory parameter/module name -> checkpoint name."""
    if name == "model" or name.startswith("model."):
        return "backbone" + name[len("model") :]
    return name


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def targets(model: nn.Module) -> list[Target]:
    m = _classes()
    out: list[Target] = []
    for name, module in model.named_modules():
        layer = _layer_index(name)
        disk = disk_name(name)
        if name.startswith("mtp.") or name.startswith("model.mtp"):
            if isinstance(module, nn.Linear):
                out.append(Target(name, module, "weight", Role.MTP, layer, [disk]))
            continue
        if isinstance(module, m.NemotronHMamba2Mixer):
            out.append(Target(f"{name}.in_proj", module.in_proj, "weight", Role.MAMBA_IN_PROJ, layer, [f"{disk}.in_proj"]))
            out.append(Target(f"{name}.out_proj", module.out_proj, "weight", Role.MAMBA_OUT_PROJ, layer, [f"{disk}.out_proj"]))
            out.append(Target(f"{name}.conv1d", module.conv1d, "weight", Role.CONV1D, layer, [f"{disk}.conv1d"]))
        elif isinstance(module, m.NemotronHAttention):
            group = f"{name}.qkv"
            for proj in ("q_proj", "k_proj", "v_proj"):
                out.append(Target(f"{name}.{proj}", getattr(module, proj), "weight", Role.ATTENTION_QKV, layer, [f"{disk}.{proj}"], fuse_group=group))
            out.append(Target(f"{name}.o_proj", module.o_proj, "weight", Role.ATTENTION_O, layer, [f"{disk}.o_proj"]))
        elif isinstance(module, m.NemotronHMoE):
            experts = module.experts
            n = experts.up_proj.shape[0]
            for proj in ("up_proj", "down_proj"):
                out.append(
                    Target(
                        f"{name}.experts", experts, proj, Role.ROUTED_EXPERTS, layer,
                        [f"{disk}.experts.{e}.{proj}" for e in range(n)], stacked=True,
                    )
                )
            out.append(Target(f"{name}.gate", module.gate, "weight", Role.ROUTER, layer, [f"{disk}.gate"]))
            for proj in ("up_proj", "down_proj"):
                out.append(
                    Target(f"{name}.shared_experts.{proj}", getattr(module.shared_experts, proj), "weight", Role.SHARED_EXPERTS, layer, [f"{disk}.shared_experts.{proj}"])
                )
        elif isinstance(module, m.NemotronHBlock) and isinstance(module.mixer, m.NemotronHMLP):
            for proj in ("up_proj", "down_proj"):
                out.append(Target(f"{name}.mixer.{proj}", getattr(module.mixer, proj), "weight", Role.DENSE_MLP, layer, [f"{disk}.mixer.{proj}"]))
    emb = model.get_input_embeddings()
    out.append(Target("model.embeddings", emb, "weight", Role.EMBEDDINGS, None, [disk_name(_module_name(model, emb))]))
    head = model.get_output_embeddings()
    if head is not None:
        out.append(Target("lm_head", head, "weight", Role.LM_HEAD, None, [disk_name(_module_name(model, head))]))
    return out


def _module_name(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError("module not found in model")


def attention_kv(model: nn.Module) -> list[AttentionKV]:
    m = _classes()
    return [
        AttentionKV(name, module.k_proj, module.v_proj, disk_name(name), module)
        for name, module in model.named_modules()
        if isinstance(module, m.NemotronHAttention)
    ]


# Whether the pick kernel runs compiled (not in Triton's interpreter): fixed at import, and a
# constant to code that torch.compile traces.
_PICK_KERNEL = not interpreted(router_kernels._topk_gather_kernel)
# Within `one_launch_routing`: the short forward runs the whole router as one launch
# (`kernels.router.route`) for up to ROUTE_MAX_TOKENS rows on a GPU.
_ONE_LAUNCH = False


def _kernel_rows(x: torch.Tensor) -> bool:
    """Whether the router's Triton kernels take these rows (on a GPU, compiled)."""
    return x.is_cuda and _PICK_KERNEL


def _router_rows(router: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the router's fp32 rows of hidden_states, its fp32 weight: the copy `single_group_routing`
    keeps, else made now)."""
    weight = getattr(router, "_weight_fp32", None)
    return (hidden_states.view(-1, router.hidden_dim).to(torch.float32),
            router.weight.to(torch.float32) if weight is None else weight)


def _one_launch_rows(x: torch.Tensor) -> bool:
    """Whether the one-launch router (`kernels.router.route`) takes these rows (by their device
    and count, so before they are made fp32)."""
    return _kernel_rows(x) and x.shape[0] <= router_kernels.ROUTE_MAX_TOKENS


def _one_group_route(router: nn.Module, hidden_states):
    """`NemotronHTopkRouter.forward` for a router whose experts form one group (n_group and
    topk_group 1). The group step there picks that one group and masks nothing, so it is left
    out: sigmoid scores, the correction bias added for the choice, the top-k experts by it
    (unsorted), their plain scores gathered, normalised and scaled. The same operations on the
    same values as the full forward, so the same experts and weights, bit for bit. On a GPU the
    pick and the gather are one launch (`kernels.router.topk_gather`, torch's top-k order), and
    the weight's fp32 copy is made once per `single_group_routing` block, not per call.

    Within `one_launch_routing`, on a GPU and for up to ROUTE_MAX_TOKENS rows, the logits too are
    in that launch (`kernels.router.route`): summed in another order than torch's matmul, so an
    expert whose sum ties another's to about 1e-7 may be picked in its place."""
    x, weight = _router_rows(router, hidden_states)
    if _ONE_LAUNCH and _one_launch_rows(x):
        norm, scale = bool(router.norm_topk_prob), float(router.routed_scaling_factor)
        if torch.compiler.is_compiling():
            return kernel_ops.route(x, weight, router.e_score_correction_bias, router.top_k, norm, scale)
        return router_kernels.route(x, weight, router.e_score_correction_bias, router.top_k, norm=norm, scale=scale)
    logits = F.linear(x, weight)
    scores = logits.sigmoid()
    if _kernel_rows(scores):
        if torch.compiler.is_compiling() or scores.requires_grad:  # one opaque operator, with a gradient
            chosen, weights = kernel_ops.topk_gather(scores, router.e_score_correction_bias, router.top_k)
        else:
            chosen, weights = router_kernels.topk_gather(scores, router.e_score_correction_bias, router.top_k)
    else:
        chosen = torch.topk(scores + router.e_score_correction_bias, k=router.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
    if router.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return logits, weights * router.routed_scaling_factor, chosen


@contextlib.contextmanager
def one_launch_routing():
    """Within the block, single-group routers on their short forward (`single_group_routing`)
    run each call of up to ROUTE_MAX_TOKENS rows on a GPU as one launch (`_one_group_route`)."""
    global _ONE_LAUNCH
    saved, _ONE_LAUNCH = _ONE_LAUNCH, True
    try:
        yield
    finally:
        _ONE_LAUNCH = saved


# Each router class's subclass with the short forward (one per class, so code compiled for it
# stays valid from one block to the next), and each router's probe verdict.
_SHORT_CLASSES: dict[type, type] = {}
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _takes_short_forward(router: nn.Module) -> bool:
    """Whether the router has one group and its two forwards gave the same experts and weights,
    bit for bit, on a probe of its own (decided once per router)."""
    if router not in _VERDICTS:
        same = False
        # A forward set on the instance (accelerate's offloading hooks) would not see the class.
        if (getattr(router, "num_group", None) == 1 and getattr(router, "topk_group", None) == 1
                and "forward" not in router.__dict__ and router.weight.device.type != "meta"):
            probe = torch.randn((7, router.hidden_dim), generator=torch.Generator().manual_seed(0)).to(
                device=router.weight.device, dtype=router.weight.dtype)
            try:
                with torch.no_grad():
                    full, short = router(probe), _one_group_route(router, probe)
                same = all(torch.equal(a, b) for a, b in zip(full, short))
                why = "its experts or weights differ from the full forward's on a probe"
            except Exception as e:  # a router this forward does not fit keeps its own
                same, why = False, f"the short forward failed on a probe ({type(e).__name__}: {e})"
            if not same:
                warnings.warn(f"{type(router).__name__} (n_group 1) keeps transformers' full forward, two top-k launches "
                              f"more per layer and step: {why}", RuntimeWarning, stacklevel=3)
        _VERDICTS[router] = same
    return _VERDICTS[router]


def _with_forward(classes: dict, base: type, suffix: str, forward) -> type:
    """`base`'s subclass with `forward`, made once per base and kept in `classes` (so that code
    compiled for it stays valid from one use to the next)."""
    if base not in classes:
        classes[base] = type(f"{base.__name__}{suffix}", (base,), {"forward": forward, "__module__": __name__})
    return classes[base]


@contextlib.contextmanager
def single_group_routing(model: nn.Module):
    """Within the block, each single-group MoE router of `model` (every Nemotron-3 router:
    n_group 1) runs the forward without the group step (`_one_group_route`): two top-k launches
    and the masking fewer per layer and decode step. Yields how many routers do; each is its own
    class again at the end. A router whose weight is not fp32 keeps an fp32 copy of it for the
    block (the forward computes its logits in fp32)."""
    router_class = getattr(_classes(), "NemotronHTopkRouter", None)
    routers = [] if router_class is None else [
        m for m in model.modules() if type(m) is router_class and _takes_short_forward(m)]
    for m in routers:
        m.__class__ = _with_forward(_SHORT_CLASSES, router_class, "OneGroup", _one_group_route)
        if m.weight.dtype != torch.float32:
            m.__dict__["_weight_fp32"] = m.weight.detach().to(torch.float32)
    try:
        yield len(routers)
    finally:
        for m in routers:
            m.__class__ = router_class
            m.__dict__.pop("_weight_fp32", None)


# Each MoE block class's subclass whose forward runs the routed and the shared experts in one
# call (`_overlapped_moe_forward`), one per class.
_OVERLAPPED_CLASSES: dict[type, type] = {}


def _one_launch_router(router: nn.Module, rows: torch.Tensor):
    """(the router's fp32 rows, its fp32 weight) where `_one_group_route` would run `router` on
    `rows` as one launch (`kernels.router.route`): a single-group router on its short forward,
    within `one_launch_routing`, on a GPU; else None."""
    if not (_ONE_LAUNCH and type(router) in _SHORT_CLASSES.values() and _one_launch_rows(rows)):
        return None
    return _router_rows(router, rows)


def _overlapped_moe_forward(self, hidden_states):
    """`NemotronHMoE.forward` with the routed experts and the shared expert in one call
    (`NVFP4Experts.with_shared`: on a GPU the shared expert on a second stream beside the routed
    experts; where the router runs as one launch, `NVFP4Experts.routed_with_shared`, the router
    in the call too and the shared expert beside it as well): the same kernels on the same values,
    so the same output bit for bit; installed only where a probe shows that
    (`overlap_shared_experts`)."""
    orig_shape = hidden_states.shape
    rows = hidden_states.view(-1, hidden_states.shape[-1])
    one_launch = _one_launch_router(self.gate, rows)
    if one_launch is None:
        _, topk_weights, topk_indices = self.gate(hidden_states)
        routed, shared = self.experts.with_shared(rows, topk_indices, topk_weights, self.shared_experts)
    else:
        g = self.gate
        routed, shared = self.experts.routed_with_shared(rows, *one_launch, g.e_score_correction_bias, g.top_k,
                                                         bool(g.norm_topk_prob), float(g.routed_scaling_factor),
                                                         self.shared_experts)
    return routed.view(*orig_shape) + shared.view(*orig_shape)


def _overlaps(block: nn.Module) -> bool:
    """Whether `block`'s experts and shared expert are fp4kit's W4A16 Triton modules that
    `NVFP4Experts.with_shared` runs (and no latent projection sits between them)."""
    from ..modules import NVFP4Experts, NVFP4Linear

    experts, shared = getattr(block, "experts", None), getattr(block, "shared_experts", None)
    linears = [getattr(shared, name, None) for name in ("up_proj", "down_proj")]
    return (isinstance(experts, NVFP4Experts) and experts.backend == "triton" and not experts.act_quant
            and all(isinstance(m, NVFP4Linear) and m.backend == "triton" and not m.act_quant and m.bias is None
                    for m in linears)
            and linears[0].layout == linears[1].layout
            and type(getattr(shared, "act_fn", None)).__name__ == "ReLUSquaredActivation"
            and all(isinstance(getattr(block, n, None), nn.Identity) for n in ("fc1_latent_proj", "fc2_latent_proj")))


def overlap_shared_experts(model: nn.Module) -> int:
    """Each Nemotron-H MoE block whose experts and shared expert run on fp4kit's W4A16 Triton
    modules (`_overlaps`) gets the forward that runs them in one call (`_overlapped_moe_forward`),
    if on a probe of its own its output equals the block's own forward's bit for bit (else it
    keeps its forward, with a warning). Returns how many blocks did."""
    block_class = getattr(_classes(), "NemotronHMoE", None)
    if block_class is None:
        return 0
    done = 0
    for block in [m for m in model.modules() if type(m) is block_class and _overlaps(m)]:
        weight = block.experts.up_proj_weight
        probe = torch.randn((1, 3, block.experts.hidden_dim), generator=torch.Generator().manual_seed(0)).to(
            device=weight.device, dtype=torch.bfloat16)
        try:
            with torch.no_grad():
                same = torch.equal(block(probe), _overlapped_moe_forward(block, probe))
            why = "its output differs from the block's own forward's on a probe"
        except Exception as e:  # a block this forward does not fit keeps its own
            same, why = False, f"the forward failed on a probe ({type(e).__name__}: {e})"
        if not same:
            warnings.warn(f"{type(block).__name__} keeps its forward, the shared expert after the routed ones: {why}",
                          RuntimeWarning, stacklevel=2)
            continue
        block.__class__ = _with_forward(_OVERLAPPED_CLASSES, block_class, "Overlapped", _overlapped_moe_forward)
        done += 1
    return done


@contextlib.contextmanager
def shared_experts_after_routed(model: nn.Module):
    """Within the block, the MoE blocks `overlap_shared_experts` switched run their own forward
    again (the shared expert after the routed ones, on the caller's stream): to compare the two.
    Yields how many blocks do."""
    blocks = [m for m in model.modules() if type(m) in _OVERLAPPED_CLASSES.values()]
    for m in blocks:
        m.__class__ = type(m).__bases__[0]
    try:
        yield len(blocks)
    finally:
        for m in blocks:
            m.__class__ = _OVERLAPPED_CLASSES[type(m)]

