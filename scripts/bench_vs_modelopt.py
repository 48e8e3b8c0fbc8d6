"""fp4kit against nvidia-modelopt on the same BF16 folder and calibration tokens, each as its own process.

    python scripts/bench_vs_modelopt.py MODEL_DIR --calib 8x32k [--out-dir DIR]

fp4kit runs as a user runs it (`fp4kit quantize --recipe modelopt-lightning`, the recipe that
is exactly ModelOpt 0.47's `w4a16_nvfp4_4o6`); ModelOpt runs that recipe in a child process
(`--modelopt-child`): import, load (`from_pretrained(device_map="cuda")`), `mtq.quantize` with a
forward loop over the same calibration tokens (fp4kit's calibration set for the same spec, source
and seed), `export_hf_checkpoint`. Both are timed as whole processes and by stage; then every
tensor name the two checkpoints share is compared byte for byte, by tensor class. Writes
benchmarks/results/vs-modelopt-<gpu>.json (a section per model folder, calibration and Mamba path:
"+mamba-kernels" where mamba-ssm and causal-conv1d import; "+fresh-triton-cache" with
`--triton-cache fresh`, each process then compiling its Triton kernels from an empty cache
instead of sharing the environment's; "+compiled-bytecode" where the import path was
byte-compiled before either tool ran, the default: `--bytecode`) and prints a table.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIGHTNING_RECIPE = "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/ptq/w4a16_nvfp4_4o6.yaml"


TARGET_SAMPLES = 1000  # the user's --calib 1000x32k


def child_env(triton_cache: str) -> dict | None:
    """The environment of one tool's process: this one's ("shared": Triton's compiled kernels on
    disk serve both, so the tool run second finds what the first compiled, mamba-ssm's kernels
    among them), or with an empty Triton cache of its own ("fresh": each tool compiles what it
    runs, as on a machine that has never run either)."""
    if triton_cache == "shared":
        return None
    if triton_cache != "fresh":
        raise ValueError(f"--triton-cache must be 'shared' or 'fresh', got {triton_cache!r}")
    cache = tempfile.mkdtemp(prefix="fp4kit-vs-modelopt-triton-")
    atexit.register(shutil.rmtree, cache, True)  # removed however the comparison ends
    return {**os.environ, "TRITON_CACHE_DIR": cache}


def compile_bytecode(paths: list[str]) -> float:
    """Byte-compile every writable directory among `paths` (the import path the two processes
    share), as pip does when it installs a package, before either tool is timed. Otherwise the
    tool run first compiles every module it imports that has no bytecode yet (an environment
    installed with `pip install --no-compile`: seconds for transformers) and the tool run second
    finds them compiled. Returns the seconds it took (untimed for both tools)."""
    dirs = [d for d in dict.fromkeys(paths) if d and os.path.isdir(d) and os.access(d, os.W_OK)]
    t0 = time.perf_counter()
    if dirs:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def projected(result: dict) -> dict:
    """Both tools at TARGET_SAMPLES samples of the measured length: the measured process plus the
    samples it did not run at its steady calibration rate (per sample after the first: fp4kit's
    `calibration:` line, the median of ModelOpt's timed forwards after the first). Results without
    those rates (older runs) take each tool's mean rate over its whole calibration forward, the
    first sample's warm-up included."""
    from fp4kit.calibration import parse_calib_spec

    n = parse_calib_spec(result["calib"]).samples
    fk, mo = result["fp4kit"], result["modelopt"]
    fk_rate, mo_rate = fk.get("calibrate_s_per_sample"), mo["stages_s"].get("calibration_forward_steady_s")
    if fk_rate is not None and mo_rate is not None:
        out = {"samples": TARGET_SAMPLES, "rate": "steady, after the first sample",
               "fp4kit_s": fk["wall_s"] + (TARGET_SAMPLES - n) * fk_rate,
               "modelopt_s": mo["wall_s"] + (TARGET_SAMPLES - n) * mo_rate}
    else:
        fk_cal, mo_cal = fk["stages_s"]["calibrate"], mo["stages_s"]["calibration_forward_s"]
        out = {"samples": TARGET_SAMPLES, "rate": "mean over the calibration forward",
               "fp4kit_s": fk["wall_s"] - fk_cal + fk_cal / n * TARGET_SAMPLES,
               "modelopt_s": mo["wall_s"] - mo_cal + mo_cal / n * TARGET_SAMPLES}
    out["speedup"] = out["modelopt_s"] / out["fp4kit_s"]
    return out


def modelopt_child(args) -> None:
    """Runs in its own process; prints one JSON line of stage times."""
    t_start = time.perf_counter()
    import torch
    import modelopt.torch.quantization as mtq
    from modelopt.recipe import load_recipe
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp4kit.calibration import build_calibration_set, parse_calib_spec

    t_import = time.perf_counter() - t_start
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cuda").eval()
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(args.model)
    samples = build_calibration_set(tok, parse_calib_spec(args.calib), None, seed=0, allow_repeat=True, progress=False)
    cfg = load_recipe(LIGHTNING_RECIPE).quantize.model_dump()
    forward_s = []

    def forward_loop(m):
        with torch.no_grad():
            for i in range(samples.shape[0]):
                torch.cuda.synchronize()
                t = time.perf_counter()
                m(input_ids=samples[i : i + 1].cuda(), use_cache=False)
                torch.cuda.synchronize()
                forward_s.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    mtq.quantize(model, cfg, forward_loop)
    torch.cuda.synchronize()
    t_quantize = time.perf_counter() - t0
    t0 = time.perf_counter()
    export_hf_checkpoint(model, export_dir=args.modelopt_child)
    t_export = time.perf_counter() - t0
    print("MODELOPT_JSON " + json.dumps({
        "import_s": t_import, "load_s": t_load, "calibration_forward_s": sum(forward_s),
        "calibration_forward_steady_s": statistics.median(forward_s[1:] or forward_s),
        "weight_calibration_s": t_quantize - sum(forward_s), "quantize_total_s": t_quantize, "export_s": t_export,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}))


def tensor_class(name: str) -> str:
    kind = name.rsplit(".", 1)[-1]
    if ".experts." in name and ".shared_experts." not in name:
        where = "routed_experts"
    elif ".shared_experts." in name:
        where = "shared_experts"
    elif "in_proj" in name or "out_proj" in name:
        where = "mamba_in_out_proj"
    elif name.endswith(("k_scale", "v_scale")):
        where = "kv_cache"
    elif "lm_head" in name:
        where = "lm_head"
    else:
        where = "other"
    return f"{where}.{kind}"


def raw(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def compare_checkpoints(a: Path, b: Path) -> dict:
    from fp4kit.export.checkpoint import CheckpointReader

    ra, rb = CheckpointReader(a), CheckpointReader(b)
    na, nb = set(ra.names()), set(rb.names())
    classes: dict[str, Counter] = {}
    for name in sorted(na & nb):
        ta, tb = ra.get(name), rb.get(name)
        same = ta.dtype == tb.dtype and ta.shape == tb.shape and raw(ta).equal(raw(tb))
        c = classes.setdefault(tensor_class(name), Counter())
        c["tensors"] += 1
        c["identical"] += int(same)
    return {"only_fp4kit": sorted(na - nb)[:20], "only_fp4kit_count": len(na - nb),
            "only_modelopt": sorted(nb - na)[:20], "only_modelopt_count": len(nb - na),
            "classes": {k: dict(v) for k, v in sorted(classes.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="BF16 model folder (with a tokenizer)")
    ap.add_argument("--calib", default="8x32k")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep both checkpoints (default: removed after the comparison)")
    ap.add_argument("--triton-cache", choices=("shared", "fresh"), default="shared",
                    help="shared: both processes use the environment's Triton cache; fresh: each gets an empty one")
    ap.add_argument("--bytecode", choices=("compiled", "as-is"), default="compiled",
                    help="compiled: every writable directory on the import path byte-compiled first, untimed; "
                         "as-is: the tool run first compiles what it imports")
    ap.add_argument("--modelopt-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.modelopt_child:
        modelopt_child(args)
        return 0
    import torch

    from fp4kit.models.nemotron_h import mamba_kernels

    kernels = mamba_kernels()  # both processes run in this environment: the same Mamba path
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="fp4kit-vs-modelopt-"))
    fk_dir, mo_dir = out / "fp4kit", out / "modelopt"
    cmd = ["fp4kit", "quantize", "--model", args.model, "--recipe", "modelopt-lightning", "--calib", args.calib,
           "--device", "cuda", "-o", str(fk_dir), "--overwrite", "--allow-repeat", "--no-progress"]
    envs = [child_env(args.triton_cache) for _ in range(2)]
    bytecode_s = compile_bytecode(sys.path) if args.bytecode == "compiled" else None
    t0 = time.perf_counter()
    fk = subprocess.run(cmd, capture_output=True, text=True, env=envs[0])
    fk_wall = time.perf_counter() - t0
    if fk.returncode:
        raise SystemExit(f"fp4kit failed:\n{fk.stdout[-3000:]}\n{fk.stderr[-3000:]}")
    fk_stages = {k.strip(): float(v) for k, v in re.findall(r"([a-z ]+?) ([0-9.]+)s", fk.stdout.split("time:", 1)[1].splitlines()[0])}
    steady = re.search(r"^calibration: ([0-9.]+) s per sample after the first", fk.stdout, re.M)
    t0 = time.perf_counter()
    mo = subprocess.run([sys.executable, __file__, args.model, "--calib", args.calib, "--modelopt-child", str(mo_dir)],
                        capture_output=True, text=True, env=envs[1])
    mo_wall = time.perf_counter() - t0
    if mo.returncode:
        raise SystemExit(f"modelopt failed:\n{mo.stdout[-3000:]}\n{mo.stderr[-3000:]}")
    mo_stages = json.loads(mo.stdout.split("MODELOPT_JSON ", 1)[1].splitlines()[0])
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "command": "python scripts/bench_vs_modelopt.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "fp4kit_command": " ".join(cmd), "calib": args.calib, "mamba_kernels": kernels, "triton_cache": args.triton_cache,
        "bytecode": args.bytecode, "bytecode_compile_s": bytecode_s,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "modelopt": __import__("modelopt").__version__, "gpu": torch.cuda.get_device_name()},
        "fp4kit": {"wall_s": fk_wall, "stages_s": fk_stages, "calibrate_s_per_sample": float(steady[1]) if steady else None},
        "modelopt": {"wall_s": mo_wall, "stages_s": mo_stages},
        "speedup_whole_process": mo_wall / fk_wall,
        "bytes": compare_checkpoints(fk_dir, mo_dir),
    }
    result["projected_1000_samples"] = projected(result)
    if not args.keep:
        shutil.rmtree(fk_dir, ignore_errors=True)
        shutil.rmtree(mo_dir, ignore_errors=True)
    gpu = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    path = ROOT / "benchmarks" / "results" / f"vs-modelopt-{gpu}.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    # One section per folder and calibration, per Mamba path (transformers' plain torch, or
    # mamba-ssm's and causal-conv1d's kernels where both import) and per Triton cache.
    section = (Path(args.model).name + "@" + args.calib + ("+mamba-kernels" if all(kernels.values()) else "")
               + ("+fresh-triton-cache" if args.triton_cache == "fresh" else "")
               + ("+compiled-bytecode" if args.bytecode == "compiled" else ""))
    doc[section] = result
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'':<10}{'whole s':>9}  stages")
    print(f"{'fp4kit':<10}{fk_wall:>9.1f}  {fk_stages}")
    print(f"{'modelopt':<10}{mo_wall:>9.1f}  { {k: round(v, 1) for k, v in mo_stages.items()} }")
    p = result["projected_1000_samples"]
    print(f"speedup {mo_wall / fk_wall:.2f}x; at {p['samples']} samples {p['speedup']:.2f}x "
          f"({p['fp4kit_s'] / 60:.1f} min against {p['modelopt_s'] / 60:.1f} min)")
    for k, c in result["bytes"]["classes"].items():
        print(f"  {k:<40}{c['identical']:>6} / {c['tensors']}")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
