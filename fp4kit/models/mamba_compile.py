"""mamba-ssm's Triton kernels for a Nemotron-H model, compiled in worker processes while it loads.

On the first forward at a new shape, mamba-ssm autotunes each kernel of its chunked scan over a
list of launch configurations, and Triton compiles every configuration in turn in the calling
process. On a machine whose Triton cache is empty that is most of the first calibration
sample. Compiling does not need the model, only the Mamba mixer's shapes, so `MambaPrecompile`
starts a few worker processes before the weights load. Each builds one mixer from the model's
config, takes its share of every autotuned kernel's configurations and runs the mixer once,
compiling that share into Triton's on-disk cache (TRITON_CACHE_DIR, shared by the processes).
The calibration's own first forward then still times every configuration on the GPU and picks
the fastest, as it would have, but finds each one compiled.

Workers never time anything: a configuration that runs once is compiled, and timings taken while
the main process copies weights to the same GPU would be noise. Their only output is Triton's
cache; a worker that fails costs nothing but the compile it did not do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_WORKERS = 8
# The modules of mamba-ssm's chunked scan whose kernels carry @triton.autotune.
SCAN_MODULES = (
    "mamba_ssm.ops.triton.ssd_chunk_state",
    "mamba_ssm.ops.triton.ssd_state_passing",
    "mamba_ssm.ops.triton.ssd_bmm",
    "mamba_ssm.ops.triton.ssd_chunk_scan",
)
# Their forward kernels and how many configurations mamba-ssm 2.3 autotunes each over: a Triton
# cache holding that many compiled binaries of each has compiled them before.
SCAN_KERNELS = {"_chunk_cumsum_fwd_kernel": 7, "_chunk_state_fwd_kernel": 9, "_state_passing_fwd_kernel": 6,
                "_bmm_chunk_fwd_kernel": 9, "_chunk_scan_fwd_kernel": 11}
MAMBA_LAYER_TYPES = ("mamba", "linear_attention")  # transformers 5.18 renames "mamba" to "linear_attention"
SPECIALISED = 16  # Triton compiles an int argument apart when it is 1 or a multiple of 16


def compile_length(seq_len: int, chunk_size: int) -> int:
    """A sequence length no longer than `seq_len` whose mixer forward launches the chunked-scan
    kernels with the same compiled variants: Triton specialises each int argument on being 1 or a
    multiple of 16, and the lengths that reach the kernels are the length itself, the number of
    chunks, and strides that carry either as a factor. Keeping the length mod 16 * chunk_size (and
    at least 16 chunks once there are that many) keeps all of them, so a 32K sample's kernels
    compile on 2K tokens."""
    period = SPECIALISED * chunk_size
    if seq_len <= period:
        return seq_len
    return period + seq_len % period


def share(configs: list, part: int, parts: int) -> list:
    """Worker `part` of `parts`'s share of one kernel's configurations: every parts-th one. A
    worker past the end of a short list still needs one to run the mixer through, and takes one
    that another worker also compiles."""
    mine = configs[part::parts]
    return mine or [configs[part % len(configs)]]


def _autotuner(obj, depth: int = 4):
    """The triton Autotuner in a module attribute (under triton.heuristics wrappers), or None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(depth):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _run_once(fn, *args, quantiles=None, **kwargs):
    """A benchmark that runs the kernel once, to compile it, and reports no time."""
    fn()
    return [0.0] * len(quantiles) if quantiles else 0.0


def take_share(modules, part: int, parts: int) -> int:
    """Gives this worker its share of each autotuned kernel in `modules`, to be compiled by one
    launch each and never timed. Returns the number of configurations it will compile."""
    seen, count = set(), 0
    for module in modules:
        for obj in list(vars(module).values()):
            tuner = _autotuner(obj)
            if tuner is None or id(tuner) in seen or not tuner.configs:
                continue
            seen.add(id(tuner))
            tuner.configs = share(list(tuner.configs), part, parts)
            tuner.cache_results = False  # the one-launch "timings" must not reach Triton's autotune cache
            tuner.do_bench = _run_once  # shadows the benchmarker (an attribute or a cached property)
            count += len(tuner.configs)
    return count


def mixer_for(model_ref: str, device: str):
    """The model's first Mamba mixer, as transformers builds it, in bf16 on `device`, with
    initial weights (compiling needs its shapes and dtypes, not its values)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    config = AutoConfig.from_pretrained(model_ref)
    layer = next(i for i, kind in enumerate(config.layer_types) if kind in MAMBA_LAYER_TYPES)
    with torch.device(device):
        return m.NemotronHMamba2Mixer(config, layer_idx=layer).to(torch.bfloat16).eval()


def run_mixer(mixer, batch: int, seq_len: int) -> None:
    import torch

    x = torch.randn(batch, seq_len, mixer.hidden_size, dtype=torch.bfloat16, device=mixer.in_proj.weight.device)
    with torch.no_grad():
        mixer(x)
    torch.cuda.synchronize()


def _worker(model_ref: str, device: str, seq_len: int, batch: int, part: int, parts: int) -> int:
    import torch

    if device == "cuda":
        device = "cuda:0"
    count = take_share([importlib.import_module(name) for name in SCAN_MODULES], part, parts)
    torch.cuda.set_device(device)
    mixer = mixer_for(model_ref, device)
    run_mixer(mixer, batch, compile_length(seq_len, mixer.chunk_size))
    return count


def _read_config(model_ref: str) -> dict | None:
    folder = Path(model_ref).expanduser()
    path = folder / "config.json" if folder.is_dir() else None
    if path is None:  # a hub id: its config only when already downloaded (no network here)
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model_ref, "config.json")
        except Exception:
            found = None
        path = Path(found) if isinstance(found, str) else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def triton_cache_dir() -> Path:
    """The folder Triton keeps compiled kernels in (TRITON_CACHE_DIR, else under TRITON_HOME or ~)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def compiled_before(cache: Path) -> bool:
    """Whether `cache` already holds each chunked-scan kernel in at least as many compiled
    binaries as it has configurations: then the first forward loads them from there, and workers
    would only add their start-up to the wait. (Binaries compiled for another model's widths
    count too; that model's first forward then compiles what it lacks, as without workers.)"""
    if not cache.is_dir():
        return False
    found = dict.fromkeys(SCAN_KERNELS, 0)
    for entry in cache.glob("*/*.cubin"):
        if entry.stem in found:
            found[entry.stem] += 1
    return all(found[name] >= configs for name, configs in SCAN_KERNELS.items())


def wanted(model_ref: str, device: str, seq_len: int, *, trust_remote_code: bool = False) -> bool:
    """Whether precompiling pays here: a Nemotron-H run by transformers' own code, on a GPU,
    calibrating in the chunked scan (2+ tokens), with mamba-ssm and causal-conv1d installed (the
    kernels transformers then calls) and triton beside them, and Triton's cache not holding them
    compiled already (`compiled_before`). Not under `--device auto`: the
    workers' CUDA contexts would take GPU memory that accelerate measures while placing a model
    too large for the GPU."""
    if not device.startswith("cuda") or seq_len < 2:
        return False
    config = _read_config(model_ref)
    if not config or config.get("model_type") != "nemotron_h":
        return False
    if trust_remote_code and "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return False  # the repository's own mixer may call the kernels differently
    if any(importlib.util.find_spec(name) is None for name in ("mamba_ssm", "causal_conv1d", "triton")):
        return False
    import torch

    return torch.cuda.is_available() and not compiled_before(triton_cache_dir())


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 2) // 2))


# GPU memory one worker may take: its CUDA context, one mixer's weights and the activations of a
# compile_length forward, rounded up.
WORKER_GPU_BYTES = 1 << 30


def weight_bytes(model_ref: str) -> int | None:
    """The bytes of a model folder's weight files (what its BF16 weights take on the GPU), or None."""
    folder = Path(model_ref)
    if not folder.is_dir():
        return None
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files) or None


def workers_that_fit(free: int, weights: int | None, most: int) -> int:
    """How many workers fit in `free` bytes of GPU memory while `weights` bytes of model load
    beside them: the model and a tenth of it on top come first, then WORKER_GPU_BYTES a worker."""
    if weights is None:
        return most
    return max(0, min(most, (free - weights - weights // 10) // WORKER_GPU_BYTES))


def workers_for(model_ref: str, device: str) -> tuple[int, int, int | None]:
    """(workers, free GPU bytes, model bytes): as many workers as default_workers() allows and
    the GPU has room for beside the model the job is about to load."""
    most = default_workers()
    if not device.startswith("cuda"):
        return most, 0, None
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    weights = weight_bytes(model_ref)
    return workers_that_fit(free, weights, most), free, weights


@dataclass
class MambaPrecompile:
    """Worker processes compiling mamba-ssm's kernels for `model_ref`'s Mamba mixer at `seq_len`
    tokens and `batch` rows. start() returns at once; wait() blocks until they end (or `timeout`)
    and returns the seconds it waited; failures() names the workers that failed. As a context
    manager, it stops any worker still running on exit."""

    model_ref: str
    device: str
    seq_len: int
    batch: int = 1
    workers: int = field(default_factory=default_workers)
    procs: list = field(default_factory=list)
    logs: list = field(default_factory=list)
    started: float = 0.0
    seconds: float = 0.0

    def command(self, part: int) -> list[str]:
        return [sys.executable, "-m", __name__, "--model", self.model_ref, "--device", self.device,
                "--seq-len", str(self.seq_len), "--batch", str(self.batch), "--part", str(part), "--parts", str(self.workers)]

    def start(self) -> MambaPrecompile:
        self.started = time.perf_counter()
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        for part in range(self.workers):
            log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker never blocks on it
            self.logs.append(log)
            self.procs.append(subprocess.Popen(self.command(part), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=log, env=env))
        return self

    def wait(self, timeout: float = 300.0) -> float:
        t0 = time.perf_counter()
        deadline = t0 + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                break
        self.stop()
        self.seconds = time.perf_counter() - self.started
        return time.perf_counter() - t0

    def failures(self) -> list[str]:
        out = []
        for part, proc in enumerate(self.procs):
            if proc.returncode not in (0, None):
                self.logs[part].seek(0)
                err = self.logs[part].read()
                last = next((line for line in reversed(err.strip().splitlines()) if line.strip()), "no message")
                out.append(f"worker {part} exited {proc.returncode}: {last.strip()}")
        return out

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def __enter__(self) -> MambaPrecompile:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        for log in self.logs:
            log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--part", type=int, required=True)
    p.add_argument("--parts", type=int, required=True)
    a = p.parse_args(argv)
    _worker(a.model, a.device, a.seq_len, a.batch, a.part, a.parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
