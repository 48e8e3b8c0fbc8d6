"""Quality of a quantized checkpoint against its BF16 reference.

`evaluate(reference, quantized)` runs both models on the same held-out token rows and reports,
per token, KL(reference || quantized) over the vocabulary (mean, median, p99), top-1 agreement
and both perplexities; and, per quantized module, the weight SQNR of the dequantized checkpoint
tensors against the reference weights and the fraction of NVFP4 blocks whose stored scale is the
Four-Over-Six "4" candidate. Both are computed from what the loader holds (`fp4kit.modules`), so they
describe the checkpoint as the engines read it; the FP8 KV cache is emulated with its k/v scales
rounded to the model dtype, the values vLLM computes with (`modules.FP8KVProjection`), and the
report's `runs_as` says so. `compare_recipes` quantizes one model under the default recipe's
scale-rule variants and tabulates the same figures side by side. `check_inputs` checks every path
argument of both before anything is loaded.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import shlex
import tempfile
from pathlib import Path

import torch
from torch import nn

from . import __version__
from .calibration import build_calibration_set, iter_documents, parse_calib_spec
from .export.checkpoint import CONFIG_FILE
from .export.load import load_quantized
from .export.modelopt import export_checkpoint
from .formats import nvfp4
from .formats.arith import ARITH_MODES
from .formats.metrics import sqnr_db
from .models import adapter_for
from .models.tiny import tiny_model_path
from .modules import FP4KIT_MODULES, FP8KVProjection, FP8Linear, NVFP4Experts, NVFP4Linear
from .quantize import DEFAULT_CALIB, EMBEDDED_CALIB, _looks_like_path, load_model, quantize
from .recipe import DEFAULT_RECIPE, load_recipe, recipe_from_dict

DEFAULT_TOKENS = 8192
DEFAULT_SEQ_LEN = 512
# Scale-rule variants of one base recipe: (scale_rule, importance) for its NVFP4 rules.
RECIPE_VARIANTS = {"6": ("6", False), "4o6": ("4o6", False), "4o6-importance": ("4o6", True), "bf16": None}
VARIANT_LABELS = {"6": "NVFP4 plain (rule 6)", "4o6": "NVFP4 4/6", "4o6-importance": "NVFP4 4/6 + importance", "bf16": "BF16"}
# How a report names the embedded model: where it lives in the source tree, not on this machine.
EMBEDDED_MODEL = "fp4kit/data/tiny-nemotron-h"


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def _check_model_folder(what: str, ref, *, checkpoint: bool = False) -> None:
    """A model given as a local path must be a folder with config.json; a hub id passes here."""
    if isinstance(ref, nn.Module):
        return
    text = str(ref)
    if not checkpoint and not _looks_like_path(text):
        return
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} {text}: no such folder" + ("" if checkpoint else " (and not a hub id of the form org/name)"))
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{what} {text}: the folder has no {CONFIG_FILE}")


def _check_out_folder(what: str, folder) -> None:
    if folder is not None and Path(folder).expanduser().exists() and not Path(folder).expanduser().is_dir():
        raise FileExistsError(f"{what} {folder} exists and is not a folder")


def check_inputs(*, reference=None, quantized=None, model=None, data=None, dataset=None, recipe=None, calib=None,
                 tokens: int = DEFAULT_TOKENS, seq_len: int = DEFAULT_SEQ_LEN, out=None, keep_checkpoints=None) -> None:
    """Every argument of `evaluate` / `compare_recipes` that can be checked without loading a model.

    reference / model: a local path must be a folder with config.json (anything else is taken
    as a hub id); quantized: a checkpoint folder with config.json; data / dataset: a source that
    `calibration.iter_documents` opens (a path must exist); recipe and calib must parse; out and
    keep_checkpoints must not be files. Raises ValueError, FileNotFoundError or FileExistsError
    naming the argument.
    """
    if reference is not None:
        _check_model_folder("reference model", reference)
    if quantized is not None:
        _check_model_folder("quantized checkpoint", quantized, checkpoint=True)
    if model is not None:
        _check_model_folder("model", model)
    if data is not None and not isinstance(data, torch.Tensor):
        try:
            iter_documents(data, split="eval")  # opens the source: a missing path raises here
        except (OSError, ValueError) as exc:
            raise type(exc)(f"evaluation text: {exc}") from None
    if dataset is not None:
        iter_documents(dataset)
    if recipe is not None:
        load_recipe(recipe)
    if calib is not None:
        parse_calib_spec(calib)
    if not isinstance(data, torch.Tensor) and (tokens < seq_len or seq_len < 2):
        raise ValueError(f"need seq_len >= 2 and tokens >= seq_len, got tokens={tokens}, seq_len={seq_len}")
    _check_out_folder("output folder", out)
    _check_out_folder("checkpoint folder", keep_checkpoints)


def provenance(command: str, device: str) -> dict:
    """date (UTC), command and versions, as every results file records them."""
    import transformers

    versions = {"fp4kit": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    versions["device"] = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), "command": command,
            "versions": versions}


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
def token_rows(tokenizer, data=None, tokens: int = DEFAULT_TOKENS, seq_len: int = DEFAULT_SEQ_LEN) -> tuple[torch.Tensor, str]:
    """[rows, seq_len] token ids: the first `tokens` tokens of the documents, EOS after each.

    data: None (the bundled eval split), a source `calibration.iter_documents` reads (file,
    folder, hub dataset id), or a 2-D tensor of token ids used as given.
    """
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be an integer [rows, seq_len] tensor, got {data.dtype} {tuple(data.shape)}")
        return data.long(), f"{data.shape[0]} given rows of {data.shape[1]} tokens"
    if tokens < seq_len or seq_len < 2:
        raise ValueError(f"need seq_len >= 2 and tokens >= seq_len, got tokens={tokens}, seq_len={seq_len}")
    if tokenizer is None:
        raise ValueError("a tokenizer is needed to turn text into token rows (pass the reference as a folder, or tokenizer=)")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to put between documents")
    ids: list[int] = []
    for doc in iter_documents(data, split="eval"):
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if len(ids) >= tokens:
            break
    rows = min(tokens, len(ids)) // seq_len
    if rows == 0:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than one row of {seq_len}")
    where = "the bundled eval split" if data is None else str(data)
    return torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len), f"{rows} x {seq_len} tokens of {where}"


# --------------------------------------------------------------------------------------------
# Output distributions
# --------------------------------------------------------------------------------------------
@torch.inference_mode()
def compare_outputs(reference: nn.Module, quantized: nn.Module, rows: torch.Tensor, *, batch_size: int = 1,
                    progress: bool = False) -> dict:
    """Per-token KL(ref || quant) (nats), top-1 agreement, perplexities, over every position."""
    from tqdm.auto import tqdm

    dev_r = next(reference.parameters()).device
    dev_q = next(quantized.parameters()).device
    kls, agree, nll_r, nll_q = [], 0, 0.0, 0.0
    for i in tqdm(range(0, rows.shape[0], batch_size), desc="evaluate", unit="batch", disable=not progress):
        batch = rows[i : i + batch_size]
        lr = reference(input_ids=batch.to(dev_r), use_cache=False).logits.float().log_softmax(-1).cpu()
        lq = quantized(input_ids=batch.to(dev_q), use_cache=False).logits.float().log_softmax(-1).cpu()
        # sum p (log p - log q) in fp64; identical logits give exactly 0. Rounding can make a
        # near-zero KL come out at -1e-9, which is clamped: KL is >= 0 by definition.
        kl = (lr.double().exp() * (lr.double() - lq.double())).sum(-1).clamp_min(0.0)
        kls.append(kl.flatten())
        agree += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        target = batch[:, 1:, None]
        nll_r -= float(lr[:, :-1].gather(-1, target).double().sum())
        nll_q -= float(lq[:, :-1].gather(-1, target).double().sum())
    kl = torch.cat(kls)
    n_pred = rows.shape[0] * (rows.shape[1] - 1)
    return {
        "tokens": int(kl.numel()),
        "kl_mean": float(kl.mean()),
        "kl_median": float(kl.median()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": agree / kl.numel(),
        "ppl_reference": math.exp(nll_r / n_pred),
        "ppl_quantized": math.exp(nll_q / n_pred),
        "kl_values": kl,
    }


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------
def stored_scale_rule(w: torch.Tensor, qt: nvfp4.NVFP4Tensor, global_amax=None) -> tuple[str, float | None]:
    """(scale rule, fraction of blocks that chose 4) of a stored NVFP4 weight, from its reference.

    The rule is read off the global scale: amax/1536 is the 4/6 (static, normalisation 256)
    path, amax/2688 the plain one (amax = max|W| per expert, or the fused group's `global_amax`),
    with the division in either of the formats' `arith` modes. For 4/6, both candidates
    (block amax x1.0 and x1.5) are recomputed with `nvfp4.static_block_scale` in the mode that
    explains the stored scales, and a block counts as "4" as `nvfp4.four_over_six_choice` says.
    """
    w = w.detach().cpu()
    block_amax = nvfp4.block_amax(w)
    own = w.abs().amax(dim=(-2, -1)).float()
    g = own if global_amax is None else torch.broadcast_to(torch.as_tensor(global_amax, dtype=torch.float32), own.shape)
    gs = qt.global_scale.cpu()
    live = g > 0
    if not bool(live.any()):
        return "unknown", None
    modes = [m for m in ARITH_MODES if torch.equal(gs[live], nvfp4.global_scale_of(g, "4o6", m)[live])]
    if not modes:
        plain = any(torch.equal(gs[live], nvfp4.global_scale_of(g, "6", m)[live]) for m in ARITH_MODES)
        return ("6" if plain else "unknown"), None
    g_b = torch.where(live, g, torch.ones_like(g)).reshape(*g.shape, 1, 1)
    live_b = live.reshape(*live.shape, 1, 1)
    stored = qt.block_scale.cpu()
    best = None
    for mode in modes:
        chose4, explained = nvfp4.four_over_six_choice(stored, block_amax, g_b, mode)
        count = int((explained & live_b).sum())
        if best is None or count > best[0]:
            best = (count, float((chose4 & live_b).double().mean()))
    return "4o6", best[1]


def _group_amax(reference: nn.Module) -> dict[str, torch.Tensor]:
    """Weight key -> the max|W| its fused group shares (q/k/v, gate/up), as the quantizer uses it."""
    groups: dict[str, list] = {}
    for t in adapter_for(reference).targets(reference):
        if t.fuse_group:
            groups.setdefault(t.fuse_group, []).append(t)
    out = {}
    for members in groups.values():
        amax = torch.stack([m.weight.detach().abs().amax().float().cpu() for m in members]).max()
        out.update({m.key: amax for m in members})
    return out


def weight_report(reference: nn.Module, quantized: nn.Module) -> list[dict]:
    """One row per quantized module (an expert stack is one row): format, SQNR, 4/6 fraction."""
    adapter = adapter_for(reference)
    ref = dict(reference.named_modules())
    group = _group_amax(reference)
    rows = []
    for module in quantized.modules():
        if isinstance(module, NVFP4Experts):
            parts = [(f"{module.name}.{p}", getattr(ref[module.name], p), module.stack(p)) for p in ("up_proj", "down_proj")]
        elif isinstance(module, NVFP4Linear):
            parts = [(f"{module.name}.weight", ref[module.name].weight, module.qweight)]
        elif isinstance(module, FP8Linear):
            parts = [(f"{module.name}.weight", ref[module.name].weight, None)]
        else:
            continue
        for key, w, qt in parts:
            w = w.detach().cpu()
            if qt is None:
                w_hat, rule, frac4 = module.dequantized_weight().cpu(), None, None
            else:
                w_hat = qt.to("cpu").dequantize()
                rule, frac4 = stored_scale_rule(w, qt.to("cpu"), group.get(key))
            name = key[: -len(".weight")] if key.endswith(".weight") else key
            rows.append({
                "module": adapter.disk_name(name), "format": module.algo, "scale_rule": rule,
                "params": w.numel(), "sqnr_db": sqnr_db(w, w_hat), "frac4": frac4,
            })
    return rows


def _runs_as(model: nn.Module) -> str:
    """How the quantized layers ran: backend and W4A16 / W4A4, from the loaded modules."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, FP8KVProjection):
            dtype = str(getattr(model, "dtype", "the model dtype")).removeprefix("torch.")
            held = f"rounded to {dtype} as vLLM holds them" if m.model_dtype_scale else "in fp32 as SGLang holds them"
            kinds.add(f"FP8 KV cache with k/v scales {held}")
        if isinstance(m, FP4KIT_MODULES) and hasattr(m, "backend"):
            mode = {True: "W4A4", False: "W4A16"}.get(getattr(m, "act_quant", None), "W8A8")
            kinds.add(f"{m.backend} backend" if m.backend == "triton" else "exact emulation")
            if isinstance(m, (NVFP4Linear, NVFP4Experts)):
                kinds.add(f"NVFP4 as {mode}")
    return ", ".join(sorted(kinds)) or "no fp4kit module"


def _weighted(rows: list[dict], field: str) -> float | None:
    vals = [(r[field], r["params"]) for r in rows if r.get(field) is not None and math.isfinite(r[field])]
    if not vals:
        return None
    return sum(v * n for v, n in vals) / sum(n for _, n in vals)


# --------------------------------------------------------------------------------------------
# evaluate
# --------------------------------------------------------------------------------------------
def _load_reference(reference, device):
    if isinstance(reference, nn.Module):
        return reference, None, getattr(reference, "name_or_path", "") or "a model in memory"
    model, tokenizer = load_model(str(reference), device=device)
    return model, tokenizer, str(reference)


def evaluate(
    reference,
    quantized,
    *,
    data=None,
    tokens: int = DEFAULT_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    device: str = "cpu",
    batch_size: int = 1,
    tokenizer=None,
    backend: str | None = None,
    act_quant: bool = True,
    out: str | Path | None = None,
    progress: bool = False,
    data_label: str | None = None,
) -> dict:
    """Compare `quantized` with `reference` (each a folder or a loaded model).

    reference: a BF16 model folder (loaded with transformers, safetensors only) or model;
    quantized: a ModelOpt-format folder (loaded with `load_quantized(device, backend=,
    act_quant=)`) or a loaded model. data / tokens / seq_len: see `token_rows`; the tokenizer
    is the reference folder's unless given. With `out`, writes eval.json, eval.md, sqnr.png and
    kl_hist.png there; `data_label` names given token rows in the report. Returns the figures
    as a dict (per-token KL values under "kl_values").
    """
    check_inputs(reference=reference, quantized=quantized, data=data, tokens=tokens, seq_len=seq_len, out=out)
    ref_model, ref_tok, ref_name = _load_reference(reference, device)
    if isinstance(quantized, nn.Module):
        q_model, q_name = quantized, getattr(quantized, "name_or_path", "") or "a model in memory"
    else:
        q_model, q_name = load_quantized(quantized, device, backend=backend, act_quant=act_quant), str(quantized)
    rows, described = token_rows(tokenizer or ref_tok, data, tokens, seq_len)
    result = compare_outputs(ref_model, q_model, rows, batch_size=batch_size, progress=progress)
    layers = weight_report(ref_model, q_model)
    result.update({
        "runs_as": _runs_as(q_model),
        "reference": ref_name,
        "quantized": q_name,
        "data": data_label or described,
        "rows": rows.shape[0],
        "seq_len": rows.shape[1],
        "weight_sqnr_db_mean": _weighted(layers, "sqnr_db"),
        "frac4": _weighted(layers, "frac4"),
        "layers": layers,
    })
    if out is not None:
        result["files"] = write_report(result, out)
    return result


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
def _num(v, fmt: str, missing: str = "-") -> str:
    if v is None:
        return missing
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, fmt)


def quality_markdown(result: dict) -> str:
    """The measured quality as Markdown, for the model card."""
    lines = [
        f"Measured against the BF16 model on {result['data']} ({result['tokens']:,} positions), "
        f"running the checkpoint with `fp4kit.load_quantized` ({result.get('runs_as', 'fp4kit modules')}).",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| KL(BF16 \u2016 quantized), mean (nats/token) | {_num(result['kl_mean'], '.3g')} |",
        f"| KL median | {_num(result['kl_median'], '.3g')} |",
        f"| KL p99 | {_num(result['kl_p99'], '.3g')} |",
        f"| top-1 agreement | {result['top1_agreement']:.2%} |",
        f"| perplexity, BF16 | {result['ppl_reference']:.3f} |",
        f"| perplexity, quantized | {result['ppl_quantized']:.3f} |",
        f"| weight SQNR, mean over quantized weights (dB) | {_num(result['weight_sqnr_db_mean'], '.2f')} |",
        f"| NVFP4 blocks choosing 4 (4/6) | {_num(result['frac4'], '.1%')} |",
    ]
    return "\n".join(lines)


def layers_markdown(layers: list[dict]) -> str:
    out = ["| module | format | scale rule | parameters | weight SQNR (dB) | blocks choosing 4 |", "|---|---|---|---:|---:|---:|"]
    for r in layers:
        out.append(f"| {r['module']} | {r['format']} | {r['scale_rule'] or '-'} | {r['params']:,} | {_num(r['sqnr_db'], '.2f')} | {_num(r['frac4'], '.1%')} |")
    return "\n".join(out)


def _kl_histogram(kl: torch.Tensor, bins: int = 60) -> dict:
    kl = kl.double()
    pos = kl[kl > 0]
    zeros = int((kl == 0).sum())
    if pos.numel() == 0:
        return {"zeros": zeros, "edges": [], "counts": []}
    lo, hi = math.log10(float(pos.min())), math.log10(float(pos.max()))
    hi = max(hi, lo + 1e-6)
    edges = torch.logspace(lo, hi, bins + 1, dtype=torch.float64)
    edges[0], edges[-1] = pos.min(), pos.max()  # 10**log10(x) need not give x back
    counts = torch.histogram(pos, bins=edges)[0]
    return {"zeros": zeros, "edges": edges.tolist(), "counts": [int(c) for c in counts]}


def _plots(result: dict, folder: Path) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("evaluate(out=...) draws its plots with matplotlib, which is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    files = []
    layers = result["layers"]
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.22 * len(layers) + 1.2)))
    if layers:
        formats = sorted({r["format"] for r in layers})
        colors = {f: plt.cm.tab10(i) for i, f in enumerate(formats)}
        vals = [r["sqnr_db"] if math.isfinite(r["sqnr_db"]) else 0.0 for r in layers]
        ax.barh(range(len(layers)), vals, color=[colors[r["format"]] for r in layers])
        ax.set_yticks(range(len(layers)), [r["module"] for r in layers], fontsize=7)
        ax.invert_yaxis()
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=colors[f], label=f) for f in formats], loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no quantized module", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("weight SQNR (dB), dequantized checkpoint vs BF16")
    ax.set_title("Per-module weight SQNR")
    fig.tight_layout()
    fig.savefig(folder / "sqnr.png", dpi=110)
    plt.close(fig)
    files.append("sqnr.png")

    hist = result["kl_histogram"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if hist["counts"]:
        edges = hist["edges"]
        ax.stairs(hist["counts"], edges, fill=True)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
        ax.text(0.5, 0.5, "every token has KL = 0", ha="center", va="center", transform=ax.transAxes)
    if result["kl_mean"] > 0:
        ax.axvline(result["kl_mean"], color="k", linestyle="--", label=f"mean {result['kl_mean']:.3g}")
        ax.legend()
    ax.set_xlabel("per-token KL(BF16 || quantized), nats")
    ax.set_ylabel("tokens")
    ax.set_title(f"KL over {result['tokens']:,} positions ({hist['zeros']:,} exactly 0)")
    fig.tight_layout()
    fig.savefig(folder / "kl_hist.png", dpi=110)
    plt.close(fig)
    files.append("kl_hist.png")
    return files


def write_report(result: dict, out: str | Path) -> list[str]:
    """eval.json, eval.md and the two plots into `out`; returns the file names."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    if "kl_values" in result:
        result["kl_histogram"] = _kl_histogram(result["kl_values"])
    data = {k: v for k, v in result.items() if k not in ("kl_values", "files")}
    (folder / "eval.json").write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")
    md = f"# Quality of `{result['quantized']}` against `{result['reference']}`\n\n{quality_markdown(result)}\n\n## Quantized modules\n\n{layers_markdown(result['layers'])}\n"
    (folder / "eval.md").write_text(md)
    return ["eval.json", "eval.md"] + _plots(result, folder)


def _finite(v):
    """JSON has no infinities: an infinite SQNR (a lossless weight) is written as the string "inf"."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


# --------------------------------------------------------------------------------------------
# Recipe comparison
# --------------------------------------------------------------------------------------------
def variant_recipe(base, variant: str):
    """The base recipe with every NVFP4 rule set to one scale-rule variant of RECIPE_VARIANTS."""
    if variant not in RECIPE_VARIANTS or RECIPE_VARIANTS[variant] is None:
        raise ValueError(f"unknown recipe variant {variant!r}; expected one of {[v for v, r in RECIPE_VARIANTS.items() if r]}")
    scale_rule, importance = RECIPE_VARIANTS[variant]
    d = base.to_dict()
    d["name"] = f"{base.name}-{variant}"
    for rule in d["rules"]:
        if rule["format"].startswith("nvfp4"):
            rule["scale_rule"], rule["importance"] = scale_rule, importance
    return recipe_from_dict(d, source=f"{base.name} with NVFP4 scale rule {variant}")


def compare_recipes(
    model: str | None = None,
    recipes=("6", "4o6", "4o6-importance", "bf16"),
    *,
    base_recipe: str | None = None,
    calib: str | None = None,
    dataset: str | None = None,
    data=None,
    tokens: int = DEFAULT_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    device: str = "cpu",
    batch_size: int = 1,
    seed: int = 0,
    out: str | Path | None = None,
    keep_checkpoints: str | Path | None = None,
    progress: bool = False,
    log=print,
) -> dict:
    """Quantize one model under scale-rule variants of a recipe and evaluate each against BF16.

    model: a BF16 model folder (default: the embedded tiny Nemotron-H). recipes: names from
    RECIPE_VARIANTS ("6" plain NVFP4, "4o6", "4o6-importance", "bf16" = the reference itself)
    applied to `base_recipe` (default: fp4kit's default recipe: experts W4A16 NVFP4, Mamba FP8,
    KV FP8). calib / dataset: the calibration set as for `fp4kit quantize` (default: 32x512 from
    the bundled corpus, 512x2048 when a dataset is given). With `out`, writes compare.json (the
    table with its date, command and versions) and compare.md there, nothing else. Checkpoints go
    to a temporary folder, removed at the end, unless `keep_checkpoints` names a folder: then
    each variant's checkpoint and its evaluate() report stay in `keep_checkpoints/<variant>/`.
    Returns {"rows": [...], "markdown": table, "results": {variant: evaluate() result}}.
    """
    for v in recipes:
        if v not in RECIPE_VARIANTS:
            raise ValueError(f"unknown recipe variant {v!r}; expected some of {list(RECIPE_VARIANTS)}")
    check_inputs(model=model, data=data, dataset=dataset, recipe=base_recipe, calib=calib, tokens=tokens,
                 seq_len=seq_len, out=out, keep_checkpoints=keep_checkpoints)
    command = _compare_command(model=model, recipes=recipes, base_recipe=base_recipe, calib=calib, dataset=dataset,
                               data=data, tokens=tokens, seq_len=seq_len, device=device, batch_size=batch_size,
                               seed=seed, out=out, keep_checkpoints=keep_checkpoints)
    base = load_recipe(base_recipe or DEFAULT_RECIPE)
    model_ref = str(model or tiny_model_path())
    log(f"loading {model_ref}")
    ref, tokenizer = load_model(model_ref, device=device)
    rows, described = token_rows(tokenizer, data, tokens, seq_len)
    # The bundled corpus holds ~180K calibration tokens: its default set is the embedded one's.
    spec = calib or (EMBEDDED_CALIB if model is None or dataset is None else DEFAULT_CALIB)
    samples = None
    if any(v != "bf16" for v in recipes):
        samples = build_calibration_set(tokenizer, spec, dataset, seed=seed, progress=progress)
    out = None if out is None else Path(out)
    keep = None if keep_checkpoints is None else Path(keep_checkpoints)
    results, table = {}, []
    with tempfile.TemporaryDirectory(prefix="fp4kit-compare-") as tmp:
        for variant in recipes:
            report = None if keep is None else keep / variant
            if variant == "bf16":
                log("evaluating BF16 against itself")
                res = evaluate(ref, ref, data=rows, data_label=described, device=device, batch_size=batch_size, out=report, progress=progress)
            else:
                recipe = variant_recipe(base, variant)
                log(f"quantizing under {recipe.name} ({spec} calibration)")
                qm = quantize(ref, recipe, samples, batch_size=batch_size, progress=progress)
                qm.calibration = {"spec": str(spec), "tokens": int(samples.numel()), "source": dataset or "the bundled calibration split", "seed": seed}
                folder = (report if report is not None else Path(tmp) / variant) / "checkpoint"
                export_checkpoint(qm, folder, tokenizer=tokenizer, source_dir=Path(model_ref) if Path(model_ref).is_dir() else None,
                                  overwrite=True, progress=progress)
                qmodel = load_quantized(folder, device)
                log(f"evaluating {recipe.name}")
                res = evaluate(ref, qmodel, data=rows, data_label=described, device=device, batch_size=batch_size, out=report, progress=progress)
                del qmodel
            results[variant] = res
            table.append({
                "recipe": VARIANT_LABELS[variant], "variant": variant, "kl_mean": res["kl_mean"], "kl_p99": res["kl_p99"],
                "top1_agreement": res["top1_agreement"], "ppl": res["ppl_quantized"],
                "weight_sqnr_db_mean": res["weight_sqnr_db_mean"], "frac4": res["frac4"],
            })
    summary = {
        **provenance(command, device),
        "model": EMBEDDED_MODEL if model is None else str(model), "base_recipe": base.name,
        "calibration": str(spec) if samples is not None else None, "data": described, "rows": table,
    }
    summary["markdown"] = recipes_markdown(summary)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(_finite({k: v for k, v in summary.items() if k != "markdown"}), indent=2) + "\n")
        (out / "compare.md").write_text(summary["markdown"] + "\n")
    summary["results"] = results
    return summary


def _compare_command(*, model, recipes, base_recipe, calib, dataset, data, tokens, seq_len, device, batch_size,
                     seed, out, keep_checkpoints) -> str:
    """The `fp4kit eval --compare-recipes` command that repeats a compare_recipes call; the call
    itself where the command line cannot express it (a subset of variants, a seed, token rows
    given in memory)."""
    if tuple(recipes) != tuple(RECIPE_VARIANTS) or seed != 0 or isinstance(data, torch.Tensor):
        given = {"model": model, "recipes": list(recipes), "base_recipe": base_recipe, "calib": calib, "dataset": dataset,
                 "data": "<token rows>" if isinstance(data, torch.Tensor) else data, "tokens": tokens, "seq_len": seq_len,
                 "seed": seed, "out": out}
        return "fp4kit.evaluate.compare_recipes(" + ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None) + ")"
    words = ["fp4kit", "eval", "--compare-recipes"]
    for flag, value, default in (("--model", model, None), ("--recipe", base_recipe, None), ("--calib", calib, None),
                                 ("--dataset", dataset, None), ("--data", data, None), ("--tokens", tokens, DEFAULT_TOKENS),
                                 ("--seq-len", seq_len, DEFAULT_SEQ_LEN), ("--batch-size", batch_size, 1),
                                 ("--device", device, "cpu"), ("--out", out, None), ("--keep-checkpoints", keep_checkpoints, None)):
        if value is not None and value != default:
            words += [flag, str(value)]
    return shlex.join(words)


def recipes_markdown(summary: dict) -> str:
    lines = [
        f"Model `{summary['model']}`, base recipe `{summary['base_recipe']}`, calibration {summary['calibration'] or '-'}, "
        f"evaluated on {summary['data']}." + (f" `{summary['command']}`, {summary['date']}." if "command" in summary else ""),
        "",
        "| recipe | mean KL | p99 KL | top-1 | ppl | mean weight SQNR (dB) | blocks choosing 4 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['recipe']} | {_num(r['kl_mean'], '.4g')} | {_num(r['kl_p99'], '.4g')} | {r['top1_agreement']:.2%} | "
            f"{r['ppl']:.3f} | {_num(r['weight_sqnr_db_mean'], '.2f')} | {_num(r['frac4'], '.1%')} |"
        )
    return "\n".join(lines)
