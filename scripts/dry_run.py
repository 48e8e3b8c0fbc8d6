"""The user's job at its real size: Nemotron-3-Nano (31.6 B) through fp4kit's pipeline on one GPU.

Builds the model of configs/models/nemotron-3-nano-30b-a3b.json directly on the GPU (random
weights: N(0, 0.02), every weight row then scaled by its own log-normal factor, so that block
maxima differ as they do in trained weights), times a plain BF16 forward on calibration-sized
samples, then runs the same library calls as `fp4kit quantize` (calibrate -> quantize -> export)
on random token ids and writes the checkpoint. Records per-stage time, the steady-state
calibration rate (per sample, after the first), peak GPU memory and peak host RSS, and projects
the user's `--calib 1000x32k` from the measured rates.

    python scripts/dry_run.py --calib 16x32k                  # all 52 layers
    python scripts/dry_run.py --calib 2x4k --layers 7         # a slice: the first 7 layers
    python scripts/dry_run.py --layers 26 --save-bf16 DIR     # the half model as a BF16 folder, for the CLI
    python scripts/dry_run.py --cli DIR --calib 8x32k         # `fp4kit quantize --model DIR` as a user runs it

The BF16 model of all 52 layers (63 GB) does not fit a 64 GB disk beside its checkpoint, so the
full model is quantized from memory; the CLI path (load from disk included) is measured on the
26-layer half model (31 GB). Results go to benchmarks/results/dry-run-<gpu>.json, one section per
mode, and a table is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "models" / "nemotron-3-nano-30b-a3b.json"
RESULTS = ROOT / "benchmarks" / "results"
TARGET = (1000, 32768)  # the user's --calib 1000x32k


def gpu_tag() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")


def versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def host_rss_peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def parse_calib(text: str) -> tuple[int, int]:
    from fp4kit.calibration import parse_calib_spec

    spec = parse_calib_spec(text)
    return spec.samples, spec.seq_len


def nano_config(layers: int | None):
    from transformers import NemotronHConfig

    raw = json.loads(CONFIG.read_text())
    if layers is not None:
        if not 1 <= layers <= len(raw["hybrid_override_pattern"]):
            raise SystemExit(f"error: --layers must be 1..{len(raw['hybrid_override_pattern'])}, got {layers}")
        raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][:layers]
        raw["num_hidden_layers"] = layers
    for key in ("architectures", "transformers_version", "torch_dtype"):
        raw.pop(key, None)
    return NemotronHConfig(**raw)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(cfg, device: str = "cuda", seed: int = 0, row_sigma: float = 0.5):
    """The model on `device` with random BF16 weights, made there: no host copy of a GPU weight."""
    from transformers import NemotronHForCausalLM

    with torch.device(device):
        model = NemotronHForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() < 2:
                continue
            p.normal_(0, 0.02, generator=g)
            rows = torch.empty(p.shape[:-1] + (1,), device=device).normal_(0, row_sigma, generator=g).exp_()
            p.mul_(rows.to(p.dtype))
    sync()
    return model


class SampleClock:
    """Wall time of every top-level forward (synchronised at its end)."""

    def __init__(self, model):
        self.stamps: list[float] = []
        self.t0 = None
        self._pre = model.register_forward_pre_hook(self._start)
        self._post = model.register_forward_hook(self._end)

    def _start(self, *_):
        sync()
        self.t0 = time.perf_counter()

    def _end(self, *_):
        sync()
        self.stamps.append(time.perf_counter() - self.t0)

    def remove(self):
        self._pre.remove()
        self._post.remove()


def plain_forward(model, samples: torch.Tensor, batch_size: int) -> list[float]:
    clock = SampleClock(model)
    try:
        with torch.inference_mode():
            for i in range(0, samples.shape[0], batch_size):
                model(input_ids=samples[i : i + batch_size].to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        clock.remove()
    return clock.stamps


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def profiled(fn, sink: dict, name: str):
    """fn wrapped in cProfile; its 30 costliest functions (cumulative) go to sink[name]."""
    import cProfile
    import pstats

    def wrapper(*a, **kw):
        prof = cProfile.Profile()
        try:
            return prof.runcall(fn, *a, **kw)
        finally:
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:30]
            sink[name] = [{"function": f"{Path(f).name}:{line}:{func}", "calls": nc, "tottime_s": round(tt, 4),
                           "cumtime_s": round(ct, 4)} for (f, line, func), (_, nc, tt, ct, _) in rows]

    return wrapper


def library_run(args) -> dict:
    import fp4kit.quantize as pipeline
    from fp4kit.models.nemotron_h import mamba_kernels
    from fp4kit.export.modelopt import export_checkpoint
    from fp4kit.quantize import quantize
    from fp4kit.recipe import load_recipe

    n, seq = parse_calib(args.calib)
    cfg = nano_config(args.layers)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_model(cfg, args.device, args.seed)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(args.seed)
    samples = torch.randint(0, cfg.vocab_size, (n, seq), generator=g)
    plain = plain_forward(model, samples[: args.plain_samples], args.batch_size)
    plain_per_batch = statistics.median(plain[1:] if len(plain) > 1 else plain)  # the first includes warm-up

    recipe = load_recipe(args.recipe)
    profile: dict = {}
    if args.profile:
        pipeline.quantize_weights = profiled(pipeline.quantize_weights, profile, "quantize")
        export_checkpoint = profiled(export_checkpoint, profile, "export")
    clock = SampleClock(model)
    try:
        qm = quantize(model, recipe, samples, backend="triton" if args.device == "cuda" else "torch", batch_size=args.batch_size, progress=not args.no_progress)
    finally:
        clock.remove()
    calib_batches = clock.stamps
    steady_per_batch = statistics.median(calib_batches[1:] if len(calib_batches) > 1 else calib_batches)

    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="fp4kit-dry-run-"))
    target = out_dir / f"nano-{cfg.num_hidden_layers}l-{recipe.name}"
    export_checkpoint(qm, target, overwrite=True, progress=not args.no_progress,
                      card_extra={"source": "random weights (scripts/dry_run.py)", "title": target.name})
    ckpt_bytes = folder_bytes(target)
    timings = dict(qm.timings)
    if not args.keep:
        shutil.rmtree(target, ignore_errors=True)

    quantized_bf16_bytes = sum(q.bytes_before for q in qm.quantized.values())
    bare = bare_kernels(qm) if args.device == "cuda" else {}
    per_sample_plain = plain_per_batch / args.batch_size
    per_sample_calib = steady_per_batch / args.batch_size
    scale = TARGET[0] * TARGET[1] / seq  # samples of this length that hold 1000 x 32K tokens
    projected = {
        "calibrate_s": per_sample_calib * scale,
        "quantize_s": timings["quantize"] + timings.get("compile wait", 0.0),
        "export_s": timings["export"],
        "plain_forward_s": per_sample_plain * scale,
    }
    projected["without_load_s"] = projected["calibrate_s"] + projected["quantize_s"] + projected["export_s"]
    projected["ratio_to_plain_without_load"] = projected["without_load_s"] / projected["plain_forward_s"]
    return {
        "layers": cfg.num_hidden_layers, "pattern": cfg.hybrid_override_pattern, "params": params,
        "calib": f"{n}x{seq}", "batch_size": args.batch_size, "recipe": recipe.name, "mamba_kernels": mamba_kernels(),
        "build_s": build_s,
        "plain_forward_per_sample_s": per_sample_plain, "plain_forward_batches_s": plain,
        "calibrate_s": timings["calibrate"], "calibrate_batches_s": calib_batches,
        "calibrate_steady_per_sample_s": per_sample_calib,
        "calibrate_steady_tokens_per_s": seq / per_sample_calib,
        "calibrate_over_plain": per_sample_calib / per_sample_plain,
        "quantize_s": timings["quantize"], "quantized_bf16_bytes": quantized_bf16_bytes,
        "quantize_tb_per_s": quantized_bf16_bytes / timings["quantize"] / 1e12,
        # Triton's compiles of the stage's kernels run in a thread during calibration; the stage
        # waits only for what is left of them.
        "compile_beside_calibrate_s": timings.get("compile beside calibrate"),
        "compile_wait_s": timings.get("compile wait"),
        **bare,
        "export_s": timings["export"], "checkpoint_bytes": ckpt_bytes,
        "export_gb_per_s": ckpt_bytes / timings["export"] / 1e9,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "peak_host_rss_gb": host_rss_peak_gb(),
        "projected_1000x32k": projected,
        **({"profile": profile} if profile else {}),
    }


def bare_kernels(qm) -> dict:
    """The quantize stage's NVFP4 kernels alone, launched back to back over the same weights (no
    checks, no read-back): plain, and summing the SQNR terms as the stage has them do; each timed
    on its second pass (the first compiles). The floor the stage is compared with."""
    from fp4kit.kernels import quantize as kq

    nv = [q for q in qm.quantized.values() if q.rule.format.startswith("nvfp4")]
    weights = [(q.target.weight.detach(), q.rule) for q in nv]
    out = {}
    for label, terms in (("bare_quantize_kernels_s", False), ("bare_quantize_with_terms_kernels_s", True)):
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for w, rule in weights:
                imp = torch.ones((*w.shape[:-2], w.shape[-1]), device=w.device) if rule.importance else None
                kq.launch(w, rule.scale_rule, None, imp, False, terms=[] if terms else None)
            torch.cuda.synchronize()
            out[label] = time.perf_counter() - t0
    out["bare_nvfp4_bf16_bytes"] = sum(w.numel() * w.element_size() for w, _ in weights)
    return out


def save_bf16(args) -> dict:
    from fp4kit.models.tiny import tiny_model_path
    from transformers import AutoTokenizer

    cfg = nano_config(args.layers)
    model = build_model(cfg, args.device, args.seed)
    dest = Path(args.save_bf16)
    t0 = time.perf_counter()
    model.save_pretrained(dest, max_shard_size="5GB")
    # Any tokenizer whose ids fit the vocabulary serves for calibration text; the bundled one does.
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(dest)
    return {"layers": cfg.num_hidden_layers, "bytes": folder_bytes(dest), "save_s": time.perf_counter() - t0}


def proc_memory(pid: int, keys: tuple[str, ...]) -> list[int]:
    """The given /proc/<pid>/status fields in bytes (0 where the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return [0] * len(keys)
    found = dict(re.findall(r"^(\w+):\s+(\d+) kB", text, re.M))
    return [int(found.get(k, 0)) * 1024 for k in keys]


_LOAD_PROBE = """
import sys, time, torch
from transformers import AutoModelForCausalLM
t0 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda")
torch.cuda.synchronize()
print("LOAD_S", time.perf_counter() - t0)
"""


def cli_run(args) -> dict:
    """`fp4kit quantize` as a separate process, beside transformers' own load of the same folder."""
    folder = Path(args.cli)
    probe = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(folder)], capture_output=True, text=True, check=True)
    hf_load = float(re.search(r"LOAD_S ([0-9.]+)", probe.stdout).group(1))
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="fp4kit-cli-")) / f"{folder.name}-nvfp4"
    cmd = ["fp4kit", "quantize", "--model", str(folder), "--calib", args.calib, "--device", "cuda", "-o", str(out),
           "--overwrite", "--allow-repeat", "--batch-size", str(args.batch_size)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True)
        peak = {"VmRSS": 0, "RssAnon": 0}
        while proc.poll() is None:
            peak = {k: max(v, now) for (k, v), now in zip(peak.items(), proc_memory(proc.pid, tuple(peak)))}
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        out_f.seek(0), err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    if proc.returncode != 0:
        raise SystemExit(f"fp4kit quantize failed ({proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    times = {k.strip(): float(v) for k, v in re.findall(r"([a-z ]+?) ([0-9.]+)s", stdout.split("time:", 1)[1].splitlines()[0])}
    src_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    result = {"command": " ".join(cmd), "wall_s": wall, "stages_s": {k.strip(): v for k, v in times.items()},
              "hf_from_pretrained_device_map_s": hf_load, "source_bytes": src_bytes, "stdout_tail": stdout[-1500:],
              "load_over_hf": times.get("load", float("nan")) / hf_load,
              "load_gb_per_s": src_bytes / times["load"] / 1e9 if times.get("load") else None,
              "checkpoint_bytes": folder_bytes(out),
              # VmRSS counts the safetensors files' mapped pages, which the kernel can drop at
              # will; RssAnon is the process's own memory (pinned buffers included).
              "peak_host_rss_gb": peak["VmRSS"] / 1e9, "peak_host_anon_gb": peak["RssAnon"] / 1e9}
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


LIBRARY_SECTIONS = ("library", "library-mamba-kernels")


def library_section() -> str:
    """The section a library run goes to: transformers runs the Mamba mixers in plain torch
    ("library") or with mamba-ssm's and causal-conv1d's kernels where both import."""
    from fp4kit.models.nemotron_h import mamba_kernels

    return LIBRARY_SECTIONS[1] if all(mamba_kernels().values()) else LIBRARY_SECTIONS[0]


def mamba_path(kernels: dict | None) -> str:
    if kernels and all(kernels.values()):
        return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in kernels.items())
    missing = [k.replace("_", "-") for k, v in (kernels or {}).items() if not v] or ["mamba-ssm", "causal-conv1d"]
    return f"transformers' plain-torch code ({' and '.join(missing)} not installed)"


def merge_results(section: str, data: dict, command: str, path: str | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(path) if path else RESULTS / f"dry-run-{gpu_tag()}.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc[section] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
                    "command": command, "versions": versions(), **data}
    cli = doc.get("cli")
    for lib in (doc.get(name) for name in LIBRARY_SECTIONS):
        if lib and cli and cli.get("load_gb_per_s"):
            # The full model's load at the half model's measured rate: 2 bytes per BF16 parameter.
            load = 2 * lib["params"] / (cli["load_gb_per_s"] * 1e9)
            proj = lib["projected_1000x32k"]
            proj["load_s"] = load
            proj["end_to_end_s"] = proj["without_load_s"] + load
            proj["ratio_to_plain"] = proj["end_to_end_s"] / proj["plain_forward_s"]
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def table(doc: dict) -> None:
    for name in LIBRARY_SECTIONS:
        lib = doc.get(name)
        if not lib:
            continue
        print(f"[{name}] Mamba mixers: {mamba_path(lib.get('mamba_kernels'))}")
        p = lib["projected_1000x32k"]
        rows = [
            ("model", f"{lib['layers']} layers, {lib['params'] / 1e9:.2f} B params, calib {lib['calib']}"),
            ("plain BF16 forward / sample", f"{lib['plain_forward_per_sample_s']:.3f} s"),
            ("calibrate / sample (steady)", f"{lib['calibrate_steady_per_sample_s']:.3f} s "
                                            f"({lib['calibrate_over_plain']:.3f}x plain, "
                                            f"{lib['calibrate_steady_tokens_per_s']:,.0f} tok/s)"),
            ("quantize", f"{lib['quantize_s']:.2f} s ({lib['quantize_tb_per_s']:.2f} TB/s of BF16 weights)"),
            ("  compile beside calibrate / wait", f"{lib.get('compile_beside_calibrate_s') or 0:.2f} s / {lib.get('compile_wait_s') or 0:.2f} s"),
            ("  bare NVFP4 kernels (+ SQNR terms)", f"{lib.get('bare_quantize_kernels_s', float('nan')):.3f} s "
                                                    f"({lib.get('bare_quantize_with_terms_kernels_s', float('nan')):.3f} s)"),
            ("export", f"{lib['export_s']:.2f} s ({lib['export_gb_per_s']:.2f} GB/s)"),
            ("peak GPU / host RSS", f"{lib['peak_gpu_gib'] or 0:.1f} GiB / {lib['peak_host_rss_gb']:.1f} GB"),
            ("1000x32k: plain forward", f"{p['plain_forward_s'] / 60:.1f} min"),
            ("1000x32k: fp4kit w/o load", f"{p['without_load_s'] / 60:.1f} min "
                                          f"({p['ratio_to_plain_without_load']:.3f}x plain)"),
        ]
        if "end_to_end_s" in p:
            rows.append(("1000x32k: fp4kit end to end", f"{p['end_to_end_s'] / 60:.1f} min ({p['ratio_to_plain']:.3f}x plain)"))
        for k, v in rows:
            print(f"{k:<36}{v}")
    cli = doc.get("cli")
    if cli:
        print(f"{'CLI whole process':<36}{cli['wall_s']:.1f} s; stages {cli['stages_s']}")
        print(f"{'CLI load vs from_pretrained':<36}{cli['stages_s'].get('load', float('nan')):.1f} s vs "
              f"{cli['hf_from_pretrained_device_map_s']:.1f} s ({cli['load_over_hf']:.2f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", default="16x32k", help="calibration NxL (k = 1024), as for fp4kit quantize")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers of the Nano pattern (default: all 52)")
    ap.add_argument("--recipe", default="nemotron-h-w4a16-4o6")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--plain-samples", type=int, default=3, help="samples for the plain-forward floor (the first is warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=None, help="where the checkpoint is written (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    ap.add_argument("--save-bf16", default=None, metavar="DIR", help="only build the model and save it as a BF16 folder")
    ap.add_argument("--cli", default=None, metavar="DIR", help="run `fp4kit quantize --model DIR` and time it")
    ap.add_argument("--profile", action="store_true", help="record where the quantize and export stages spend host time")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke run of the same flow with the torch backend (use a small --layers and --calib)")
    ap.add_argument("--results", default=None, help="results file (default benchmarks/results/dry-run-<gpu>.json)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU here; --device cpu runs a smoke run of the same flow", file=sys.stderr)
        return 2
    command = "python scripts/dry_run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.save_bf16:
        info = save_bf16(args)
        print(f"saved {info['layers']} layers, {info['bytes'] / 1e9:.1f} GB in {info['save_s']:.1f} s to {args.save_bf16}")
        return 0
    section, data = ("cli", cli_run(args)) if args.cli else (library_section(), library_run(args))
    path = merge_results(section, data, command, args.results)
    table(json.loads(path.read_text()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
