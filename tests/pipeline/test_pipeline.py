"""The pipeline on small random models: plan, observers, quantized tensors, export layout."""

import json

import pytest
import torch
from safetensors import safe_open

from fp4kit.calibrate import Observers
from fp4kit.export.modelopt import export_checkpoint, quant_configs
from fp4kit.export.writer import OutputExistsError
from fp4kit.formats import fp8, nvfp4
from fp4kit.models import Role, adapter_for
from fp4kit.plan import PlanError, plan_targets
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe, recipe_from_dict

from tiny_models import build_llama, build_nemotron_h


def read_all(folder):
    out = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                assert k not in out
                out[k] = h.get_tensor(k)
    return out


def test_nemotron_h_roles(nemotron_h_model):
    targets = adapter_for(nemotron_h_model).targets(nemotron_h_model)
    roles = {}
    for t in targets:
        roles.setdefault(t.role, []).append(t)
    assert len(roles[Role.ROUTED_EXPERTS]) == 4  # up/down of two MoE layers
    assert all(t.is_stack and len(t.disk_names) == 8 for t in roles[Role.ROUTED_EXPERTS])
    assert roles[Role.ROUTED_EXPERTS][0].disk_names[3] == "backbone.layers.1.mixer.experts.3.up_proj"
    assert [t.disk_names[0] for t in roles[Role.MAMBA_IN_PROJ]] == ["backbone.layers.0.mixer.in_proj"]
    assert len(roles[Role.ATTENTION_QKV]) == 3 and len({t.fuse_group for t in roles[Role.ATTENTION_QKV]}) == 1
    assert len(roles[Role.SHARED_EXPERTS]) == 4 and len(roles[Role.ROUTER]) == 2 and len(roles[Role.CONV1D]) == 1
    assert roles[Role.LM_HEAD][0].disk_names == ["lm_head"]
    assert roles[Role.EMBEDDINGS][0].disk_names == ["backbone.embeddings"]


def test_llama_roles_share_groups(llama_model):
    targets = adapter_for(llama_model).targets(llama_model)
    qkv = [t for t in targets if t.role == Role.ATTENTION_QKV and t.layer == 0]
    gate_up = [t for t in targets if t.fuse_group and t.fuse_group.endswith("gate_up") and t.layer == 0]
    assert len(qkv) == 3 and len(gate_up) == 2


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_expert_statistics_match_a_direct_computation(impl, token_samples):
    model = build_nemotron_h()
    model.config._experts_implementation = impl
    moe = model.model.layers[1].mixer
    seen = {}

    def grab(module, args):
        seen["x"] = args[0].detach().reshape(-1, args[0].shape[-1])

    h = moe.register_forward_pre_hook(grab)
    up = next(t for t in adapter_for(model).targets(model) if t.key == "model.layers.1.mixer.experts.up_proj")
    down = next(t for t in adapter_for(model).targets(model) if t.key == "model.layers.1.mixer.experts.down_proj")
    with torch.no_grad(), Observers(model, amax_targets=[up, down], importance_targets=[up, down], moe_experts={up.name: up.module}) as obs:
        model(input_ids=token_samples[:1], use_cache=False)
    h.remove()
    stats = obs.stats
    x = seen["x"]
    _, _, idx = moe.gate(x)
    ref_amax, ref_down = torch.zeros(8), torch.zeros(8)
    ref_sq = torch.zeros(8, x.shape[1])
    for e in range(8):
        rows = (idx == e).any(-1)
        if rows.any():
            xe = x[rows]
            ref_amax[e] = xe.abs().max().float()
            ref_sq[e] = (xe.float() ** 2).sum(0)
            act = torch.relu(torch.nn.functional.linear(xe, moe.experts.up_proj[e])) ** 2
            ref_down[e] = act.abs().max().float()
    assert torch.equal(stats.expert_tokens[up.name], torch.bincount(idx.reshape(-1), minlength=8))
    assert torch.equal(stats.input_amax[up.key], ref_amax)
    assert torch.allclose(stats.square_sum(up.key), ref_sq, rtol=1e-5)
    assert torch.allclose(stats.input_amax[down.key], ref_down, rtol=2e-2)  # bf16 GEMM differs by path
    assert stats.importance(down.key).shape == (8, 32)


def test_plan_warns_for_rules_that_match_nothing_and_keeps_bad_k_in_bf16():
    model = build_llama()
    recipe = recipe_from_dict({"name": "x", "rules": [{"roles": ["routed_experts"], "format": "nvfp4"}, {"roles": ["dense_mlp"], "format": "nvfp4"}]})
    plan, warnings = plan_targets(model, recipe)
    assert any("matches no module" in w and "routed_experts" in w for w in warnings)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj = torch.nn.Linear(120, 64, bias=False).to(torch.bfloat16)
    plan, _ = plan_targets(model, recipe)
    down = next(p for p in plan if p.target.name == "model.layers.0.mlp.down_proj")
    assert down.rule is None and "K=120" in down.reason


def test_exclude_pattern_that_matches_nothing_is_reported(nemotron_h_model):
    recipe = recipe_from_dict({"name": "x", "rules": [{"roles": ["routed_experts"], "format": "nvfp4"}], "exclude": ["*.mixer.gate_proj", "backbone.layers.1.*"]})
    plan, warnings = plan_targets(nemotron_h_model, recipe)
    assert any("'*.mixer.gate_proj' matches no module" in w for w in warnings)
    assert not any("backbone.layers.1.*" in w for w in warnings)
    layer1 = [p for p in plan if p.target.layer == 1 and p.target.role == Role.ROUTED_EXPERTS]
    assert layer1 and all(p.rule is None for p in layer1)


def test_split_formats_inside_a_fused_group_are_refused(llama_model):
    recipe = recipe_from_dict({"name": "x", "rules": [{"names": ["*.q_proj"], "format": "fp8"}, {"roles": ["attention_qkv"], "format": "nvfp4"}]})
    with pytest.raises(PlanError, match="self_attn.qkv"):
        plan_targets(llama_model, recipe)


def test_calibration_is_required_when_the_recipe_needs_statistics(nemotron_h_model):
    with pytest.raises(ValueError, match="needs calibration statistics"):
        quantize(nemotron_h_model, load_recipe("nemotron-h-w4a16-4o6"), None, progress=False)


@pytest.fixture
def exported(tmp_path, token_samples):
    model = build_nemotron_h()
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples, progress=False)
    return model, qm, export_checkpoint(qm, tmp_path / "ckpt", progress=False)


def test_export_layout_of_the_default_recipe(exported):
    model, qm, path = exported
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "config.json", "fp4kit.json", "generation_config.json", "hf_quant_config.json", "model.safetensors"]
    tensors = read_all(path)
    e = "backbone.layers.1.mixer.experts.5"
    assert tensors[f"{e}.up_proj.weight"].dtype == torch.uint8 and tensors[f"{e}.up_proj.weight"].shape == (32, 32)
    assert tensors[f"{e}.up_proj.weight_scale"].dtype == torch.float8_e4m3fn and tensors[f"{e}.up_proj.weight_scale"].shape == (32, 4)
    assert tensors[f"{e}.up_proj.weight_scale_2"].shape == () and f"{e}.up_proj.input_scale" not in tensors  # W4A16
    assert tensors["backbone.layers.0.mixer.in_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["backbone.layers.0.mixer.in_proj.input_scale"].shape == ()
    assert tensors["backbone.layers.2.mixer.k_proj.k_scale"].shape == () and tensors["backbone.layers.2.mixer.v_proj.v_scale"].item() > 0
    assert tensors["backbone.layers.2.mixer.q_proj.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("model.") for k in tensors)
    # Every quantized byte re-derives from the BF16 weights through the formats.
    stack = model.model.layers[1].mixer.experts.up_proj.detach()
    q = nvfp4.quantize(stack[5], scale_rule="4o6")
    assert torch.equal(tensors[f"{e}.up_proj.weight"], q.packed)
    assert torch.equal(tensors[f"{e}.up_proj.weight_scale"].view(torch.uint8), q.block_scale.view(torch.uint8))
    qf, s = fp8.quantize_per_tensor(model.model.layers[0].mixer.in_proj.weight.detach())
    assert torch.equal(tensors["backbone.layers.0.mixer.in_proj.weight"].view(torch.uint8), qf.view(torch.uint8))
    assert torch.equal(tensors["backbone.layers.0.mixer.in_proj.weight_scale"], s)


def test_export_configs_are_consistent(exported):
    model, qm, path = exported
    nested = json.loads((path / "hf_quant_config.json").read_text())
    config = json.loads((path / "config.json").read_text())
    flat = config["quantization_config"]
    assert config["hybrid_override_pattern"] == "ME*E"
    assert flat["quant_method"] == "modelopt" and flat["quant_algo"] == nested["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert flat["quantized_layers"] == nested["quantization"]["quantized_layers"]
    assert flat["kv_cache_quant_algo"] == nested["quantization"]["kv_cache_quant_algo"] == "FP8"
    layers = flat["quantized_layers"]
    assert layers["backbone.layers.1.mixer.experts.7.down_proj"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert layers["backbone.layers.0.mixer.out_proj"] == {"quant_algo": "FP8"}
    tensors = read_all(path)
    for module in layers:
        assert f"{module}.weight" in tensors, module
        assert "\x00" not in module and "sentinel" not in module


def test_single_format_recipe_lists_exclusions(tmp_path, token_samples):
    model = build_llama()
    qm = quantize(model, load_recipe("nvfp4-w4a16"), token_samples, progress=False)
    nested, flat = quant_configs(qm)
    assert flat["quant_algo"] == "W4A16_NVFP4" and flat["group_size"] == 16
    assert flat["ignore"] == ["lm_head"] == nested["quantization"]["exclude_modules"]
    # q/k/v share one global scale
    scales = [qm.quantized[f"model.layers.0.self_attn.{p}.weight"].tensors["weight_scale_2"][0] for p in ("q_proj", "k_proj", "v_proj")]
    assert scales[0] == scales[1] == scales[2]


def test_sharded_export_has_a_complete_index(tmp_path, token_samples):
    model = build_nemotron_h()
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples, progress=False)
    path = export_checkpoint(qm, tmp_path / "sharded", progress=False, max_shard_bytes=64_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    tensors = read_all(path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_export_refuses_an_existing_folder_and_is_atomic(tmp_path, token_samples, monkeypatch):
    model = build_nemotron_h()
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples, progress=False)
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(OutputExistsError, match="--overwrite"):
        export_checkpoint(qm, target, progress=False)
    import fp4kit.export.modelopt as exp

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(exp, "write_json", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(qm, tmp_path / "never", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing half-written left behind
    monkeypatch.undo()
    path = export_checkpoint(qm, target, overwrite=True, progress=False)
    assert (path / "model.safetensors").is_file()


def test_tensors_the_model_drops_on_load_are_carried_over(tmp_path, token_samples):
    """Nemotron-H's `mtp.*` subtree is ignored by transformers on load; the export keeps it."""
    from safetensors.torch import load_file, save_file

    from fp4kit.quantize import load_model
    from fp4kit.verify import verify

    src = tmp_path / "src"
    build_nemotron_h().save_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    mtp = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tensors["mtp.layers.0.mixer.q_proj.weight"] = mtp
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(str(src), device="cpu", tokenizer=False)
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), token_samples, progress=False)
    out = export_checkpoint(qm, tmp_path / "ckpt", source_dir=src, progress=False)
    assert torch.equal(read_all(out)["mtp.layers.0.mixer.q_proj.weight"], mtp)
    report = verify(out, source=str(src))
    assert report.ok, report.text()
