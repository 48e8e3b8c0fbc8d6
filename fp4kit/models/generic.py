"""Dense Hugging Face decoders (Llama-style): q/k/v/o attention and gate/up/down MLPs.

Roles are found by module structure, not by model name: an attention block is a module with
q_proj, k_proj, v_proj and o_proj Linears; an MLP one with gate_proj, up_proj and down_proj.
Checkpoint names equal in-memory names.
"""

from __future__ import annotations

from torch import nn

from .roles import AttentionKV, Role, Target


def disk_name(name: str) -> str:
    return name


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _has_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def targets(model: nn.Module) -> list[Target]:
    out: list[Target] = []
    for name, module in model.named_modules():
        layer = _layer_index(name)
        if _has_linears(module, ("q_proj", "k_proj", "v_proj", "o_proj")):
            for proj in ("q_proj", "k_proj", "v_proj"):
                out.append(Target(f"{name}.{proj}", getattr(module, proj), "weight", Role.ATTENTION_QKV, layer, [f"{name}.{proj}"], fuse_group=f"{name}.qkv"))
            out.append(Target(f"{name}.o_proj", module.o_proj, "weight", Role.ATTENTION_O, layer, [f"{name}.o_proj"]))
        elif _has_linears(module, ("gate_proj", "up_proj", "down_proj")):
            for proj in ("gate_proj", "up_proj"):
                out.append(Target(f"{name}.{proj}", getattr(module, proj), "weight", Role.DENSE_MLP, layer, [f"{name}.{proj}"], fuse_group=f"{name}.gate_up"))
            out.append(Target(f"{name}.down_proj", module.down_proj, "weight", Role.DENSE_MLP, layer, [f"{name}.down_proj"]))
    names = {id(m): n for n, m in model.named_modules()}
    emb = model.get_input_embeddings()
    out.append(Target(names[id(emb)], emb, "weight", Role.EMBEDDINGS, None, [names[id(emb)]]))
    head = model.get_output_embeddings()
    if head is not None and head.weight is not emb.weight:
        out.append(Target(names[id(head)], head, "weight", Role.LM_HEAD, None, [names[id(head)]]))
    return out


def attention_kv(model: nn.Module) -> list[AttentionKV]:
    return [
        AttentionKV(name, module.k_proj, module.v_proj, name, module)
        for name, module in model.named_modules()
        if _has_linears(module, ("q_proj", "k_proj", "v_proj", "o_proj"))
    ]
