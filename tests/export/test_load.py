"""load_quantized on small random Nemotron-H and Llama checkpoints written by fp4kit.

The reference for every checkpoint is the original model with each quantized weight replaced by
its dequantized checkpoint tensor and the same activation / KV rounding applied with hooks, so
the logits must be equal, not close.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fp4kit.export.checkpoint import CheckpointError, read_quant_scheme
from fp4kit.export.load import load_quantized
from fp4kit.modules import FP8KVProjection, FP8Linear, NVFP4Experts, NVFP4Linear, fake_quant_nvfp4, native_e4m3
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.formats import e4m3, fp8, nvfp4
from fp4kit.models import adapter_for
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe, recipe_from_dict

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parents[1] / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

SAMPLES = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
PROMPT = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))

# One checkpoint with every kind of layer the loader runs: W4A16 experts (4/6), W4A4 shared
# experts, FP8 Mamba projections, a W4A16 lm_head, FP8 KV cache; MIXED_PRECISION.
EVERYTHING = {
    "name": "everything",
    "kv_cache": "fp8",
    "rules": [
        {"roles": ["routed_experts"], "format": "nvfp4_w4a16", "scale_rule": "4o6"},
        {"roles": ["shared_experts"], "format": "nvfp4", "scale_rule": "6"},
        {"roles": ["mamba_in_proj", "mamba_out_proj"], "format": "fp8"},
        {"roles": ["lm_head"], "format": "nvfp4_w4a16", "scale_rule": "6"},
    ],
}


def _export(model, recipe, folder):
    qm = quantize(model, recipe, SAMPLES, progress=False)
    return qm, export_checkpoint(qm, folder, progress=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    # The BF16 originals as transformers loads them (from_pretrained keeps RoPE's inverse
    # frequencies in fp32, where `model.to(bfloat16)` would round them).
    out["bf16_nemotron"] = _saved(models.build_nemotron_h(), root / "bf16_nemotron")
    out["bf16_llama"] = _saved(models.build_llama(), root / "bf16_llama")
    out["nemotron"] = _export(models.build_nemotron_h(), recipe_from_dict(EVERYTHING), root / "nemotron")
    out["nemotron_w4a4"] = _export(models.build_nemotron_h(), load_recipe("nemotron-h-nvfp4-w4a4"), root / "nemotron_w4a4")
    out["llama_w4a4"] = _export(models.build_llama(), load_recipe("nvfp4-w4a4"), root / "llama_w4a4")
    out["llama_fp8"] = _export(models.build_llama(), load_recipe("fp8"), root / "llama_fp8")
    return out


def _saved(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def bf16(folder: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return e4m3.decode(e4m3.encode(x.float() / scale)) * scale


def reference(original: Path, folder: Path, *, act_quant: bool) -> nn.Module:
    """The original model with dequantized checkpoint weights and hook-applied rounding."""
    model = bf16(original)
    model.config._experts_implementation = "eager"  # the loop NVFP4Experts emulates
    adapter = adapter_for(model)
    scheme = read_quant_scheme(folder)
    t = read_all(folder)
    to_bf16 = lambda m, args, out: out.to(torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        for target in adapter.targets(model):
            if target.is_stack:
                algos = {scheme.algo_for(d) for d in target.disk_names}
                if algos == {None}:
                    continue
                stack = [nvfp4.NVFP4Tensor(t[f"{d}.weight"], t[f"{d}.weight_scale"], t[f"{d}.weight_scale_2"]) for d in target.disk_names]
                setattr(target.module, target.param, nn.Parameter(torch.stack([q.dequantize(torch.bfloat16) for q in stack])))
        for name, m in list(model.named_modules()):
            if not isinstance(m, nn.Linear):
                continue
            d = adapter.disk_name(name)
            algo = scheme.algo_for(d)
            if m.weight is model.get_input_embeddings().weight:
                continue  # a tied head is the embedding table, stored once in BF16
            if algo == "FP8":
                m.weight = nn.Parameter(fp8.dequantize_per_tensor(t[f"{d}.weight"], t[f"{d}.weight_scale"]))
                s = t[f"{d}.input_scale"]
                m.register_forward_pre_hook(lambda mod, args, s=s: (_fp8_round(args[0], s),))
                m.register_forward_hook(to_bf16)
            elif algo in ("NVFP4", "W4A16_NVFP4"):
                q = nvfp4.NVFP4Tensor(t[f"{d}.weight"], t[f"{d}.weight_scale"], t[f"{d}.weight_scale_2"])
                if algo == "NVFP4" and act_quant:
                    m.weight = nn.Parameter(q.dequantize(torch.float32))
                    s = t[f"{d}.input_scale"]
                    m.register_forward_pre_hook(lambda mod, args, s=s: (fake_quant_nvfp4(args[0], s),))
                    m.register_forward_hook(to_bf16)
                else:
                    m.weight = nn.Parameter(q.dequantize(torch.bfloat16))
        if scheme.kv_cache_algo == "FP8":
            for kv in adapter.attention_kv(model):
                for kind, proj in (("k", kv.k_proj), ("v", kv.v_proj)):
                    s = t[f"{kv.disk_name}.{kind}_proj.{kind}_scale"]
                    # the scale as vLLM computes with it: the stored fp32 value rounded to the model dtype
                    proj.register_forward_hook(lambda mod, args, out, s=s: _fp8_round(out, s.to(out.dtype).float()).to(out.dtype))
    return model


@pytest.mark.parametrize(
    "which, original, act_quant",
    [
        ("nemotron", "bf16_nemotron", True),
        ("nemotron", "bf16_nemotron", False),
        ("nemotron_w4a4", "bf16_nemotron", False),
        ("llama_w4a4", "bf16_llama", True),
        ("llama_w4a4", "bf16_llama", False),
        ("llama_fp8", "bf16_llama", True),
    ],
)
def test_logits_equal_the_dequantized_reference(ckpts, which, original, act_quant):
    _, path = ckpts[which]
    loaded = load_quantized(path, act_quant=act_quant)
    ref = reference(ckpts[original], path, act_quant=act_quant)
    with torch.no_grad():
        got = loaded(input_ids=PROMPT).logits
        want = ref(input_ids=PROMPT).logits
        assert torch.equal(got, want)
        assert not torch.equal(got, bf16(ckpts[original])(input_ids=PROMPT).logits)  # it is not the BF16 model


def test_a_head_tied_to_the_embeddings(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    original = _saved(LlamaForCausalLM(cfg).to(torch.bfloat16), tmp_path / "bf16")
    _, path = _export(bf16(original), load_recipe("nvfp4-w4a16"), tmp_path / "ckpt")
    loaded = load_quantized(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=PROMPT).logits, reference(original, path, act_quant=True)(input_ids=PROMPT).logits)


def test_w4a4_experts_quantize_their_activations(ckpts):
    _, path = ckpts["nemotron_w4a4"]
    on, off = load_quantized(path, act_quant=True), load_quantized(path, act_quant=False)
    assert isinstance(on.model.layers[1].mixer.experts, NVFP4Experts) and on.model.layers[1].mixer.experts.act_quant
    with torch.no_grad():
        a, b = on(input_ids=PROMPT).logits, off(input_ids=PROMPT).logits
    assert torch.isfinite(a).all() and not torch.equal(a, b)
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl < 0.05  # FP4 activations perturb the output a little, not wholesale


def test_w4a4_expert_loop_against_a_per_token_restatement():
    g = torch.Generator().manual_seed(7)
    e, i, h, t, k = 4, 32, 48, 10, 2
    up = nvfp4.quantize(torch.randn(e, i, h, generator=g).to(torch.bfloat16) * 0.1)
    down = nvfp4.quantize(torch.randn(e, h, i, generator=g).to(torch.bfloat16) * 0.1)
    up_s, down_s = torch.rand(e, generator=g) * 1e-3 + 1e-4, torch.rand(e, generator=g) * 1e-4 + 1e-5
    experts = NVFP4Experts(up, down, lambda x: torch.relu(x).square(), up_input_scale=up_s, down_input_scale=down_s,
                           act_quant=True, backend="torch")
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    got = experts(x, idx, w)
    u, d = up.dequantize(), down.dequantize()
    # The loop adds each token's slots in expert order into a buffer of the dtype transformers'
    # own loop uses (fp32 up to transformers 5.24, the hidden states' bf16 from 5.25).
    acc = torch.float32 if experts.accumulate_in_routing_dtype else torch.bfloat16
    want = torch.zeros(t, h, dtype=acc)
    for tok in range(t):
        for slot in sorted(range(k), key=lambda s: int(idx[tok, s])):
            ex = int(idx[tok, slot])
            a = (fake_quant_nvfp4(x[tok : tok + 1], up_s.max()) @ u[ex].T).to(torch.bfloat16)
            a = torch.relu(a).square()
            y = (fake_quant_nvfp4(a, down_s.max()) @ d[ex].T).to(torch.bfloat16)
            want[tok] += (y[0].float() * w[tok, slot]).to(acc)
    assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-6)
    assert not torch.equal(got, NVFP4Experts(up, down, lambda x: torch.relu(x).square(), up_input_scale=None,
                                             down_input_scale=None, act_quant=False, backend="torch")(x, idx, w))


def test_every_quantized_module_is_an_fp4kit_module(ckpts):
    qm, path = ckpts["nemotron"]
    loaded = load_quantized(path)
    modules = dict(loaded.named_modules())
    layers = json.loads((path / "config.json").read_text())["quantization_config"]["quantized_layers"]
    kinds = {"W4A16_NVFP4": (NVFP4Linear, NVFP4Experts), "NVFP4": (NVFP4Linear,), "FP8": (FP8Linear,)}
    for disk, entry in layers.items():
        name = "model" + disk[len("backbone"):] if disk.startswith("backbone") else disk
        if ".experts." in name:  # one checkpoint module per expert -> the layer's stack
            name = name.split(".experts.")[0] + ".experts"
        assert isinstance(modules[name], kinds[entry["quant_algo"]]), disk
        assert modules[name].algo == entry["quant_algo"]
    assert isinstance(loaded.lm_head, NVFP4Linear) and not loaded.lm_head.act_quant
    assert loaded.model.layers[1].mixer.shared_experts.up_proj.act_quant  # W4A4 on Blackwell
    attn = loaded.model.layers[2].mixer
    assert isinstance(attn.k_proj, FP8KVProjection) and isinstance(attn.v_proj, FP8KVProjection)
    assert type(attn.q_proj) is nn.Linear  # attention stays BF16 in this recipe
    stored = read_all(path)["backbone.layers.1.mixer.experts.5.up_proj.weight_scale"]
    held = loaded.model.layers[1].mixer.experts.up_proj_weight_scale[5]
    assert torch.equal(held.view(torch.uint8), stored.view(torch.uint8))
    llama = load_quantized(ckpts["llama_w4a4"][1])
    assert all(isinstance(getattr(llama.model.layers[0].self_attn, p), NVFP4Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert type(llama.lm_head) is nn.Linear  # in the `ignore` list


def test_generate_runs_with_and_without_the_cache(ckpts):
    for which in ("nemotron", "llama_fp8"):
        model = load_quantized(ckpts[which][1])
        with torch.no_grad():
            first = model(input_ids=PROMPT[:1]).logits[0, -1].argmax()
            cached = model.generate(PROMPT[:1], max_new_tokens=6, do_sample=False, use_cache=True)
            uncached = model.generate(PROMPT[:1], max_new_tokens=6, do_sample=False, use_cache=False)
        assert cached.shape == (1, PROMPT.shape[1] + 6) and uncached.shape == cached.shape
        assert cached[0, PROMPT.shape[1]] == first == uncached[0, PROMPT.shape[1]]
        assert ((cached >= 0) & (cached < 512)).all()


def _copy(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / path.name
    shutil.copytree(path, dst)
    return dst


def _edit_tensors(folder: Path, edit) -> None:
    tensors = read_all(folder)
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_an_unplaceable_quantized_tensor_is_named(ckpts, tmp_path):
    path = _copy(ckpts["nemotron"][1], tmp_path)
    _edit_tensors(path, lambda t: t.update({"backbone.layers.2.mixer.q_proj.weight_scale": torch.ones(64, 4).to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.2\.mixer\.q_proj\.weight_scale"):
        load_quantized(path)


def test_subtrees_the_model_class_skips_are_skipped(ckpts, tmp_path):
    extra = {"mtp.layers.0.mixer.up_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}
    nemotron = _copy(ckpts["nemotron"][1], tmp_path)
    _edit_tensors(nemotron, lambda t: t.update(extra))
    load_quantized(nemotron)  # Nemotron-H has no MTP module and skips `mtp.*`, as from_pretrained does
    llama = _copy(ckpts["llama_fp8"][1], tmp_path)
    _edit_tensors(llama, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.0\.mixer\.up_proj\.weight"):
        load_quantized(llama)


def test_a_listed_module_without_its_tensors_is_named(ckpts, tmp_path):
    path = _copy(ckpts["nemotron"][1], tmp_path)
    _edit_tensors(path, lambda t: t.pop("backbone.layers.3.mixer.experts.6.down_proj.weight_scale_2"))
    with pytest.raises(CheckpointError, match=r"experts\.6\.down_proj\.weight_scale_2"):
        load_quantized(path)


def test_a_quantized_weight_the_config_does_not_list_is_refused(ckpts, tmp_path):
    path = _copy(ckpts["nemotron"][1], tmp_path)
    for name in ("config.json", "hf_quant_config.json"):
        cfg = json.loads((path / name).read_text())
        q = cfg["quantization_config"] if name == "config.json" else cfg["quantization"]
        del q["quantized_layers"]["backbone.layers.0.mixer.in_proj"]
        (path / name).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.0\.mixer\.in_proj\.weight"):
        load_quantized(path)


@pytest.mark.parametrize("algo", ["MXFP8", "NVFP4_AWQ"])
def test_an_unsupported_quant_algo_is_named(ckpts, tmp_path, algo):
    path = _copy(ckpts["llama_fp8"][1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = algo
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=algo):
        load_quantized(path)


def test_an_unsupported_layer_algo_in_a_mixed_checkpoint_is_named(ckpts, tmp_path):
    path = _copy(ckpts["nemotron"][1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quantized_layers"]["backbone.layers.0.mixer.out_proj"] = {"quant_algo": "INT4_AWQ"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="INT4_AWQ"):
        load_quantized(path)


def test_configs_that_disagree_are_refused(ckpts, tmp_path):
    path = _copy(ckpts["llama_fp8"][1], tmp_path)
    nested = json.loads((path / "hf_quant_config.json").read_text())
    nested["quantization"]["quant_algo"] = "NVFP4"
    (path / "hf_quant_config.json").write_text(json.dumps(nested))
    with pytest.raises(CheckpointError, match="disagree"):
        load_quantized(path)


def test_pickle_checkpoints_are_refused(ckpts, tmp_path):
    path = _copy(ckpts["llama_fp8"][1], tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load_quantized(path)


def test_missing_kv_scales_are_refused(ckpts, tmp_path):
    path = _copy(ckpts["llama_fp8"][1], tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.v_proj.v_scale"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.v_scale"):
        load_quantized(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("which, act_quant", [("nemotron", True), ("nemotron", False), ("llama_w4a4", True), ("llama_fp8", True)])
def test_cuda_fast_path_matches_the_emulation(ckpts, which, act_quant):
    path = ckpts[which][1]
    fast = load_quantized(path, "cuda", act_quant=act_quant)
    slow = load_quantized(path, "cuda", backend="torch", act_quant=act_quant)
    with torch.no_grad():
        a = fast(input_ids=PROMPT.cuda()).logits.float()
        b = slow(input_ids=PROMPT.cuda()).logits.float()
    # Summation order differs (Triton tiles, _scaled_mm vs torch's GEMM): close, not equal.
    assert torch.allclose(a, b, rtol=0.05, atol=0.05), (a - b).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_w4a4_experts_have_no_triton_kernel(ckpts):
    with pytest.raises(CheckpointError, match="no W4A4 MoE kernel"):
        load_quantized(ckpts["nemotron_w4a4"][1], "cuda", act_quant=True)


def test_native_e4m3_cast_equals_the_emulator():
    # Every 241st fp32 bit pattern (17.8 M values: every exponent, NaN and Inf included): the
    # clamp-and-cast the loader uses on a GPU gives the emulator's bytes (tests/gpu repeats
    # this on CUDA, where the loader uses it).
    bits = torch.arange(-2**31, 2**31, 241, dtype=torch.int64).to(torch.int32)
    q = bits.view(torch.float32)
    assert torch.equal(native_e4m3(q).view(torch.uint8), e4m3.encode(q))


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The embedded tiny Nemotron-H under the default recipe: its shared experts are W4A16 NVFP4 linears."""
    from fp4kit.models.tiny import tiny_model_path
    from fp4kit.quantize import load_model
    from fp4kit.recipe import DEFAULT_RECIPE

    model, _ = load_model(str(tiny_model_path()), device="cpu", tokenizer=False)
    return _export(model, load_recipe(DEFAULT_RECIPE), tmp_path_factory.mktemp("embedded") / "ckpt")[1]


def test_packed_layout_runs_the_dequantized_weights(embedded):
    reference = load_quantized(embedded, backend="torch")
    packed = load_quantized(embedded, backend="torch", layout="packed")
    linears = {m.name: m for m in packed.modules() if isinstance(m, NVFP4Linear)}
    ref_linears = {m.name: m for m in reference.modules() if isinstance(m, NVFP4Linear)}
    assert linears and all(m.layout == "packed" and "weight" not in dict(m.named_buffers()) for m in linears.values())
    for name, m in linears.items():  # the packed weight holds the checkpoint's bytes
        a, b = m.qweight, ref_linears[name].qweight
        assert torch.equal(a.packed, b.packed) and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    prompt = PROMPT[:, :8]
    with torch.no_grad():
        want = reference(input_ids=prompt).logits
        assert torch.equal(packed(input_ids=prompt).logits, want)  # backend "torch": the unpacked weight, dequantized
        # Only the packed linears switch to the kernel (Triton's interpreter on CPU); each one's
        # output is compared with the dequantized weight's on the input it was given. (Through
        # the whole model, one-ulp BF16 differences of the fp32 sums' order grow too much for
        # the logits to be a measure of the GEMM.)
        seen = []

        def check(m, args, out):
            x = args[0]
            seen.append(torch.allclose(out.float(), F.linear(x, m.qweight.dequantize(x.dtype)).float(), rtol=0.05, atol=0.05))

        for m in linears.values():
            m.backend = "triton"
            m.register_forward_hook(check)
        packed(input_ids=prompt)
    assert len(seen) == len(linears) and all(seen)


def test_packed_layout_refuses_what_it_does_not_run(embedded, ckpts):
    packed = load_quantized(embedded, backend="torch", layout="packed")
    linear = next(m for m in packed.modules() if isinstance(m, NVFP4Linear))
    with pytest.raises(ValueError, match="packed for torch.bfloat16 activations, got torch.float32"):
        linear(torch.zeros(2, linear.in_features))
    with pytest.raises(CheckpointError, match="layout 'packed' runs NVFP4 weights with 16-bit activations"):
        load_quantized(ckpts["llama_w4a4"][1], layout="packed", act_quant=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        load_quantized(embedded, layout="transposed")


def test_the_expert_loop_accumulates_as_the_installed_transformers_does():
    """One token routed to four experts of output 1, 2^-9, 2^-9, 2^-9: a bf16 buffer keeps 1.0,
    an fp32 one sums 1 + 3 * 2^-9 and rounds it to 1.0078125. transformers' own loop and the
    fp4kit loop must land on the same value."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    model = models.build_nemotron_h()
    model.config._experts_implementation = "eager"  # the loop NVFP4Experts emulates
    hf = next(m for m in model.modules() if isinstance(m, NemotronHExperts))
    e, i, h = hf.up_proj.shape
    with torch.no_grad():
        up = torch.zeros(e, i, h)
        up[:, 0, 0] = 1.0
        down = torch.zeros(e, h, i)
        down[:, 0, 0] = 1.0
        hf.up_proj.copy_(up)
        hf.down_proj.copy_(down)
        hf.to(torch.bfloat16)
        x = torch.zeros(1, h, dtype=torch.bfloat16)
        x[0, 0] = 1.0
        idx = torch.tensor([[0, 1, 2, 3]])
        w = torch.tensor([[1.0, 2.0**-9, 2.0**-9, 2.0**-9]])
        theirs = hf(x, idx, w)[0, 0].item()
        q_up, q_down = nvfp4.quantize(up.to(torch.bfloat16)), nvfp4.quantize(down.to(torch.bfloat16))
        ours = NVFP4Experts(q_up, q_down, hf.act_fn, up_input_scale=None, down_input_scale=None, act_quant=False,
                            backend="torch")(x, idx, w)[0, 0].item()
    assert theirs in (1.0, 1.0078125)
    assert ours == theirs
