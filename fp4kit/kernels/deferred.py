"""Data checks queued on the device and read back together.

A GPU quantizer cannot know whether its input held a NaN, or whether a given global amax covered
the weight, without waiting for the GPU. `DeferredCheck` keeps such a check as the tensors it
reads next to the function that raises the reference's error. The check itself runs later, for
many tensors at once (`failed`): the tensors of every check are concatenated and tested in a few
launches, and the flags come back in one transfer per device, so a caller quantizing hundreds of
tensors neither waits on the GPU per tensor nor launches a reduction per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

# What makes a check fail, per kind of condition, on the concatenated values (one or two
# same-length vectors, in the dtype the tensors promote to): a NaN or an Inf; a NaN, an Inf or a
# negative value; a first value that is not finite or is below the second.
_VIOLATION = {
    "finite": lambda v: ~torch.isfinite(v),
    "finite_nonnegative": lambda v: ~(torch.isfinite(v) & (v >= 0)),
    "covers": lambda v, floor: ~torch.isfinite(v) | (v < floor),
}


class DeferredCheck:
    """A data check for later: `raise_error` raises the error the eager check would raise (it is
    called only for a check that failed). The check fails where `bad` (a bool tensor) holds a
    True, where a tensor of `finite` holds a NaN or an Inf, where a tensor of
    `finite_nonnegative` holds a NaN, an Inf or a negative value, or where, for a pair (a, b) of
    `covers` (same shape), a is not finite or below b. Calling the object runs the check now."""

    def __init__(self, raise_error: Callable[[], None], *, bad: torch.Tensor | None = None,
                 finite: Sequence[torch.Tensor] = (), finite_nonnegative: Sequence[torch.Tensor] = (),
                 covers: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        self.raise_error = raise_error
        self.conditions: list[tuple[str, tuple[torch.Tensor, ...]]] = []
        if bad is not None:
            self.conditions.append(("bad", (bad,)))
        self.conditions += [("finite", (t,)) for t in finite]
        self.conditions += [("finite_nonnegative", (t,)) for t in finite_nonnegative]
        for a, b in covers:
            if a.shape != b.shape:
                raise ValueError(f"DeferredCheck: covers pairs a {tuple(a.shape)} with b {tuple(b.shape)}")
            self.conditions.append(("covers", (a, b)))

    def __call__(self) -> None:
        if failed([self]):
            self.fail()

    def fail(self) -> None:
        """Raise the check's error (for a check known to have failed)."""
        self.raise_error()
        raise AssertionError("a deferred check failed on the device but its error function did not raise")


def queue(checks: Iterable[DeferredCheck]) -> list[tuple[torch.Tensor, list[int]]]:
    """The checks' flags, queued and not read: per device, a bool tensor of one flag per condition
    and the index of the check each flag belongs to. Per device and kind of condition the
    tensors are concatenated and tested at once, each condition's flag being the maximum of its
    segment; nothing waits for the device."""
    checks = list(checks)
    groups: dict[tuple[torch.device, str], list[tuple[int, tuple[torch.Tensor, ...]]]] = {}
    for i, c in enumerate(checks):
        for kind, tensors in c.conditions:
            groups.setdefault((tensors[0].device, kind), []).append((i, tensors))
    flags: dict[torch.device, list[torch.Tensor]] = {}
    owners: dict[torch.device, list[int]] = {}
    for (device, kind), entries in groups.items():
        nonempty = [(i, ts) for i, ts in entries if ts[0].numel()]
        if not nonempty:
            continue
        if kind == "bad":
            bad = torch.cat([ts[0].reshape(-1).bool() for _, ts in nonempty])
        else:
            columns = zip(*(ts for _, ts in nonempty))
            bad = _VIOLATION[kind](*(torch.cat([t.reshape(-1) for t in col]) for col in columns))  # dtypes promote
        flags.setdefault(device, []).append(_segment_any(bad, [ts[0].numel() for _, ts in nonempty]))
        owners.setdefault(device, []).extend(i for i, _ in nonempty)
    return [(torch.cat(parts), owners[device]) for device, parts in flags.items()]


def failing(queued: list[tuple[torch.Tensor, list[int]]], host_flags: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the failing checks, from `queue`'s flags as read back (`host_flags`, in the
    same order)."""
    out: set[int] = set()
    for (_, owners), host in zip(queued, host_flags):
        out.update(i for i, f in zip(owners, host.tolist()) if f)
    return sorted(out)


def failed(checks: Iterable[DeferredCheck]) -> list[int]:
    """Indices of the failing checks: `queue`, then all flags back in one transfer per device."""
    queued = queue(checks)
    return failing(queued, [flags.cpu() for flags, _ in queued])


def _segment_any(bad: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[len(lengths)] bool: whether each consecutive segment of `bad` holds a True."""
    if len(lengths) == 1:
        return bad.any().reshape(1)
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    # The running count of Trues, read at each segment's end: a segment holds a True where its
    # count rose.
    counts = torch.cat([bad.new_zeros(1, dtype=torch.int64), bad.long().cumsum(0)])
    at = counts[to_device(torch.cat([torch.zeros(1, dtype=torch.int64), ends]), bad.device)]
    return at[1:] > at[:-1]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device: to a GPU through pinned
    memory, asynchronously (a plain copy from pageable memory waits for the stream)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def run_all(checks: Iterable[DeferredCheck]) -> None:
    """Raise the error of the first failing check (in the order given), after one read-back."""
    checks = list(checks)
    bad = failed(checks)
    if bad:
        checks[bad[0]].fail()
