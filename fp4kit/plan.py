"""The plan: which weight of a model each recipe rule decides, and what quantizing it produced.

`plan_targets` walks the model's adapter targets and picks each one's rule (or none), refusing
what a recipe cannot do to a model; `fused_group_amax` gives the siblings that engines fuse
(q/k/v, gate/up) one global amax. `QuantizedModel` is the result `quantize.quantize` hands to
the export.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from .calibrate import Statistics
from .formats.arith import DEFAULT_ARITH
from .formats.constants import NVFP4_BLOCK_SIZE
from .models import AttentionKV, Role, Target, adapter_for
from .recipe import Recipe, Rule


class PlanError(ValueError):
    """The recipe cannot be applied to this model as written."""


@dataclass
class Planned:
    target: Target
    rule: Rule | None
    reason: str = ""  # why a target a rule asked for stays BF16


@dataclass
class QuantizedTarget:
    """The checkpoint tensors of one quantized weight (lists hold one entry per expert)."""

    target: Target
    rule: Rule
    algo: str
    tensors: dict[str, list[torch.Tensor]]
    sqnr_db: float
    frac4: float | None
    bytes_before: int
    bytes_after: int


@dataclass
class QuantizedModel:
    model: nn.Module
    adapter: ModuleType
    recipe: Recipe
    plan: list[Planned]
    quantized: dict[str, QuantizedTarget]
    kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]]
    stats: Statistics
    kv_layers: list[AttentionKV]
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)
    arith: str = DEFAULT_ARITH
    calibrate_s_per_sample: float | None = None  # steady calibration time per sample (quantize.BatchClock)

    def empty_experts(self) -> dict[str, list[int]]:
        """MoE layers whose experts received no calibration token."""
        return {
            name: torch.nonzero(counts == 0).flatten().tolist()
            for name, counts in self.stats.expert_tokens.items()
            if bool((counts == 0).any())
        }


def plan_targets(model: nn.Module, recipe: Recipe, adapter: ModuleType | None = None) -> tuple[list[Planned], list[str]]:
    """Which rule decides each weight; warnings for rules that match nothing."""
    adapter = adapter or adapter_for(model)
    plan: list[Planned] = []
    used = [False] * len(recipe.rules)
    for t in adapter.targets(model):
        rule = recipe.rule_for(t.role.value, t.disk_names[0])
        for i, r in enumerate(recipe.rules):
            if r is rule:
                used[i] = True
        reason = ""
        if rule is not None:
            if t.role in (Role.EMBEDDINGS, Role.ROUTER, Role.CONV1D):
                raise PlanError(f"recipe {recipe.name!r}: role {t.role.value} ({t.disk_names[0]}) cannot be quantized")
            k = t.weight.shape[-1]
            if k % NVFP4_BLOCK_SIZE and rule.format.startswith("nvfp4"):
                reason = f"K={k} is not a multiple of {NVFP4_BLOCK_SIZE}"
                rule = None
        plan.append(Planned(t, rule, reason))
    warnings = [f"{p.target.disk_names[0]}: kept in BF16 ({p.reason})" for p in plan if p.reason]
    names = [d for p in plan for d in p.target.disk_names]
    warnings += [
        f"recipe {recipe.name!r}: exclude pattern {pat!r} matches no module of this model"
        for pat in recipe.exclude
        if not any(fnmatch.fnmatchcase(n, pat) for n in names)
    ]
    warnings += [
        f"recipe {recipe.name!r}: rule {i} ({r.format} for roles {list(r.roles)} names {list(r.names)}) matches no module of this model"
        for i, (r, u) in enumerate(zip(recipe.rules, used))
        if not u
    ]
    _check_groups(plan, recipe)
    return plan, warnings


def _check_groups(plan: list[Planned], recipe: Recipe) -> None:
    groups: dict[str, set] = defaultdict(set)
    for p in plan:
        if p.target.fuse_group:
            groups[p.target.fuse_group].add(None if p.rule is None else (p.rule.format, p.rule.scale_rule))
        if p.target.is_stack:
            groups[p.target.name].add(None if p.rule is None else p.rule.format)
    for name, kinds in groups.items():
        if len(kinds) > 1:
            raise PlanError(
                f"recipe {recipe.name!r} gives the members of {name} different formats {sorted(map(str, kinds))}; "
                "serving engines need one format for layers that are fused or form one MoE layer"
            )




def fused_group_amax(plan: list[Planned]) -> dict[str, torch.Tensor]:
    """max|W| over each group of NVFP4 siblings that read one input (q/k/v, gate/up): their shared
    global amax, so that the engines' fused layer sees one weight_scale_2."""
    out: dict[str, torch.Tensor] = {}
    for p in plan:
        if p.rule is not None and p.target.fuse_group and p.rule.format.startswith("nvfp4"):
            a = p.target.weight.detach().abs().amax().float()
            g = p.target.fuse_group
            out[g] = a if g not in out else torch.maximum(out[g], a)
    return out
