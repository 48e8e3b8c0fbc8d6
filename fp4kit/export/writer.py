"""Writes a ModelOpt-format checkpoint folder atomically, streaming its safetensors shards.

Everything goes to a temporary sibling folder first (`.<name>.partial-<pid>`), which is renamed
to the final name only once every file is complete, so an interrupted run never leaves a folder
that passes for a checkpoint.

Shards are written by `write_safetensors`, which lays out a file exactly as
`safetensors.torch.save_file` does (tests/export/test_writer.py compares the bytes) but streams
each tensor from wherever it lives: GPU tensors pass through a few small page-locked buffers, the
next chunk's copy running while the previous one is written, so neither a shard nor the
checkpoint is ever held in host memory.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# safetensors' dtype names, in the order its writer places tensors (this dtype order first, then
# the name).
_DTYPES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.uint16: "U16", torch.int16: "I16", torch.float8_e8m0fnu: "F8_E8M0",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPES)}


class OutputExistsError(FileExistsError):
    pass


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat uint8 tensor on t's device (no copy for a contiguous t)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def safetensors_layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The header (length prefix included) and the order of the data, as safetensors writes them."""
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
    order = sorted(tensors, key=lambda n: (_RANK[tensors[n].dtype], n))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = _tensor_bytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, order


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


class _Stage:
    """A ring of page-locked host buffers and a copy stream, one per writer thread."""

    BUFFERS = 3
    BUFFER_BYTES = 64 << 20

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer_bytes = self.BUFFER_BYTES
        self.stream = torch.cuda.Stream(device)
        self.bufs = [torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(self.BUFFERS)]
        self.views = [b.numpy() for b in self.bufs]


_local = threading.local()


def _stage_for(device: torch.device) -> _Stage:
    stages = getattr(_local, "stages", None)
    if stages is None:
        stages = _local.stages = {}
    key = (device, _Stage.BUFFERS, _Stage.BUFFER_BYTES)
    if key not in stages:
        stages[key] = _Stage(device)
    return stages[key]


def _stream_gpu(fd: int, run: list[torch.Tensor], ready: torch.cuda.Event | None) -> None:
    """Writes the bytes of consecutive GPU tensors (one device) through the thread's stage: the
    copy into one buffer runs while another buffer is written."""
    stage = _stage_for(run[0].device)
    if ready is not None:
        stage.stream.wait_event(ready)
    pending: deque = deque()  # (buffer index, bytes filled, event)
    slot, fill = 0, 0

    def seal() -> None:
        nonlocal slot, fill
        if fill:
            event = torch.cuda.Event()
            event.record(stage.stream)
            pending.append((slot, fill, event))
            slot, fill = (slot + 1) % stage.BUFFERS, 0
        if len(pending) == stage.BUFFERS:
            drain(1)

    def drain(count: int) -> None:
        for _ in range(min(count, len(pending))):
            i, n, event = pending.popleft()
            event.synchronize()
            _write_all(fd, stage.views[i][:n])

    with torch.cuda.stream(stage.stream):
        for t in run:
            raw = _raw(t)
            done, total = 0, raw.numel()
            while done < total:
                n = min(total - done, stage.buffer_bytes - fill)
                stage.bufs[slot][fill : fill + n].copy_(raw[done : done + n], non_blocking=True)
                fill += n
                done += n
                if fill == stage.buffer_bytes:
                    seal()
        seal()
        drain(len(pending))


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
                      ready: dict[torch.device, torch.cuda.Event] | None = None) -> None:
    """A safetensors file of `tensors` (CPU or CUDA), byte-identical to `save_file`'s.

    ready: per CUDA device, an event recorded after the tensors were produced (the copies wait
    on it instead of on the whole device)."""
    header, order = safetensors_layout(tensors, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, header)
        run: list[torch.Tensor] = []  # consecutive GPU tensors of one device
        for name in order:
            t = tensors[name].detach()
            if not t.numel():
                continue
            if t.device.type == "cuda" and (not run or run[0].device == t.device):
                run.append(t)
                continue
            if run:
                _stream_gpu(fd, run, (ready or {}).get(run[0].device))
                run = []
            if t.device.type == "cuda":
                run.append(t)
            else:
                _write_all(fd, _raw(t).numpy())
        if run:
            _stream_gpu(fd, run, (ready or {}).get(run[0].device))
    finally:
        os.close(fd)


class ShardWriter:
    """Collects tensors and writes safetensors shards of at most `max_shard_bytes`.

    Tensors are held as given (GPU tensors stay on the GPU) until their shard is written; each
    full shard goes to one of WRITERS background threads at once, while the next is collected."""

    WRITERS = 2

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._writing: list[Future] = []
        self._pool = ThreadPoolExecutor(max_workers=self.WRITERS, thread_name_prefix="fp4kit-shard")
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        t = tensor.detach()
        if t.device.type not in ("cpu", "cuda"):
            t = t.to("cpu")
        size = _tensor_bytes(t)
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        devices = {t.device for t in self._pending.values() if t.device.type == "cuda"}
        ready = {}
        for d in devices:
            ready[d] = torch.cuda.Event()
            ready[d].record(torch.cuda.current_stream(d))
        path = self.folder / f"shard-{len(self._shards):05d}.tmp"
        self._writing.append(self._pool.submit(write_safetensors, self._pending, path, {"format": "pt"}, ready))
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def wait(self) -> None:
        """Block until every shard handed to the background threads is on disk (a failed write
        raises here)."""
        try:
            while self._writing:
                self._writing.pop(0).result()
        finally:
            self._pool.shutdown(wait=True)

    def close(self) -> list[str]:
        """Finish the shards; rename them to their final names; write the index if sharded."""
        self._flush()
        self.wait()
        n = len(self._shards)
        if n == 0:
            raise ValueError("no tensors to write")
        if n == 1:
            os.replace(self.folder / "shard-00000.tmp", self.folder / "model.safetensors")
            return ["model.safetensors"]
        files, weight_map = [], {}
        for i, names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / f"shard-{i:05d}.tmp", self.folder / fname)
            files.append(fname)
            weight_map.update({name: fname for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return files + ["model.safetensors.index.json"]


def _modes_as_created(folder: Path) -> None:
    """Give the folder and its files the modes a plain open() would (0666 / 0777 less the umask):
    some writers create their files 0600, which others sharing the checkpoint cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for p in folder.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


class AtomicFolder:
    """A folder that appears under its final name only when `commit()` is called."""

    def __init__(self, final: Path, *, overwrite: bool) -> None:
        self.final = Path(final)
        if self.final.exists() and not overwrite:
            raise OutputExistsError(f"output folder {self.final} exists; pass --overwrite to replace it")
        if self.final.exists() and not self.final.is_dir():
            raise OutputExistsError(f"output path {self.final} exists and is not a folder")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.final.parent / f".{self.final.name}.partial-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()

    def commit(self) -> Path:
        _modes_as_created(self.tmp)
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "AtomicFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
