"""The launch-shape sweeps of scripts/tune_kernels.py, one module per kernel file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Sweep:
    """One sweep: `run()` times candidates and returns rows; `pick(rows)` gives `kernel`'s table `table`."""

    kernel: str
    table: str
    run: Callable[[], list]
    pick: Callable[[list], object]
    doc: str
