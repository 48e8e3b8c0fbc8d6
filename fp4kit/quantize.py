"""The pipeline: load -> calibrate -> quantize -> export.

`quantize(model, recipe, samples)` is the one verb; `run(...)` wraps it with loading, the
calibration set and the export for the CLI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .calibrate import Observers, Statistics
from .formats import FormatError, fp8, nvfp4
from .formats.arith import DEFAULT_ARITH, check_mode, div_const
from .formats.constants import FP8_MAX, NVFP4_GLOBAL_DENOM
from .formats.metrics import sqnr_db_of, sqnr_terms
from .kernels.backend import BACKENDS
from .models import Role, adapter_for
from .plan import Planned, QuantizedModel, QuantizedTarget, fused_group_amax, plan_targets
from .recipe import DEFAULT_RECIPE, QUANT_ALGO, Recipe, Rule


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
    seq = samples.shape[1]
    # Counted in tokens, so the bar shows tokens/s and the time left.
    bar = tqdm(total=samples.numel(), initial=start * seq, desc=f"calibrate ({samples.shape[0]} x {seq})", unit="tok",
               unit_scale=True, disable=not progress)
    with torch.inference_mode():
        for i in range(start, samples.shape[0], batch_size):
            batch = samples[i : i + batch_size].to(device)
            model(input_ids=batch, use_cache=False, logits_to_keep=1)
            bar.update(batch.numel())
            done = i + batch.shape[0]
            if state is not None and (done // batch_size) % state.every == 0 and done < samples.shape[0]:
                state.save(stats, done)
    bar.close()


def _nvfp4(w, rule: Rule, global_amax, importance, backend: str, arith: str):
    if backend == "triton":
        from .kernels import quantize as kq

        return kq.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, importance=importance, return_choice=True, arith=arith)
    return nvfp4.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, importance=importance, return_choice=True, arith=arith)


def _split(t: torch.Tensor, stack: bool) -> list[torch.Tensor]:
    """One checkpoint tensor per expert of a stack (views; they stay on the weight's device until
    the export streams them out)."""
    t = t.detach()
    return list(t.unbind(0)) if stack else [t]


def _non_finite_error(t, w: torch.Tensor) -> FormatError:
    bad = ~torch.isfinite(w)
    first = torch.nonzero(bad)[0].tolist()
    name = t.disk_names[first[0]] if t.is_stack else t.disk_names[0]
    where = tuple(first[1:]) if t.is_stack else tuple(first)
    return FormatError(
        f"{name}.weight ({t.role.value}): {int(torch.isnan(w).sum())} NaN and {int(torch.isinf(w).sum())} Inf "
        f"values (first at {where}); non-finite weights cannot be quantized"
    )


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


# Elements dequantized at a time for the SQNR: bounds the float64 temporaries of a large stack.
_ERROR_CHUNK = 1 << 26


def _chunks(n: int, per_item: int) -> list[slice]:
    step = max(1, _ERROR_CHUNK // max(1, per_item))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _nvfp4_error(w: torch.Tensor, qt: nvfp4.NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sqnr_terms of w against qt's dequantized values, a few members (or rows) at a time."""
    if w.dim() < 2:
        return sqnr_terms(w, qt.dequantize())
    stack = w.dim() > 2  # one global scale per member, else one for all rows
    signal = noise = 0
    for sl in _chunks(w.shape[0], w[0].numel()):
        part = nvfp4.NVFP4Tensor(qt.packed[sl], qt.block_scale[sl], qt.global_scale[sl] if stack else qt.global_scale)
        s, n = sqnr_terms(w[sl], part.dequantize())
        signal, noise = signal + s, noise + n
    return signal, noise


def quantize_weights(
    plan: list[Planned], stats: Statistics, *, backend: str, progress: bool, warnings: list[str],
    arith: str = DEFAULT_ARITH,
) -> dict[str, QuantizedTarget]:
    """Every planned weight in its format. The quantized tensors stay on the weight's device, and
    nothing here waits for the GPU per weight: the SQNR terms and 4/6 fractions are read back
    together at the end (a weight that cannot be quantized raises as soon as its kernel says so)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    group_amax = fused_group_amax(plan)
    out: dict[str, QuantizedTarget] = {}
    pending: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
    todo = [p for p in plan if p.rule is not None]
    for p in tqdm(todo, desc="quantize", unit="weight", disable=not progress):
        t, rule = p.target, p.rule
        w = t.weight.detach()
        stack = t.is_stack
        n = w.shape[0] if stack else 1
        algo = QUANT_ALGO[rule.format]
        try:
            if rule.format.startswith("nvfp4"):
                importance = stats.importance(t.key) if rule.importance else None
                if rule.importance and importance is None:
                    warnings.append(f"{t.disk_names[0]}: no E[x^2] was collected; 4/6 uses the plain squared error")
                qt, choice = _nvfp4(w, rule, group_amax.get(t.fuse_group), importance, backend, arith)
                signal, noise = _nvfp4_error(w, qt)
                tensors = {
                    "weight": _split(qt.packed, stack),
                    "weight_scale": _split(qt.block_scale, stack),
                    "weight_scale_2": _split(qt.global_scale, stack),
                }
                if rule.format == "nvfp4":
                    tensors["input_scale"] = _input_scale(stats.input_amax.get(t.key), NVFP4_GLOBAL_DENOM, n, t.disk_names[0], warnings, arith)
                frac4 = choice.float().mean() if rule.scale_rule == "4o6" else None
                after = qt.packed.numel() + qt.block_scale.numel() + 4 * qt.global_scale.numel()
            else:
                search = rule.amax_search or None
                members = w.unbind(0) if stack else [w]
                parts = [fp8.quantize_per_tensor(x, arith, amax_multipliers=search) for x in members]
                tensors = {"weight": [q for q, _ in parts], "weight_scale": [s for _, s in parts]}
                tensors["input_scale"] = _input_scale(stats.input_amax.get(t.key), FP8_MAX, n, t.disk_names[0], warnings, arith)
                terms = [sqnr_terms(x, fp8.dequantize_per_tensor(q, s)) for x, (q, s) in zip(members, parts)]
                signal, noise = sum(a for a, _ in terms), sum(b for _, b in terms)
                frac4 = None
                after = w.numel() + 4 * n
        except ValueError as exc:
            if not bool(torch.isfinite(w).all()):
                raise _non_finite_error(t, w) from None
            raise type(exc)(f"{t.disk_names[0]} ({t.role.value}): {exc}") from None
        pending[t.key] = (signal, noise, frac4)
        out[t.key] = QuantizedTarget(
            target=t, rule=rule, algo=algo, tensors=tensors, sqnr_db=float("nan"), frac4=None,
            bytes_before=w.numel() * w.element_size(), bytes_after=after,
        )
    for key, (signal, noise, frac4) in pending.items():
        out[key].sqnr_db = sqnr_db_of(float(signal), float(noise))
        out[key].frac4 = None if frac4 is None else float(frac4)
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
EMBEDDED_CALIB = "32x512"  # the bundled corpus is small: the embedded model's default set


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
    if device != "cpu":
        # Straight from the files to the device ("auto": accelerate spreads it over GPUs and CPU):
        # no copy of the whole model in host memory.
        kwargs["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(model_ref, **kwargs)
    tok = AutoTokenizer.from_pretrained(model_ref, trust_remote_code=trust_remote_code) if tokenizer else None
    return model.eval(), tok


def run(job: QuantizeJob, log=print) -> tuple[QuantizedModel, Path]:
    from .calibration import build_calibration_set
    from .export.modelopt import export_checkpoint

    recipe, spec, model_ref, output = validate_job(job)
    timings = {}
    t0 = time.perf_counter()
    import transformers  # noqa: F401  (its import is a stage of its own, not part of loading the weights)
    from transformers import AutoModelForCausalLM  # noqa: F401

    timings["import"] = time.perf_counter() - t0
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
