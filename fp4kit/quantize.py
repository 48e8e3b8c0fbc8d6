"""The pipeline: load -> calibrate -> quantize -> export.

`quantize(model, recipe, samples)` is the one verb; `run(...)` wraps it with loading, the
calibration set and the export for the CLI.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from tqdm.auto import tqdm

from .calibrate import Observers, Statistics
from .formats import FormatError, fp8, nvfp4
from .formats.arith import DEFAULT_ARITH, check_mode, div_const
from .formats.constants import FP8_MAX, NVFP4_BLOCK_SIZE, NVFP4_GLOBAL_DENOM
from .models import AttentionKV, Role, Target, adapter_for
from .recipe import QUANT_ALGO, Recipe, Rule

BACKENDS = ("torch", "triton")


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
    import fnmatch

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


class CalibState:
    """Periodic snapshots of the calibration statistics, so that a killed run can resume.

    The snapshot holds the statistics after the first `done` samples and a fingerprint of
    everything that decides them (model, recipe, calibration spec, source, seed, batch size); a
    resumed run with a different fingerprint is refused. Statistics are maxima, counts and fp32
    sums accumulated in sample order, so resuming gives the same bytes as an uninterrupted run.
    """

    def __init__(self, folder: Path, fingerprint: dict, every: int = 8) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.every = max(1, every)

    def load(self) -> tuple[Statistics, int] | None:
        import json

        from safetensors.torch import load_file

        meta = self.folder / "state.json"
        if not meta.is_file():
            return None
        saved = json.loads(meta.read_text())
        if saved.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"--resume: the saved calibration in {self.folder} was made with different settings "
                f"({saved.get('fingerprint')}); remove it or run without --resume"
            )
        return Statistics.from_state_dict(load_file(str(self.folder / "stats.safetensors"))), int(saved["done"])

    def save(self, stats: Statistics, done: int) -> None:
        import json
        import os

        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / "stats.safetensors.tmp"
        save_file(stats.state_dict(), str(tmp))
        os.replace(tmp, self.folder / "stats.safetensors")
        meta_tmp = self.folder / "state.json.tmp"
        meta_tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "done": done}))
        os.replace(meta_tmp, self.folder / "state.json")

    def clear(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def _forward_samples(model: nn.Module, samples: torch.Tensor, batch_size: int, progress: bool, stats: Statistics,
                     start: int = 0, state: CalibState | None = None) -> None:
    device = next(model.parameters()).device
    bar = tqdm(total=samples.shape[0], initial=start, desc="calibrate", unit="sample", disable=not progress)
    with torch.inference_mode():
        for i in range(start, samples.shape[0], batch_size):
            batch = samples[i : i + batch_size].to(device)
            model(input_ids=batch, use_cache=False, logits_to_keep=1)
            bar.update(batch.shape[0])
            done = i + batch.shape[0]
            if state is not None and (done // batch_size) % state.every == 0 and done < samples.shape[0]:
                state.save(stats, done)
    bar.close()


def _sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    w = w.float()
    noise = (w - w_hat.float()).pow(2).sum().item()
    signal = w.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _nvfp4(w, rule: Rule, global_amax, importance, backend: str, arith: str):
    if backend == "triton":
        from .kernels import quantize as kq

        return kq.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, importance=importance, return_choice=True, arith=arith)
    return nvfp4.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, importance=importance, return_choice=True, arith=arith)


def _split(t: torch.Tensor, stack: bool) -> list[torch.Tensor]:
    t = t.detach().cpu()
    return list(t.unbind(0)) if stack else [t]


def _input_scale(amax: torch.Tensor | None, denom: float, n: int, what: str, warnings: list[str], arith: str) -> list[torch.Tensor]:
    """amax / denom per expert (or one); a layer or expert that saw no token gets 1.0."""
    if amax is None:
        warnings.append(f"{what}: no calibration input reached it; input_scale set to 1.0")
        return [torch.tensor(1.0)] * n
    amax = amax.detach().float().cpu().reshape(-1)
    dead = torch.nonzero(~(amax > 0)).flatten().tolist()
    if dead and len(dead) < amax.numel():
        # Experts that saw no token take the layer's largest amax: engines run one activation
        # scale per MoE layer (the max over its experts), so any other value would either be
        # ignored or dominate it.
        warnings.append(f"{what}: {len(dead)} of {amax.numel()} experts saw no calibration input; they take the layer's largest input amax")
        amax = torch.where(amax > 0, amax, amax.max())
    elif dead:
        warnings.append(f"{what}: saw no calibration input; input_scale set to 1.0")
    scale = torch.where(amax > 0, div_const(amax, denom, arith), torch.ones_like(amax))
    return [s.reshape(()) for s in scale.unbind(0)]


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


def quantize_weights(
    plan: list[Planned], stats: Statistics, *, backend: str, progress: bool, warnings: list[str],
    arith: str = DEFAULT_ARITH,
) -> dict[str, QuantizedTarget]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    group_amax = fused_group_amax(plan)
    out: dict[str, QuantizedTarget] = {}
    todo = [p for p in plan if p.rule is not None]
    for p in tqdm(todo, desc="quantize", unit="weight", disable=not progress):
        t, rule = p.target, p.rule
        w = t.weight.detach()
        stack = t.is_stack
        n = w.shape[0] if stack else 1
        algo = QUANT_ALGO[rule.format]
        bad = ~torch.isfinite(w)
        if bool(bad.any()):
            first = torch.nonzero(bad)[0].tolist()
            name = t.disk_names[first[0]] if stack else t.disk_names[0]
            where = tuple(first[1:]) if stack else tuple(first)
            raise FormatError(
                f"{name}.weight ({t.role.value}): {int(torch.isnan(w).sum())} NaN and {int(torch.isinf(w).sum())} Inf "
                f"values (first at {where}); non-finite weights cannot be quantized"
            )
        try:
            if rule.format.startswith("nvfp4"):
                importance = stats.importance(t.key) if rule.importance else None
                if rule.importance and importance is None:
                    warnings.append(f"{t.disk_names[0]}: no E[x^2] was collected; 4/6 uses the plain squared error")
                qt, choice = _nvfp4(w, rule, group_amax.get(t.fuse_group), importance, backend, arith)
                w_hat = qt.dequantize()
                tensors = {
                    "weight": _split(qt.packed, stack),
                    "weight_scale": _split(qt.block_scale, stack),
                    "weight_scale_2": _split(qt.global_scale, stack),
                }
                if rule.format == "nvfp4":
                    tensors["input_scale"] = _input_scale(stats.input_amax.get(t.key), NVFP4_GLOBAL_DENOM, n, t.disk_names[0], warnings, arith)
                frac4 = choice.float().mean().item() if rule.scale_rule == "4o6" else None
                after = qt.packed.numel() + qt.block_scale.numel() + 4 * qt.global_scale.numel()
            else:
                search = rule.amax_search or None
                parts = [fp8.quantize_per_tensor(x, arith, amax_multipliers=search) for x in (w.unbind(0) if stack else [w])]
                tensors = {"weight": [q.cpu() for q, _ in parts], "weight_scale": [s.cpu() for _, s in parts]}
                tensors["input_scale"] = _input_scale(stats.input_amax.get(t.key), FP8_MAX, n, t.disk_names[0], warnings, arith)
                w_hat = torch.stack([fp8.dequantize_per_tensor(q, s) for q, s in parts]) if stack else fp8.dequantize_per_tensor(*parts[0])
                frac4 = None
                after = w.numel() + 4 * n
        except ValueError as exc:
            raise type(exc)(f"{t.disk_names[0]} ({t.role.value}): {exc}") from None
        out[t.key] = QuantizedTarget(
            target=t, rule=rule, algo=algo, tensors=tensors, sqnr_db=_sqnr_db(w, w_hat), frac4=frac4,
            bytes_before=w.numel() * w.element_size(), bytes_after=after,
        )
        del w_hat
    return out


def quantize(
    model: nn.Module,
    recipe: Recipe,
    samples: torch.Tensor | None,
    *,
    backend: str | None = None,
    batch_size: int = 1,
    progress: bool = True,
    state: CalibState | None = None,
    arith: str = DEFAULT_ARITH,
) -> QuantizedModel:
    """Calibrate `model` on `samples` ([N, L] token ids) and quantize it under `recipe`."""
    adapter = adapter_for(model)
    device = next(model.parameters()).device
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        raise ValueError("backend 'triton' needs the model's weights on a CUDA device")
    plan, warnings = plan_targets(model, recipe, adapter)
    kv_layers = adapter.attention_kv(model) if recipe.kv_cache == "fp8" else []
    need_amax = [p.target for p in plan if p.rule is not None and p.rule.format in ("fp8", "nvfp4")]
    need_sq = [p.target for p in plan if p.rule is not None and p.rule.importance]
    moe = {p.target.name: p.target.module for p in plan if p.target.role == Role.ROUTED_EXPERTS}
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    stats, start = Statistics(), 0
    if state is not None:
        resumed = state.load()
        if resumed is not None:
            stats, start = resumed
            warnings.append(f"resumed calibration after {start} of {samples.shape[0]} samples")
    needs_data = bool(need_amax or need_sq or kv_layers)
    if samples is not None and samples.numel():
        with Observers(model, amax_targets=need_amax, importance_targets=need_sq, kv_layers=kv_layers, moe_experts=moe, stats=stats):
            _forward_samples(model, samples, batch_size, progress, stats, start, state)
        stats.expert_tokens = {k: v.cpu() for k, v in stats.expert_tokens.items()}
    elif needs_data:
        raise ValueError(f"recipe {recipe.name!r} needs calibration statistics, but no calibration samples were given")
    timings["calibrate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    quantized = quantize_weights(plan, stats, backend=backend, progress=progress, warnings=warnings, arith=arith)
    timings["quantize"] = time.perf_counter() - t0

    kv_scales = {}
    for kv in kv_layers:
        if kv.name not in stats.kv_amax:
            warnings.append(f"{kv.disk_name}: attention saw no calibration token; KV scales set to 1.0")
            kv_scales[kv.disk_name] = (torch.tensor(1.0), torch.tensor(1.0))
            continue
        k, v = (a.detach().float().cpu() for a in stats.kv_amax[kv.name])
        kv_scales[kv.disk_name] = tuple(torch.where(a > 0, div_const(a, FP8_MAX, arith), torch.ones_like(a)) for a in (k, v))
    qm = QuantizedModel(model, adapter, recipe, plan, quantized, kv_scales, stats, kv_layers, timings, warnings, arith=arith)
    empty = qm.empty_experts()
    for name, experts in empty.items():
        qm.warnings.append(f"{adapter.disk_name(name)}: {len(experts)} expert(s) received no calibration token: {experts[:16]}{' ...' if len(experts) > 16 else ''}")
    return qm


# --- the job the CLI runs -------------------------------------------------------------------

DEFAULT_CALIB = "512x2048"
EMBEDDED_CALIB = "32x512"
DEFAULT_RECIPE = "nemotron-h-w4a16-4o6"


@dataclass
class QuantizeJob:
    model: str | None = None  # folder or hub id; None = the embedded tiny Nemotron-H
    recipe: str = DEFAULT_RECIPE
    calib: str | None = None
    dataset: str | None = None
    output: str | None = None
    overwrite: bool = False
    seed: int = 0
    device: str = "cpu"
    backend: str | None = None
    batch_size: int = 1
    allow_repeat: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    progress: bool = True
    max_shard_bytes: int | None = None
    resume: bool = False
    arith: str = DEFAULT_ARITH  # "cuda": ModelOpt's bytes on CUDA; "cpu": on CPU
    checkpoint_every: int = 8  # calibration batches between statistics snapshots


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or text.count("/") != 1 or Path(text).exists()


def validate_job(job: QuantizeJob):
    """Everything that can be checked before any weight is loaded; returns (recipe, spec, model_ref, output)."""
    from .calibration import iter_documents, parse_calib_spec
    from .models.tiny import tiny_model_path
    from .recipe import load_recipe

    recipe = load_recipe(job.recipe)
    spec = parse_calib_spec(job.calib or (EMBEDDED_CALIB if job.model is None else DEFAULT_CALIB))
    if job.dataset is not None:
        iter_documents(job.dataset)  # checks that the source exists (and reads as text) now
    check_mode(job.arith)
    if job.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1, got {job.checkpoint_every}")
    if job.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {job.batch_size}")
    if job.backend is not None and job.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {job.backend!r}")
    if job.model is None:
        model_ref = str(tiny_model_path())
    else:
        model_ref = job.model
        if _looks_like_path(model_ref):
            p = Path(model_ref).expanduser()
            if not p.is_dir():
                raise FileNotFoundError(f"--model {model_ref}: no such folder (and not a hub id of the form org/name)")
            if not (p / "config.json").is_file():
                raise FileNotFoundError(f"--model {model_ref}: the folder has no config.json")
            if not job.allow_pickle and not any(p.glob("*.safetensors")) and any(p.glob("*.bin")):
                raise ValueError(
                    f"--model {model_ref}: only pickle (.bin) weights, which can run code when loaded; "
                    "convert them to safetensors, or pass --allow-pickle if you trust the source"
                )
            model_ref = str(p)
    if job.output is None:
        name = Path(model_ref).name if job.model is None or _looks_like_path(model_ref) else model_ref.split("/")[-1]
        output = Path(f"{name}-{recipe.name}")
    else:
        output = Path(job.output).expanduser()
    if output.exists() and not job.overwrite:
        raise FileExistsError(f"output folder {output} exists; pass --overwrite to replace it")
    if Path(model_ref).is_dir():
        check_free_space(Path(model_ref), output)
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {job.device}: no CUDA device is available")
    return recipe, spec, model_ref, output


def check_free_space(model_dir: Path, output: Path) -> None:
    """Refuse to start when the output's disk cannot hold a checkpoint as large as the BF16 source
    (an upper bound: quantized weights are smaller)."""
    import shutil

    need = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    parent = output.resolve().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if need > free:
        raise OSError(f"{parent} has {free / 1e9:.1f} GB free; the checkpoint may need up to {need / 1e9:.1f} GB (the BF16 source size)")


def load_model(model_ref: str, *, device: str, trust_remote_code: bool = False, tokenizer: bool = True,
               allow_pickle: bool = False):
    """BF16 model (+ tokenizer). Weights from safetensors only unless `allow_pickle`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(dtype=torch.bfloat16, trust_remote_code=trust_remote_code, use_safetensors=None if allow_pickle else True)
    if device == "auto":
        kwargs["device_map"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(model_ref, **kwargs)
    if device != "auto":
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(model_ref, trust_remote_code=trust_remote_code) if tokenizer else None
    return model.eval(), tok


def run(job: QuantizeJob, log=print) -> tuple[QuantizedModel, Path]:
    from .calibration import build_calibration_set
    from .export.modelopt import export_checkpoint

    recipe, spec, model_ref, output = validate_job(job)
    timings = {}
    t0 = time.perf_counter()
    log(f"loading {model_ref} on {job.device}")
    model, tokenizer = load_model(model_ref, device=job.device, trust_remote_code=job.trust_remote_code,
                                  allow_pickle=job.allow_pickle)
    timings["load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    samples = build_calibration_set(
        tokenizer, spec, job.dataset, seed=job.seed, allow_repeat=job.allow_repeat, progress=job.progress
    )
    timings["calibration set"] = time.perf_counter() - t0

    fingerprint = {"model": model_ref, "recipe": recipe.to_dict(), "calib": str(spec), "dataset": job.dataset,
                   "seed": job.seed, "batch_size": job.batch_size, "allow_repeat": job.allow_repeat, "arith": job.arith}
    state = CalibState(output.parent / f".{output.name}.calib-state", fingerprint, job.checkpoint_every)
    if not job.resume:
        state.clear()
    qm = quantize(model, recipe, samples, backend=job.backend, batch_size=job.batch_size, progress=job.progress, state=state,
                  arith=job.arith)
    qm.calibration = {"spec": str(spec), "tokens": int(samples.numel()), "source": job.dataset or "the bundled Shakespeare calibration split", "seed": job.seed}
    source_dir = Path(model_ref) if Path(model_ref).is_dir() else None
    extra = {"source": job.model or "the embedded tiny Nemotron-H", "title": f"{Path(model_ref).name} {recipe.name}"}
    kwargs = {} if job.max_shard_bytes is None else {"max_shard_bytes": job.max_shard_bytes}
    path = export_checkpoint(
        qm, output, tokenizer=tokenizer, source_dir=source_dir, overwrite=job.overwrite, progress=job.progress, card_extra=extra, **kwargs
    )
    state.clear()
    qm.timings = {**timings, **qm.timings}
    return qm, path
