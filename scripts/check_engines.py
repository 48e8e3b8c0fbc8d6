"""Load a checkpoint with a serving engine's own model class and weight loader, on the CPU, and
check every parameter it fills against the checkpoint's bytes.

    python scripts/check_engines.py CKPT --engine vllm   [--mtp] [--json OUT]
    python scripts/check_engines.py CKPT --engine sglang [--mtp] [--json OUT]
    python scripts/check_engines.py merge OUT.json REPORT.json... [--extra META.json]

Run it with the python of an environment where the engine is installed. The engine's config
classes read config.json / hf_quant_config.json, its model class (Nemotron-H, or the MTP draft
with --mtp; any architecture the engine registers) is built on the CPU and its own
`load_weights` runs on the checkpoint's tensors. Only the GPU kernel and backend selection is
replaced (`stub_kernel_choice_*`): the quant methods' kernel pickers, which look for CUDA
kernels, return an inert object, and `process_weights_after_loading` (which converts loaded
weights into a kernel's layout) is not run.

The load runs twice, with every parameter and buffer pre-filled with all-ones bytes (NaN in
every floating dtype) and then with zero bytes. Between two tensors of the checkpoint the
script records which elements changed, so each disk tensor maps to the elements the engine's
loader wrote for it (through the engine's own stacked-parameter and expert mappings). Reported:

- `unwritten`: parameter elements that kept the fill in both runs (`unwritten_defaulted`
  apart: parameters the engine's own completeness rule lets a checkpoint omit, such as the
  attention `q_scale` / `prob_scale` of an FP8 KV cache, which take a default);
- `differs`: a disk tensor whose written elements do not hold its bytes (cast to the
  parameter's dtype where the engine's parameter has another dtype);
- `rounded`: a disk tensor the engine stores in a dtype that cannot hold it exactly (e.g.
  vLLM's bf16 `k_scale` for an fp32 scale), with the values before and after;
- `skipped`: disk tensors the loader did not write anywhere, apart from the subtree the engine
  skips by design for this model (`mtp.*` for the main model; everything but `mtp.*` and the
  shared embedding / head for the MTP draft);
- `misplaced`: a disk tensor written somewhere else than the engine's own mapping (its
  stacked-parameter list, expert mapping and the fused layer's shard sizes) puts it;
- `overlaps`: elements written by more than one disk tensor.

Exit status: 0 when nothing is unwritten, differs, is misplaced, is skipped or overlaps; 1 otherwise; 2 when
the engine could not build or load the model (the error is in the report).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch

FILL_BYTES = (0xFF, 0x00)


# ----------------------------------------------------------------------------------------
# Engine-independent part: fills, write tracing, comparison, report.
# ----------------------------------------------------------------------------------------

def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """[numel, element_size] uint8 view of a tensor's elements (a copy when not contiguous)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def fill_bytes(t: torch.Tensor, byte: int) -> None:
    """Set every byte of `t` to `byte` (0xFF is NaN in every floating dtype)."""
    with torch.no_grad():
        data = t.data
        if data.numel() == 0:
            return
        if data.is_contiguous():
            data.reshape(-1).view(torch.uint8).fill_(byte)
        else:
            src = torch.full((data.numel() * data.element_size(),), byte, dtype=torch.uint8)
            data.copy_(src.view(data.dtype).reshape(data.shape))


def still_filled(t: torch.Tensor, byte: int) -> torch.Tensor:
    """Bool tensor of t's shape: elements whose every byte is `byte`."""
    return (element_bytes(t) == byte).all(dim=1).reshape(t.shape)


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (each storage once: the first name wins)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    items = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, t in items:
        if t is None or t.numel() == 0:
            continue
        key = (t.data.untyped_storage().data_ptr(), t.data.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def parameter_names(module: torch.nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


class Region:
    """The elements of one tensor that one disk tensor wrote: a box (start/stop per dim) when
    the written set is exactly a box, else a bool mask."""

    __slots__ = ("box", "mask", "shape")

    def __init__(self, mask: torch.Tensor):
        self.shape = tuple(mask.shape)
        self.box = None
        self.mask = None
        if mask.dim() == 0:
            self.box = ()
            return
        idx = mask.nonzero()
        lo = idx.min(dim=0).values.tolist()
        hi = (idx.max(dim=0).values + 1).tolist()
        volume = 1
        for a, b in zip(lo, hi):
            volume *= b - a
        if volume == idx.shape[0]:
            self.box = tuple(zip(lo, hi))
        else:
            self.mask = mask.clone()

    def to_mask(self) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        m = torch.zeros(self.shape, dtype=torch.bool)
        m[self.slices()] = True
        return m

    def slices(self):
        return tuple(slice(a, b) for a, b in self.box)

    def union(self, other: "Region") -> "Region":
        if self.box is not None and self.box == other.box:
            return self
        return Region(self.to_mask() | other.to_mask())

    def describe(self) -> str:
        if self.box is None:
            return f"mask of {int(self.mask.sum())} elements"
        if self.box == ():
            return "[]"
        return "[" + ", ".join(f"{a}:{b}" for a, b in self.box) + "]"

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """The written elements of t: the box as a tensor, or the mask's elements in order."""
        if self.box is not None:
            return t[self.slices()] if self.box else t
        return t[self.mask]


class WriteTracer:
    """Snapshots every tensor of a module and, at each `step(label)`, records which elements
    changed since the last step as written for `label`."""

    def __init__(self, module: torch.nn.Module):
        self.tensors = named_tensors(module)
        self.snap = {n: element_bytes(t).clone() for n, t in self.tensors.items()}
        self.writes: dict[str, list[tuple[str, Region]]] = {}
        self.order: list[str] = []

    def step(self, label: str) -> None:
        found = []
        for name, t in self.tensors.items():
            cur = element_bytes(t)
            old = self.snap[name]
            if torch.equal(cur, old):
                continue
            changed = (cur != old).any(dim=1).reshape(t.shape)
            found.append((name, Region(changed)))
            self.snap[name] = cur.clone()
        if label not in self.writes:
            self.order.append(label)
            self.writes[label] = []
        self.writes[label].extend(found)


def traced(weights, tracer: WriteTracer):
    """Yield the (name, tensor) pairs of `weights`; after the loader has taken each one and
    asks for the next, attribute what changed to the previous name."""
    prev = None
    for name, tensor in weights:
        if prev is not None:
            tracer.step(prev)
        prev = name
        yield name, tensor
    if prev is not None:
        tracer.step(prev)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: equal bytes (a, b same dtype, same numel)."""
    return (element_bytes(a) == element_bytes(b)).all(dim=1)


def compare_region(disk: torch.Tensor, target: torch.Tensor, region: Region) -> dict:
    """Compare the elements `region` marks in `target` with the disk tensor.

    status: exact (same bytes, in order), broadcast (a one-element disk tensor copied to
    every written element), transposed (a 2-D disk tensor stored transposed), rounded (the
    engine's dtype differs and the cast changed values, the cast bytes are all there),
    differs (anything else)."""
    got = region.values(target.detach()).reshape(-1)
    want = disk.detach()
    cast = want.dtype != target.dtype
    if cast:
        want = want.to(target.dtype)
    rec = {"param_dtype": str(target.dtype).replace("torch.", ""), "disk_dtype": str(disk.dtype).replace("torch.", ""),
           "region": region.describe(), "elements": int(got.numel())}
    status = None
    if got.numel() == want.numel():
        if bool(_same_bytes(got, want.reshape(-1)).all()):
            status = "exact"
        elif want.dim() == 2 and region.box is not None and len(region.box) >= 2 and \
                bool(_same_bytes(got, want.t().contiguous().reshape(-1)).all()):
            status = "transposed"
    elif want.numel() == 1 and got.numel() > 1:
        if bool(_same_bytes(got, want.reshape(1).expand(got.numel()).contiguous()).all()):
            status = "broadcast"
    if status is None:
        n = min(got.numel(), want.numel())
        bad = int((~_same_bytes(got[:n], want.reshape(-1)[:n])).sum()) if n else 0
        rec.update(status="differs", mismatched=bad + abs(got.numel() - want.numel()), disk_elements=int(want.numel()))
        return rec
    rec["status"] = status
    if cast and disk.is_floating_point():
        back = want.to(disk.dtype)
        if not torch.equal(element_bytes(back), element_bytes(disk.detach())):
            rec["status"] = "rounded" if status == "exact" else f"rounded_{status}"
            d = disk.detach().reshape(-1).double()
            w = want.reshape(-1).double()
            rel = ((w - d).abs() / d.abs().clamp_min(torch.finfo(torch.float64).tiny)).max().item()
            rec["max_rel_change"] = rel
            if disk.numel() == 1:
                rec["disk_value"] = d.item()
                rec["stored_value"] = w.item()
    return rec


class Expect:
    """Where the engine's own name mapping says a disk tensor goes: the parameter, and for a
    fused parameter the slice along dim 0 (stacked shard: `rows`; expert: `expert`; a
    per-shard scale vector: `slot`)."""

    __slots__ = ("param", "rows", "expert", "slot", "via", "transform")

    def __init__(self, param: str, rows: tuple[int, int] | None = None, expert: int | None = None,
                 slot: int | None = None, via: str = "", transform=None):
        self.param, self.rows, self.expert, self.slot, self.via = param, rows, expert, slot, via
        # (description, fn): a conversion the engine's weight loader applies by design
        self.transform = transform


def placement_problems(expect: Expect, regions: dict) -> list[str]:
    """Compare where a disk tensor landed (target -> Region) with where the engine's mapping
    says it belongs."""
    if expect.param not in regions:
        return [f"expected in {expect.param} ({expect.via}), written to {sorted(regions)}"]
    region = regions[expect.param]
    if region.box is None:
        return [f"{expect.param}: written elements are not one box ({region.describe()})"]
    dim0 = region.box[0] if region.box else (0, 1)
    want = None
    if expect.expert is not None:
        want = (expect.expert, expect.expert + 1)
    elif expect.slot is not None:
        want = (expect.slot, expect.slot + 1)
    elif expect.rows is not None:
        want = tuple(expect.rows)
    if want is not None and tuple(dim0) != want:
        return [f"{expect.param}: dim 0 {dim0[0]}:{dim0[1]}, the mapping ({expect.via}) gives {want[0]}:{want[1]}"]
    return []


def analyse(runs: list[tuple[int, WriteTracer]], disk: dict, param_names: set[str], expected_skip, expect=None) -> dict:
    """Combine the two loads (fill byte, tracer) into a report.

    disk: name -> tensor (or a zero-argument callable returning it); expected_skip(name) is
    True for disk tensors the engine skips by design for this model; expect(name) -> Expect or
    None: where the engine's mapping puts it (checked against where it landed)."""
    (fill_a, tr_a), (fill_b, tr_b) = runs
    report = {"unwritten": {}, "unwritten_buffers": {}, "differs": {}, "misplaced": {}, "rounded": {}, "skipped": [],
              "skipped_by_design": [], "overlaps": {}, "written": 0, "placement_checked": 0, "checked": {}}
    # Unwritten: elements that kept the fill in both loads.
    for name, ta in tr_a.tensors.items():
        tb = tr_b.tensors.get(name)
        if tb is None:
            continue
        left = still_filled(ta, fill_a) & still_filled(tb, fill_b)
        n = int(left.sum())
        if n:
            key = "unwritten" if name in param_names else "unwritten_buffers"
            report[key][name] = {"elements": n, "of": int(left.numel()), "shape": list(left.shape),
                                 "dtype": str(ta.dtype).replace("torch.", "")}
    # Per disk tensor: the union of what the two loads saw it write.
    coverage: dict[str, torch.Tensor] = {}
    statuses: dict[str, int] = {}
    for name in disk:
        regions: dict[str, Region] = {}
        for _, tr in runs:
            for target, region in tr.writes.get(name, []):
                regions[target] = regions[target].union(region) if target in regions else region
        if not regions:
            (report["skipped_by_design"] if expected_skip(name) else report["skipped"]).append(name)
            continue
        tensor = disk[name]() if callable(disk[name]) else disk[name]
        exp = expect(name) if expect else None
        if exp is not None:
            report["placement_checked"] += 1
            problems = placement_problems(exp, regions)
            if problems:
                report["misplaced"][name] = problems
        for target, region in regions.items():
            if exp is not None and exp.transform is not None and target == exp.param:
                rec = compare_region(exp.transform[1](tensor), tr_a.tensors[target], region)
                rec["loader_transform"] = exp.transform[0]
            else:
                rec = compare_region(tensor, tr_a.tensors[target], region)
            rec["target"] = target
            statuses[rec["status"]] = statuses.get(rec["status"], 0) + 1
            if rec["status"] == "differs":
                report["differs"].setdefault(name, []).append(rec)
            elif rec["status"].startswith("rounded"):
                report["rounded"].setdefault(name, []).append(rec)
            cov = coverage.setdefault(target, torch.zeros(region.shape, dtype=torch.int16))
            cov[region.to_mask()] += 1
        report["written"] += 1
    for target, cov in coverage.items():
        n = int((cov > 1).sum())
        if n:
            report["overlaps"][target] = n
    report["checked"] = dict(sorted(statuses.items()))
    report["ok"] = not (report["unwritten"] or report["differs"] or report["misplaced"] or report["skipped"] or report["overlaps"])
    return report


def run_checked_load(build, load, weights, expected_skip, expect_for=None, disk_weights=None, exempt_for=None) -> dict:
    """build() -> a fresh model; load(model, iterator) runs the engine's loader; weights(model)
    -> the (name, tensor) iterator the engine feeds its loader; disk_weights() -> every tensor
    of the checkpoint (default: weights(None)); expect_for(model) -> expect(name) (see
    `analyse`); exempt_for(model) -> exempt(param) -> reason or None, for parameters the engine
    itself fills with a default when a checkpoint has none. Two loads (all-ones fill, zero
    fill)."""
    runs = []
    names: set[str] = set()
    expect = exempt = None
    for fill in FILL_BYTES:
        model = build()
        if expect is None and expect_for is not None:
            expect = expect_for(model)
        if exempt is None and exempt_for is not None:
            exempt = exempt_for(model)
        for t in named_tensors(model).values():
            fill_bytes(t, fill)
        tracer = WriteTracer(model)
        with torch.no_grad():
            load(model, traced(weights(model), tracer))
        runs.append((fill, tracer))
        names = parameter_names(model)
    disk = {}
    for name, t in (disk_weights or (lambda: weights(None)))():
        disk[name] = t
    report = analyse(runs, disk, names, expected_skip, expect)
    if exempt is not None:
        for name in list(report["unwritten"]):
            reason = exempt(name)
            if reason:
                report.setdefault("unwritten_defaulted", {})[name] = dict(report["unwritten"].pop(name), reason=reason)
        report["ok"] = not (report["unwritten"] or report["differs"] or report["misplaced"] or report["skipped"] or report["overlaps"])
    return report


# ----------------------------------------------------------------------------------------
# Checkpoint reading.
# ----------------------------------------------------------------------------------------

def checkpoint_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt / f for f in files]
    return sorted(ckpt.glob("*.safetensors"))


def iter_checkpoint(ckpt: Path):
    from safetensors import safe_open

    for f in checkpoint_files(ckpt):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def mtp_skip(mtp: bool):
    """The subtree a loader skips by design: the MTP layers for the main model; for the MTP
    draft everything but `mtp.*` (the draft shares the target's embedding and head)."""
    if mtp:
        return lambda name: not name.startswith("mtp.")
    return lambda name: name.startswith("mtp.")


# ----------------------------------------------------------------------------------------
# Shared by the engine parts.
# ----------------------------------------------------------------------------------------

# Both engines' Mamba-2 mixers load `A_log` into the parameter `A` through a weight loader
# that stores -exp(A_log) in fp32 (vLLM layers/mamba/mamba_mixer2.py, SGLang
# srt/layers/attention/mamba/mamba.py: `composed_weight_loader(..., lambda x: -torch.exp(x.float()))`).
MAMBA_A_TRANSFORM = ("-exp(float(A_log))", lambda t: -torch.exp(t.float()))


class InertKernel:
    """Stands in for a GPU kernel object the engine would select; nothing calls it during a
    weight load."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return InertKernel()

    def __call__(self, *args, **kwargs):
        return InertKernel()

    def __bool__(self):
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stacked_expect(name_after: str, module, shard_id, param, via: str) -> Expect:
    """Expected rows of a stacked shard in a fused linear: the shard's offset and size along the
    output dim from the layer's own `output_sizes` (q, k, v or an integer shard index), or one
    slot per shard in a per-shard scale vector."""
    sizes = list(getattr(module, "output_sizes", None) or [])
    if isinstance(shard_id, str):
        index = "qkv".index(shard_id) if shard_id in ("q", "k", "v") else None
    else:
        index = shard_id
    if index is None or not sizes:
        return Expect(name_after, via=via)
    shape0 = param.shape[0] if param.dim() else 1
    if shape0 == sum(sizes):
        start = sum(sizes[:index])
        return Expect(name_after, rows=(start, start + sizes[index]), via=via)
    if shape0 == len(sizes):
        return Expect(name_after, slot=index, via=via)
    return Expect(name_after, via=via)


def expert_expect(name_after: str, expert_id: int, shard_id: str, param, intermediate: int | None, via: str) -> Expect:
    """Expected place of one expert's tensor in a fused expert parameter [E, ...]: index
    `expert_id` along dim 0. Nemotron-H's experts are not gated, so w13 holds the up
    projection alone (shard w1); the w1 / w3 halves of a gated w13 are not told apart."""
    return Expect(name_after, expert=expert_id, via=via)


# ----------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------

def stub_kernel_choice_vllm() -> list[str]:
    """Replace vLLM's GPU kernel / backend pickers for quantized layers with ones that return an
    inert kernel; the CPU platform has none of these kernels. Returns what was replaced."""
    import vllm.model_executor.layers.quantization.modelopt as mo

    replaced = []

    def inert(*args, **kwargs):
        return InertKernel()

    mo.select_linear_kernel = inert
    replaced.append("vllm.model_executor.layers.quantization.modelopt.select_linear_kernel")
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method  # noqa: F401

    for modname, fn in (("vllm.model_executor.layers.fused_moe.oracle.nvfp4", "select_nvfp4_moe_backend"),
                        ("vllm.model_executor.layers.fused_moe.oracle.fp8", "select_fp8_moe_backend"),
                        ("vllm.model_executor.layers.fused_moe.oracle.unquantized", "select_unquantized_moe_backend")):
        mod = __import__(modname, fromlist=[fn])
        orig = getattr(mod, fn)

        def pick(*args, _fn=fn, **kwargs):
            return _vllm_first_backend(_fn), InertKernel
        for other in list(sys.modules.values()):  # every module that imported it by name
            if getattr(other, "__name__", "").startswith("vllm.") and getattr(other, fn, None) is orig:
                setattr(other, fn, pick)
        replaced.append(f"{modname}.{fn}")
    # The CPU platform has no non-gated (relu2) fused-MoE kernel and FusedMoEConfig refuses
    # the layer there; the check asks the platform, so answer it as a CUDA platform would.
    import vllm.model_executor.layers.fused_moe.config as moe_cfg

    orig_post_init = moe_cfg.FusedMoEConfig.__post_init__

    def post_init(self):
        plat = moe_cfg.current_platform
        plat.is_cuda_alike = lambda: True
        try:
            orig_post_init(self)
        finally:
            del plat.is_cuda_alike
    moe_cfg.FusedMoEConfig.__post_init__ = post_init
    replaced.append("vllm.model_executor.layers.fused_moe.config.FusedMoEConfig: platform kernel check answered as CUDA")
    # The CPU attention backend has no FP8 KV cache; take it as the backend all the same (the
    # attention layer's k_scale / v_scale parameters come from the quant config, not from it).
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu_attn = AttentionBackendEnum.CPU_ATTN.get_class()
    cpu_attn.supports_kv_cache_dtype = classmethod(lambda cls, dtype: True)
    replaced.append("CPU_ATTN attention backend: accepts the FP8 KV cache dtype")
    return replaced


def _vllm_first_backend(fn: str):
    if fn == "select_nvfp4_moe_backend":
        from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend as B
    elif fn == "select_fp8_moe_backend":
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend as B
    else:
        import vllm.model_executor.layers.fused_moe.oracle.unquantized as u

        B = next(v for k, v in vars(u).items() if k.endswith("MoeBackend") and isinstance(v, type) and hasattr(v, "__members__"))
    for name in ("MARLIN", "TRITON"):
        if hasattr(B, name):
            return getattr(B, name)
    return next(iter(B))


class VllmEngine:
    name = "vllm"

    def __init__(self, ckpt: Path, mtp: bool):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        self.ckpt, self.mtp = ckpt, mtp
        import vllm
        from vllm.engine.arg_utils import EngineArgs

        self.version = vllm.__version__
        self.stubbed = stub_kernel_choice_vllm()
        kw = dict(model=str(ckpt), dtype="bfloat16", enforce_eager=True, load_format="safetensors", max_model_len=256)
        if mtp:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
        # The CPU platform wants a CPU Triton backend to run kernels; none runs here.
        import vllm.triton_utils as tu

        had = tu.HAS_TRITON
        tu.HAS_TRITON = True
        try:
            self.vllm_config = EngineArgs(**kw).create_engine_config()
        finally:
            tu.HAS_TRITON = had
        self.stubbed.append("vllm.triton_utils.HAS_TRITON: True while the CPU platform checks the config")
        self._init_distributed()

    def _init_distributed(self):
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        if ps._WORLD is None:
            with set_current_vllm_config(self.vllm_config):
                ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
                ps.initialize_model_parallel(1, 1)

    def model_config(self):
        if self.mtp:
            return self.vllm_config.speculative_config.draft_model_config
        return self.vllm_config.model_config

    def build(self):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        mc = self.model_config()
        # A second build registers the same layer names again: start from an empty context.
        self.vllm_config.compilation_config.static_forward_context.clear()
        with set_current_vllm_config(self.vllm_config), set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            return initialize_model(vllm_config=self.vllm_config, model_config=mc)

    def weights(self, model):
        """The engine's own checkpoint iterator (with the model's filters)."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        loader = DefaultModelLoader(self.vllm_config.load_config)
        return loader.get_all_weights(self.model_config(), model)

    def load(self, model, weights):
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            model.load_weights(weights)

    def expect_for(self, model):
        """Expected placement from vLLM's own tables: the model's WeightsMapper (with the quant
        config's scale mappers, as AutoWeightsLoader merges them), stacked shard ids, and each
        RoutedExperts layer's `get_expert_mapping`."""
        from vllm.model_executor.models.utils import WeightsMapper

        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        mapper = getattr(model, "hf_to_vllm_mapper", None) or WeightsMapper()
        qc = self.vllm_config.quant_config if not self.mtp else getattr(model, "quant_config", None)
        if qc is not None:
            mapper = mapper | qc.get_cache_scale_mapper()
            if hasattr(qc, "get_checkpoint_weight_mapper"):
                mapper = mapper | qc.get_checkpoint_weight_mapper()
        experts = {n: m for n, m in modules.items() if hasattr(m, "get_expert_mapping") and hasattr(m, "w2_weight")}
        mtp_experts = []
        if self.mtp and getattr(self.model_config().hf_config, "n_routed_experts", None):
            # NemotronHMTP.load_weights maps experts through the model-level table
            from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping

            mtp_experts = fused_moe_make_expert_params_mapping(
                model, ckpt_gate_proj_name="up_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name=None,
                num_experts=self.model_config().hf_config.n_routed_experts)

        def expect(name):
            if self.mtp:
                name = name.replace("mtp.layers.", "model.layers.") if name.startswith("mtp.") else name
                mapped = (name, None)
            else:
                mapped = mapper._map_name_with_shard(name)
            if mapped is None:
                return None
            new, shard = mapped
            for param_name, weight_name, expert_id, shard_id in mtp_experts:
                if weight_name in new:
                    target = new.replace(weight_name, param_name)
                    return expert_expect(target, expert_id, shard_id, params[target], None, f"expert {expert_id} {shard_id}") \
                        if target in params else Expect(target, via=f"expert {expert_id} {shard_id}")
            for path, mod in experts.items():
                # RoutedExperts.load_weights: qual_name.replace(weight_name, param_name), less
                # the layer name, is the attribute on the RoutedExperts module.
                layer = getattr(mod, "layer_name", path)
                if not new.startswith(layer + "."):
                    continue
                for param_name, weight_name, expert_id, shard_id in mod.get_expert_mapping():
                    if weight_name in new:
                        leaf = new.replace(weight_name, param_name).removeprefix(layer + ".")
                        target = f"{path}.{leaf}"
                        if target in params:
                            return expert_expect(target, expert_id, shard_id, params[target], None, f"expert {expert_id} {shard_id}")
                        return Expect(target, via=f"expert {expert_id} {shard_id}")
                return None
            if self.mtp:
                for pn, wn, sid in (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")):
                    if wn in new and ".mixer." in new:
                        new, shard = new.replace(wn, pn), sid
                        break
            if new not in params:
                return None
            if shard is not None:
                mod = modules.get(new.rsplit(".", 1)[0])
                return stacked_expect(new, mod, shard, params[new], f"stacked {shard}")
            if name.endswith(".A_log") and new.endswith(".A"):
                return Expect(new, via="name", transform=MAMBA_A_TRANSFORM)
            return Expect(new, via="name")
        return expect


    def exempt_for(self, model):
        """vLLM's `DefaultModelLoader.track_weights_loading` lets a quantized checkpoint omit
        the parameters of a `BaseKVCacheMethod` module (they default)."""
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        kv = {n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), BaseKVCacheMethod)}

        import vllm.model_executor.layers.quantization.modelopt as mo

        modules = dict(model.named_modules())

        def exempt(name):
            owner, leaf = name.rsplit(".", 1)
            if owner in kv:
                return "KV-cache quant parameter: vLLM defaults it when the checkpoint has none"
            qm = getattr(modules.get(owner), "quant_method", None)
            if leaf == "input_scale" and isinstance(getattr(qm, "fmt", None), mo._DropInputScale):
                return "W4A16_NVFP4 placeholder: vLLM registers input_scale and retires it after loading (modelopt.py _DropInputScale)"
            if leaf in ("w13_input_scale", "w2_input_scale") and getattr(qm, "use_a16", False):
                return "W4A16_NVFP4 experts: registered, never read (ModelOptNvFp4FusedMoE.use_a16)"
            return None
        return exempt


# ----------------------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------------------

class SglangEngine:
    name = "sglang"

    def __init__(self, ckpt: Path, mtp: bool):
        import sglang
        import torch.distributed as dist
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
        from sglang.srt.server_args import ServerArgs

        self.ckpt, self.mtp = ckpt, mtp
        self.version = sglang.__version__
        # Backend choices as server options: Marlin MoE (the NVFP4 MoE path SGLang takes below
        # Blackwell), no CUDA graphs, no radix cache (its Mamba snapshots need GPU support).
        self.stubbed = ["server args: moe_runner_backend=marlin, disable_cuda_graph, disable_radix_cache"]
        kw = dict(model_path=str(ckpt), device="cpu", dtype="bfloat16", tp_size=1, load_format="safetensors",
                  disable_cuda_graph=True, disable_radix_cache=True, moe_runner_backend="marlin")
        if mtp:
            kw.update(speculative_algorithm="EAGLE", speculative_draft_model_path=str(ckpt),
                      speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
        self.server_args = ServerArgs(**kw)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        reset_context()
        publish(self.server_args, role="test", ranks=SpawnRanks(world_rank=0))
        if not dist.is_initialized():
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        if ps._WORLD is not None:
            get_parallel().override_permanently(world_group=ps._WORLD)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(backend="gloo")
        from sglang.srt.layers.moe.utils import initialize_moe_config

        initialize_moe_config()
        self.model_config = ModelConfig.from_server_args(self.server_args, model_path=str(ckpt),
                                                         is_draft_model=mtp)
        self.stubbed += stub_kernel_choice_sglang()

    def build(self):
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        load_config = LoadConfig(load_format="safetensors")
        quant_config = _get_quantization_config(self.model_config, load_config)
        self.quant_config = quant_config
        with set_default_torch_dtype(self.model_config.dtype), torch.device("cpu"):
            return _initialize_model(self.model_config, load_config, quant_config)

    def weights(self, model):
        from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

        files = [str(f) for f in checkpoint_files(self.ckpt)]
        return safetensors_weights_iterator(files)

    def load(self, model, weights):
        model.load_weights(weights)

    def expect_for(self, model):
        """Expected placement from SGLang's own tables: the model's remap_prefix/remap_substr,
        its stacked_params_mapping and FusedMoE.make_expert_params_mapping (as its
        load_weights applies them)."""
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
        from sglang.srt.models.nemotron_h import replace_prefix, replace_substrings

        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        stacked = list(getattr(model, "stacked_params_mapping", []) or [])
        n_exp = getattr(model.config, "max_n_routed_experts", None) or getattr(model.config, "n_routed_experts", 0)
        experts = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="up_proj", ckpt_down_proj_name="down_proj",
                                                      ckpt_up_proj_name="", num_experts=n_exp) if n_exp else []

        def expect(name):
            if hasattr(model, "remap_prefix"):
                name = replace_prefix(name, model.remap_prefix)
                name = replace_substrings(name, model.remap_substr)
            if self.mtp:
                name = name.replace("mtp.layers.", "model.layers.")
            for param_name, weight_name, shard_id in stacked:
                if weight_name in name:
                    new = name.replace(weight_name, param_name)
                    if new in params:
                        return stacked_expect(new, modules.get(new.rsplit(".", 1)[0]), shard_id, params[new], f"stacked {shard_id}")
                    return None
            for param_name, weight_name, expert_id, shard_id in experts:
                if weight_name in name:
                    new = name.replace(weight_name, param_name)
                    if new in params:
                        return expert_expect(new, expert_id, shard_id, params[new], None, f"expert {expert_id} {shard_id}")
                    return None
            if name in params:
                if name.endswith(".A") :
                    return Expect(name, via="name", transform=MAMBA_A_TRANSFORM)
                return Expect(name, via="name")
            return None
        return expect

    def exempt_for(self, model):
        """Parameters SGLang creates that no checkpoint carries: KV-cache scales (default 1.0
        when absent), the swizzled copy of an NVFP4
        MoE block scale (a kernel layout, built from `w*_weight_scale`; modelopt_quant.py
        ModelOptNvFp4FusedMoEMethod.create_weights), and the `input_scale` placeholders of
        weight-only NVFP4 (ModelOptNvFp4A16LinearMethod: "consumed during loading and
        discarded before runtime"; MoE: the W4A16 config's experts, filled with 1.0)."""
        from sglang.srt.layers.quantization import modelopt_quant as mq
        from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod

        modules = dict(model.named_modules())
        a16_config = getattr(self.quant_config, "nvfp4a16_config", None)  # this model's, not a later build's

        def exempt(name):
            owner, leaf = name.rsplit(".", 1)
            qm = getattr(modules.get(owner), "quant_method", None)
            if isinstance(qm, BaseKVCacheMethod):
                return "KV-cache quant parameter: SGLang defaults it when the checkpoint has none (quantization/kv_cache.py)"
            if leaf.endswith("_blockscale_swizzled"):
                return "kernel-layout copy of the NVFP4 MoE block scale, derived after loading"
            if leaf == "input_scale" and isinstance(qm, mq.ModelOptNvFp4A16LinearMethod):
                return "W4A16_NVFP4 placeholder: discarded before runtime (ModelOptNvFp4A16LinearMethod)"
            mqc = getattr(qm, "quant_config", None)
            a16 = mqc is not None and (getattr(mqc, "is_w4a16", False) or (a16_config is not None and mqc is a16_config))
            if leaf in ("w13_input_scale", "w2_input_scale") and a16:
                return "W4A16_NVFP4 experts: no input scale on disk; SGLang fills 1.0 (ModelOptNvFp4FusedMoEMethod.create_weights)"
            return None
        return exempt


def stub_kernel_choice_sglang() -> list[str]:
    """SGLang without a GPU and without its CPU kernel package (not on PyPI) picks vLLM's
    custom rotary op as a fallback kernel; take the CPU rotary path instead."""
    import sglang.srt.layers.rotary_embedding.base as rope

    rope._is_cpu = True
    return ["sglang.srt.layers.rotary_embedding.base._is_cpu = True (rotary kernel choice)"]


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------

ENGINES = {"vllm": lambda ckpt, mtp: VllmEngine(ckpt, mtp), "sglang": lambda ckpt, mtp: SglangEngine(ckpt, mtp)}


def versions(engine_name: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in (engine_name, "torch", "transformers", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def check(ckpt: Path, engine_name: str, mtp: bool = False) -> dict:
    result = {"checkpoint": str(ckpt), "engine": engine_name, "mtp": mtp, "versions": versions(engine_name),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        engine = ENGINES[engine_name](ckpt, mtp)
        result["stubbed"] = engine.stubbed
        report = run_checked_load(engine.build, engine.load, engine.weights, mtp_skip(mtp),
                                  expect_for=engine.expect_for, disk_weights=lambda: iter_checkpoint(ckpt),
                                  exempt_for=engine.exempt_for)
    except Exception as exc:  # the engine refused the checkpoint: that is the finding
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc(limit=-6).splitlines()[-14:])
        return result
    result.update(report)
    return result


def summarize(report: dict) -> dict:
    """One report's outcome in a few numbers (the full lists stay in the report)."""
    if "error" in report:
        return {"ok": False, "error": report["error"]}
    out = {"ok": report["ok"], "written": report["written"], "placement_checked": report["placement_checked"],
           "checked": report["checked"]}
    for key in ("unwritten", "differs", "misplaced", "overlaps"):
        out[key] = sorted(report[key])
    out["skipped"] = report["skipped"]
    out["skipped_by_design"] = len(report["skipped_by_design"])
    out["unwritten_defaulted"] = {k: v["reason"] for k, v in report.get("unwritten_defaulted", {}).items()}
    out["rounded"] = {k: [{"param": r["target"], "param_dtype": r["param_dtype"], "disk": r.get("disk_value"),
                           "stored": r.get("stored_value"), "max_rel_change": r["max_rel_change"]} for r in v]
                      for k, v in report["rounded"].items()}
    return out


def merge(reports: list[Path], labels: dict | None = None) -> dict:
    """Runs of this script (their --json files) in one table: engine -> checkpoint (its folder's
    parent/name, or labels[path]) -> summary."""
    table: dict = {}
    meta: dict = {}
    for path in reports:
        r = json.loads(path.read_text())
        meta.setdefault(r["engine"], {"versions": r["versions"], "stubbed": r.get("stubbed")})
        if r.get("stubbed"):
            meta[r["engine"]]["stubbed"] = r["stubbed"]
        ck = Path(r["checkpoint"])
        key = (labels or {}).get(r["checkpoint"], f"{ck.parent.name}/{ck.name}") + (" --mtp" if r.get("mtp") else "")
        table.setdefault(r["engine"], {})[key] = dict(summarize(r), date=r["date"], report=path.name)
    return {"engines": meta, "results": table}


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "merge":
        ap = argparse.ArgumentParser(prog="check_engines.py merge", description="combine --json reports into one file")
        ap.add_argument("out", type=Path)
        ap.add_argument("reports", type=Path, nargs="+")
        ap.add_argument("--extra", type=Path, help="a JSON object merged in at the top (e.g. how the runs were made)")
        a = ap.parse_args(argv[1:])
        doc = json.loads(a.extra.read_text()) if a.extra else {}
        doc.update(merge(a.reports))
        a.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True)
    ap.add_argument("--mtp", action="store_true", help="load the checkpoint's mtp.* subtree with the engine's MTP draft model")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = check(args.checkpoint, args.engine, args.mtp)
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    if "error" in result:
        return 2
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
