"""The pipeline: load -> calibrate -> quantize -> export.

`quantize(model, recipe, samples)` is the one verb; `run(...)` wraps it with loading, the
calibration set and the export for the CLI.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from . import parallel
from .calibrate import Observers, Statistics, fitting_batch, measured_forward
from .formats import FormatError, fp8, nvfp4
from .formats.arith import DEFAULT_ARITH, check_mode, div_const
from .formats.constants import FP8_MAX, NVFP4_GLOBAL_DENOM
from .formats.metrics import Terms, sqnr_db_of, sqnr_terms
from .kernels.backend import BACKENDS
from .kernels.deferred import failing, queue as queue_checks, to_device
from .models import Role, adapter_for, mamba_compile
from .models.roles import input_device
from .plan import Planned, QuantizedModel, QuantizedTarget, fused_group_amax, plan_targets
from .recipe import DEFAULT_RECIPE, QUANT_ALGO, Recipe, Rule


class CalibState:
    """Periodic snapshots of the calibration statistics, so that a killed run can resume.

    The snapshot holds the statistics after the first `done` samples and a fingerprint of
    everything that decides them (model, recipe, calibration spec, source, seed, batch size); a
    resumed run with a different fingerprint is refused. Statistics are maxima, counts and exact
    sums, so resuming gives the same bytes as an uninterrupted run. A data-parallel run keeps one
    snapshot per rank (`for_rank`).
    """

    def __init__(self, folder: Path, fingerprint: dict, every: int = 8) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.every = max(1, every)

    @staticmethod
    def read(folder: Path) -> dict | None:
        """The snapshot's record ({"fingerprint", "done"}), or None where there is none."""
        import json

        meta = Path(folder) / "state.json"
        if not meta.is_file():
            return None
        try:
            saved = json.loads(meta.read_text())
            int(saved["done"])
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"--resume: the calibration snapshot in {folder} is damaged; remove it and run without --resume") from None
        return saved

    def saved_samples(self) -> int | None:
        """How many samples the snapshot holds; None without one; raises if its settings differ."""
        saved = self.read(self.folder)
        if saved is None:
            return None
        if saved.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"--resume: the saved calibration in {self.folder} was made with different settings "
                f"({saved.get('fingerprint')}); remove it or run without --resume"
            )
        return int(saved["done"])

    def load(self) -> tuple[Statistics, int] | None:
        from safetensors.torch import load_file

        done = self.saved_samples()
        if done is None:
            return None
        name = self.read(self.folder).get("stats", "stats.safetensors")
        try:
            return Statistics.from_state_dict(load_file(str(self.folder / name))), done
        except Exception as exc:  # safetensors raises an error type of its own for a damaged file
            raise ValueError(f"--resume: the calibration snapshot in {self.folder} is damaged ({exc}); "
                             "remove it and run without --resume") from None

    def for_rank(self, rank: int, world: int) -> "CalibState":
        """The snapshot of one rank of a data-parallel run: a folder of its own, and the number of
        ranks in the fingerprint (a resumed run must have as many)."""
        return CalibState(self.folder / f"rank-{rank}-of-{world}", {**self.fingerprint, "ranks": world}, self.every)

    def rank_counts(self) -> set[int]:
        """The numbers of ranks of the data-parallel runs whose snapshots the folder holds."""
        import re

        found = set()
        for sub in self.folder.glob("rank-*-of-*"):
            m = re.fullmatch(r"rank-(\d+)-of-(\d+)", sub.name)
            if m and (sub / "state.json").is_file():
                found.add(int(m[2]))
        return found

    @classmethod
    def read_any(cls, folder: Path) -> dict | None:
        """The record of a one-process snapshot, or for a data-parallel run's per-rank snapshots
        ({"done": the samples all ranks hold}); None where there is neither."""
        saved = cls.read(folder)
        worlds = cls(folder, {}).rank_counts()
        if saved is not None or not worlds:
            return saved
        world = max(worlds)
        parts = [cls.read(Path(folder) / f"rank-{r}-of-{world}") for r in range(world)]
        return {"done": sum(int(p["done"]) for p in parts if p is not None)}

    def batch_size(self) -> int | None:
        """The batch size the snapshot's run calibrated with (data-parallel runs record it)."""
        saved = self.read(self.folder)
        return None if saved is None or saved.get("batch_size") is None else int(saved["batch_size"])

    def save(self, stats: Statistics, done: int, batch_size: int | None = None) -> None:
        import json
        import os

        from safetensors.torch import save_file

        # The statistics go to a file named by the sample count, and state.json, replaced last, names
        # it: a run killed at any point leaves a record and statistics that belong together.
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"stats-{done}.safetensors"
        tmp = self.folder / (name + ".tmp")
        save_file(stats.state_dict(), str(tmp))
        os.replace(tmp, self.folder / name)
        meta_tmp = self.folder / "state.json.tmp"
        meta = {"fingerprint": self.fingerprint, "done": done, "stats": name}
        if batch_size is not None:
            meta["batch_size"] = batch_size
        meta_tmp.write_text(json.dumps(meta))
        os.replace(meta_tmp, self.folder / "state.json")
        for old in self.folder.glob("stats*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def clear(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def _forward_shard(model: nn.Module, samples: torch.Tensor, batch_size: int | str, progress: bool, stats: Statistics,
                   start: int, state: CalibState | None, rank: int, world: int) -> int:
    """This rank's share of the calibration forward (`parallel`): the batches one process would run,
    batch k on rank k mod world; `start` is how many samples of its share this rank has done (a
    resumed run). Returns the batch size."""
    device = input_device(model)
    n, seq = samples.shape
    auto = batch_size == AUTO_BATCH
    first_alone = auto and device.type == "cuda"
    saved = state.batch_size() if state is not None and start else None
    measured = False
    if first_alone:  # rank 0 measures on sample 0, as one process does, and tells the others
        size = saved or 0
        if rank == 0 and not start:
            batch = samples[0:1].to(device)
            with torch.inference_mode():
                added, free = measured_forward(model, batch)
            size, measured = fitting_batch(added, free, n - 1), True
            if progress:
                tqdm.write(f"batch size auto: {size} (one sample adds {added / 2**30:.2f} GiB at its peak; {free / 2**30:.1f} GiB free)")
        size = parallel.broadcast_int(size, device)
        if saved is not None and saved != size:
            raise ValueError(f"--resume: rank {rank}'s calibration snapshot was made with batch size {saved}, this run's is {size}; "
                             "remove the snapshot or give --batch-size")
    else:
        size = 1 if auto else batch_size
    mine = parallel.shard(parallel.batch_layout(n, size, first_alone), rank, world)
    total = sum(b - a for a, b in mine)
    bar = tqdm(total=total * seq, initial=start * seq, desc=f"calibrate ({n} x {seq}, rank {rank} of {world})",
               unit="tok", unit_scale=True, disable=not progress)
    done = batches = 0
    with torch.inference_mode():
        for a, b in mine:
            if done + (b - a) <= start:  # in the snapshot this run resumed from
                done += b - a
                batches += 1
                continue
            if not (measured and (a, b) == (0, 1)):  # else the measuring forward was this batch
                model(input_ids=samples[a:b].to(device), use_cache=False, logits_to_keep=1)
            done += b - a
            batches += 1
            bar.update((b - a) * seq)
            if state is not None and (batches % state.every == 0 or done == total):
                state.save(stats, done, batch_size=size)
    bar.close()
    return size


class BatchClock:
    """Each calibration batch's time without a wait for the device: CUDA events on a GPU (read
    once, at the end), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list = []
        self.rows: list[int] = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the model's GPU, which need not be the current one
        return event

    def start(self) -> None:
        self.marks = [self._mark()]

    def lap(self, rows: int) -> None:
        self.marks.append(self._mark())
        self.rows.append(rows)

    def per_sample(self) -> list[float]:
        """Seconds per sample of each batch run."""
        if self.cuda and len(self.marks) > 1:
            self.marks[-1].synchronize()
        pairs = zip(self.marks, self.marks[1:])
        seconds = [a.elapsed_time(b) * 1e-3 if self.cuda else b - a for a, b in pairs]
        return [t / r for t, r in zip(seconds, self.rows)]

    def steady(self) -> float | None:
        """The median seconds per sample after the first batch (its lazy compiles and allocations),
        or of the one batch there was; None before any, or where the device cannot time them (the
        figure is a report, never a reason for the job to fail)."""
        try:
            each = self.per_sample()
        except RuntimeError:
            return None
        return statistics.median(each[1:] or each) if each else None


def _forward_samples(model: nn.Module, samples: torch.Tensor, batch_size: int | str, progress: bool, stats: Statistics,
                     start: int = 0, state: CalibState | None = None, clock: BatchClock | None = None) -> int:
    """Runs the calibration forward over samples[start:]; returns the batch size used. With
    batch_size "auto" on a CUDA device the first sample runs alone and its peak memory sets the
    batch for the rest (`calibrate.fitting_batch`); on other devices "auto" is 1. `clock` times
    each batch."""
    device = input_device(model)
    n, seq = samples.shape
    auto = batch_size == AUTO_BATCH
    size = 1 if auto else batch_size
    # Counted in tokens, so the bar shows tokens/s and the time left.
    bar = tqdm(total=samples.numel(), initial=start * seq, desc=f"calibrate ({n} x {seq})", unit="tok",
               unit_scale=True, disable=not progress)
    batches, i = 0, start
    if clock is not None:
        clock.start()
    with torch.inference_mode():
        while i < n:
            batch = samples[i : i + size].to(device)
            if auto and batches == 0 and device.type == "cuda":
                added, free = measured_forward(model, batch)
                size = fitting_batch(added, free, n - i - 1)
                if progress:
                    bar.write(f"batch size auto: {size} (one sample adds {added / 2**30:.2f} GiB at its peak; {free / 2**30:.1f} GiB free)")
            else:
                model(input_ids=batch, use_cache=False, logits_to_keep=1)
            if clock is not None:
                clock.lap(batch.shape[0])
            bar.update(batch.numel())
            batches += 1
            i += batch.shape[0]
            # Every `every` batches, and once calibration is complete: a run stopped while it
            # quantizes or exports resumes without calibrating again.
            if state is not None and (batches % state.every == 0 or i == n):
                state.save(stats, i)
    bar.close()
    return size


def _nvfp4(w, rule: Rule, global_amax, importance, backend: str, arith: str, deferred: list, terms: list):
    """The NVFP4Tensor; its `Terms` (sum w^2, sum (w - dequantized)^2, blocks on the 4 candidate)
    appended to `terms`. On the GPU the kernel sums those as it quantizes and the data checks go
    to `deferred` (see kernels.quantize.quantize), so no weight waits on the host."""
    if backend == "triton":
        from .kernels import quantize as kq

        return kq.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, importance=importance,
                           arith=arith, deferred=deferred, terms=terms)
    qt, choice = nvfp4.quantize(w, scale_rule=rule.scale_rule, global_amax=global_amax, importance=importance,
                                return_choice=True, arith=arith)
    terms.append(Terms.of(*_nvfp4_error(w, qt), choice.double().sum(), choice.numel()))
    return qt


def _fp8(w: torch.Tensor, arith: str, search, backend: str, deferred: list, terms: list) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 per-tensor (bytes, scale), its (sum w^2, sum (w - dequantized)^2) appended to `terms`
    as partial sums ([rows, 2], added at the read-back);
    on the GPU in one pass without a host wait (kernels.fp8), the finiteness check going to
    `deferred`."""
    if backend == "triton":
        from .kernels import fp8 as kfp8

        return kfp8.quantize_per_tensor(w, arith, amax_multipliers=search, deferred=deferred, terms=terms)
    q, scale = fp8.quantize_per_tensor(w, arith, amax_multipliers=search)
    terms.append(torch.stack(sqnr_terms(w, fp8.dequantize_per_tensor(q, scale))).reshape(1, 2))
    return q, scale


class _Members(Sequence):
    """The members of an expert stack as a sequence of views, each made when it is asked for: a
    stack of hundreds of experts is not split in the quantize stage, the export takes them one
    at a time."""

    def __init__(self, stack: torch.Tensor) -> None:
        self.stack = stack

    def __len__(self) -> int:
        return self.stack.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.stack[j] for j in range(*i.indices(len(self)))]
        return self.stack[i]


def _split(t: torch.Tensor, stack: bool) -> Sequence:
    """One checkpoint tensor per expert of a stack (views; they stay on the weight's device until
    the export streams them out)."""
    t = t.detach()
    return _Members(t) if stack else [t]


def _non_finite_error(t, w: torch.Tensor) -> FormatError:
    bad = ~torch.isfinite(w)
    first = torch.nonzero(bad)[0].tolist()
    name = t.disk_names[first[0]] if t.is_stack else t.disk_names[0]
    where = tuple(first[1:]) if t.is_stack else tuple(first)
    return FormatError(
        f"{name}.weight ({t.role.value}): {int(torch.isnan(w).sum())} NaN and {int(torch.isinf(w).sum())} Inf "
        f"values (first at {where}); non-finite weights cannot be quantized"
    )


def _named(t, w: torch.Tensor, exc: ValueError) -> ValueError:
    """A quantizer's error, naming the checkpoint tensor (and for non-finite weights, the expert
    and the first position)."""
    if not bool(torch.isfinite(w).all()):
        return _non_finite_error(t, w)
    return type(exc)(f"{t.disk_names[0]} ({t.role.value}): {exc}")


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
    """sqnr_terms of w against qt's dequantized values, a few members (or rows) at a time (the
    torch backend; the GPU kernels sum them as they quantize)."""
    if w.dim() < 2:
        return sqnr_terms(w, qt.dequantize())
    stack = w.dim() > 2  # one global scale per member, else one for all rows
    signal = noise = 0
    for sl in _chunks(w.shape[0], w[0].numel()):
        part = nvfp4.NVFP4Tensor(qt.packed[sl], qt.block_scale[sl], qt.global_scale[sl] if stack else qt.global_scale)
        s, n = sqnr_terms(w[sl], part.dequantize())
        signal, noise = signal + s, noise + n
    return signal, noise


class _HostCopy:
    """Tensors on their way to the host, one transfer per device: a GPU's are concatenated and
    copied into pinned memory behind the work queued on its stream so far, without waiting, and
    `get` waits for that copy alone, so the host can go on while later kernels run."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.sizes = [t.numel() for t in tensors]
        self.groups: list[tuple[list[int], torch.Tensor, torch.cuda.Event | None]] = []
        by_device: dict = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for device, idx in by_device.items():
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # dtypes promote
            event = None
            if device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                flat = host
            self.groups.append((idx, flat, event))

    def get(self) -> list[torch.Tensor]:
        out: list = [None] * len(self.sizes)
        for idx, host, event in self.groups:
            if event is not None:
                event.synchronize()
            for i, part in zip(idx, host.split([self.sizes[i] for i in idx])):
                out[i] = part
        return out


def _column_sums(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each [rows, c] tensor's column sums in float64, in a few launches per device and column
    count (a reduction per tensor would be hundreds of small kernels after the last quantize
    kernel)."""
    out: list = [None] * len(parts)
    groups: dict = {}
    for i, part in enumerate(parts):
        groups.setdefault((part.device, part.shape[-1]), []).append(i)
    for (device, cols), idx in groups.items():
        data = torch.cat([parts[i].reshape(-1, cols) for i in idx]).to(torch.float64)
        lengths = to_device(torch.tensor([parts[i].numel() // cols for i in idx]), device)
        # unsafe: the lengths are known to add up (the safe path reads them back to check)
        sums = torch.segment_reduce(data, "sum", lengths=lengths, axis=0, unsafe=True)
        for i, row in zip(idx, sums.unbind(0)):
            out[i] = row
    return out


def quantize_weights(
    plan: list[Planned], stats: Statistics, *, backend: str, progress: bool, warnings: list[str],
    arith: str = DEFAULT_ARITH,
) -> dict[str, QuantizedTarget]:
    """Every planned weight in its format. The quantized tensors stay on the device that quantized them, and
    nothing waits for the GPU per weight (`queue_weights`): the input amaxes, the data checks,
    and the SQNR terms and 4/6 fractions are each read back once at the end (a weight that cannot
    be quantized raises then, named as it would be at once)."""
    out, pending, checks, input_scales = queue_weights(plan, stats, backend=backend, progress=progress,
                                                       warnings=warnings, arith=arith)
    return _read_back_results(out, pending, checks, input_scales, warnings, arith)


def queue_weights(
    plan: list[Planned], stats: Statistics, *, backend: str, progress: bool, warnings: list[str],
    arith: str = DEFAULT_ARITH,
) -> tuple[dict, dict, list, list]:
    """Queue every planned weight's quantization, error terms and data checks; on the GPU this
    never waits for the device (tests/gpu checks it in torch's sync-debug mode). Returns what
    `quantize_weights` reads back."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    group_amax = fused_group_amax(plan)
    out: dict[str, QuantizedTarget] = {}
    pending: dict[str, tuple[torch.Tensor, int | None]] = {}  # partial sums [rows, 2 or 3]; blocks (4/6 rule)
    checks: list[tuple[Planned, list]] = []
    input_scales: list[tuple[list, str, float, int, str]] = []  # (slot, target key, denominator, members, name)
    todo = [p for p in plan if p.rule is not None]
    # The input amaxes go to the host ahead of every quantize kernel: their scales are made on
    # the host while the kernels run (`_read_back_results`).
    amaxes = {p.target.key: a.detach().float() for p in todo
              if p.rule.format in ("nvfp4", "fp8") and (a := stats.input_amax.get(p.target.key)) is not None}
    amax_copy = _HostCopy(list(amaxes.values()))
    # With the Triton kernels every weight is quantized on the GPU, also one that `--device auto`
    # placed on the CPU (copied over for its turn, its statistics with it).
    gpu = next((p.target.weight.device for p in todo if p.target.weight.device.type == "cuda"), None) \
        if backend == "triton" else None
    for p in tqdm(todo, desc="quantize", unit="weight", disable=not progress):
        t, rule = p.target, p.rule
        w = t.weight.detach()
        if gpu is not None and w.device != gpu:
            w = w.to(gpu)
        stack = t.is_stack
        n = w.shape[0] if stack else 1
        algo = QUANT_ALGO[rule.format]
        try:
            if rule.format.startswith("nvfp4"):
                importance = stats.importance(t.key) if rule.importance else None
                if importance is not None and importance.device != w.device:
                    importance = importance.to(w.device)
                if rule.importance and importance is None:
                    warnings.append(f"{t.disk_names[0]}: no E[x^2] was collected; 4/6 uses the plain squared error")
                deferred: list = []
                terms: list = []
                shared = group_amax.get(t.fuse_group)
                qt = _nvfp4(w, rule, None if shared is None else shared.to(w.device), importance, backend, arith, deferred,
                            terms)
                checks.append((p, deferred))
                (part, blocks), = terms
                tensors = {
                    "weight": _split(qt.packed, stack),
                    "weight_scale": _split(qt.block_scale, stack),
                    "weight_scale_2": _split(qt.global_scale, stack),
                }
                if rule.format == "nvfp4":
                    tensors["input_scale"] = []  # filled after the loop (`input_scales`)
                    input_scales.append((tensors["input_scale"], t.key, NVFP4_GLOBAL_DENOM, n, t.disk_names[0]))
                if rule.scale_rule != "4o6":
                    blocks = None
                after = qt.packed.numel() + qt.block_scale.numel() + 4 * qt.global_scale.numel()
            else:
                search = rule.amax_search or None
                members = w.unbind(0) if stack else [w]
                deferred = []
                terms = []
                parts = [_fp8(x, arith, search, backend, deferred, terms) for x in members]
                checks.append((p, deferred))
                tensors = {"weight": [q for q, _ in parts], "weight_scale": [s for _, s in parts], "input_scale": []}
                input_scales.append((tensors["input_scale"], t.key, FP8_MAX, n, t.disk_names[0]))
                part = terms[0] if len(terms) == 1 else torch.cat(terms)
                blocks = None
                after = w.numel() + 4 * n
        except ValueError as exc:
            raise _named(t, w, exc) from None
        pending[t.key] = (part, blocks)
        out[t.key] = QuantizedTarget(
            target=t, rule=rule, algo=algo, tensors=tensors, sqnr_db=float("nan"), frac4=None,
            bytes_before=w.numel() * w.element_size(), bytes_after=after,
        )
    return out, pending, checks, (input_scales, list(amaxes), amax_copy)


def _read_back_results(out: dict, pending: dict, checks: list, input_scales: tuple, warnings: list[str],
                       arith: str) -> dict[str, QuantizedTarget]:
    # The input scales first: their amaxes were copied ahead of the kernels, so this host work
    # overlaps the kernels still running.
    slots, amax_keys, amax_copy = input_scales
    amax_host = dict(zip(amax_keys, amax_copy.get()))
    for slot, key, denom, n, what in slots:
        slot.extend(_input_scale(amax_host.get(key), denom, n, what, warnings, arith))
    # Each weight's error terms added up in float64 and the data checks' flags, queued behind the
    # kernels that write them, then read back in one transfer per device.
    keys = list(pending)
    flat = [(p, c) for p, of_weight in checks for c in of_weight]
    flags = queue_checks([c for _, c in flat])
    host = _HostCopy(_column_sums([pending[key][0] for key in keys]) + [f for f, _ in flags]).get()
    bad = failing(flags, host[len(keys):])
    if bad:  # the first failure's error, named
        p, c = flat[bad[0]]
        try:
            c.fail()
        except ValueError as exc:
            raise _named(p.target, p.target.weight.detach(), exc) from None
    # The error terms and 4/6 fractions of every weight.
    for key, total in zip(keys, host[:len(keys)]):
        signal, noise, *count4 = total.tolist()
        blocks = pending[key][1]
        out[key].sqnr_db = sqnr_db_of(signal, noise)
        out[key].frac4 = None if blocks is None else count4[0] / blocks
    return out


class _KernelWarmUp(threading.Thread):
    """Compiles the Triton kernels the quantize stage will launch while the model calibrates.

    Triton compiles a kernel for each set of constants and argument properties (alignment,
    divisibility by 16) on its first launch, seconds in all for a recipe's shapes, and the
    quantize stage itself takes a fraction of that. This thread runs each distinct launch once,
    on the real weights and on a stream of its own, discarding the results, so the compiles
    overlap the calibration forward instead of adding to the stage. A failure here is ignored:
    the stage itself then reports it."""

    def __init__(self, plan: list[Planned], arith: str) -> None:
        super().__init__(name="fp4kit-kernel-warm-up", daemon=True)
        self.plan, self.arith, self.seconds = plan, arith, 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            seen = set()
            gpu = next((p.target.weight.device for p in self.plan if p.target.weight.device.type == "cuda"), None)
            if gpu is None:
                return
            stream = torch.cuda.Stream(gpu)
            with torch.cuda.stream(stream):
                for p in self.plan:
                    w, rule = p.target.weight.detach(), p.rule
                    if w.device.type != "cuda":
                        continue  # placed on the CPU by `--device auto`: quantized on the GPU in its turn
                    key = (tuple(w.shape), w.dtype, rule.format, rule.scale_rule, bool(rule.importance),
                           bool(p.target.fuse_group), p.target.is_stack)
                    if key in seen:
                        continue
                    seen.add(key)
                    if rule.format == "fp8":
                        member = w[0] if p.target.is_stack else w
                        _fp8(member, self.arith, rule.amax_search or None, "triton", [], [])
                        continue
                    g = w.abs().amax().float() if p.target.fuse_group else None
                    imp = torch.ones((*w.shape[:-2], w.shape[-1]), device=w.device) if rule.importance else None
                    _nvfp4(w, rule, g, imp, "triton", self.arith, [], [])
            stream.synchronize()
        except Exception:
            pass
        self.seconds = time.perf_counter() - t0


def quantize(
    model: nn.Module,
    recipe: Recipe,
    samples: torch.Tensor | None,
    *,
    backend: str | None = None,
    batch_size: int | str = 1,
    progress: bool = True,
    state: CalibState | None = None,
    arith: str = DEFAULT_ARITH,
) -> QuantizedModel | None:
    """Calibrate `model` on `samples` ([N, L] token ids) and quantize it under `recipe`.

    In a torch.distributed process group (`parallel`) every rank runs its share of the calibration
    batches and receives the reduced statistics; rank 0 quantizes and returns the model, the other
    ranks return None."""
    adapter = adapter_for(model)
    rank, world = parallel.rank_world()
    device = input_device(model)
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
    kernel_plan = [p for p in plan if p.rule is not None and (p.rule.format.startswith("nvfp4") or p.rule.format == "fp8")]
    warm_up = _KernelWarmUp(kernel_plan, arith) if backend == "triton" and kernel_plan and rank == 0 else None
    if warm_up is not None:
        warm_up.start()

    t0 = time.perf_counter()
    stats, start = Statistics(), 0
    if state is not None and world > 1:
        state = state.for_rank(rank, world)
    if state is not None:
        resumed = state.load()
        if resumed is not None:
            stats, start = resumed
            warnings.append(f"resumed calibration after {start} of {samples.shape[0]} samples")
    needs_data = bool(need_amax or need_sq or kv_layers)
    clock = BatchClock(device)
    if samples is not None and samples.numel():
        with Observers(model, amax_targets=need_amax, importance_targets=need_sq, kv_layers=kv_layers, moe_experts=moe, stats=stats):
            if world > 1:
                _forward_shard(model, samples, batch_size, progress and rank == 0, stats, start, state, rank, world)
            else:
                _forward_samples(model, samples, batch_size, progress, stats, start, state, clock)
        if world > 1:
            stats = parallel.reduce_statistics(stats, device)
        stats.expert_tokens = {k: v.cpu() for k, v in stats.expert_tokens.items()}
    elif needs_data:
        raise ValueError(f"recipe {recipe.name!r} needs calibration statistics, but no calibration samples were given")
    timings["calibrate"] = time.perf_counter() - t0
    steady = clock.steady()
    if rank != 0:
        return None

    if warm_up is not None:
        t0 = time.perf_counter()
        warm_up.join()
        timings["compile beside calibrate"] = warm_up.seconds
        timings["compile wait"] = time.perf_counter() - t0
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
    qm = QuantizedModel(model, adapter, recipe, plan, quantized, kv_scales, stats, kv_layers, timings, warnings, arith=arith,
                        calibrate_s_per_sample=steady)
    empty = qm.empty_experts()
    for name, experts in empty.items():
        qm.warnings.append(f"{adapter.disk_name(name)}: {len(experts)} expert(s) received no calibration token: {experts[:16]}{' ...' if len(experts) > 16 else ''}")
    return qm


# --- the job the CLI runs -------------------------------------------------------------------

AUTO_BATCH = "auto"  # --batch-size auto: the largest batch that fits the device
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
    batch_size: int | str = 1  # or "auto"
    allow_repeat: bool = False
    trust_remote_code: bool = False
    allow_pickle: bool = False
    progress: bool = True
    max_shard_bytes: int | None = None
    resume: bool = False
    arith: str = DEFAULT_ARITH  # "cuda": ModelOpt's bytes on CUDA; "cpu": on CPU
    checkpoint_every: int = 8  # calibration batches between statistics snapshots
    max_memory: str | None = None  # with device "auto": accelerate's per-device caps, "0=40GiB,cpu=200GiB"


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or text.count("/") != 1 or Path(text).exists()


# --- preflight: every input checked before any weight is read --------------------------------


class NetworkError(RuntimeError):
    """The hub could not be reached to look up a model id."""


def validate_job(job: QuantizeJob, ranks: int | None = None):
    """Every input checked before any weight is read, cheapest first: recipe, calibration spec,
    options, device, model folder (config, architecture, weight files and their headers), output
    (a folder or absent, writable, free disk), a snapshot for --resume, calibration source (there,
    and large enough for N x L). Returns (recipe, spec, model_ref, output).

    Refusals raise ValueError or OSError with one line naming the input and the fix; a hub model
    that cannot be reached raises NetworkError."""
    from .calibration import check_source_size, parse_calib_spec
    from .models.tiny import tiny_model_path
    from .recipe import load_recipe

    recipe = load_recipe(job.recipe)
    spec = parse_calib_spec(job.calib or (EMBEDDED_CALIB if job.model is None else DEFAULT_CALIB))
    check_mode(job.arith)
    if job.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1, got {job.checkpoint_every}")
    if job.batch_size != AUTO_BATCH and (not isinstance(job.batch_size, int) or job.batch_size < 1):
        raise ValueError(f"--batch-size must be a whole number >= 1 or {AUTO_BATCH!r}, got {job.batch_size!r}")
    if job.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {job.seed}")
    if job.backend is not None and job.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {job.backend!r}")
    check_device(job.device, job.backend)
    if job.max_memory is not None:
        parse_max_memory(job.max_memory, job.device)

    model_dir = tiny_model_path() if job.model is None else None
    if job.model is not None and _looks_like_path(job.model):
        model_dir = Path(job.model).expanduser()
        if not model_dir.is_dir():
            raise FileNotFoundError(f"--model {job.model}: no such folder (and not a hub id of the form org/name)")
    if model_dir is not None:
        weight_bytes = check_model_folder(model_dir, allow_pickle=job.allow_pickle, trust_remote_code=job.trust_remote_code)
        model_ref = str(model_dir)
    else:
        weight_bytes = None
        model_ref = job.model
        check_hub_model(model_ref, trust_remote_code=job.trust_remote_code)

    if job.output is None:
        name = model_dir.name if model_dir is not None else model_ref.split("/")[-1]
        output = Path(f"{name}-{recipe.name}")
    else:
        output = Path(job.output).expanduser()
    check_output(output, job.overwrite, model_dir)
    if job.resume:
        state = CalibState(calib_state_dir(output), job_fingerprint(job, recipe, spec, model_ref))
        rank, world, _ = parallel.env_world()
        if ranks is not None:  # `--gpus N` checks before it starts the ranks
            rank, world = 0, ranks
        worlds = state.rank_counts()
        held = " and ".join(f"{w}-rank" for w in sorted(worlds))
        if world > 1:
            if world not in worlds:
                raise FileNotFoundError(
                    f"--resume: no calibration snapshot of a {world}-rank run in {state.folder}"
                    + (f" (it holds {held} snapshots); resume with as many ranks as the killed run had" if held else "")
                    + ", or run without --resume"
                )
            state.for_rank(rank, world).saved_samples()  # its settings; a rank that saved nothing yet starts afresh
        elif state.saved_samples() is None:
            if held:
                raise FileNotFoundError(f"--resume: {state.folder} holds {held} snapshots; resume under torchrun with as "
                                        "many ranks as the killed run had, or run without --resume")
            raise FileNotFoundError(
                f"--resume: there is no calibration snapshot for {output} ({calib_state_dir(output)} does not exist); "
                "check -o, or run without --resume to start afresh"
            )
    if weight_bytes is not None:
        check_free_space(weight_bytes, output)
    check_source_size(job.dataset, spec, _token_counter(model_dir), allow_repeat=job.allow_repeat)
    return recipe, spec, model_ref, output


_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?$", re.IGNORECASE)


def parse_max_memory(text: str, device: str = "auto") -> dict:
    """`--max-memory 0=40GiB,1=40GiB,cpu=200GiB` -> accelerate's `max_memory` ({0: "40GiB", ...,
    "cpu": "200GiB"}): how much of each device the placement of `--device auto` may fill; what
    does not fit goes to the next device, then to the CPU. A GPU index must exist here."""
    if device != "auto":
        raise ValueError(f"--max-memory caps how --device auto spreads the model; it does not apply to --device {device}")
    caps: dict = {}
    for part in text.split(","):
        key, eq, size = (x.strip() for x in part.partition("="))
        if not eq or not key or not size:
            raise ValueError(f"--max-memory: {part.strip()!r} is not DEVICE=SIZE (e.g. 0=40GiB or cpu=200GiB)")
        if not _SIZE.match(size):
            raise ValueError(f"--max-memory: {size!r} (for {key}) is not a size such as 40GiB, 500MB or 1000000000")
        if key.isdigit():
            index = int(key)
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= n:
                raise ValueError(f"--max-memory: GPU {index} does not exist here ({n} CUDA device(s))")
            key = index
        elif key not in ("cpu",):
            raise ValueError(f"--max-memory: {key!r} is not a GPU index or cpu")
        if key in caps:
            raise ValueError(f"--max-memory: {key} is given twice")
        size = size.replace(" ", "")
        caps[key] = int(size) if size.isdigit() else size
    return caps


def check_device(device: str, backend: str | None = None) -> None:
    """`device` is cpu, cuda, cuda:N (a device this machine has) or auto; `backend` can run there."""
    if device != "auto":
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"--device {device}: expected cpu, cuda, cuda:N or auto")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available; use --device cpu")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise ValueError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if backend == "triton" and not on_cuda:
        raise ValueError("--backend triton runs on a CUDA device only; use --device cuda, or --backend torch on the CPU")


def _read_json(path: Path, where: str):
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{where}: {path.name} is not UTF-8 text; restore it from the model's source") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: {path.name} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "restore it from the model's source"
        ) from None


def _causal_lm_types() -> set[str] | None:
    """The model types transformers' AutoModelForCausalLM builds, read from the source of its
    mapping (importing it costs seconds: it imports every model's configuration); None if that
    source is not where this transformers version keeps it."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    path = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" for t in node.targets):
            try:
                return {model_type for model_type, _ in ast.literal_eval(node.value.args[0])}
            except (ValueError, TypeError, IndexError, AttributeError):
                return None
    return None


def check_config(config, where: str, *, trust_remote_code: bool = False) -> None:
    """A parsed config.json names an architecture transformers can build as a causal LM (or the
    folder brings its own code and --trust-remote-code allows it)."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config.json is not a JSON object; restore it from the model's source")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{where}: config.json has no model_type, so the architecture is unknown; restore it from the model's source")
    known = _causal_lm_types()
    if known is None or model_type in known:
        return
    own_code = isinstance(config.get("auto_map"), dict) and "AutoModelForCausalLM" in config["auto_map"]
    if own_code and trust_remote_code:
        return
    import importlib.metadata

    version = importlib.metadata.version("transformers")
    if own_code:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not built into transformers {version}; the folder brings its "
            "own code (auto_map): pass --trust-remote-code if you trust it"
        )
    raise ValueError(
        f"{where}: model_type {model_type!r} is not a causal LM transformers {version} can build; check config.json, "
        "or upgrade transformers"
    )


def check_model_folder(folder: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False, flag: str = "--model") -> int:
    """config.json parses and names a supported architecture; every weight file the index names
    is there with a sane safetensors header (8-byte length, JSON header, the data it describes
    inside the file). Reads headers only. Returns the weight files' total size in bytes.
    Messages name the folder as `flag` gave it."""
    from .export.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
    from .export.conformance import read_safetensors_header

    where = f"{flag} {folder}"
    if not folder.is_dir():
        raise FileNotFoundError(f"{where}: no such folder")
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{where}: the folder has no config.json")
    check_config(_read_json(folder / CONFIG_FILE, where), where, trust_remote_code=trust_remote_code)

    index = folder / INDEX_FILE
    if index.is_file():
        index_json = _read_json(index, where)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{where}: {INDEX_FILE} has no weight_map of tensor names to files; restore it from the model's source")
        files: dict[str, list[str]] = {}
        for tensor, file in weight_map.items():
            files.setdefault(file, []).append(tensor)
    elif (folder / SINGLE_FILE).is_file():
        files = {SINGLE_FILE: []}
    else:
        pickles = sorted(p for p in folder.glob("*.bin") if p.is_file())
        if pickles and not allow_pickle:
            raise ValueError(
                f"{where}: only pickle (.bin) weights, which can run code when loaded; "
                "convert them to safetensors, or pass --allow-pickle if you trust the source"
            )
        if pickles:
            return sum(p.stat().st_size for p in pickles)
        raise FileNotFoundError(
            f"{where}: no weights ({SINGLE_FILE} or {INDEX_FILE}); download the model's weights into the folder"
        )
    total = 0
    for file, tensors in sorted(files.items()):
        path = folder / file
        if not path.is_file():
            raise FileNotFoundError(f"{where}: {file}, named in {INDEX_FILE}, is missing; download it again")
        try:
            header, problems = read_safetensors_header(path)
        except OSError as exc:
            raise OSError(f"{where}: {file} cannot be read ({exc.strerror or exc})") from None
        except Exception as exc:  # conformance's header error: the file as a whole is unreadable
            raise ValueError(f"{where}: {file} is not a valid safetensors file ({exc}); download it again") from None
        if problems:
            _, tensor, message = problems[0]
            raise ValueError(f"{where}: {file} is damaged or truncated (tensor {tensor}: {message}); download it again")
        missing = [t for t in tensors if t not in header]
        if missing:
            raise ValueError(f"{where}: {INDEX_FILE} places {missing[0]} in {file}, which does not hold it; download the model again")
        total += path.stat().st_size
    return total


def check_hub_model(repo_id: str, *, trust_remote_code: bool = False) -> None:
    """A hub model id: its config.json in the local cache, else one request (no retries) that says
    whether the hub can be reached and has it."""
    from huggingface_hub import constants, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import build_hf_headers, get_session

    where = f"--model {repo_id}"
    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        check_config(_read_json(Path(cached), where), where, trust_remote_code=trust_remote_code)
        return
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{where}: not in the local hub cache, and HF_HUB_OFFLINE is set; download it first, or give a local folder")
    try:
        response = get_session().head(hf_hub_url(repo_id, "config.json"), headers=build_hf_headers(), follow_redirects=True, timeout=10)
    except Exception as exc:  # the HTTP client's connection, DNS, proxy and timeout errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise NetworkError(
            f"{where}: cannot reach {constants.ENDPOINT} ({first}); check the network, or give a local model folder"
        ) from None
    if response.status_code in (401, 403, 404):
        raise FileNotFoundError(
            f"{where}: no such model on the hub, or it is private or gated (HTTP {response.status_code}); "
            "check the id, or log in with `hf auth login`"
        )
    if response.status_code >= 400:
        raise NetworkError(f"{where}: the hub answered HTTP {response.status_code}; try again later, or give a local model folder")
    check_config(_read_json(Path(hf_hub_download(repo_id, "config.json")), where), where, trust_remote_code=trust_remote_code)


def check_output(output: Path, overwrite: bool, model_dir: Path | None = None) -> None:
    """The output is a folder or absent (--overwrite for a folder), not the source model, and its
    location is writable (tested by creating and removing a file there)."""
    import os
    import tempfile

    if output.exists() and not output.is_dir():
        raise FileExistsError(f"-o {output}: is a file, not a folder; choose another name (--overwrite replaces only a folder)")
    if model_dir is not None and output.exists() and (output.resolve() == model_dir.resolve() or output.resolve() in model_dir.resolve().parents):
        raise ValueError(f"-o {output}: holds the source model; choose another folder")
    if output.exists() and not overwrite:
        raise FileExistsError(f"output folder {output} exists; pass --overwrite to replace it")
    anchor = output.absolute().parent
    while not anchor.exists():
        anchor = anchor.parent
    if not anchor.is_dir():
        raise FileExistsError(f"-o {output}: {anchor} is a file, so no folder can be made below it; choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=anchor, prefix=".fp4kit-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PermissionError(f"-o {output}: cannot write in {anchor} ({exc.strerror or exc}); choose a writable location") from None


def check_free_space(need: int, output: Path) -> None:
    """Refuse to start when the output's disk cannot hold `need` bytes: a checkpoint as large as the
    BF16 source (an upper bound: quantized weights are smaller)."""
    import shutil

    parent = output.absolute().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if need > free:
        raise OSError(
            f"-o {output}: {parent} has {free / 1e9:.1f} GB free; the checkpoint may need up to {need / 1e9:.1f} GB "
            "(the BF16 source size); free space or choose another location"
        )


def _token_counter(model_dir: Path | None):
    """Token counts per document with the model's own tokenizer.json (the `tokenizers` library
    alone, without transformers), or None where the folder has none."""
    path = None if model_dir is None else model_dir / "tokenizer.json"
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception:  # tokenizers' own error type; transformers names the problem when it loads the file
        return None
    return lambda docs: [len(e.ids) for e in tokenizer.encode_batch(docs, add_special_tokens=False)]


def calib_state_dir(output: Path) -> Path:
    """Where a run writing `output` keeps its calibration snapshots."""
    return output.parent / f".{output.name}.calib-state"


def job_fingerprint(job: QuantizeJob, recipe: Recipe, spec, model_ref: str) -> dict:
    """Everything that decides the calibration statistics (see CalibState)."""
    return {"model": model_ref, "recipe": recipe.to_dict(), "calib": str(spec), "dataset": job.dataset,
            "seed": job.seed, "batch_size": job.batch_size, "allow_repeat": job.allow_repeat, "arith": job.arith}


# --- the run ----------------------------------------------------------------------------------


class _KernelFallbacks:
    """Keeps transformers' "`x` is falling back to its reference PyTorch implementation" warnings
    out of the output while installed, remembering the packages they name."""

    LOGGER = "transformers.integrations.hub_kernels"

    def __init__(self) -> None:
        self.missing: list[str] = []

    def filter(self, record) -> bool:
        import re

        # transformers <= 5.24: "... because `x` is not installed"; 5.25: "... is either not installed or
        # doesn't support the device of the inputs"
        found = re.search(r"falling back to its reference .* because `([\w.-]+)` is (?:either )?not installed", record.getMessage())
        if found is None:
            return True
        if found[1] not in self.missing:
            self.missing.append(found[1])
        return False

    def __enter__(self):
        import logging

        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        import logging

        logging.getLogger(self.LOGGER).removeFilter(self)

    def note(self) -> str | None:
        if not self.missing:
            return None
        names = " and ".join(name.replace("_", "-") for name in self.missing)
        return f"note: install {names} for faster calibration (transformers ran its reference PyTorch code instead)"


def mamba_kernel_note(model: nn.Module, device: torch.device) -> str | None:
    """Before a Nemotron-H model calibrates on a GPU: the note that transformers will run its Mamba
    mixers in plain torch, when mamba-ssm or causal-conv1d does not import here."""
    from .models.nemotron_h import MODEL_TYPE, mamba_kernels

    if device.type != "cuda" or getattr(model.config, "model_type", None) != MODEL_TYPE:
        return None
    missing = [name.replace("_", "-") for name, version in mamba_kernels().items() if version is None]
    if not missing:
        return None
    return (f"note: {' and '.join(missing)} not installed: the Mamba mixers run in transformers' plain-torch code, "
            f"which made the calibration forward 1.9x slower on an H200 (pip install --no-build-isolation {' '.join(missing)})")


def load_model(model_ref: str, *, device: str, trust_remote_code: bool = False, tokenizer: bool = True,
               allow_pickle: bool = False, progress: bool = True, max_memory: dict | None = None):
    """BF16 model (+ tokenizer). Weights from safetensors only unless `allow_pickle`; transformers'
    own "Loading weights" bar only with `progress`. max_memory (device "auto"): accelerate's caps
    per device (`parse_max_memory`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    kwargs = dict(dtype=torch.bfloat16, trust_remote_code=trust_remote_code, use_safetensors=None if allow_pickle else True)
    if device != "cpu":
        # Straight from the files to the device ("auto": accelerate spreads it over GPUs and CPU):
        # no copy of the whole model in host memory.
        kwargs["device_map"] = device
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_ref, **kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model_ref, trust_remote_code=trust_remote_code) if tokenizer else None
    return model.eval(), tok


def run(job: QuantizeJob, log=print, checked: tuple | None = None) -> tuple[QuantizedModel | None, Path]:
    """validate_job (or its result, `checked`), then load -> calibrate -> quantize -> export.
    Under torchrun with 2+ ranks: data-parallel calibration (`parallel`); rank 0 exports and
    returns the model, the other ranks (None, output)."""
    from .calibration import build_calibration_set
    from .export.modelopt import export_checkpoint

    recipe, spec, model_ref, output = checked if checked is not None else validate_job(job)
    device = parallel.init(job.device)  # under torchrun: this rank's device, in the process group
    rank, world = parallel.rank_world()
    progress = job.progress and rank == 0
    if rank != 0:
        log = lambda message: None  # noqa: E731  (rank 0 speaks for the run)
    state = CalibState(calib_state_dir(output), job_fingerprint(job, recipe, spec, model_ref), job.checkpoint_every)
    if not job.resume and rank == 0:
        state.clear()  # a snapshot left by an earlier run is not this run's to continue
    parallel.barrier()
    timings = {}
    # mamba-ssm's kernels compile in worker processes while the model loads (rank 0's workers
    # fill the Triton cache that every rank on this machine reads).
    precompile = contextlib.nullcontext()
    if rank == 0 and mamba_compile.wanted(model_ref, device, spec.seq_len, trust_remote_code=job.trust_remote_code):
        first_batch = 1 if job.batch_size == AUTO_BATCH else min(job.batch_size, spec.samples)
        workers, free, weights = mamba_compile.workers_for(model_ref, device)
        if workers:
            precompile = mamba_compile.MambaPrecompile(model_ref, device, spec.seq_len, first_batch, workers=workers).start()
            log(f"compiling mamba-ssm's kernels for {spec.seq_len}-token samples in {workers} processes beside the load")
        else:
            log(f"not compiling mamba-ssm's kernels ahead: {free / 1e9:.1f} GB free on {device} leaves no room beside "
                f"the {weights / 1e9:.1f} GB model; the first sample compiles them")
    t0 = time.perf_counter()
    import transformers  # noqa: F401  (its import is a stage of its own, not part of loading the weights)
    from transformers import AutoModelForCausalLM  # noqa: F401

    timings["import"] = time.perf_counter() - t0
    with precompile, _KernelFallbacks() as fallbacks:
        t0 = time.perf_counter()
        log(f"loading {model_ref} on {job.device}" + (f" in each of {world} ranks" if world > 1 else ""))
        caps = parse_max_memory(job.max_memory, job.device) if job.max_memory is not None else None
        model, tokenizer = load_model(model_ref, device=device, trust_remote_code=job.trust_remote_code,
                                      allow_pickle=job.allow_pickle, progress=progress, max_memory=caps)
        if caps is not None:
            where = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in getattr(model, "hf_device_map", {}).values()}
            where = where or {str(p.device) for p in model.parameters()}
            log(f"placed over {', '.join(sorted(where))} (--max-memory {job.max_memory})")
        timings["load"] = time.perf_counter() - t0
        early = mamba_kernel_note(model, input_device(model)) if job.progress else None
        if early:
            log(early)

        t0 = time.perf_counter()
        samples = build_calibration_set(
            tokenizer, spec, job.dataset, seed=job.seed, allow_repeat=job.allow_repeat, progress=progress
        )
        timings["calibration set"] = time.perf_counter() - t0
        if isinstance(precompile, mamba_compile.MambaPrecompile):
            waited = precompile.wait()
            timings["mamba compile beside load"], timings["mamba compile wait"] = precompile.seconds, waited
            for failure in precompile.failures():
                log(f"note: compiling mamba-ssm's kernels ahead failed in {failure}; the first sample compiles them")
        parallel.barrier()

        qm = quantize(model, recipe, samples, backend=job.backend, batch_size=job.batch_size, progress=progress, state=state,
                      arith=job.arith)
    if qm is None:  # another rank of a data-parallel run: rank 0 quantizes and exports
        return None, output
    # The fallbacks cost time on a GPU only; on the CPU there is nothing faster to install.
    if job.progress and input_device(model).type == "cuda" and fallbacks.note() and not early:
        log(fallbacks.note())
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
