"""What an installed fp4kit reads at run time is in its wheel: every non-Python file under a
package (the recipes, the launch tables, the embedded model and corpus) is matched by a
package-data glob of pyproject.toml, so `pip install .` (not only `pip install -e .`) runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dir(name: str, mapping: dict) -> Path:
    if name in mapping:
        return ROOT / mapping[name]
    parent, _, last = name.rpartition(".")
    return (_package_dir(parent, mapping) / last) if parent else ROOT / name


def test_every_data_file_of_a_package_is_shipped():
    cfg = _setuptools()
    mapping = cfg.get("package-dir", {})
    data = cfg.get("package-data", {})
    dirs = {name: _package_dir(name, mapping) for name in cfg["packages"]}
    missing = []
    for name, folder in dirs.items():
        assert folder.is_dir(), f"package {name}: {folder} does not exist"
        others = [d for n, d in dirs.items() if n != name and d != folder and d.is_relative_to(folder)]
        files = {p for p in folder.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
                 and "__pycache__" not in p.parts and not any(p.is_relative_to(o) for o in others)}
        shipped = {p for pattern in data.get(name, []) for p in folder.glob(pattern) if p.is_file()}
        missing += [f"{name}: {p.relative_to(ROOT)}" for p in sorted(files - shipped)]
    assert not missing, "not in any package-data glob of pyproject.toml: " + ", ".join(missing)


def test_the_launch_tables_and_recipes_are_among_them():
    # The files the library opens through importlib.resources exist where the globs look.
    cfg = _setuptools()
    assert "tuning/*.json" in cfg["package-data"]["fp4kit.kernels"]
    assert list((ROOT / "fp4kit" / "kernels" / "tuning").glob("*.json"))
    assert list((ROOT / "configs").glob("*.yaml"))
