"""fp4kit's modules form layers; an import may only point down or sideways, and never in a circle.

Layers, lowest first (a module may import its own layer and the ones below it):

    0 formats                 the number formats, bit for bit: the contract
    1 kernels                 Triton kernels checked against formats
    2 models, recipe,         what a model is made of, what a recipe asks for, calibration
      calibrate, calibration, statistics and text (and their reduction over data-parallel
      parallel, modules,      ranks), the runtime nn.Modules, the plan (which module gets
      plan, export.checkpoint which rule), and the checkpoint's vocabulary and reader (which
                              the modules' errors and names come from)
    3 export.*, fp4kit,       writing a checkpoint (writer, card, modelopt), loading it
      decode                  (load), checking it (conformance), uploading it (push); the
                              package root (__version__, lazy re-exports of load_quantized
                              and generate); decoding from static buffers (decode)
    4 quantize                the pipeline: load -> calibrate -> quantize -> export
    5 verify, evaluate,       judging a checkpoint: re-derived bytes, quality; what the
      ssm_eval                fp16 SSM-state cache costs in accuracy
    6 cli                     the command line

Every import counts: module level and inside functions, `import x` and `from . import x`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (package name, folder): calibration/ is installed as fp4kit.calibration.
PACKAGES = (("fp4kit", ROOT / "fp4kit"), ("fp4kit.calibration", ROOT / "calibration"))

LAYERS = (
    ("formats",),
    ("kernels",),
    ("models", "recipe", "calibrate", "calibration", "parallel", "modules", "plan", "export.checkpoint"),
    ("export", "", "decode"),
    ("quantize",),
    ("verify", "evaluate", "ssm_eval"),
    ("cli",),
)


def layer_of(module: str) -> int:
    """The layer of a module named below `fp4kit.`; the longest matching entry wins."""
    rel = module[len("fp4kit."):] if module.startswith("fp4kit.") else ""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if rel == name or (name and rel.startswith(name + ".")):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and the docstring")
    return best[0]


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The fp4kit modules `name` imports anywhere in its source (resolved, `from a import b`
    counting as an import of a.b when that is a module, else of a)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        for t in targets:
            # `import fp4kit.a.b` imports the deepest module that exists
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, targets in g.items() for b in targets if layer_of(b) > layer_of(a))


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_points_upward():
    assert upward(graph()) == []


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_walk_sees_function_level_imports():
    # The walk itself: a function-level import from export up to verify is an upward arrow,
    # and closes a circle with verify's own import of export.
    g = graph()
    assert "fp4kit.export.modelopt" in g["fp4kit.verify"]
    g["fp4kit.export.modelopt"] = g["fp4kit.export.modelopt"] | {"fp4kit.verify"}
    assert any("fp4kit.export.modelopt (layer 3) imports fp4kit.verify (layer 5)" == a for a in upward(g))
    assert any({"fp4kit.export.modelopt", "fp4kit.verify"} <= set(c) for c in circles(g))
