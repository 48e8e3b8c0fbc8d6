"""Writes a ModelOpt-format checkpoint folder atomically.

Everything goes to a temporary sibling folder first (`.<name>.partial-<pid>`), which is renamed
to the final name only once every file is complete, so an interrupted run never leaves a folder
that passes for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


class OutputExistsError(FileExistsError):
    pass


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _PinnedStage:
    """A page-locked host buffer that a shard's GPU tensors are copied into: the copies run at full
    PCIe speed without a host sync per tensor, and the buffer is reused shard after shard."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def host_copies(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        need = sum(_aligned(_tensor_bytes(t)) for t in tensors.values())
        if self._buf is None or self._buf.numel() < need:
            self._buf = None
            self._buf = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        raw = self._buf.numpy()
        out, offset = {}, 0
        for name, t in tensors.items():
            n = _tensor_bytes(t)
            # A storage of its own per tensor (safetensors refuses tensors that share one).
            host = torch.frombuffer(memoryview(raw[offset : offset + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            host = host.view(t.dtype).view(t.shape)
            host.copy_(t, non_blocking=True)
            out[name] = host
            offset += _aligned(n)
        torch.cuda.synchronize()
        return out


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


class ShardWriter:
    """Collects tensors and writes safetensors shards of at most `max_shard_bytes`.

    Tensors are held as given (GPU tensors stay on the GPU) until their shard is written. Up to
    IN_FLIGHT shards are written at once by background threads while the next one is collected,
    so the host holds at most that many shards whatever the checkpoint's size."""

    IN_FLIGHT = 2

    def __init__(self, folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self._free = [_PinnedStage() for _ in range(self.IN_FLIGHT)]
        self._writing: list[tuple[Future, _PinnedStage]] = []
        self._pool = ThreadPoolExecutor(max_workers=self.IN_FLIGHT, thread_name_prefix="fp4kit-shard")
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        t = tensor.detach().contiguous()
        size = _tensor_bytes(t)
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += size
        self.total_bytes += size

    def _wait_oldest(self) -> None:
        future, stage = self._writing.pop(0)
        future.result()  # a failed write raises here
        self._free.append(stage)

    def _flush(self) -> None:
        if not self._pending:
            return
        if not self._free:
            self._wait_oldest()
        stage = self._free.pop()
        index = len(self._shards)
        on_gpu = {k: t for k, t in self._pending.items() if t.device.type == "cuda"}
        host = {k: t.to("cpu") for k, t in self._pending.items() if t.device.type not in ("cpu", "cuda")}
        if on_gpu:
            host.update(stage.host_copies(on_gpu))
        tensors = {k: host.get(k, t) for k, t in self._pending.items()}
        path = str(self.folder / f"shard-{index:05d}.tmp")
        self._writing.append((self._pool.submit(save_file, tensors, path, {"format": "pt"}), stage))
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def wait(self) -> None:
        """Block until every shard handed to the background threads is on disk."""
        try:
            while self._writing:
                self._wait_oldest()
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
