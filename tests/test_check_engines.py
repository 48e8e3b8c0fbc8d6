"""scripts/check_engines.py's own logic (fills, write tracing, comparison, report) on a toy
model with a loader that stacks q/k/v into one parameter, as the serving engines do. The
engines themselves are not needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("check_engines", _ROOT / "scripts" / "check_engines.py")
check_engines = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check_engines)


class Toy(torch.nn.Module):
    def __init__(self, scale_dtype=torch.float32):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16))  # q: 0:4, k: 4:8, v: 8:12
        self.packed = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.uint8), requires_grad=False)
        self.k_scale = torch.nn.Parameter(torch.zeros((), dtype=scale_dtype), requires_grad=False)
        self.slot_scales = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32), requires_grad=False)
        self.register_buffer("cache", torch.zeros(5))


OFFSETS = {"q": 0, "k": 4, "v": 8}


def disk_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "attn.q_proj.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "attn.k_proj.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "attn.v_proj.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        # 0xFF bytes are valid packed FP4 codes: they must count as written.
        "packed": torch.tensor([[0xFF, 0x01, 0xFF], [0x00, 0xFF, 0x7F]], dtype=torch.uint8),
        "attn.k_proj.k_scale": torch.tensor(0.0090681, dtype=torch.float32),
        "in_proj.weight_scale": torch.tensor(0.5, dtype=torch.float32),
    }


def make_loader(offsets=OFFSETS, skip=()):
    def load(model, weights):
        for name, t in weights:
            if name in skip:
                continue
            if name.endswith("_proj.weight"):
                shard = name.split(".")[1][0]
                rows = offsets[shard]
                model.qkv.data[rows:rows + 4].copy_(t)
            elif name == "packed":
                model.packed.data.copy_(t)
            elif name.endswith("k_scale"):
                model.k_scale.data.copy_(t)
            elif name == "in_proj.weight_scale":
                model.slot_scales.data.copy_(t.expand(3))  # one disk scale fills every slot
    return load


def expect_for(model):
    """The toy's mapping tables: q/k/v stack into `qkv` in that order, 4 rows each."""
    sizes = {"q": 4, "k": 4, "v": 4}

    def expect(name):
        if name.endswith("_proj.weight"):
            shard = name.split(".")[1][0]
            start = sum(sizes[s] for s in "qkv"[: "qkv".index(shard)])
            return check_engines.Expect("qkv", rows=(start, start + sizes[shard]), via=f"stacked {shard}")
        return None
    return expect


def run(loader, scale_dtype=torch.float32, tensors=None, expected_skip=lambda n: False):
    tensors = tensors or disk_tensors()
    return check_engines.run_checked_load(lambda: Toy(scale_dtype), loader, lambda model: iter(tensors.items()), expected_skip, expect_for)


def test_a_faithful_loader_passes_and_every_slice_is_checked():
    report = run(make_loader())
    assert report["ok"], report
    assert report["written"] == 6 and not report["unwritten"] and not report["differs"] and not report["misplaced"]
    assert report["checked"] == {"broadcast": 1, "exact": 5}
    assert report["unwritten_buffers"] == {"cache": {"elements": 5, "of": 5, "shape": [5], "dtype": "float32"}}


def test_swapped_stacked_shards_are_reported_as_misplaced():
    report = run(make_loader(offsets={"q": 0, "k": 8, "v": 4}))
    assert not report["ok"] and not report["differs"]  # the bytes are intact, in the wrong slice
    assert set(report["misplaced"]) == {"attn.k_proj.weight", "attn.v_proj.weight"}
    assert "dim 0 8:12" in report["misplaced"]["attn.k_proj.weight"][0]
    assert report["placement_checked"] == 3


def test_a_skipped_tensor_leaves_its_slice_unwritten():
    report = run(make_loader(skip={"attn.v_proj.weight"}))
    assert not report["ok"]
    assert report["skipped"] == ["attn.v_proj.weight"]
    assert report["unwritten"]["qkv"]["elements"] == 16


def test_skips_by_design_are_listed_apart():
    report = run(make_loader(skip={"attn.v_proj.weight"}), expected_skip=lambda n: n == "attn.v_proj.weight")
    assert report["skipped_by_design"] == ["attn.v_proj.weight"] and not report["skipped"]
    assert not report["ok"]  # its slice is still unwritten


def test_overlapping_writes_are_reported():
    report = run(make_loader(offsets={"q": 0, "k": 4, "v": 4}))
    assert report["overlaps"] == {"qkv": 16}
    assert report["unwritten"]["qkv"]["elements"] == 16
    assert "attn.k_proj.weight" in report["differs"]  # v overwrote it


def test_a_narrower_parameter_dtype_is_reported_as_rounding():
    report = run(make_loader(), scale_dtype=torch.bfloat16)
    assert report["ok"]  # rounding is reported, not a failure
    rec = report["rounded"]["attn.k_proj.k_scale"][0]
    assert rec["param_dtype"] == "bfloat16" and rec["disk_dtype"] == "float32"
    assert rec["disk_value"] == pytest.approx(0.0090681) and rec["stored_value"] == pytest.approx(0.0090942, rel=1e-4)


def test_a_value_changed_after_its_write_differs():
    def load(model, weights):
        make_loader()(model, weights)
        model.packed.data[1, 2] = 0x7E  # after the last tensor: no disk tensor is credited with it

    report = run(load)
    assert not report["ok"]
    assert list(report["differs"]) == ["packed"] and report["differs"]["packed"][0]["mismatched"] == 1


def test_region_and_compare_helpers():
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[1:3, 2:5] = True
    r = check_engines.Region(mask)
    assert r.box == ((1, 3), (2, 5)) and r.describe() == "[1:3, 2:5]"
    mask[0, 0] = True
    r2 = check_engines.Region(mask)
    assert r2.box is None and r2.describe() == "mask of 7 elements"
    assert torch.equal(r.union(r2).to_mask(), mask)
    target = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    disk = target[1:3, 2:5].clone()
    assert check_engines.compare_region(disk, target, r)["status"] == "exact"
    assert check_engines.compare_region(disk.t().contiguous(), target, r)["status"] == "transposed"
    disk[0, 0] = -1
    assert check_engines.compare_region(disk, target, r)["status"] == "differs"


def test_fill_reads_back_as_filled_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.int64):
        t = torch.zeros(3, 2, dtype=dtype)
        for byte in check_engines.FILL_BYTES:
            check_engines.fill_bytes(t, byte)
            assert bool(check_engines.still_filled(t, byte).all())
        check_engines.fill_bytes(t, 0xFF)
        if dtype.is_floating_point:
            assert bool(t.float().isnan().all())


def test_merge_summarizes_reports(tmp_path):
    report = run(make_loader(skip={"attn.v_proj.weight"}), scale_dtype=torch.bfloat16)
    report.update(checkpoint="/x/ckpt-a", engine="toy", mtp=False, versions={"toy": "1"}, date="d", stubbed=["k"])
    failed = {"checkpoint": "/x/ckpt-b", "engine": "toy", "mtp": True, "versions": {"toy": "1"}, "date": "d",
              "ok": False, "error": "RuntimeError: boom"}
    paths = []
    for i, r in enumerate((report, failed)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(check_engines.json.dumps(r, default=str))
    doc = check_engines.merge(paths)
    a = doc["results"]["toy"]["x/ckpt-a"]
    assert a["ok"] is False and a["skipped"] == ["attn.v_proj.weight"] and a["unwritten"] == ["qkv"]
    assert a["rounded"]["attn.k_proj.k_scale"][0]["stored"] == pytest.approx(0.0090942, rel=1e-4)
    assert doc["results"]["toy"]["x/ckpt-b --mtp"] == {"ok": False, "error": "RuntimeError: boom", "date": "d", "report": "r1.json"}
    assert doc["engines"]["toy"]["stubbed"] == ["k"]
