"""scripts/compare_modelopt_mse.py: the block classes it assigns all at once, in the order its
CLASSES give them, and the checkpoint reading that lets it remove a folder it has read."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("compare_modelopt_mse", _ROOT / "scripts" / "compare_modelopt_mse.py")
cmp = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = cmp  # its dataclasses look their module up
_SPEC.loader.exec_module(cmp)


def _first_class(r, b, differ, reproduced, dep, err6, err4):
    """The documented rule for one block: the first class that holds."""
    if not differ[r, b]:
        return None
    if not reproduced[r, b]:
        return "modelopt_decision_not_reproduced"
    for key, cls in (("scale_underflow", "fake_quant_scale_underflow"), ("scale_code_differs", "fake_quant_scale_code_differs"),
                     ("step_differs", "fake_quant_step_last_bits"), ("reconstruction_differs", "fake_quant_rounding_differs")):
        if dep[key][r, b]:
            return cls
    if abs(float(err6[r, b]) - float(err4[r, b])) <= 16 * 2.0**-23 * abs(float(err4[r, b])):
        return "near_tie_summation"
    return "unexplained"


def test_each_block_gets_the_first_class_that_holds():
    g = torch.Generator().manual_seed(0)
    shape = (64, 48)
    sparse = lambda p: torch.rand(shape, generator=g) < p  # noqa: E731
    differ, reproduced = sparse(0.5), ~sparse(0.1)
    dep = {k: sparse(0.15) for k in ("scale_underflow", "scale_code_differs", "step_differs", "reconstruction_differs")}
    err6 = torch.rand(shape, generator=g) + 0.5
    err4 = torch.where(sparse(0.3), err6 * (1 + 2.0**-22), err6 * 1.01)  # a third within a 16-term sum's rounding
    cand = cmp.Candidates([], [], [], [err6, err4], [])
    got = cmp.classify_blocks(differ, reproduced, dep, cand)
    names = list(cmp.CLASSES)
    seen = set()
    for r in range(shape[0]):
        for b in range(shape[1]):
            want = _first_class(r, b, differ, reproduced, dep, err6, err4)
            assert int(got[r, b]) == (-1 if want is None else names.index(want)), (r, b, want)
            seen.add(want)
    assert seen == set(names) | {None}  # every class and the agreeing blocks occur, so each test is exercised


def test_a_read_checkpoint_holds_no_map_of_its_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(tmp_path / "model.safetensors"))
    tensors = cmp.read_checkpoint(tmp_path)
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()
    (tmp_path / "model.safetensors").unlink()
    assert torch.equal(tensors["a.weight"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
