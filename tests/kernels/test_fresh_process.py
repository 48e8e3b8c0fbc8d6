"""Runs tests/kernels in a fresh process with TRITON_INTERPRET=1 where this one cannot interpret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import IN_SUBPROCESS_ONLY


def test_in_fresh_process():
    if not IN_SUBPROCESS_ONLY:
        pytest.skip("the tests of this folder ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
