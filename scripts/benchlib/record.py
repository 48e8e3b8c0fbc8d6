"""The record every results file under benchmarks/results/ starts with: `date` (UTC), the
`command` that wrote it (the script's path from the repository root and its arguments) and the
`versions` of what it ran on (python, the installed torch, triton, transformers, nvidia-modelopt,
fp4kit, mamba-ssm and causal-conv1d, CUDA, the GPU's name). tests/test_results_provenance.py checks every committed file
for these three fields.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import re
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "triton", "transformers", "nvidia-modelopt", "fp4kit", "mamba-ssm", "causal-conv1d")


def command_line(argv: list[str] | None = None) -> str:
    """`python <script> <args>` for this process, the script's path relative to the repository."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        argv[0] = script.relative_to(ROOT).as_posix()
    return "python " + shlex.join(argv)


def versions() -> dict:
    """Python, each installed package of PACKAGES (None where it is not installed), CUDA, GPU."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out["torch"] is not None:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return out


def run_record(argv: list[str] | None = None) -> dict:
    """{"date", "command", "versions"} of this run, to start a results file with."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "command": command_line(argv), "versions": versions()}



def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200": the suffix of a results file's name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def write_results(doc: dict, stem: str, device_name: str, *, out: str | None = None, smoke: bool = False) -> Path:
    """Writes a results file and returns its path: `out` if given, else a temporary file for a smoke
    run, else benchmarks/results/<stem>-<gpu slug>.json."""
    if out is not None:
        path = Path(out)
    elif smoke:
        path = Path(tempfile.mkdtemp(prefix=f"fp4kit-{stem}-")) / f"{stem}-{gpu_slug(device_name)}.json"
    else:
        path = ROOT / "benchmarks" / "results" / f"{stem}-{gpu_slug(device_name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
