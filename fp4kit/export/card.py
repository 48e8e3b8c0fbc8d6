"""The summary of a quantized model: a per-role table for the CLI and the model card."""

from __future__ import annotations

import math
from collections import defaultdict

from ..recipe import QUANT_ALGO


def role_rows(qm) -> list[dict]:
    """One row per (role, format): parameter count, bytes before/after, SQNR, 4/6 fraction."""
    groups: dict[tuple[str, str], dict] = defaultdict(lambda: {"params": 0, "before": 0, "after": 0, "sqnr": [], "frac4": [], "modules": 0})
    for p in qm.plan:
        t = p.target
        q = qm.quantized.get(t.key)
        fmt = "bf16" if q is None else (f"{QUANT_ALGO[q.rule.format]}" + (" 4/6" if q.rule.scale_rule == "4o6" and q.rule.format.startswith("nvfp4") else ""))
        g = groups[(t.role.value, fmt)]
        w = t.weight
        g["params"] += w.numel()
        g["modules"] += len(t.disk_names)
        g["before"] += w.numel() * w.element_size()
        if q is None:
            g["after"] += w.numel() * w.element_size()
        else:
            g["after"] += q.bytes_after
            g["sqnr"].append((q.sqnr_db, w.numel()))
            if q.frac4 is not None:
                g["frac4"].append((q.frac4, w.numel()))
    rows = []
    for (role, fmt), g in sorted(groups.items()):
        row = {"role": role, "format": fmt, "modules": g["modules"], "params": g["params"], "bytes_before": g["before"], "bytes_after": g["after"]}
        if g["sqnr"]:
            finite = [(s, n) for s, n in g["sqnr"] if math.isfinite(s)]
            row["sqnr_db_mean"] = sum(s * n for s, n in finite) / max(1, sum(n for _, n in finite)) if finite else math.inf
            row["sqnr_db_min"] = min(s for s, _ in g["sqnr"])
        if g["frac4"]:
            row["frac4"] = sum(f * n for f, n in g["frac4"]) / sum(n for _, n in g["frac4"])
        rows.append(row)
    return rows


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def summary_table(rows: list[dict]) -> str:
    head = f"{'role':<16}{'format':<18}{'modules':>8}{'params':>14}{'before':>11}{'after':>11}{'SQNR dB':>9}{'min dB':>8}{'->4':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        sq = f"{r['sqnr_db_mean']:.2f}" if "sqnr_db_mean" in r else "-"
        mn = f"{r['sqnr_db_min']:.2f}" if "sqnr_db_min" in r else "-"
        f4 = f"{r['frac4']:.1%}" if "frac4" in r else "-"
        lines.append(
            f"{r['role']:<16}{r['format']:<18}{r['modules']:>8}{r['params']:>14,}{_fmt_bytes(r['bytes_before']):>11}{_fmt_bytes(r['bytes_after']):>11}{sq:>9}{mn:>8}{f4:>7}"
        )
    tb = sum(r["bytes_before"] for r in rows)
    ta = sum(r["bytes_after"] for r in rows)
    lines.append(f"{'total':<16}{'':<18}{'':>8}{sum(r['params'] for r in rows):>14,}{_fmt_bytes(tb):>11}{_fmt_bytes(ta):>11}")
    return "\n".join(lines)


def _md_table(rows: list[dict]) -> str:
    out = ["| role | format | modules | parameters | BF16 size | stored size | weight SQNR (dB) | blocks choosing 4 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sq = f"{r['sqnr_db_mean']:.2f}" if "sqnr_db_mean" in r else "-"
        f4 = f"{r['frac4']:.1%}" if "frac4" in r else "-"
        out.append(f"| {r['role']} | {r['format']} | {r['modules']} | {r['params']:,} | {_fmt_bytes(r['bytes_before'])} | {_fmt_bytes(r['bytes_after'])} | {sq} | {f4} |")
    return "\n".join(out)


def model_card(qm, nested_config: dict, total_bytes: int, extra: dict) -> str:
    rows = role_rows(qm)
    recipe = qm.recipe
    calib = qm.calibration or {}
    lines = [
        f"# {extra.get('title', 'NVFP4 checkpoint')}",
        "",
        f"Quantized with fp4kit from `{extra.get('source', 'a BF16 model')}` under the recipe `{recipe.name}` "
        f"(version {recipe.version}). Checkpoint format: nvidia-modelopt (`quant_method: modelopt`, "
        f"`quant_algo: {nested_config['quantization'].get('quant_algo')}`"
        + (f", KV cache `{nested_config['quantization']['kv_cache_quant_algo']}`" if nested_config["quantization"].get("kv_cache_quant_algo") else "")
        + "), loadable by vLLM and SGLang.",
        "",
        "## Loading",
        "",
        "- vLLM: `vllm serve <this folder>` (the quantization is read from config.json).",
        "- SGLang: `python -m sglang.launch_server --model-path <this folder>`.",
        "- transformers: `fp4kit.load_quantized(<this folder>)` (pip install fp4kit). Plain "
        "`AutoModelForCausalLM.from_pretrained` has no loader for this format: it fails on NVFP4 "
        "shapes, or reads FP8 codes as unscaled numbers.",
        "",
        "## Quantization details",
        "",
        recipe.description or "",
        "",
        _md_table(rows),
        "",
        f"Checkpoint tensors: {total_bytes / 1e9:.3f} GB.",
        "",
        "## Calibration",
        "",
        f"- samples: {calib.get('spec', 'none')} ({calib.get('tokens', 0):,} tokens) from {calib.get('source', 'n/a')}, seed {calib.get('seed', 'n/a')}",
        "- statistics: FP8 input amax, KV amax, per-expert token counts"
        + (", per-channel E[x^2]" if any(r.importance for r in recipe.rules) else ""),
    ]
    empty = qm.empty_experts()
    if empty:
        lines.append(f"- experts that received no calibration token: {sum(len(v) for v in empty.values())} (in {len(empty)} layers)")
    if "quality" in extra:
        lines += ["", "## Quality", "", extra["quality"]]
    lines += ["", "## Recipe", "", "```yaml", recipe.to_yaml().rstrip(), "```", ""]
    return "\n".join(lines)


def set_quality_section(folder, markdown: str):
    """Write (or replace) the `## Quality` section of a checkpoint's model card."""
    from pathlib import Path

    card = Path(folder) / "README.md"
    text = card.read_text() if card.is_file() else ""
    section = f"## Quality\n\n{markdown.strip()}\n\n"
    start = text.find("## Quality\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        at = text.find("## Recipe\n")
        text = text[:at] + section + text[at:] if at >= 0 else text.rstrip() + "\n\n" + section
    card.write_text(text)
    return card
