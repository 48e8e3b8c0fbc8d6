"""`fp4kit verify`: is this checkpoint right?

1. conformance: files, configs and every tensor against the serving engines' loader rules
   (fp4kit.export.conformance);
2. with a source model: every quantized byte re-derived from the BF16 weights under the
   recorded recipe and compared exactly (and every BF16 tensor compared to the source);
3. against ModelOpt: a sample of layers re-quantized with nvidia-modelopt's own NVFP4/FP8 code;
4. tensor parallelism: which layers shard cleanly for TP=N (and with expert parallelism).
Nothing from the checkpoint is executed: tensors are read from safetensors files only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .export.checkpoint import CONFIG_FILE, METADATA_FILE, CheckpointReader, read_metadata, weight_suffixes
from .export.conformance import check_checkpoint
from .export.modelopt import unloaded_source_tensors
from .formats import fp8, nvfp4
from .formats.constants import FOUR_OVER_SIX_MULTIPLIERS, FP8_NORM_4O6, NVFP4_BLOCK_SIZE
from .models import adapter_for
from .plan import fused_group_amax, plan_targets
from .quantize import load_model
from .recipe import QUANT_ALGO, recipe_from_dict

AGAINST = ("modelopt",)  # the other quantizers a checkpoint can be re-derived with


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    tensor: str | None = None


@dataclass
class VerifyReport:
    checkpoint: str
    checks: list[Check] = field(default_factory=list)
    sections: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str = "", tensor: str | None = None) -> None:
        self.checks.append(Check(name, ok, detail, tensor))

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "ok": self.ok, "checks": [asdict(c) for c in self.checks], **self.sections}

    def text(self) -> str:
        failed = [c for c in self.checks if not c.ok]
        lines = [f"fp4kit verify {self.checkpoint}: {'PASS' if self.ok else 'FAIL'} ({len(self.checks) - len(failed)}/{len(self.checks)} checks hold)"]
        by_name: dict[str, list[Check]] = {}
        for c in self.checks:
            by_name.setdefault(c.name, []).append(c)
        for name, cs in by_name.items():
            bad = [c for c in cs if not c.ok]
            lines.append(f"  {'ok  ' if not bad else 'FAIL'} {name}: {len(cs) - len(bad)}/{len(cs)}")
            for c in bad[:20]:
                lines.append(f"       {c.tensor or ''} {c.detail}".rstrip())
            if len(bad) > 20:
                lines.append(f"       ... and {len(bad) - 20} more")
        tp = self.sections.get("tensor_parallel")
        if tp:
            lines.append(f"  TP={tp['tp']}{' with expert parallelism' if tp['ep'] else ''}: {'shards cleanly' if tp['ok'] else 'does NOT shard cleanly'}")
            for reason in tp["problems"][:20]:
                lines.append(f"       {reason}")
        return "\n".join(lines)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False, f"dtype/shape {a.dtype}{tuple(a.shape)} != expected {b.dtype}{tuple(b.shape)}"
    ua, ub = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    diff = int((ua != ub).sum())
    return diff == 0, "" if diff == 0 else f"{diff} of {ua.numel()} bytes differ"


def _expected_nvfp4(w: torch.Tensor, rule, global_amax, stored_scale: torch.Tensor | None, arith: str) -> nvfp4.NVFP4Tensor:
    """The bytes the recipe implies. With importance weighting the per-block 4/6 choice depends on
    calibration statistics, so it is taken from the stored scales after checking that each one is
    one of the block's two candidates; every other byte is re-derived."""
    if not rule.importance:
        return nvfp4.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, arith=arith)
    g = torch.as_tensor(global_amax if global_amax is not None else w.abs().amax().float(), dtype=torch.float32)
    blocks = nvfp4.block_amax(w)
    chose4, explained = nvfp4.four_over_six_choice(stored_scale, blocks, g, arith)
    if not bool(explained.all()):
        raise ValueError(f"{int((~explained).sum())} block scales are neither 4/6 candidate")
    mult = torch.where(chose4, FOUR_OVER_SIX_MULTIPLIERS[1], FOUR_OVER_SIX_MULTIPLIERS[0])
    return nvfp4.quantize_static(w, blocks * mult, g, fp8_norm=FP8_NORM_4O6, arith=arith)


def rederive(report: VerifyReport, folder: Path, source: str, *, device: str = "cpu") -> None:
    """Compare every tensor of the checkpoint with what the recipe makes of the source weights."""
    meta = read_metadata(folder)
    if meta is None or "recipe" not in meta:
        report.add("rederive", False, f"{METADATA_FILE} with the recipe is missing: nothing to re-derive from")
        return
    recipe = recipe_from_dict(meta["recipe"], source=f"{folder}/{METADATA_FILE}")
    arith = meta.get("arith", "cuda")
    model, _ = load_model(source, device=device, tokenizer=False)
    plan, _ = plan_targets(model, recipe)
    reader = CheckpointReader(folder)
    expected_names: set[str] = set()
    group_amax = fused_group_amax(plan)
    covered: set[str] = set()
    for p in plan:
        t = p.target
        covered.add(t.key)
        w = t.weight.detach()
        parts = list(w.unbind(0)) if t.is_stack else [w]
        for disk, part in zip(t.disk_names, parts):
            if p.rule is None:
                name = f"{disk}.weight"
                expected_names.add(name)
                if name not in reader:
                    report.add("rederive", False, "missing from the checkpoint", name)
                    continue
                ok, detail = _bytes_equal(reader.get(name), part.cpu())
                report.add("rederive", ok, detail, name)
                continue
            suffixes = weight_suffixes(QUANT_ALGO[p.rule.format])
            expected_names.update(f"{disk}.{s}" for s in suffixes)
            missing = [s for s in suffixes if f"{disk}.{s}" not in reader]
            if missing:
                report.add("rederive", False, f"missing {missing}", disk)
                continue
            try:
                if p.rule.format.startswith("nvfp4"):
                    q = _expected_nvfp4(part, p.rule, group_amax.get(t.fuse_group), reader.get(f"{disk}.weight_scale"), arith)
                    want = {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": q.global_scale}
                else:
                    qw, s = fp8.quantize_per_tensor(part, arith, amax_multipliers=p.rule.amax_search or None)
                    want = {"weight": qw, "weight_scale": s}
            except ValueError as exc:
                report.add("rederive", False, str(exc), f"{disk}.weight_scale")
                continue
            for suffix, tensor in want.items():
                ok, detail = _bytes_equal(reader.get(f"{disk}.{suffix}"), tensor.cpu())
                report.add("rederive", ok, detail, f"{disk}.{suffix}")
    ad = adapter_for(model)
    for key, tensor in model.state_dict().items():
        if key in covered:
            continue
        name = ad.disk_name(key)
        expected_names.add(name)
        if name not in reader:
            if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in name:
                continue
            report.add("rederive", False, "missing from the checkpoint", name)
            continue
        ok, detail = _bytes_equal(reader.get(name), tensor.cpu())
        report.add("rederive", ok, detail, name)
    source_dir = Path(source)
    carried = unloaded_source_tensors(model, source_dir if source_dir.is_dir() else None)
    source_reader = CheckpointReader(source_dir) if carried else None
    for name in carried:
        expected_names.add(name)
        if name not in reader:
            report.add("rederive", False, "in the source but missing from the checkpoint", name)
            continue
        ok, detail = _bytes_equal(reader.get(name), source_reader.get(name))
        report.add("rederive", ok, detail, name)
    extra = sorted(n for n in reader.names() if n not in expected_names and not n.endswith(("k_scale", "v_scale")))
    for name in extra:
        report.add("rederive", False, "not produced by the recorded recipe from the source", name)


def against_modelopt(report: VerifyReport, folder: Path, source: str, *, sample: int = 8, device: str = "cpu") -> None:
    """Re-quantize a sample of NVFP4/FP8 modules with nvidia-modelopt's own code and compare bytes."""
    from types import SimpleNamespace

    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    meta = read_metadata(folder)
    if meta is None:
        report.add("modelopt", False, f"{METADATA_FILE} is missing")
        return
    recipe = recipe_from_dict(meta["recipe"])
    arith = meta.get("arith", "cuda")
    modelopt_device = "cuda" if arith == "cuda" else "cpu"
    if modelopt_device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--against modelopt: this checkpoint uses ModelOpt's CUDA arithmetic (arith "
            "'cuda'), so ModelOpt must run on a CUDA device to reproduce it; none is available"
        )
    model, _ = load_model(source, device=device, tokenizer=False)
    plan, _ = plan_targets(model, recipe)
    reader = CheckpointReader(folder)
    chosen = [p for p in plan if p.rule is not None and not (p.target.fuse_group and p.rule.format.startswith("nvfp4"))]
    step = max(1, len(chosen) // sample)
    for p in chosen[::step][:sample]:
        t, rule = p.target, p.rule
        w = (t.weight.detach()[0] if t.is_stack else t.weight.detach()).to(modelopt_device)
        disk = t.disk_names[0]
        if rule.format.startswith("nvfp4"):
            stored_scale = reader.get(f"{disk}.weight_scale")
            if rule.scale_rule == "6":
                q, scale, scale2 = NVFP4QTensor.quantize(w.clone(), NVFP4_BLOCK_SIZE)
            else:
                blocks = nvfp4.block_amax(w)
                g = w.abs().amax().float()
                chose4, _ = nvfp4.four_over_six_choice(stored_scale.to(w.device), blocks, g, arith)
                mult = torch.where(chose4, FOUR_OVER_SIX_MULTIPLIERS[1], FOUR_OVER_SIX_MULTIPLIERS[0])
                quantizer = SimpleNamespace(global_amax=g, _amax=(blocks * mult).reshape(-1, 1),
                                            block_sizes={-1: 16, "type": "static", "scale_bits": (4, 3), "four_over_six": True})
                scale2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer)
                scale, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, scale2)
                q, _, _ = NVFP4QTensor.quantize(w.clone(), NVFP4_BLOCK_SIZE, scale, scale2)
            for suffix, tensor in (("weight", q._quantized_data), ("weight_scale", scale), ("weight_scale_2", scale2)):
                ok, detail = _bytes_equal(reader.get(f"{disk}.{suffix}"), tensor.reshape(reader.get(f"{disk}.{suffix}").shape).cpu())
                report.add("modelopt", ok, detail, f"{disk}.{suffix}")
        else:
            scale = w.abs().amax().float() / 448.0
            qw = to_quantized_weight(w, scale, QUANTIZATION_FP8)
            for suffix, tensor in (("weight", qw), ("weight_scale", scale)):
                ok, detail = _bytes_equal(reader.get(f"{disk}.{suffix}"), tensor.cpu())
                report.add("modelopt", ok, detail, f"{disk}.{suffix}")


def tensor_parallel(folder: Path, tp: int, ep: bool = False) -> dict:
    """Which quantized layers shard cleanly for tensor parallelism of `tp` (vLLM/SGLang layout).

    Column-parallel layers (q/k/v, up, in_proj) split N; row-parallel ones (o, down, out_proj)
    split K, and an NVFP4 K shard must hold whole 16-element blocks. Routed experts are split
    like their MLP unless expert parallelism keeps each expert whole. Mamba needs n_groups % tp == 0.
    """
    reader = CheckpointReader(folder)
    config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    problems: list[str] = []
    row_parallel = ("o_proj", "down_proj", "out_proj")
    for name in reader.names():
        if not name.endswith(".weight_scale") or reader.get(name).dtype != torch.float8_e4m3fn:
            continue
        module = name[: -len(".weight_scale")]
        proj = module.rsplit(".", 1)[-1]
        if ".experts." in module and ep:
            continue
        k = reader.get(name).shape[-1] * NVFP4_BLOCK_SIZE
        n = reader.get(f"{module}.weight").shape[0]
        if proj in row_parallel:
            if k % tp or (k // tp) % NVFP4_BLOCK_SIZE:
                problems.append(f"{module}: K={k} splits into {k / tp:g} per rank, not a whole number of {NVFP4_BLOCK_SIZE}-element blocks")
        elif n % tp:
            problems.append(f"{module}: N={n} does not split into {tp} equal parts")
    n_groups = config.get("n_groups")
    if n_groups is not None and config.get("model_type") == "nemotron_h" and n_groups % tp:
        problems.append(f"Mamba n_groups={n_groups} is not divisible by tp={tp}")
    heads = config.get("num_key_value_heads")
    if heads and heads % tp and tp % heads:
        problems.append(f"num_key_value_heads={heads} and tp={tp}: neither divides the other")
    # one line per distinct reason shape is enough for a report
    seen, unique = set(), []
    for p in problems:
        key = p.split(":", 1)[1] if ".experts." in p else p
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return {"tp": tp, "ep": ep, "ok": not problems, "problems": unique, "count": len(problems)}


def verify(
    checkpoint: str | Path,
    *,
    source: str | None = None,
    against: str | None = None,
    tp: int | None = None,
    ep: bool = False,
    device: str = "cpu",
) -> VerifyReport:
    folder = Path(checkpoint)
    report = VerifyReport(str(folder))
    conf = check_checkpoint(folder)
    for f in conf.findings:
        report.add("conformance", f.level != "error", f"[{f.code}] {f.message}", f.tensor_or_key)
    if not conf.findings:
        report.add("conformance", True, "all engine loader rules hold")
    report.sections["conformance"] = conf.to_dict()
    if not conf.ok and any(f.code.startswith(("header", "file", "shard")) for f in conf.errors):
        return report  # unreadable files: nothing further can be checked safely
    if source is not None:
        rederive(report, folder, source, device=device)
    if against is not None:
        if against not in AGAINST:
            raise ValueError(f"--against must be one of {AGAINST}, got {against!r}")
        if source is None:
            raise ValueError("--against modelopt needs --source (the BF16 weights to re-quantize)")
        against_modelopt(report, folder, source, device=device)
    if tp is not None:
        section = tensor_parallel(folder, tp, ep)
        report.sections["tensor_parallel"] = section
        report.add("tensor_parallel", section["ok"], "; ".join(section["problems"][:3]))
    return report
