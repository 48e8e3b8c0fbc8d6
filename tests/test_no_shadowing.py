"""No folder of the test suite can be imported under a top-level name.

pytest puts the first folder above a test package that has no __init__.py on sys.path. Were that
tests/, `import kernels` inside transformers (which it does whenever the `kernels` distribution
is installed) would load tests/kernels instead.
"""

import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_tests_folder_is_not_on_sys_path():
    assert str(TESTS) not in {str(Path(p).resolve()) for p in sys.path if p}


def test_no_test_folder_resolves_as_a_top_level_module():
    for folder in sorted(p for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        spec = importlib.util.find_spec(folder.name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        assert origin is None or TESTS not in origin.parents, (
            f"`import {folder.name}` would load {origin}")
