"""fp4kit's `modelopt-lightning` recipe against nvidia-modelopt 0.47 making its own 4/6 choices.

tests/pipeline/test_modelopt_parity.py hands ModelOpt fp4kit's per-block 4/6 choices. Here
ModelOpt decides for itself, as its Lightning recipe (`w4a16_nvfp4_4o6.yaml`) does: `mtq.quantize`
with the recipe's quant_cfg and its MSE algorithm (amax multipliers 1.0 and 1.5 per block), then
`export_hf_checkpoint`. fp4kit runs what `fp4kit quantize --recipe modelopt-lightning --calib NxL
--device D` runs, on the same model and the same calibration tokens. Every tensor of the two
checkpoints is compared (names, dtypes, shapes, bytes); for each NVFP4 4/6 weight, per 16-element
block: whose 4/6 choice differs, which packed and scale bytes differ, and why.

How each side decides (ModelOpt 0.47 source: model_calib.mse_calibrate, calib/mse.py
MseCalibrator, StaticBlockScaleQuantizer._fake_quantize, kernels/.../fp4_kernel.py):
  ModelOpt  per block, candidate amax a*c for c in linspace(1.0, 1.5, 2): the weight, cast to
            fp32 and viewed as [blocks, 16], goes through its static fake-quant kernel with fp32
            output: scale = fake_e4m3(a*c/6) against global amax g*448/256 (no 2^-9 floor: a
            scale of at most 2^-10 becomes 0 and the block reads as all zeros), then each
            element E2M1-rounded from |x|/scale (a Triton division on CUDA) and multiplied back.
            Error: F.mse_loss(x, xq, reduction="none") summed over the block with torch.sum;
            torch.argmin keeps the first candidate on a tie.
  fp4kit    per block, the bytes each candidate would export (static scale with the 2^-9
            floor, step e4m3 * g/1536, exact division, nvfp4.quantize), squared error in fp32
            summed in a fixed pairwise order; 4 only if strictly smaller.
So ModelOpt judges a reconstruction computed by its fake quant, not the one its export writes.
A block whose choices differ is put in the first class below that holds for it (CLASSES).
The same MSE search also runs on the recipe's FP8 weight quantizers (Mamba in/out_proj): their
per-tensor amax becomes max|W| or 1.5 * max|W|; fp4kit's recipe searches the same way
(`amax_search`), and a tensor where the two chose differently is classed
TENSOR_CLASSES["fp8_weight_mse_multiplier"].

Activation scales (input_scale, k_scale, v_scale) come from each side's calibration forward.
Where one differs, fp4kit runs once more with its MoE experts dispatched as ModelOpt's calibration
dispatches them (config._experts_implementation = "eager") and those scales are compared again
(activation_scale_control); `every_difference_explained` holds only if they then agree.

ModelOpt's fake-quant kernel needs CUDA and Triton. With --device cpu (a smoke test of this
script) ModelOpt's MSE runs on a torch transcription of that kernel instead (same scale
function, same thresholds, exact division); its results say so and are not a parity result.

    python scripts/compare_modelopt_mse.py                        # tiny Nemotron-H on CUDA
    python scripts/compare_modelopt_mse.py --model DIR --calib 8x256 --device cuda
    python scripts/compare_modelopt_mse.py --device cpu --out /tmp/smoke.json

Writes benchmarks/results/modelopt-mse-parity-<gpu>.json (or --out; with its date, command and
versions) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fp4kit.formats import e2m1, e4m3, fp8, nvfp4  # noqa: E402
from fp4kit.export.checkpoint import CheckpointReader, read_quant_configs  # noqa: E402
from fp4kit.formats.arith import div_by_scale  # noqa: E402
from fp4kit.formats.constants import E4M3_MAX, NVFP4_BLOCK_SIZE  # noqa: E402

LIGHTNING_RECIPE = "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/ptq/w4a16_nvfp4_4o6.yaml"
FP4KIT_RECIPE = "modelopt-lightning"
MAX_EXAMPLES = 8  # differing blocks kept per class in the JSON

# Why a block's 4/6 choice differs, in the order they are tested. `owner` says whose arithmetic
# the difference comes from.
CLASSES: dict[str, dict[str, str]] = {
    "modelopt_decision_not_reproduced": {
        "owner": "unexplained",
        "explanation": (
            "ModelOpt's calibrated amax holds a choice that its own fake quant and loss, re-run "
            "here on the same weight, do not give; the diagnosis below does not apply."
        ),
    },
    "fake_quant_scale_underflow": {
        "owner": "modelopt",
        "explanation": (
            "ModelOpt's MSE fake quant casts the block scale to E4M3 without the 2^-9 floor that "
            "its export applies: for this candidate the scale rounds to 0 and the block is judged "
            "as all zeros, while the export writes scale 2^-9 and nonzero codes."
        ),
    },
    "fake_quant_scale_code_differs": {
        "owner": "modelopt",
        "explanation": (
            "The fake quant rounds the block scale to a different E4M3 code than the export: it "
            "computes (a/6) * (448 / (g*1.75/6)) where the export computes (a/6) * 256 / (g/6); "
            "a*256/g is often exactly an E4M3 midpoint (a and g are bf16), and the two roundings "
            "land on either side of it."
        ),
    },
    "fake_quant_step_last_bits": {
        "owner": "modelopt",
        "explanation": (
            "Same E4M3 scale code, but the fake quant's step e4m3 * (1 / (448 / (g*1.75/6))) "
            "differs in the last bits from the exported step e4m3 * g/1536; ModelOpt scores a "
            "reconstruction its export does not write, which flips a close decision."
        ),
    },
    "fake_quant_rounding_differs": {
        "owner": "modelopt",
        "explanation": (
            "Same step, but an element's E2M1 value differs: the fake quant's |x| / step (a "
            "Triton fp32 division on CUDA) falls on the other side of an E2M1 midpoint than the "
            "export's exact division."
        ),
    },
    "near_tie_summation": {
        "owner": "none",
        "explanation": (
            "Both sides reconstruct the block identically for both candidates; the two squared "
            "errors agree to within the rounding of a 16-term fp32 sum, which ModelOpt forms with "
            "torch.sum and fp4kit in a fixed pairwise order."
        ),
    },
    "unexplained": {
        "owner": "unexplained",
        "explanation": "None of the above holds; the example records hold the numbers.",
    },
}
TENSOR_CLASSES: dict[str, str] = {
    "nvfp4_4o6_choice": "NVFP4 4/6 weight, scale or packed bytes: follow from the block choices above",
    "fp8_weight_mse_multiplier": (
        "FP8 weight and weight_scale. The recipe's MSE algorithm searches its amax "
        "multipliers {1.0, 1.5} for every static weight quantizer, the FP8 Mamba projections included "
        "(fp8_scale_sweep=false means 'multiplier-search MSE for all quantizers'). Where 1.5 * max|W| "
        "gives the lower fake-quant MSE ModelOpt keeps it, stored in the weight dtype (bf16), and exports "
        "weight_scale = bf16(1.5 * max|W|) / 448 with the weight bytes quantized to that scale. "
        "fp4kit's modelopt-lightning runs the same search (amax_search: [1.0, 1.5]); a difference here "
        "means the two searches chose differently."
    ),
    "nvfp4_same_choice_bytes_differ": "NVFP4 bytes differ in blocks where both chose the same candidate: export arithmetic",
    "global_scale": "weight_scale_2 differs: the two global amax differ",
    "activation_scale": (
        "a scale computed from calibration activations (input_scale, k_scale, v_scale) differs. "
        "ModelOpt calibrates with config._experts_implementation = 'eager' (its per-expert F.linear "
        "interception needs it); fp4kit with the model's own implementation (grouped_mm on CUDA), so "
        "activations after the first MoE layer, and a max over them, can differ in the last bits; "
        "see each row's ulps_apart"
    ),
    "other": "any other byte difference",
}


# --- ModelOpt's fake quant: recorded on CUDA, transcribed on the CPU ---------------------------


@dataclass
class FakeQuantCalls:
    """What ModelOpt's MSE calibration passed to its static NVFP4 fake-quant kernel."""

    emulated: bool
    fake_quant: object = None  # the kernel itself, unrecorded, for the diagnosis
    active: bool = False
    calls: Counter = field(default_factory=Counter)


# ModelOpt's fp4_round_magnitude, outermost test first: (bound, bound included, magnitude below it).
_FP4_ROUNDING = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
                 (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))


def _fp4_round_magnitude(a: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(a, 6.0)
    for bound, included, value in reversed(_FP4_ROUNDING):  # innermost where() first
        out = torch.where(a <= bound if included else a < bound, value, out)
    return out


def _static_fake_quant_on_cpu(x, amax, global_amax=None, quantize_block_scales=True, fp8_max_for_normalization=E4M3_MAX, out_dtype=None):
    """ModelOpt's `static_blockwise_fp4_fake_quant` + `nvfp4_scalar_quant`, in torch (exact division)."""
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel import compute_fp4_scales

    n = amax.numel()
    scale = compute_fp4_scales(amax, global_amax, quantize_block_scales, fp8_max_for_normalization=fp8_max_for_normalization)
    scale = scale.float().reshape(n, 1)
    v = x.contiguous().reshape(n, -1).float()
    zero = scale == 0.0
    safe = torch.where(zero | scale.isnan() | scale.isinf(), torch.ones_like(scale), scale)
    r = _fp4_round_magnitude(v.abs() / safe) * safe
    y = torch.where(zero, torch.zeros_like(v), torch.where(v >= 0, r, -r))
    return y.to(out_dtype or x.dtype).reshape(x.shape)


def install_fake_quant(device: torch.device) -> FakeQuantCalls:
    """Wrap (CUDA) or provide (CPU) the kernel ModelOpt's StaticBlockScaleQuantizer calls."""
    import modelopt.torch.kernels.quantization.gemm as kernels

    calls = FakeQuantCalls(emulated=device.type != "cuda")
    if calls.emulated:
        kernels.IS_AVAILABLE = True  # checked per call by StaticBlockwiseFP4FakeQuantFunction
        inner = _static_fake_quant_on_cpu
    elif not kernels.IS_AVAILABLE:
        raise SystemExit("ModelOpt's Triton kernels did not load on this CUDA machine (is triton installed?)")
    else:
        inner = kernels.static_blockwise_fp4_fake_quant

    def fake_quant(x, amax, global_amax=None, quantize_block_scales=True, fp8_max_for_normalization=E4M3_MAX, out_dtype=None):
        if calls.active:
            out = out_dtype or x.dtype
            calls.calls[f"x {x.dtype} -> {out} on {x.device.type}, fp8 norm {fp8_max_for_normalization:g}"] += 1
        return inner(x, amax, global_amax, quantize_block_scales, fp8_max_for_normalization, out_dtype)

    kernels.static_blockwise_fp4_fake_quant = fake_quant
    calls.fake_quant = inner
    return calls


# --- the two runs -------------------------------------------------------------------------------


def modelopt_lightning_cfg() -> tuple[dict, dict]:
    from modelopt.recipe import load_recipe

    cfg = load_recipe(LIGHTNING_RECIPE).quantize.model_dump()
    algo = cfg["algorithm"]
    expected = {"method": "mse", "start_multiplier": 1.0, "stop_multiplier": 1.5, "step_size": 0.5, "fp8_scale_sweep": False}
    got = {k: algo.get(k) for k in expected}
    if got != expected:
        raise SystemExit(f"{LIGHTNING_RECIPE}: algorithm {got} is not the 4/6 MSE search this script diagnoses ({expected})")
    return cfg, got


def quantizer_weight(model, quantizer_name: str) -> torch.Tensor:
    """The weight a ModelOpt weight quantizer quantizes (a Linear's, or one expert's slice)."""
    parent, _, leaf = quantizer_name.rpartition(".")
    if leaf.isdigit():  # `<experts>.up_proj_weight_quantizers.<e>`
        owner, _, lst = parent.rpartition(".")
        return getattr(model.get_submodule(owner), lst.removesuffix("_weight_quantizers"))[int(leaf)]
    if leaf != "weight_quantizer":
        raise ValueError(f"unexpected weight quantizer name {quantizer_name}")
    return model.get_submodule(parent).weight


def quantizer_disk_name(quantizer_name: str, disk_name) -> str:
    parent, _, leaf = quantizer_name.rpartition(".")
    if leaf.isdigit():
        owner, _, lst = parent.rpartition(".")
        return f"{disk_name(owner)}.{leaf}.{lst.removesuffix('_weight_quantizers')}"
    return disk_name(parent)


@dataclass
class ModelOptChoice:
    """ModelOpt's calibrated 4/6 state for one exported NVFP4 module."""

    mult: torch.Tensor  # [blocks] float32: 1.0, 1.5, or NaN where the amax is neither a nor 1.5a
    global_amax: torch.Tensor  # 0-d float32, as its fake quant and its export use it
    fp8_norm: float


def run_modelopt(model_ref: str, samples: torch.Tensor, device: torch.device, out_dir: Path, calls: FakeQuantCalls) -> tuple[dict, dict]:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer
    from modelopt.torch.quantization.utils.numeric_utils import fp8_max_for_normalization

    from fp4kit.models import adapter_for
    from fp4kit.quantize import load_model

    cfg, algorithm = modelopt_lightning_cfg()
    model, _ = load_model(model_ref, device=str(device), tokenizer=False)
    disk_name = adapter_for(model).disk_name

    def forward_loop(m):
        with torch.no_grad():
            for i in range(samples.shape[0]):
                m(input_ids=samples[i : i + 1].to(device), use_cache=False)

    t0 = time.perf_counter()
    calls.active = True
    mtq.quantize(model, cfg, forward_loop)
    calls.active = False
    t_quantize = time.perf_counter() - t0

    choices: dict[str, ModelOptChoice] = {}
    with torch.no_grad():
        for name, q in model.named_modules():
            if not (isinstance(q, StaticBlockScaleQuantizer) and q.is_enabled and (q.block_sizes or {}).get("four_over_six")):
                continue
            w = quantizer_weight(model, name).detach()
            a = w.reshape(-1, NVFP4_BLOCK_SIZE).abs().amax(-1).float()
            amax = q._amax.float().reshape(-1)
            mult = torch.full_like(a, float("nan"))
            mult = torch.where(amax == a, 1.0, mult)
            mult = torch.where((amax == a * 1.5) & (amax != a), 1.5, mult)
            choices[quantizer_disk_name(name, disk_name)] = ModelOptChoice(
                mult.cpu(), q.global_amax.detach().float().reshape(()).clone(), fp8_max_for_normalization(q)
            )
    t0 = time.perf_counter()
    export_hf_checkpoint(model, export_dir=str(out_dir))
    info = {"recipe": LIGHTNING_RECIPE, "algorithm": algorithm, "quantizers_4o6": len(choices),
            "quantize_s": round(t_quantize, 2), "export_s": round(time.perf_counter() - t0, 2)}
    del model
    return choices, info


def run_fp4kit(model_ref: str, calib: str, seed: int, device: torch.device, arith: str, out_dir: Path, shown: str):
    """fp4kit's run on `model_ref` (a folder), with its command as `shown` names the model."""
    from fp4kit.quantize import QuantizeJob, run

    job = QuantizeJob(model=model_ref, recipe=FP4KIT_RECIPE, calib=calib, output=str(out_dir), overwrite=True,
                      seed=seed, device=str(device), progress=False, arith=arith)
    t0 = time.perf_counter()
    qm, path = run(job, log=lambda m: print(f"fp4kit: {m}", file=sys.stderr))
    command = f"fp4kit quantize --model {shown} --recipe {FP4KIT_RECIPE} --calib {calib} --seed {seed} --device {device} --arith {arith} -o <tmp>"
    return qm, Path(path), {"command": command, "total_s": round(time.perf_counter() - t0, 2),
                            "timings_s": {k: round(v, 2) for k, v in qm.timings.items()}, "warnings": qm.warnings}


def activation_scale_control(model_ref: str, calib: str, seed: int, device: torch.device, arith: str, out_dir: Path,
                             shown: str, mo: dict, names: list[str]) -> dict:
    """fp4kit once more with its MoE experts run as ModelOpt's calibration runs them (per-expert
    "eager"), and the activation scales that differed compared again."""
    import fp4kit.quantize as fq

    load = fq.load_model

    def load_with_eager_experts(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        model.config._experts_implementation = "eager"
        for m in model.modules():  # each experts module dispatches on its own config at every call
            if hasattr(m, "has_gate") and getattr(m, "config", None) is not None:
                m.config._experts_implementation = "eager"
        return model, tokenizer

    fq.load_model = load_with_eager_experts
    try:
        qm, path, info = run_fp4kit(model_ref, calib, seed, device, arith, out_dir, shown)
    finally:
        fq.load_model = load
    del qm
    reader = CheckpointReader(path)
    rows = []
    for name in names:
        a, b = mo[name], reader.get(name)
        rows.append({"name": name, "values": [float(a), float(b)], "identical": bool(torch.equal(raw_bytes(a), raw_bytes(b)))})
    del reader
    return {"what": "fp4kit with config._experts_implementation = 'eager' set after its load, as ModelOpt's calibration sets it",
            "fp4kit_total_s": info["total_s"], "tensors": len(rows), "identical": sum(r["identical"] for r in rows),
            "rows": rows}


# --- reading and comparing ---------------------------------------------------------------------


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor, copied out of the files' memory maps (the folder may be removed afterwards)."""
    reader = CheckpointReader(folder)
    tensors = {name: reader.get(name).clone() for name in sorted(reader.names())}
    del reader
    gc.collect()
    return tensors


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Distance in fp32 units in the last place between two finite fp32 scalars of one sign."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.numel() != 1 or b.numel() != 1:
        return None
    ia, ib = (int(t.reshape(1).view(torch.int32).item()) for t in (a, b))
    return abs(ia - ib) if (ia >= 0) == (ib >= 0) else None


@dataclass
class Candidates:
    """Both 4/6 candidates of every block of a 2-D weight [N, K]: per block [N, K/16] (recon [N, K/16, 16])."""

    scale: list[torch.Tensor]  # float8_e4m3fn block scale each candidate exports
    step: list[torch.Tensor]  # fp32 step the export dequantizes with
    recon: list[torch.Tensor]  # fp32 exported reconstruction
    err: list[torch.Tensor]  # fp4kit's fp32 pairwise-summed squared error
    exact: list[torch.Tensor]  # float64 squared error of the exported reconstruction


def fp4kit_candidates(w: torch.Tensor, g: torch.Tensor, arith: str) -> Candidates:
    """What nvfp4.quantize(scale_rule="4o6") computes for each candidate, kept per block."""
    n, k = w.shape
    x = w.float().reshape(n, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_amax = w.reshape(n, -1, NVFP4_BLOCK_SIZE).abs().amax(-1).float()
    g = torch.where(g == 0, torch.ones_like(g), g).float()
    global_scale = nvfp4.global_scale_of(g, "4o6", arith)
    c = Candidates([], [], [], [], [])
    for scale in nvfp4.four_over_six_candidates(block_amax, g, arith):
        step = scale.float() * global_scale
        recon = e2m1.decode(e2m1.encode(x / step.unsqueeze(-1))) * step.unsqueeze(-1)
        d = recon - x
        c.scale.append(scale)
        c.step.append(step)
        c.recon.append(recon)
        c.err.append(nvfp4.block_sum16(d * d))
        c.exact.append((recon.double() - x.double()).pow(2).sum(-1))
    return c


@dataclass
class ModelOptView:
    """What ModelOpt's MSE search saw for each candidate, per block [N, K/16]."""

    loss: list[torch.Tensor]  # its loss: torch.sum over the block of F.mse_loss(x, xq)
    step: list[torch.Tensor]  # its fake-quant block step (compute_fp4_scales)
    recon: list[torch.Tensor]  # its fake-quant output, [N, K/16, 16]
    decision: torch.Tensor  # argmin over the candidates: True = chose 1.5 (block max -> 4)


def modelopt_view(w: torch.Tensor, choice: ModelOptChoice, fake_quant) -> ModelOptView:
    """Re-run ModelOpt's MSE candidate evaluation for one weight, as MseCalibrator.collect does it."""
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel import compute_fp4_scales
    from modelopt.torch.quantization import utils as quant_utils

    n, k = w.shape
    x = w.reshape(-1, NVFP4_BLOCK_SIZE).float()  # the calibrator's [blocks, 16] input, cast to fp32
    initial = w.reshape(-1, NVFP4_BLOCK_SIZE).abs().amax(-1, keepdim=True).float()
    g = choice.global_amax.to(w.device)
    reduce_axis = quant_utils.convert_quantization_axis_to_reduce_axis(x, (0,))
    v = ModelOptView([], [], [], None)
    for cand in torch.linspace(1.0, 1.5, steps=2, device=w.device):
        amax = initial * cand
        xq = fake_quant(x, amax, g, True, choice.fp8_norm, x.dtype)
        loss = quant_utils.reduce_sum(F.mse_loss(x, xq, reduction="none"), axis=reduce_axis, keepdims=False)
        v.loss.append(loss.reshape(n, -1))
        v.step.append(compute_fp4_scales(amax, g, True, fp8_max_for_normalization=choice.fp8_norm).float().reshape(n, -1))
        v.recon.append(xq.reshape(n, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE))
    v.decision = torch.argmin(torch.stack(v.loss), dim=0) == 1
    return v


def fake_quant_scale_value(step: torch.Tensor, g: torch.Tensor, fp8_norm: float) -> torch.Tensor:
    """The E4M3 value inside a fake-quant step: step / (g * (448 / fp8_norm) / 6 / 448), re-rounded."""
    per_tensor = g.double() * (E4M3_MAX / fp8_norm) / 6.0 / E4M3_MAX
    return e4m3.cast((step.double() / per_tensor).float()).float()


def choice_from_scale(written: torch.Tensor, c: Candidates) -> torch.Tensor:
    """Per block: 0 = the 6 candidate's scale byte, 1 = the 4 candidate's, 2 = both equal it, 3 = neither."""
    wb, s6, s4 = (raw_bytes(t).reshape(t.shape) for t in (written, c.scale[0], c.scale[1]))
    is6, is4 = wb == s6, wb == s4
    out = torch.full(wb.shape, 3, dtype=torch.uint8, device=wb.device)
    out[is6 & ~is4] = 0
    out[is4 & ~is6] = 1
    out[is6 & is4] = 2
    return out


def departures(w: torch.Tensor, view: ModelOptView, cand: Candidates, choice: ModelOptChoice) -> dict[str, torch.Tensor]:
    """Per block [N, K/16], for either candidate: where ModelOpt's fake quant departs from its export."""
    n, k = w.shape
    nonzero = (w.reshape(n, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE) != 0).any(-1)
    out = {"scale_underflow": [], "scale_code_differs": [], "step_differs": [], "reconstruction_differs": []}
    for i in range(len(cand.scale)):
        fq_step = view.step[i]
        under = (fq_step == 0) & nonzero
        code = fake_quant_scale_value(fq_step, choice.global_amax.to(w.device), choice.fp8_norm)
        out["scale_underflow"].append(under)
        out["scale_code_differs"].append((code != cand.scale[i].float()) & ~under)
        out["step_differs"].append(fq_step != cand.step[i])
        out["reconstruction_differs"].append((view.recon[i] != cand.recon[i]).any(-1))
    return {key: masks[0] | masks[1] for key, masks in out.items()}


# What each test of `classify_blocks` reads, in CLASSES order after the decision check.
_DEPARTURE_CLASSES = (("scale_underflow", "fake_quant_scale_underflow"), ("scale_code_differs", "fake_quant_scale_code_differs"),
                      ("step_differs", "fake_quant_step_last_bits"), ("reconstruction_differs", "fake_quant_rounding_differs"))


def classify_blocks(differ: torch.Tensor, reproduced: torch.Tensor, dep: dict[str, torch.Tensor], cand: Candidates) -> torch.Tensor:
    """Per block [N, K/16]: the index in CLASSES of the first class that holds, or -1 where the choices agree."""
    names = list(CLASSES)
    # Same reconstruction on both sides: the two errors are sums of the same 16 squares.
    tie = torch.isclose(cand.err[0], cand.err[1], rtol=NVFP4_BLOCK_SIZE * 2.0**-23, atol=0.0)
    tests = [~reproduced] + [dep[key] for key, _ in _DEPARTURE_CLASSES] + [tie]
    order = ["modelopt_decision_not_reproduced"] + [cls for _, cls in _DEPARTURE_CLASSES] + ["near_tie_summation"]
    out = torch.full(differ.shape, names.index("unexplained"), dtype=torch.int8, device=differ.device)
    for test, cls in reversed(list(zip(tests, order))):  # the first test that holds is written last
        out = torch.where(test, names.index(cls), out)
    return torch.where(differ, out, -1)


def diagnose_module(disk: str, w: torch.Tensor, mo_choice: ModelOptChoice | None, mo: dict, fk: dict, arith: str,
                    fake_quant, classes: Counter, examples: dict[str, list]) -> dict:
    """Block-level comparison of one NVFP4 4/6 module (w: its BF16 weight [N, K]; the work stays on its device)."""
    n, k = w.shape
    nb = k // NVFP4_BLOCK_SIZE
    dev = w.device
    names = {s: f"{disk}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")}
    rec: dict = {"module": disk, "blocks": n * nb}
    if any(names[s] not in mo for s in names) or any(names[s] not in fk for s in names):
        rec["error"] = "not an NVFP4 module in both checkpoints"
        return rec
    g = w.abs().amax().float()
    cand = fp4kit_candidates(w, g, arith)
    fk_choice = nvfp4.quantize(w, scale_rule="4o6", return_choice=True, arith=arith)[1]
    fk_mirror_choice = cand.err[1] < cand.err[0]
    rec["fp4kit_reference_reproduced"] = bool(torch.equal(fk_choice, fk_mirror_choice))

    packed_mo, packed_fk = mo[names["weight"]].to(dev), fk[names["weight"]].to(dev)
    scale_mo, scale_fk = mo[names["weight_scale"]].to(dev), fk[names["weight_scale"]].to(dev)
    same_layout = packed_mo.shape == packed_fk.shape == (n, k // 2) and scale_mo.shape == scale_fk.shape == (n, nb)
    if not same_layout:
        rec["error"] = f"shapes differ: packed {tuple(packed_mo.shape)} / {tuple(packed_fk.shape)}, scale {tuple(scale_mo.shape)} / {tuple(scale_fk.shape)}"
        return rec
    packed_diff = (packed_mo != packed_fk).reshape(n, nb, NVFP4_BLOCK_SIZE // 2)
    scale_diff = raw_bytes(scale_mo).reshape(n, nb) != raw_bytes(scale_fk).reshape(n, nb)
    block_bytes_diff = packed_diff.any(-1) | scale_diff
    rec["packed_bytes_differ"] = int(packed_diff.sum())
    rec["packed_bytes"] = packed_fk.numel()
    rec["scale_bytes_differ"] = int(scale_diff.sum())
    rec["blocks_bytes_differ"] = int(block_bytes_diff.sum())
    gs_mo, gs_fk = mo[names["weight_scale_2"]], fk[names["weight_scale_2"]]
    rec["weight_scale_2_equal"] = bool(torch.equal(raw_bytes(gs_mo), raw_bytes(gs_fk)))

    by_bytes = {"modelopt": choice_from_scale(scale_mo, cand), "fp4kit": choice_from_scale(scale_fk, cand)}
    rec["fp4kit_bytes_agree_with_its_choice"] = int(((by_bytes["fp4kit"] == fk_choice.to(torch.uint8)) | (by_bytes["fp4kit"] == 2)).sum())
    rec["scale_byte_is_neither_candidate"] = {s: int((b == 3).sum()) for s, b in by_bytes.items()}
    rec["fp4kit_chose_4"] = int(fk_choice.sum())
    if mo_choice is None:
        rec["error"] = "no ModelOpt 4/6 quantizer maps to this module"
        return rec

    mult = mo_choice.mult.reshape(n, nb).to(dev)
    rec["modelopt_amax_unrecognised"] = int(mult.isnan().sum())
    mo_c = mult == 1.5
    rec["modelopt_chose_4"] = int(mo_c.sum())
    rec["modelopt_global_amax_equals_max_abs_w"] = bool(torch.equal(mo_choice.global_amax.to(dev), g))
    view = modelopt_view(w, mo_choice, fake_quant)
    reproduced = (view.decision == mo_c) & ~mult.isnan()
    rec["modelopt_decision_reproduced"] = int(reproduced.sum())

    dep = departures(w, view, cand, mo_choice)
    rec["blocks_where_modelopt_scores_other_values"] = {k: int(v.sum()) for k, v in dep.items()}

    differ = mo_c != fk_choice
    rec["blocks_choice_differs"] = int(differ.sum())
    rec["blocks_bytes_differ_same_choice"] = int((block_bytes_diff & ~differ).sum())
    exact6, exact4 = cand.exact
    better = torch.where(exact4 < exact6, 1, torch.where(exact6 < exact4, 0, -1))  # -1: exact tie
    verdict_of = torch.where(better < 0, 0, torch.where(better == mo_c.long(), 1, 2))[differ]
    verdict = Counter({v: c for v, c in zip(("exact_tie", "modelopt_closer", "fp4kit_closer"),
                                            torch.bincount(verdict_of, minlength=3).tolist()) if c})
    cls_of = classify_blocks(differ, reproduced, dep, cand)
    counts = torch.bincount(cls_of[differ].long(), minlength=len(CLASSES)).tolist()
    mod_classes = Counter({cls: c for cls, c in zip(CLASSES, counts) if c})
    for i, cls in enumerate(CLASSES):
        room = MAX_EXAMPLES - len(examples.get(cls, ()))
        if not mod_classes[cls] or room <= 0:
            continue
        for r, b in torch.nonzero(cls_of == i)[:room].tolist():  # row-major, as the blocks lie
            examples[cls].append({
                "module": disk, "row": r, "block": b,
                "block_amax": float(w[r, b * NVFP4_BLOCK_SIZE : (b + 1) * NVFP4_BLOCK_SIZE].abs().amax().float()),
                "global_amax": float(g), "modelopt_chose": 4 if mo_c[r, b] else 6, "fp4kit_chose": 4 if fk_choice[r, b] else 6,
                "modelopt_loss_6_4": [float(view.loss[0][r, b]), float(view.loss[1][r, b])],
                "fp4kit_err_6_4": [float(cand.err[0][r, b]), float(cand.err[1][r, b])],
                "exported_err_fp64_6_4": [float(exact6[r, b]), float(exact4[r, b])],
                "modelopt_step_6_4": [float(view.step[0][r, b]), float(view.step[1][r, b])],
                "export_step_6_4": [float(cand.step[0][r, b]), float(cand.step[1][r, b])],
            })
    classes.update(mod_classes)
    rec["classes"] = dict(mod_classes)
    rec["closer_in_fp64"] = dict(verdict)
    return rec


def diagnose_fp8(disk: str, w: torch.Tensor, mo: dict, fk: dict, arith: str, multipliers: list[float]) -> dict:
    """Which of the recipe's amax multipliers ModelOpt's FP8 weight_scale holds, and whether its bytes follow."""
    rec = {"module": disk, "identical": all(torch.equal(raw_bytes(mo[f"{disk}.{s}"]), raw_bytes(fk[f"{disk}.{s}"])) for s in ("weight", "weight_scale"))}
    mx = w.abs().amax().float()
    rec["max_abs_w"] = float(mx)
    rec["modelopt_amax_multiplier"] = None
    for c in multipliers:
        amax = (mx * c).to(w.dtype).float()  # ModelOpt keeps the calibrated amax in the weight dtype
        scale = fp8.scale_from_amax(amax, arith)
        if torch.equal(raw_bytes(scale.cpu()), raw_bytes(mo[f"{disk}.weight_scale"])):
            rec["modelopt_amax_multiplier"] = c
            rec["modelopt_amax"] = float(amax)
            q = e4m3.cast(div_by_scale(w, scale.to(w.device), arith)).cpu()
            rec["modelopt_weight_bytes_follow_from_its_scale"] = bool(torch.equal(raw_bytes(q), raw_bytes(mo[f"{disk}.weight"])))
            break
    return rec


def tensor_class(name: str, nvfp4_modules: set[str], fp8_multiplier: dict[str, float | None]) -> str:
    module, _, leaf = name.rpartition(".")
    if module in nvfp4_modules:
        return "global_scale" if leaf == "weight_scale_2" else "nvfp4_4o6_choice"
    if leaf in ("weight", "weight_scale") and fp8_multiplier.get(module, 1.0) not in (None, 1.0):
        return "fp8_weight_mse_multiplier"
    if leaf in ("input_scale", "k_scale", "v_scale"):
        return "activation_scale"
    return "other"


def compare(mo: dict, fk: dict, fk_roles: dict[str, str], nvfp4_modules: set[str], fp8_multiplier: dict[str, float | None]) -> tuple[list[dict], dict]:
    """Every tensor: present in both, dtype, shape, bytes."""
    rows = []
    for name in sorted(set(mo) | set(fk)):
        a, b = mo.get(name), fk.get(name)
        kv = name.endswith((".k_scale", ".v_scale"))
        row = {"name": name, "role": "kv_cache" if kv else fk_roles.get(name.rpartition(".")[0], "other")}
        if a is None or b is None:
            row["only_in"] = "modelopt" if b is None else "fp4kit"
            row["identical"] = False
            rows.append(row)
            continue
        row["dtype"] = [str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch.")]
        row["shape"] = [list(a.shape), list(b.shape)]
        same_meta = a.dtype == b.dtype and a.shape == b.shape
        row["identical"] = bool(same_meta and torch.equal(raw_bytes(a), raw_bytes(b)))
        if same_meta and not row["identical"]:
            row["bytes_differ"] = int((raw_bytes(a) != raw_bytes(b)).sum())
            row["class"] = tensor_class(name, nvfp4_modules, fp8_multiplier)
            if a.numel() == 1 and a.dtype == torch.float32:
                row["values"] = [float(a), float(b)]
                row["ulps_apart"] = ulps_apart(a, b)
        elif not same_meta:
            row["class"] = "other"
        rows.append(row)
    summary = {"tensors": len(rows), "identical": sum(r["identical"] for r in rows),
               "only_in_modelopt": [r["name"] for r in rows if r.get("only_in") == "modelopt"],
               "only_in_fp4kit": [r["name"] for r in rows if r.get("only_in") == "fp4kit"],
               "dtype_or_shape_differs": [r["name"] for r in rows if "dtype" in r and (r["dtype"][0] != r["dtype"][1] or r["shape"][0] != r["shape"][1])],
               "by_class": dict(Counter(r["class"] for r in rows if "class" in r))}
    return rows, summary


def quant_config_summary(folder: Path) -> dict:
    hf = read_quant_configs(folder)[1]
    layers = hf.get("quantized_layers", {})
    algos = Counter(v.get("quant_algo") for v in layers.values())
    return {"quant_algo": hf.get("quant_algo"), "kv_cache_quant_algo": hf.get("kv_cache_quant_algo"),
            "quantized_layers_by_algo": dict(algos)}


# --- analysis and report -----------------------------------------------------------------------


def quantized_weights(qm) -> tuple[dict[str, tuple[torch.Tensor, str]], dict[str, torch.Tensor], dict[str, str]]:
    """From fp4kit's plan, by checkpoint module name: NVFP4 4/6 weights (+ role), FP8 weights, every role."""
    nvfp4_w: dict[str, tuple[torch.Tensor, str]] = {}
    fp8_w: dict[str, torch.Tensor] = {}
    roles: dict[str, str] = {}
    for p in qm.plan:
        t = p.target
        for i, disk in enumerate(t.disk_names):
            roles[disk] = t.role.value
            if p.rule is None:
                continue
            w = t.weight.detach()
            w = w[i] if t.is_stack else w
            if p.rule.format.startswith("nvfp4") and p.rule.scale_rule == "4o6":
                nvfp4_w[disk] = (w, t.role.value)
            elif p.rule.format == "fp8":
                fp8_w[disk] = w
    return nvfp4_w, fp8_w, roles


def recipe_multipliers(algorithm: dict) -> list[float]:
    """The amax multipliers ModelOpt's MseCalibrator tries: linspace(start, stop, steps)."""
    steps = round((algorithm["stop_multiplier"] - algorithm["start_multiplier"]) / algorithm["step_size"]) + 1
    return [float(c) for c in torch.linspace(algorithm["start_multiplier"], algorithm["stop_multiplier"], steps)]


def analyse(qm, mo: dict, fk: dict, mo_choices: dict[str, ModelOptChoice], mo_info: dict, arith: str, fake_quant) -> dict:
    nvfp4_w, fp8_w, roles = quantized_weights(qm)
    fp8_modules = [diagnose_fp8(disk, w, mo, fk, arith, recipe_multipliers(mo_info["algorithm"]))
                   for disk, w in fp8_w.items() if f"{disk}.weight_scale" in mo and f"{disk}.weight_scale" in fk]
    fp8_multiplier = {m["module"]: m["modelopt_amax_multiplier"] for m in fp8_modules}
    rows, summary = compare(mo, fk, roles, set(nvfp4_w), fp8_multiplier)
    classes: Counter = Counter()
    examples: dict[str, list] = defaultdict(list)
    modules = []
    started, shown = time.perf_counter(), 0.0
    with torch.no_grad():
        for i, (disk, (w, role)) in enumerate(nvfp4_w.items(), 1):
            rec = diagnose_module(disk, w, mo_choices.get(disk), mo, fk, arith, fake_quant, classes, examples)
            rec["role"] = role
            modules.append(rec)
            spent = time.perf_counter() - started
            if spent - shown >= 10.0 or i == len(nvfp4_w):
                shown = spent
                print(f"compared {i}/{len(nvfp4_w)} NVFP4 modules, {spent:.0f} s, "
                      f"ETA {spent / i * (len(nvfp4_w) - i):.0f} s", file=sys.stderr)

    def total(key: str) -> int:
        return sum(m.get(key, 0) for m in modules)

    blocks, differ = total("blocks"), total("blocks_choice_differs")
    depart, closer = Counter(), Counter()
    for m in modules:
        depart.update(m.get("blocks_where_modelopt_scores_other_values", {}))
        closer.update(m.get("closer_in_fp64", {}))
    totals = {
        "tensors": summary["tensors"], "tensors_identical": summary["identical"],
        "nvfp4_4o6_modules": len(modules), "blocks": blocks, "blocks_choice_differs": differ,
        "fraction_blocks_differ": differ / blocks if blocks else 0.0,
        "blocks_bytes_differ": total("blocks_bytes_differ"),
        "blocks_bytes_differ_same_choice": total("blocks_bytes_differ_same_choice"),
        "packed_bytes_differ": total("packed_bytes_differ"),
        "scale_bytes_differ": total("scale_bytes_differ"),
        "modelopt_decision_reproduced": f"{total('modelopt_decision_reproduced')}/{blocks}",
        "modelopt_chose_4": total("modelopt_chose_4"),
        "fp4kit_chose_4": total("fp4kit_chose_4"),
        "blocks_where_modelopt_scores_other_values": dict(depart),
        "closer_in_fp64": dict(closer),
        "fp8_weights": len(fp8_modules),
        "fp8_weights_identical": sum(m["identical"] for m in fp8_modules),
        "fp8_modelopt_amax_multiplier": dict(Counter(str(m["modelopt_amax_multiplier"]) for m in fp8_modules)),
    }
    differences = list_differences(classes, modules, totals, summary, rows, fp8_modules)
    return {
        "totals": totals,
        "differences": differences,
        "all_differences_attributed_to_modelopt_or_ties": all(d["owner"] in ("modelopt", "none") for d in differences),
        "tensor_summary": summary,
        "classes": {c: classes.get(c, 0) for c in CLASSES},
        "class_explanations": CLASSES,
        "tensor_class_explanations": TENSOR_CLASSES,
        "examples": dict(examples),
        "modelopt_quantizers_without_fp4kit_module": sorted(set(mo_choices) - set(nvfp4_w)),
        "fp8_modules": fp8_modules,
        "nvfp4_modules": modules,
        "tensors": rows,
    }


def list_differences(classes: Counter, modules: list[dict], totals: dict, summary: dict, rows: list[dict], fp8_modules: list[dict]) -> list[dict]:
    """Every kind of difference found, with whose arithmetic it comes from."""
    out = [{"what": f"{n} NVFP4 4/6 blocks", "class": cls, "owner": CLASSES[cls]["owner"]} for cls, n in classes.items()]
    if totals["blocks_bytes_differ_same_choice"]:
        out.append({"what": f"{totals['blocks_bytes_differ_same_choice']} NVFP4 blocks with the same choice but different bytes",
                    "class": "nvfp4_same_choice_bytes_differ", "owner": "unexplained"})
    broken = [m["module"] for m in modules if "error" in m]
    if broken:
        out.append({"what": f"{len(broken)} NVFP4 modules not compared", "class": "module_error", "owner": "unexplained", "tensors": broken})
    for cls, n in summary["by_class"].items():
        if cls == "nvfp4_4o6_choice":
            continue
        # fp4kit's recipe runs ModelOpt's FP8 range search too: a differing FP8 weight is unexplained.
        owner = {"activation_scale": "calibration_forward"}.get(cls, "unexplained")
        out.append({"what": f"{n} tensors", "class": cls, "owner": owner, "tensors": [r["name"] for r in rows if r.get("class") == cls]})
    for key in ("only_in_modelopt", "only_in_fp4kit", "dtype_or_shape_differs"):
        if summary[key]:
            out.append({"what": f"{len(summary[key])} tensors", "class": key, "owner": "unexplained", "tensors": summary[key]})
    return out


def gpu_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def print_table(result: dict) -> None:
    roles: dict[str, Counter] = defaultdict(Counter)
    for r in result["tensors"]:
        roles[r["role"]]["tensors"] += 1
        roles[r["role"]]["identical"] += r["identical"]
    for m in result["nvfp4_modules"]:
        c = roles[m["role"]]
        c["blocks"] += m["blocks"]
        c["differ"] += m.get("blocks_choice_differs", 0)
        c["bytes"] += m.get("blocks_bytes_differ", 0)
    print(f"{'role':<16}{'tensors':>9}{'identical':>11}{'4/6 blocks':>12}{'choice differs':>16}{'bytes differ':>14}")
    for role, c in sorted(roles.items()):
        cells = [f"{c[k]:,}" if c["blocks"] else "-" for k in ("blocks", "differ", "bytes")]
        print(f"{role:<16}{c['tensors']:>9}{c['identical']:>11}{cells[0]:>12}{cells[1]:>16}{cells[2]:>14}")
    t = result["totals"]
    print(f"tensors identical: {t['tensors_identical']}/{t['tensors']}; 4/6 blocks whose choice differs: "
          f"{t['blocks_choice_differs']:,}/{t['blocks']:,} ({t['fraction_blocks_differ']:.3e}); "
          f"ModelOpt's decisions reproduced: {t['modelopt_decision_reproduced']}")
    print(f"FP8 weights identical: {t['fp8_weights_identical']}/{t['fp8_weights']}; ModelOpt's amax multiplier: {t['fp8_modelopt_amax_multiplier']}")
    for d in result["differences"]:
        print(f"  {d['class']:<34}{d['what']:>26}  ({d['owner']})")
    print(f"all differences attributed to ModelOpt or to ties: {result['all_differences_attributed_to_modelopt_or_ties']}")
    control = result.get("activation_scale_control")
    if control:
        print(f"activation scales with fp4kit's experts run eagerly, as ModelOpt calibrates: "
              f"{control['identical']}/{control['tensors']} identical to ModelOpt's")
    print(f"every difference explained: {result['every_difference_explained']}")
    if result["modelopt_fake_quant"]["emulated"]:
        print("note: ModelOpt's fake quant was a CPU transcription of its Triton kernel: a smoke test, not a parity result")


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Nemotron-H model folder (default: the embedded tiny Nemotron-H)")
    ap.add_argument("--calib", default="8x256", help="calibration set NxL from the bundled corpus (default 8x256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda (ModelOpt's real MSE path) or cpu (smoke test)")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/modelopt-mse-parity-<gpu>.json)")
    ap.add_argument("--keep", type=Path, help="keep both checkpoints in this folder")
    ap.add_argument("--experts-control", action="store_true",
                    help="run the eager-experts control even when no activation scale differs (it then compares all of them)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        ap.error("--device must be cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available (use --device cpu for a smoke test)")
    arith = "cuda" if device.type == "cuda" else "cpu"  # ModelOpt's bytes follow the device it runs on
    started = time.perf_counter()

    from transformers import AutoTokenizer

    from benchlib.record import run_record

    from fp4kit.calibration import build_calibration_set, parse_calib_spec
    from fp4kit.evaluate import EMBEDDED_MODEL
    from fp4kit.models.tiny import tiny_model_path

    model_ref = str(Path(args.model).expanduser().resolve()) if args.model else str(tiny_model_path())
    shown = args.model or EMBEDDED_MODEL  # as given: no path of this machine in the results
    spec = parse_calib_spec(args.calib)
    samples = build_calibration_set(AutoTokenizer.from_pretrained(model_ref), spec, None, seed=args.seed, progress=False)
    calls = install_fake_quant(device)

    with tempfile.TemporaryDirectory(prefix="modelopt-mse-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"ModelOpt {LIGHTNING_RECIPE} on {device} ...", file=sys.stderr)
        mo_choices, mo_info = run_modelopt(model_ref, samples, device, work / "modelopt", calls)
        mo = read_checkpoint(work / "modelopt")
        configs = {"modelopt": quant_config_summary(work / "modelopt")}
        if not args.keep:  # fp4kit's free-space check then sees the disk the ModelOpt checkpoint held
            shutil.rmtree(work / "modelopt")
        gc.collect()  # ModelOpt's model and its quantizers go before fp4kit loads its own copy
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"fp4kit --recipe {FP4KIT_RECIPE} on {device} (arith {arith}) ...", file=sys.stderr)
        qm, fk_path, fk_info = run_fp4kit(model_ref, str(spec), args.seed, device, arith, work / "fp4kit", shown)
        fk = read_checkpoint(fk_path)
        configs["fp4kit"] = quant_config_summary(fk_path)
        if not args.keep:
            shutil.rmtree(fk_path)

        t0 = time.perf_counter()
        analysis = analyse(qm, mo, fk, mo_choices, mo_info, arith, calls.fake_quant)
        compare_s = time.perf_counter() - t0
        del qm
        differing = [r["name"] for r in analysis["tensors"] if r.get("class") == "activation_scale"]
        if args.experts_control and not differing:
            differing = [n for n in sorted(mo) if n.endswith((".input_scale", ".k_scale", ".v_scale")) and n in fk]
        if differing:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"fp4kit again with eager experts, for {len(differing)} activation scales ...", file=sys.stderr)
            control = activation_scale_control(model_ref, str(spec), args.seed, device, arith, work / "fp4kit-eager-experts",
                                               shown, mo, differing)
            analysis["activation_scale_control"] = control
            analysis["activation_scales_equal_with_modelopt_experts"] = control["identical"] == control["tensors"]
        owners_ok = all(d["owner"] in ("modelopt", "none") or (d["owner"] == "calibration_forward" and analysis.get(
            "activation_scales_equal_with_modelopt_experts", False)) for d in analysis["differences"])
        analysis["every_difference_explained"] = owners_ok

    result = {
        "what": "fp4kit --recipe modelopt-lightning vs nvidia-modelopt mtq.quantize(Lightning w4a16_nvfp4_4o6, MSE 4/6) + export_hf_checkpoint",
        **run_record(),
        "device": str(device),
        "arith": arith,
        "model": shown,
        "calibration": {"spec": str(spec), "seed": args.seed, "source": "bundled corpus, calibration split",
                        "tokens": int(samples.numel()), "sha256": hashlib.sha256(samples.numpy().tobytes()).hexdigest()},
        "modelopt": mo_info,
        "modelopt_fake_quant": {
            "emulated": calls.emulated,
            "what": ("torch transcription of static_blockwise_fp4_fake_quant (CPU smoke test; not a parity result)"
                     if calls.emulated else "ModelOpt's Triton kernel"),
            "calls_during_mtq_quantize": dict(calls.calls),
        },
        "fp4kit": fk_info,
        "quant_config": configs,
        **analysis,
        "compare_s": round(compare_s, 2),
        "total_s": round(time.perf_counter() - started, 2),
    }
    out = args.out or REPO / "benchmarks" / "results" / f"modelopt-mse-parity-{gpu_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {out} ({result['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
