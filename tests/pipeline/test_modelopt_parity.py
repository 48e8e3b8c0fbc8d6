"""fp4kit's checkpoints against nvidia-modelopt 0.47's, on the same tiny models and tokens, on CPU.

nvidia-modelopt is called here as the oracle: `mtq.quantize` with its preset (or recipe) config,
then `export_hf_checkpoint`. Both checkpoints must hold the same tensor names, dtypes, shapes and
bytes; the quantization configs must agree on the fields serving engines act on.

Cases
- llama-w4a16: recipe `nvfp4-w4a16` vs ModelOpt `W4A16_NVFP4_CFG` (max calibration).
- llama-fp8:   recipe `fp8` vs ModelOpt `FP8_DEFAULT_CFG` + `FP8_KV_CFG` (k_scale / v_scale).
- nemotron-h:  recipe `modelopt-lightning` vs ModelOpt's own Lightning recipe file
  (`w4a16_nvfp4_4o6.yaml`). Its MSE 4/6 search runs on a Triton fake-quant kernel, so on CPU the
  recipe runs with the `max` algorithm instead (static 4/6 quantizers then hold the plain
  per-block amax, multiplier 1.0); fp4kit's per-block 4/6 choices are then written into those
  quantizers (amax x 1.5 where fp4kit chose 4) before ModelOpt exports. Everything else --
  static-scale arithmetic, FP8 Mamba projections with input scales, KV scales, fused-expert
  splitting, naming -- is ModelOpt's own.

ModelOpt converts transformers' fused `NemotronHExperts` ([E, I, H] parameters) itself
(`_QuantNonGatedFusedExperts`: one weight quantizer per expert and projection) and exports
one module per expert, `backbone.layers.L.mixer.experts.E.{up,down}_proj.*`: the same layout
fp4kit writes.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("modelopt")
import modelopt  # noqa: E402
import modelopt.torch.quantization as mtq  # noqa: E402
from modelopt.recipe import load_recipe as modelopt_load_recipe  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402
from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer  # noqa: E402

from fp4kit.export.modelopt import export_checkpoint  # noqa: E402
from fp4kit.formats import nvfp4  # noqa: E402
from fp4kit.quantize import quantize  # noqa: E402
from fp4kit.recipe import load_recipe  # noqa: E402

from tiny_models import build_llama, build_nemotron_h  # noqa: E402

LIGHTNING_RECIPE = "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/ptq/w4a16_nvfp4_4o6.yaml"

# Tensors known to differ between the two checkpoints, per case: name glob -> cause.
# The identity tests leave these names out (and require each glob to match at least one tensor);
DIFFERENCES: dict[str, dict[str, str]] = {}

# Quantization-config fields on which the two exporters knowingly differ; each is asserted in
# exactly this form below.
CONFIG_DIFFERENCES: dict[str, str] = {
    "exclude_modules / ignore": (
        "ModelOpt also lists the input embedding (`model.embed_tokens`); fp4kit lists only "
        "Linear layers kept in BF16, since an engine never quantizes an embedding."
    ),
    "config_groups / flat group_size": (
        "ModelOpt's config.json quantization_config carries `config_groups` (group_size inside); "
        "fp4kit writes no config_groups and a top-level `group_size`."
    ),
    "flat ignore (MIXED_PRECISION)": "ModelOpt writes `ignore: []`; fp4kit leaves the key out.",
    "flat kv_cache_quant_algo": (
        "with FP8 KV both write `kv_cache_scheme`; fp4kit also repeats `kv_cache_quant_algo` in "
        "the flat form, ModelOpt does not."
    ),
    "quantized_layers routed experts": (
        "ModelOpt lists one entry per MoE layer (`...mixer.experts`); fp4kit one per expert "
        "projection (`...mixer.experts.E.up_proj`), which is the module the tensors belong to. "
        "Same quant_algo/group_size for every member."
    ),
    "quantized_layers junk names (ModelOpt 0.47.0 defect)": (
        "every ModelOpt key for Nemotron-H ends in `.\\x00backbone.pt_name_sentinel`: its name "
        "remapper appends the sentinel `.\\x00modelopt_name_sentinel`, then applies the reverse of "
        "transformers' `backbone` -> `model` key rename as the unanchored regex `model.`, whose "
        "`.` matches the `o` of `modelopt`; the rewritten sentinel is then not stripped."
    ),
}
JUNK_SUFFIX = ".\x00backbone.pt_name_sentinel"


# --- helpers -------------------------------------------------------------------------------


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                assert k not in out, f"{k} stored twice in {folder}"
                out[k] = h.get_tensor(k)
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def load_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def forward_loop(tokens: torch.Tensor):
    def loop(model):
        with torch.no_grad():
            for i in range(tokens.shape[0]):
                model(input_ids=tokens[i : i + 1], use_cache=False)

    return loop


@dataclass
class Case:
    name: str
    modelopt: dict[str, torch.Tensor]
    fp4kit: dict[str, torch.Tensor]
    modelopt_hf: dict
    fp4kit_hf: dict
    modelopt_flat: dict
    fp4kit_flat: dict
    modelopt_model: object = None
    fp4kit_qm: object = None
    info: dict = field(default_factory=dict)


def make_case(name, model_dir, out_dir, tokens, modelopt_cfg, recipe, before_export=None) -> Case:
    mo_model = load_model(model_dir)
    mtq.quantize(mo_model, modelopt_cfg, forward_loop(tokens))
    info = before_export(mo_model) if before_export else {}
    mo_dir = out_dir / f"{name}-modelopt"
    export_hf_checkpoint(mo_model, export_dir=str(mo_dir))

    # ModelOpt runs on the CPU here, where torch divides by constants exactly.
    qm = quantize(load_model(model_dir), load_recipe(recipe), tokens, progress=False, batch_size=1, arith="cpu")
    fk_dir = export_checkpoint(qm, out_dir / f"{name}-fp4kit", source_dir=model_dir, progress=False)

    def cfgs(folder):
        return json.loads((folder / "hf_quant_config.json").read_text()), json.loads((folder / "config.json").read_text())["quantization_config"]

    mo_hf, mo_flat = cfgs(mo_dir)
    fk_hf, fk_flat = cfgs(Path(fk_dir))
    return Case(name, read_checkpoint(mo_dir), read_checkpoint(Path(fk_dir)), mo_hf, fk_hf, mo_flat, fk_flat, mo_model, qm, info)


def known(case: str, tensor: str) -> bool:
    return any(fnmatch.fnmatchcase(tensor, p) for p in DIFFERENCES.get(case, {}))


def assert_identical(case: Case) -> int:
    """Every tensor identical except the known differences; returns how many were compared."""
    mo, fk = case.modelopt, case.fp4kit
    assert sorted(set(mo) - set(fk)) == [], "only in ModelOpt's checkpoint"
    assert sorted(set(fk) - set(mo)) == [], "only in fp4kit's checkpoint"
    for pattern in DIFFERENCES.get(case.name, {}):
        assert any(fnmatch.fnmatchcase(k, pattern) for k in mo), f"DIFFERENCES entry {pattern!r} matches no tensor"
    meta = [(k, mo[k].dtype, fk[k].dtype, tuple(mo[k].shape), tuple(fk[k].shape)) for k in mo if (mo[k].dtype, mo[k].shape) != (fk[k].dtype, fk[k].shape)]
    assert meta == [], "dtype/shape differences (name, modelopt dtype, fp4kit dtype, modelopt shape, fp4kit shape)"
    compared = [k for k in sorted(mo) if not known(case.name, k)]
    differ = [k for k in compared if not same_tensor(mo[k], fk[k])]
    assert differ == [], "byte differences"
    return len(compared)


def strip_junk(name: str) -> str:
    return name[: -len(JUNK_SUFFIX)] if name.endswith(JUNK_SUFFIX) else name


def moe_layer_of(name: str) -> str:
    """`...mixer.experts.3.up_proj` -> `...mixer.experts`; other names unchanged."""
    return re.sub(r"\.experts\.\d+\.(up|down|gate)_proj$", ".experts", name)


# --- the three cases (each built once) -----------------------------------------------------


@pytest.fixture(scope="module")
def calib_tokens():
    # 4 sequences of 64 random token ids; with this draw the RoPE'd keys of both Llama layers
    # reach a different max than the keys before RoPE.
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 512, (4, 64), generator=g)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def llama_dir(workdir):
    # Saved and reloaded on both sides: a model built in fp32 and cast with .to(bfloat16) also
    # casts the rotary inv_freq buffer, which a loaded checkpoint keeps in fp32.
    path = workdir / "llama"
    build_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def nemotron_dir(workdir):
    path = workdir / "nemotron-h"
    build_nemotron_h().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_w4a16(llama_dir, workdir, calib_tokens):
    return make_case("llama-w4a16", llama_dir, workdir, calib_tokens, copy.deepcopy(mtq.W4A16_NVFP4_CFG), "nvfp4-w4a16")


@pytest.fixture(scope="module")
def llama_fp8(llama_dir, workdir, calib_tokens):
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(list(mtq.FP8_KV_CFG["quant_cfg"]))
    return make_case("llama-fp8", llama_dir, workdir, calib_tokens, cfg, "fp8")


def lightning_cfg_with_max() -> dict:
    cfg = modelopt_load_recipe(LIGHTNING_RECIPE).quantize.model_dump()
    assert cfg["algorithm"]["method"] == "mse" and cfg["algorithm"]["stop_multiplier"] == 1.5
    cfg["algorithm"] = "max"
    return cfg


def quantizer_weight(model, quantizer_name: str) -> torch.Tensor:
    """The weight a ModelOpt weight quantizer quantizes (a Linear's, or one expert's slice)."""
    parent, _, leaf = quantizer_name.rpartition(".")
    if leaf.isdigit():  # `<experts>.up_proj_weight_quantizers.<e>`
        owner, _, lst = parent.rpartition(".")
        return getattr(model.get_submodule(owner), lst.removesuffix("_weight_quantizers"))[int(leaf)]
    assert leaf == "weight_quantizer", quantizer_name
    return model.get_submodule(parent).weight


def transplant_four_over_six(model) -> dict:
    """Write fp4kit's per-block 4/6 choices into ModelOpt's static NVFP4 quantizers.

    Also records how ModelOpt holds the fused experts before its export rewrites them.
    """
    info = {"quantizers": [], "blocks": 0, "chose_4": 0}
    experts = model.model.layers[1].mixer.experts
    info["experts"] = {"class": type(experts).__name__}
    for proj in ("up_proj", "down_proj"):
        quantizers = getattr(experts, f"{proj}_weight_quantizers")
        assert all(isinstance(q, StaticBlockScaleQuantizer) and q.is_enabled for q in quantizers)
        info["experts"][proj] = {
            "stack": tuple(getattr(experts, proj).shape),
            "quantizers": len(quantizers),
            "amax_shape": tuple(quantizers[0]._amax.shape),
        }
    for name, q in model.named_modules():
        if not isinstance(q, StaticBlockScaleQuantizer) or not q.is_enabled:
            continue
        w = quantizer_weight(model, name).detach()
        block_amax = w.reshape(-1, 16).abs().amax(-1).float()
        # What max calibration leaves: plain per-block amax (multiplier 1.0), global amax = max|W|.
        assert torch.equal(q._amax, block_amax.reshape(q._amax.shape)), name
        assert torch.equal(q.global_amax.float(), w.abs().amax().float()), name
        _, choose4 = nvfp4.quantize(w, scale_rule="4o6", return_choice=True, arith="cpu")
        mult = torch.where(choose4.reshape(-1), 1.5, 1.0)
        q.amax = (block_amax * mult).reshape(q._amax.shape)
        info["quantizers"].append(name)
        info["blocks"] += choose4.numel()
        info["chose_4"] += int(choose4.sum())
    return info


@pytest.fixture(scope="module")
def nemotron(nemotron_dir, workdir, calib_tokens):
    return make_case("nemotron-h", nemotron_dir, workdir, calib_tokens, lightning_cfg_with_max(), "modelopt-lightning", transplant_four_over_six)


# --- Llama ---------------------------------------------------------------------------------


def test_llama_w4a16_tensors_identical(llama_w4a16):
    n = assert_identical(llama_w4a16)
    assert n == len(llama_w4a16.modelopt) == 49
    packed = [k for k, t in llama_w4a16.fp4kit.items() if k.endswith(".weight") and t.dtype == torch.uint8]
    assert len(packed) == 14  # q,k,v,o,gate,up,down x 2 layers


def test_llama_fp8_tensors_identical(llama_fp8):
    n = assert_identical(llama_fp8)
    known_names = [k for k in llama_fp8.modelopt if known("llama-fp8", k)]
    assert n + len(known_names) == len(llama_fp8.modelopt) == 53
    kv = sorted(k for k in llama_fp8.modelopt if k.endswith(("k_scale", "v_scale")))
    assert kv == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj.k_scale", "v_proj.v_scale")]
    for k in kv:
        assert llama_fp8.fp4kit[k].dtype == torch.float32 and llama_fp8.fp4kit[k].shape == ()
    assert all(same_tensor(llama_fp8.modelopt[k], llama_fp8.fp4kit[k]) for k in kv if k.endswith("v_scale"))


@pytest.mark.parametrize("case", ["llama-w4a16", "llama-fp8"])
def test_llama_quant_config(case, llama_w4a16, llama_fp8):
    c = {"llama-w4a16": llama_w4a16, "llama-fp8": llama_fp8}[case]
    mo, fk = c.modelopt_hf["quantization"], c.fp4kit_hf["quantization"]
    algo = "W4A16_NVFP4" if case == "llama-w4a16" else "FP8"
    assert mo["quant_algo"] == fk["quant_algo"] == algo
    assert mo.get("group_size") == fk.get("group_size") == (16 if algo == "W4A16_NVFP4" else None)
    kv = "FP8" if case == "llama-fp8" else None
    assert mo.get("kv_cache_quant_algo") == fk.get("kv_cache_quant_algo") == kv
    # Both write the key, null without KV quantization (vLLM's nested NVFP4 parser requires it).
    assert "kv_cache_quant_algo" in mo and "kv_cache_quant_algo" in fk
    # CONFIG_DIFFERENCES["exclude_modules / ignore"]
    assert sorted(mo["exclude_modules"]) == ["lm_head", "model.embed_tokens"]
    assert sorted(fk["exclude_modules"]) == ["lm_head"]
    assert set(c.modelopt_flat["ignore"]) - {"model.embed_tokens"} == set(c.fp4kit_flat["ignore"])
    # the flat config.json form
    assert c.modelopt_flat["quant_method"] == c.fp4kit_flat["quant_method"] == "modelopt"
    assert c.modelopt_flat["quant_algo"] == c.fp4kit_flat["quant_algo"] == algo
    assert c.modelopt_flat.get("kv_cache_scheme") == c.fp4kit_flat.get("kv_cache_scheme")
    assert "kv_cache_quant_algo" not in c.modelopt_flat  # CONFIG_DIFFERENCES["flat kv_cache_quant_algo"]
    assert c.fp4kit_flat.get("kv_cache_quant_algo") == kv
    # CONFIG_DIFFERENCES["config_groups / flat group_size"]
    assert "config_groups" in c.modelopt_flat and "config_groups" not in c.fp4kit_flat
    if algo == "W4A16_NVFP4":
        assert c.modelopt_flat["config_groups"]["group_0"]["weights"]["group_size"] == c.fp4kit_flat["group_size"] == 16


# --- Nemotron-H ----------------------------------------------------------------------------


def test_nemotron_h_modelopt_splits_fused_experts(nemotron):
    before = nemotron.info["experts"]
    assert before["class"] == "QuantNemotronHExperts"
    for proj, (rows, k) in (("up_proj", (32, 64)), ("down_proj", (64, 32))):
        assert before[proj]["stack"] == (8, rows, k)
        assert before[proj]["quantizers"] == 8  # one static NVFP4 quantizer per expert
        assert before[proj]["amax_shape"] == (rows * k // 16, 1)
    # the export unpacks the fused parameters into one module per expert, in place
    experts = nemotron.modelopt_model.model.layers[1].mixer.experts
    assert not hasattr(experts, "up_proj")
    assert experts.get_submodule("7.down_proj").weight.dtype == torch.uint8
    names = [k for k in nemotron.modelopt if ".mixer.experts." in k]
    assert len(names) == 2 * 8 * 2 * 3  # MoE layers x experts x (up, down) x (weight, scale, scale_2)
    assert "backbone.layers.3.mixer.experts.7.down_proj.weight_scale_2" in names


def test_nemotron_h_tensors_identical(nemotron):
    info = nemotron.info
    # 2 MoE layers x (8 experts x 2 + 2 shared) + lm_head = 37 static 4/6 quantizers
    assert len(info["quantizers"]) == 37
    assert 0 < info["chose_4"] < info["blocks"]  # both scale choices are exercised
    n = assert_identical(nemotron)
    assert n == len(nemotron.modelopt) == 139
    mo = nemotron.modelopt
    assert mo["backbone.layers.0.mixer.in_proj.weight"].dtype == torch.float8_e4m3fn
    assert mo["backbone.layers.0.mixer.in_proj.input_scale"].shape == ()
    assert mo["backbone.layers.2.mixer.k_proj.k_scale"].dtype == torch.float32
    assert mo["lm_head.weight"].dtype == torch.uint8 and mo["lm_head.weight_scale"].dtype == torch.float8_e4m3fn
    assert mo["backbone.layers.2.mixer.q_proj.weight"].dtype == torch.bfloat16
    assert mo["backbone.layers.1.mixer.gate.weight"].dtype == torch.float32


def test_nemotron_h_quant_config(nemotron):
    mo, fk = nemotron.modelopt_hf["quantization"], nemotron.fp4kit_hf["quantization"]
    assert mo["quant_algo"] == fk["quant_algo"] == "MIXED_PRECISION"
    assert mo["kv_cache_quant_algo"] == fk["kv_cache_quant_algo"] == "FP8"
    assert "exclude_modules" not in fk
    # CONFIG_DIFFERENCES["quantized_layers routed experts"]: fold fp4kit's per-expert entries
    grouped: dict[str, dict] = {}
    for name, entry in fk["quantized_layers"].items():
        key = moe_layer_of(name)
        assert grouped.setdefault(key, entry) == entry, f"{name}: members of {key} disagree"
    modelopt_layers = {strip_junk(k): v for k, v in mo["quantized_layers"].items()}
    assert grouped == modelopt_layers
    assert grouped["backbone.layers.1.mixer.experts"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert grouped["backbone.layers.0.mixer.in_proj"] == {"quant_algo": "FP8"}
    assert grouped["lm_head"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    # flat form
    mf, ff = nemotron.modelopt_flat, nemotron.fp4kit_flat
    assert mf["quant_algo"] == ff["quant_algo"] == "MIXED_PRECISION"
    assert mf["kv_cache_scheme"] == ff["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert "kv_cache_quant_algo" not in mf and ff["kv_cache_quant_algo"] == "FP8"
    assert ff["quantized_layers"] == fk["quantized_layers"]
    assert {strip_junk(k): v for k, v in mf["quantized_layers"].items()} == modelopt_layers
    assert mf["ignore"] == [] and "ignore" not in ff  # CONFIG_DIFFERENCES["flat ignore (MIXED_PRECISION)"]


def test_nemotron_h_fp4kit_layer_names_are_real_modules(nemotron):
    """Every fp4kit quantized_layers key is a clean name of a module holding tensors."""
    model = nemotron.fp4kit_qm.model
    tensors = nemotron.fp4kit
    for name in nemotron.fp4kit_hf["quantization"]["quantized_layers"]:
        assert name.isprintable() and "\x00" not in name and "sentinel" not in name, repr(name)
        assert f"{name}.weight" in tensors, name
        assert f"{name}.weight_scale" in tensors, name
        memory = "model" + name[len("backbone") :] if name.startswith("backbone.") else name
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(up_proj|down_proj)", memory)
        if m:
            stack = getattr(model.get_submodule(m.group(1)), m.group(3))
            assert int(m.group(2)) < stack.shape[0], name
        else:
            assert isinstance(model.get_submodule(memory), torch.nn.Linear), name


def test_nemotron_h_modelopt_junk_layer_names(nemotron):
    """Documents CONFIG_DIFFERENCES["quantized_layers junk names (ModelOpt 0.47.0 defect)"]."""
    keys = list(nemotron.modelopt_hf["quantization"]["quantized_layers"])
    flat_keys = list(nemotron.modelopt_flat["quantized_layers"])
    junk = [k for k in keys if "\x00" in k]
    if modelopt.__version__.startswith("0.47."):
        assert junk == keys and all(k.endswith(JUNK_SUFFIX) for k in keys)
        assert all(k.endswith(JUNK_SUFFIX) for k in flat_keys)
        assert "lm_head" + JUNK_SUFFIX in keys
    # whatever the version: once the junk is cut off, ModelOpt names the same modules
    fk_grouped = {moe_layer_of(k) for k in nemotron.fp4kit_hf["quantization"]["quantized_layers"]}
    assert {strip_junk(k) for k in keys} == fk_grouped
