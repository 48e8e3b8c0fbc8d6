"""Data checks queued on the device and read back together.

A GPU quantizer cannot know whether its input held a NaN, or whether a given global amax covered
the weight, without waiting for the GPU. `DeferredCheck` keeps such a check as a 0-d bool tensor
(True: the check failed) next to the function that raises the reference's error, so that a caller
quantizing hundreds of tensors waits on the GPU once (`run_all`) instead of once per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class DeferredCheck:
    """`bad`: a 0-d bool tensor, True when the check fails; `raise_error`: raises the error the
    eager check would have raised (it is called only when `bad` is True). Calling the object runs
    the check now."""

    def __init__(self, bad: torch.Tensor, raise_error: Callable[[], None]) -> None:
        self.bad = bad.reshape(())
        self.raise_error = raise_error

    def __call__(self) -> None:
        if bool(self.bad):
            self.fail()

    def fail(self) -> None:
        """Raise the check's error (for a check known to have failed)."""
        self.raise_error()
        raise AssertionError("a deferred check failed on the device but its error function did not raise")


def failed(checks: Iterable[DeferredCheck]) -> list[int]:
    """Indices of the failing checks, with one read-back per device."""
    checks = list(checks)
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(checks):
        by_device.setdefault(c.bad.device, []).append(i)
    out: list[int] = []
    for idx in by_device.values():
        flags = torch.stack([checks[i].bad for i in idx]).cpu().tolist()
        out += [i for i, f in zip(idx, flags) if f]
    return sorted(out)


def run_all(checks: Iterable[DeferredCheck]) -> None:
    """Raise the error of the first failing check (in the order given), after one read-back."""
    checks = list(checks)
    bad = failed(checks)
    if bad:
        checks[bad[0]].fail()
