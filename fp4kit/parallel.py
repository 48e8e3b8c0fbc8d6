"""Data-parallel calibration over torch.distributed ranks (`torchrun`, or `fp4kit quantize --gpus N`).

Every rank loads the model and runs a share of the calibration batches; the statistics are then
reduced so that every rank holds what one process running all batches would hold, byte for byte:

- the batches are laid out as one process lays them out (their composition depends on the batch
  size only), and batch k runs on rank k mod N: a rank's share is fixed by the batch index;
- maxima (input amax, KV amax) reduce with MAX, which is exact in any order;
- counts (tokens per expert, tokens seen, tokens per channel) are integers: SUM is exact;
- sums of x^2 are exact integer sums (`calibrate.exact_add`): SUM of their int64 limbs is exact.

So the checkpoint is the same from 1, 2 or N ranks, provided each batch's forward gives the same
activations wherever it runs (the same kind of device and software).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from .calibrate import Statistics
from .kernels.backend import make_current

# A rank waits this long for the others in a collective before it gives up (torchrun stops the
# whole group as soon as one rank exits with an error).
TIMEOUT = timedelta(minutes=30)


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _import_world_defaults() -> None:
    """Imports, before the process group exists, the torch modules whose functions take
    `group=group.WORLD` as a default argument. Imported later (transformers' modeling code imports
    them while loading a model), they would bind the live group into those defaults: it would then
    outlive `destroy_process_group`, its communication threads running on until the interpreter
    tears it down at exit, where gloo's teardown can abort the process (SIGABRT), and torchrun
    then stops every rank."""
    import torch.distributed.fsdp  # noqa: F401  (its grad scaler's process_group default)
    import torch.distributed.nn.functional  # noqa: F401  (ten collectives' group defaults)


def init(device: str) -> str:
    """Joins torchrun's process group (NCCL on CUDA, gloo on the CPU) when there are 2+ ranks, and
    returns this rank's device: `cuda` becomes `cuda:<local rank>`."""
    import torch.distributed as dist

    rank, world, local = env_world()
    if world <= 1:
        make_current(device)
        return device
    if device == "auto":
        raise ValueError("--device auto spreads one model over the GPUs; with several ranks each rank holds "
                         "its own copy: use --device cuda")
    cuda = device.startswith("cuda")
    if cuda:
        if ":" in device:
            raise ValueError(f"--device {device}: with several ranks each rank takes the GPU of its local rank; use --device cuda")
        if torch.cuda.device_count() <= local:
            raise ValueError(f"rank {rank} needs GPU {local}, but this machine has {torch.cuda.device_count()}")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        _import_world_defaults()
        dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT,
                                **({"device_id": torch.device(device)} if cuda else {}))
    return device


def batch_layout(n: int, size: int, first_alone: bool) -> list[tuple[int, int]]:
    """The calibration batches as (start, end) sample indices: the first sample alone where its
    forward measures the batch size (`--batch-size auto` on CUDA), then `size` samples each."""
    out, i = [], 0
    if first_alone and n:
        out.append((0, 1))
        i = 1
    while i < n:
        out.append((i, min(i + size, n)))
        i += size
    return out


def shard(layout: list[tuple[int, int]], rank: int, world: int) -> list[tuple[int, int]]:
    """Batch k runs on rank k mod world."""
    return layout[rank::world]


def _comm_device(device: torch.device) -> torch.device:
    import torch.distributed as dist

    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_int(value: int, device: torch.device, src: int = 0) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_comm_device(device))
    dist.broadcast(t, src)
    return int(t.item())


def reduce_statistics(stats: Statistics, device: torch.device) -> Statistics:
    """Every rank's statistics -> the statistics of all batches, on every rank (see the module
    docstring for why the result does not depend on the number of ranks)."""
    import torch.distributed as dist

    comm = _comm_device(device)
    # every statistic as {kind: {key: tensor}}, the KV pair split into its two maxima
    stores = {
        "input_amax": stats.input_amax, "sq_sum": stats.sq_sum, "sq_count": stats.sq_count, "expert_tokens": stats.expert_tokens,
        "kv_k": {k: v[0] for k, v in stats.kv_amax.items()}, "kv_v": {k: v[1] for k, v in stats.kv_amax.items()},
    }
    ops = {"input_amax": dist.ReduceOp.MAX, "kv_k": dist.ReduceOp.MAX, "kv_v": dist.ReduceOp.MAX,
           "sq_sum": dist.ReduceOp.SUM, "sq_count": dist.ReduceOp.SUM, "expert_tokens": dist.ReduceOp.SUM}
    mine = {kind: {k: (tuple(v.shape), str(v.dtype)) for k, v in store.items()} for kind, store in stores.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    union: dict[str, dict] = {kind: {} for kind in mine}
    for theirs in everyone:
        for kind, entries in theirs.items():
            for key, meta in entries.items():
                if union[kind].setdefault(key, meta) != meta:
                    raise RuntimeError(f"ranks disagree on the shape of calibration statistic {kind}:{key}: {union[kind][key]} vs {meta}")

    reduced: dict[str, dict] = {kind: {} for kind in stores}
    for kind, store in stores.items():  # the same keys in the same order on every rank
        for key in sorted(union[kind]):
            shape, dtype = union[kind][key]
            t = store.get(key)
            t = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=comm) if t is None else t.detach().to(comm).clone()
            dist.all_reduce(t, op=ops[kind])
            reduced[kind][key] = t.to(device)
    out = Statistics(input_amax=reduced["input_amax"], sq_sum=reduced["sq_sum"], sq_count=reduced["sq_count"],
                     expert_tokens=reduced["expert_tokens"],
                     kv_amax={k: (reduced["kv_k"][k], reduced["kv_v"][k]) for k in reduced["kv_k"]})
    seen = torch.tensor([stats.tokens_seen], dtype=torch.int64, device=comm)
    dist.all_reduce(seen)
    out.tokens_seen = int(seen.item())
    return out


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def finish() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
