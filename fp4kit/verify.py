"""`fp4kit verify`: is this checkpoint right?

1. conformance: files, configs and every tensor against the serving engines' loader rules
   (fp4kit.export.conformance);
2. with a source model: every quantized byte re-derived from the BF16 weights under the
   recorded recipe and compared exactly (and every BF16 tensor compared to the source);
3. against ModelOpt: a sample of layers re-quantized with nvidia-modelopt's own NVFP4/FP8 code;
4. tensor parallelism: which layers, of any format, shard cleanly for TP=N (and with expert
   parallelism);
5. for information: each fp32 k/v scale and the bf16 value vLLM keeps of it.
Nothing from the checkpoint is executed: tensors are read from safetensors files only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .export.checkpoint import CONFIG_FILE, INDEX_FILE, KV_SUFFIXES, METADATA_FILE, CheckpointReader, read_metadata, weight_suffixes
from .export.conformance import TensorInfo, check_checkpoint, read_safetensors_header
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
        lines = [f"fp4kit verify {self.checkpoint}: {'PASS' if self.ok else 'FAIL'}"]
        conf = self.sections.get("conformance")
        by_name: dict[str, list[Check]] = {}
        for c in self.checks:
            by_name.setdefault(c.name, []).append(c)
        for name, cs in by_name.items():
            bad = [c for c in cs if not c.ok]
            if name == "conformance" and conf is not None:
                summary = f"{_count(conf['errors'], 'error')}, {_count(conf['warnings'], 'warning')} over {_count(conf['tensors'], 'tensor')}"
            elif name == "tensor_parallel":
                tp = self.sections["tensor_parallel"]
                summary = f"TP={tp['tp']}{' with expert parallelism' if tp['ep'] else ''}: " + (
                    "shards cleanly" if tp["ok"] else f"does NOT shard cleanly, {_count(tp['count'], 'problem')}"
                    + (f" of {_count(len(tp['problems']), 'kind')}, the first of each shown" if len(tp["problems"]) < tp["count"] else "")
                )
                bad = [Check(name, False, "", reason) for reason in tp["problems"]]
            else:
                summary = f"{len(bad)} of {_count(len(cs), 'sampled tensor' if name == 'modelopt' else 'tensor')} differ"
            lines.append(f"  {'ok  ' if not bad else 'FAIL'} {name}: {summary}")
            shown = bad + ([c for c in cs if c.ok and c.detail.startswith("[")] if name == "conformance" else [])
            for c in shown[:20]:
                lines.append(f"       {'' if not c.ok else 'warning '}{c.tensor or ''} {c.detail}".rstrip())
            if len(shown) > 20:
                lines.append(f"       ... and {len(shown) - 20} more")
        for kv in self.sections.get("kv_scales_bf16", []):
            lines.append(
                f"  info {kv['tensor']}: {kv['value']:.8g}, {kv['bf16']:.8g} as vLLM's bf16 parameter "
                f"({kv['rel_change']:+.3%})"
            )
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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


def modelopt_mse_algorithm(amax_search: tuple[float, ...]) -> dict | str:
    """ModelOpt's calibration algorithm for an FP8 rule: `max`, or its `mse` search, whose
    candidates are `linspace(start, stop, steps)` times max|W| -- a recipe's `amax_search` must be
    such a list (as in ModelOpt's Lightning recipe: start 1.0, stop 1.5, step 0.5)."""
    if len(amax_search) <= 1:
        if amax_search and amax_search[0] != 1.0:
            raise ValueError(f"amax_search {list(amax_search)}: ModelOpt's mse search cannot try a single multiplier other than 1.0")
        return "max"
    start, stop = amax_search[0], amax_search[-1]
    step = (stop - start) / (len(amax_search) - 1)
    steps = math.ceil((stop - start) / step) + 1 if step > 0 else 0
    grid = torch.linspace(start, stop, steps=max(steps, 1)).tolist() if steps == len(amax_search) else []
    if grid != [float(torch.tensor(c, dtype=torch.float32)) for c in amax_search]:
        raise ValueError(
            f"amax_search {list(amax_search)} is not an increasing, evenly spaced list: ModelOpt's mse "
            "search takes start_multiplier, stop_multiplier and step_size"
        )
    return {"method": "mse", "start_multiplier": start, "stop_multiplier": stop, "step_size": step}


def _modelopt_fp8(w: torch.Tensor, amax_search: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 bytes, 0-d fp32 weight_scale) of w as ModelOpt makes them: its own calibration on a
    Linear holding w (`max`, or `mse` over the recipe's multipliers), then its export functions."""
    import contextlib
    import io

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import get_weight_scaling_factor, to_quantized_weight

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    linear.weight.data.copy_(w)
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "enable": True, "cfg": {"num_bits": (4, 3), "axis": None}},
        ],
        "algorithm": modelopt_mse_algorithm(amax_search),
    }
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        mtq.quantize(linear, cfg, forward_loop=None)
    scale = get_weight_scaling_factor(linear, "weight").float().reshape(())  # stored 0-d, as ModelOpt's export writes it
    return to_quantized_weight(w, scale, QUANTIZATION_FP8), scale


def four_over_six_from_weight(w: torch.Tensor, rule, stored_scale: torch.Tensor, arith: str) -> torch.Tensor:
    """The per-block 4/6 choice (True = 4) the recipe's rule makes of w, independent of the
    checkpoint: fp4kit.formats.nvfp4's squared-error rule (a tie keeps 6). With `importance` the
    rule needs calibration statistics the checkpoint does not hold; the stored choice is then
    used, after checking that every stored block scale is one of its block's two candidates."""
    if not rule.importance:
        return nvfp4.quantize(w, scale_rule="4o6", arith=arith, return_choice=True)[1]
    chose4, explained = nvfp4.four_over_six_choice(stored_scale, nvfp4.block_amax(w), w.abs().amax().float(), arith)
    if not bool(explained.all()):
        raise ValueError(f"{int((~explained).sum())} block scales are neither 4/6 candidate")
    return chose4


def against_modelopt(report: VerifyReport, folder: Path, source: str, *, sample: int = 8, device: str = "cpu") -> None:
    """Re-quantize a sample of NVFP4/FP8 modules with nvidia-modelopt's own code and compare bytes.

    FP8: ModelOpt calibrates the range itself, `max` or (a rule with `amax_search`) its `mse`
    search over those multipliers. NVFP4 4/6: ModelOpt takes its per-block decision only inside
    `mse_calibrate`, on a Triton fake-quant kernel (CUDA only) that judges the fake-quantized
    block rather than the exported bytes, so its decision differs from the recipe's rule on some
    blocks (scripts/compare_modelopt_mse.py). The decision is therefore re-derived from the BF16
    weight by the recipe's rule (`four_over_six_from_weight`), and ModelOpt turns it into bytes.
    """
    from types import SimpleNamespace

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
            if rule.scale_rule == "6":
                q, scale, scale2 = NVFP4QTensor.quantize(w.clone(), NVFP4_BLOCK_SIZE)
            else:
                try:
                    chose4 = four_over_six_from_weight(w, rule, reader.get(f"{disk}.weight_scale").to(w.device), arith)
                except ValueError as exc:
                    report.add("modelopt", False, str(exc), f"{disk}.weight_scale")
                    continue
                blocks = nvfp4.block_amax(w)
                mult = torch.where(chose4, FOUR_OVER_SIX_MULTIPLIERS[1], FOUR_OVER_SIX_MULTIPLIERS[0])
                quantizer = SimpleNamespace(global_amax=w.abs().amax().float(), _amax=(blocks * mult).reshape(-1, 1),
                                            block_sizes={-1: 16, "type": "static", "scale_bits": (4, 3), "four_over_six": True})
                scale2 = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer)
                scale, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, scale2)
                q, _, _ = NVFP4QTensor.quantize(w.clone(), NVFP4_BLOCK_SIZE, scale, scale2)
            want = {"weight": q._quantized_data, "weight_scale": scale, "weight_scale_2": scale2}
        else:
            try:
                qw, scale = _modelopt_fp8(w, rule.amax_search)
            except ValueError as exc:
                report.add("modelopt", False, str(exc), f"{disk}.weight_scale")
                continue
            want = {"weight": qw, "weight_scale": scale}
        for suffix, tensor in want.items():
            stored = reader.get(f"{disk}.{suffix}")
            ok, detail = _bytes_equal(stored, tensor.reshape(stored.shape).cpu())
            report.add("modelopt", ok, detail, f"{disk}.{suffix}")


ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")  # split along K (in features); the rest along N
# Not split by tensor parallelism: vocab-parallel (padded) embeddings and head, the replicated
# router, norms; conv1d follows the Mamba in_proj rule; attention q/k/v follow the head rule.
_NOT_SPLIT = ("embeddings", "embed_tokens", "wte", "lm_head", "gate", "conv1d")


def _tensor_headers(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape and place, from the safetensors headers (no data is read)."""
    index = folder / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else sorted(p.name for p in folder.glob("*.safetensors"))
    out: dict[str, TensorInfo] = {}
    for f in files:
        out.update(read_safetensors_header(folder / f)[0])
    return out


def _format_of(info: TensorInfo) -> str:
    return {"U8": "NVFP4", "F8_E4M3": "FP8"}.get(info.dtype, info.dtype)


def _mamba_in_proj(what: str, n: int, quantized: bool, config: dict, tp: int) -> str | None:
    """vLLM `MambaMixer2` / SGLang `mamba.py`: in_proj is five column blocks z, x (heads x
    head_dim each), B, C (n_groups x state each) and dt (heads), each split by tp on its own;
    they assert mamba_num_heads % tp == 0 and n_groups % tp == 0 (n_groups == 1 is replicated
    instead, which SGLang refuses for a quantized in_proj)."""
    heads, head_dim = config.get("mamba_num_heads"), config.get("mamba_head_dim")
    groups, state = config.get("n_groups"), config.get("ssm_state_size")
    if not all(isinstance(v, int) and v > 0 for v in (heads, head_dim, groups, state)):
        return f"{what}: N={n} does not split into {tp} equal parts" if n % tp else None
    inner, bc = heads * head_dim, groups * state
    replicated = groups == 1 and not quantized
    blocks = {"z": inner, "x": inner, "dt": heads} if replicated else {"z": inner, "x": inner, "B": bc, "C": bc, "dt": heads}
    bad = [f"{k}={v}" for k, v in blocks.items() if v % tp]
    if not bad and (replicated or groups % tp == 0) and heads % tp == 0:
        return None
    return (
        f"{what}: Mamba in_proj N={n} = z {inner} + x {inner} + B {bc} + C {bc} + dt {heads}, each block split "
        f"by tp={tp}: " + (f"{', '.join(bad)} not divisible; the" if bad else "every block divides, but the")
        + f" engines need mamba_num_heads ({heads}) and "
        f"n_groups ({groups}) divisible by tp" + ("" if quantized else " (or n_groups == 1)")
    )


def tensor_parallel(folder: Path, tp: int, ep: bool = False) -> dict:
    """Which layers shard cleanly for tensor parallelism of `tp` (vLLM/SGLang layout), whatever
    their format: NVFP4, FP8 or BF16.

    Column-parallel layers (up, gate, shared and routed expert up_proj) split N; row-parallel ones
    (o, down, out_proj) split K, and an NVFP4 K shard must hold whole 16-element blocks. Attention
    splits by heads (num_attention_heads % tp; KV heads and tp: one divides the other). A Mamba
    in_proj splits by its own sub-blocks (`_mamba_in_proj`). Routed experts are split like their
    MLP unless expert parallelism keeps each expert whole.
    """
    folder = Path(folder)
    infos = _tensor_headers(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    problems: list[str] = []
    attention = False
    for name, info in sorted(infos.items()):
        module, _, leaf = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if leaf != "weight" or len(info.shape) != 2 or module.startswith("mtp.") or proj in _NOT_SPLIT or "norm" in proj:
            continue
        if ".experts." in module and ep:
            continue
        if proj in ("q_proj", "k_proj", "v_proj"):
            attention = True
            continue
        packed = info.dtype == "U8"
        n, k = info.shape[0], info.shape[1] * (2 if packed else 1)
        what = f"{module} ({_format_of(info)})"
        if proj == "in_proj" and config.get("model_type") == "nemotron_h":
            reason = _mamba_in_proj(what, n, info.dtype in ("U8", "F8_E4M3"), config, tp)
            if reason:
                problems.append(reason)
        elif proj in ROW_PARALLEL:
            if k % tp:
                problems.append(f"{what}: K={k} does not split into {tp} equal parts")
            elif packed and (k // tp) % NVFP4_BLOCK_SIZE:
                problems.append(f"{what}: K={k} splits into {k // tp} per rank, not a whole number of {NVFP4_BLOCK_SIZE}-element blocks")
        elif n % tp:
            problems.append(f"{what}: N={n} does not split into {tp} equal parts")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if attention and isinstance(heads, int) and heads % tp:
        problems.append(f"attention: num_attention_heads={heads} is not divisible by tp={tp}")
    if attention and isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        problems.append(f"attention: num_key_value_heads={kv_heads} and tp={tp}: neither divides the other")
    # one line per distinct reason is enough for a report (the first module that has it)
    seen, unique = set(), []
    for p in problems:
        key = p.split(":", 1)[1]
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return {"tp": tp, "ep": ep, "ok": not problems, "problems": unique, "count": len(problems)}


def kv_scales_as_bf16(folder: Path) -> list[dict]:
    """Each fp32 k_scale / v_scale and the value vLLM keeps: its KV scale parameters are created
    under the model's default dtype (bf16), so the loader rounds the scale to bf16."""
    out = []
    for name, info in sorted(_tensor_headers(Path(folder)).items()):
        if not name.endswith(KV_SUFFIXES) or info.dtype != "F32" or info.nbytes != 4:
            continue
        with open(info.file, "rb") as f:
            f.seek(info.start)
            value = torch.frombuffer(bytearray(f.read(4)), dtype=torch.float32)[0]
        rounded = value.to(torch.bfloat16).float()
        rel = float((rounded - value) / value) if float(value) != 0 else 0.0
        out.append({"tensor": name, "value": float(value), "bf16": float(rounded), "rel_change": rel})
    return out


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
    if not conf.ok and any({"header", "file", "shard"} & set(f.code.split("_")) for f in conf.errors):
        return report  # unreadable files: nothing further can be checked safely
    if conf.ok:
        report.sections["kv_scales_bf16"] = kv_scales_as_bf16(folder)
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
