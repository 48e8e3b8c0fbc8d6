"""`fp4kit verify` on a `modelopt-lightning` checkpoint: ModelOpt's FP8 range search, the 4/6 tie
rule, tensor parallelism of every format, vLLM's bf16 KV scales and the report's summary lines.

The source model is the tiny Nemotron-H with two weights set so that the rules matter: the Mamba
in_proj holds values for which the x1.5 FP8 range has the smaller error, and one 16-element block
of routed expert 0 holds the expert's maximum 16 times, so that both 4/6 candidates reconstruct
it exactly (a tie, which keeps 6).
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4kit.export.checkpoint import CheckpointReader
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.formats import e2m1, e4m3, fp8
from fp4kit.quantize import load_model, quantize
from fp4kit.recipe import load_recipe
from fp4kit.verify import (
    VerifyReport,
    _mamba_in_proj,
    against_modelopt,
    kv_scales_as_bf16,
    modelopt_mse_algorithm,
    tensor_parallel,
    verify,
)

from tiny_models import build_nemotron_h

IN_PROJ = "backbone.layers.0.mixer.in_proj"
EXPERT0 = "backbone.layers.1.mixer.experts.0.up_proj"


def _source_model():
    model = build_nemotron_h()
    g = torch.Generator().manual_seed(1)
    w = model.model.layers[0].mixer.in_proj.weight
    # |w| in [0.6, 0.85] x 0.08 and one element 0.08: the x1.5 range puts the bulk on a finer E4M3 step
    bulk = (torch.rand(w.shape, generator=g) * 0.25 + 0.6) * torch.where(torch.rand(w.shape, generator=g) < 0.5, -1.0, 1.0)
    bulk[0, 0] = 1.0
    w.data.copy_((bulk * 0.08).to(w.dtype))
    up = model.model.layers[1].mixer.experts.up_proj  # [E, I, H]
    peak = 2.0 ** torch.ceil(torch.log2(up.data[0].abs().amax().float())).item()
    up.data[0, 0, :16] = peak  # the expert's max in every element of its first block
    return model


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("lightning")
    _source_model().save_pretrained(base / "source")
    model, _ = load_model(str(base / "source"), device="cpu", tokenizer=False)
    samples = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    # ModelOpt's CPU arithmetic, so that ModelOpt itself can run here
    qm = quantize(model, load_recipe("modelopt-lightning"), samples, progress=False, arith="cpu")
    export_checkpoint(qm, base / "ckpt", progress=False)
    return base


def rewrite(folder, tensors):
    """Replace tensors in the checkpoint's safetensors file(s)."""
    reader = CheckpointReader(folder)
    for shard in sorted({reader.where[n] for n in tensors}):
        data = load_file(folder / shard)
        data.update({n: t for n, t in tensors.items() if reader.where[n] == shard})
        save_file(data, str(folder / shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tie_as_4(made):
    """The checkpoint with the tied block stored as its x1.5 candidate (scale 384, codes 4.0)."""
    ckpt = made / "tie-as-4"
    shutil.copytree(made / "ckpt", ckpt)
    reader = CheckpointReader(ckpt)
    scale, packed = reader.get(f"{EXPERT0}.weight_scale").clone(), reader.get(f"{EXPERT0}.weight").clone()
    scale[0, 0] = e4m3.cast(torch.tensor(384.0))
    packed[0, :8] = 0x66  # E2M1 code 6 (+4.0) in both nibbles
    rewrite(ckpt, {f"{EXPERT0}.weight_scale": scale, f"{EXPERT0}.weight": packed})
    return ckpt


def _against(ckpt, source):
    report = VerifyReport(str(ckpt))
    against_modelopt(report, ckpt, str(source), sample=100)
    return report


# --- ModelOpt's FP8 range search (`amax_search`) ---


def test_the_fp8_range_search_chooses_1_5_for_in_proj(made):
    model, _ = load_model(str(made / "source"), device="cpu", tokenizer=False)
    w = model.model.layers[0].mixer.in_proj.weight.detach()
    amax, best, _ = fp8.search_amax(w, (1.0, 1.5))
    assert best == 1
    stored = CheckpointReader(made / "ckpt").get(f"{IN_PROJ}.weight_scale")
    assert torch.equal(stored, fp8.scale_from_amax(amax, "cpu"))
    assert not torch.equal(stored, fp8.scale_from_amax(w.abs().amax(), "cpu"))


def test_against_modelopt_honours_the_recipes_amax_search(made):
    report = _against(made / "ckpt", made / "source")
    assert [c for c in report.checks if not c.ok] == []
    # 2 FP8 Mamba projections x 2 tensors + 9 NVFP4 modules (4 expert stacks, 4 shared, lm_head) x 3
    assert len(report.checks) == 31
    assert {c.tensor for c in report.checks if c.tensor.startswith(IN_PROJ)} == {f"{IN_PROJ}.weight", f"{IN_PROJ}.weight_scale"}


def test_fp8_bytes_of_the_plain_max_range_fail_against_modelopt(made):
    ckpt = made / "max-range"
    shutil.copytree(made / "ckpt", ckpt)
    model, _ = load_model(str(made / "source"), device="cpu", tokenizer=False)
    q, s = fp8.quantize_per_tensor(model.model.layers[0].mixer.in_proj.weight.detach(), "cpu")
    rewrite(ckpt, {f"{IN_PROJ}.weight": q, f"{IN_PROJ}.weight_scale": s})
    report = _against(ckpt, made / "source")
    assert [c.tensor for c in report.checks if not c.ok] == [f"{IN_PROJ}.weight", f"{IN_PROJ}.weight_scale"]


@pytest.mark.parametrize(
    "search, expected",
    [
        ((), "max"),
        ((1.0,), "max"),
        ((1.0, 1.5), {"method": "mse", "start_multiplier": 1.0, "stop_multiplier": 1.5, "step_size": 0.5}),
        ((0.5, 1.0, 1.5, 2.0), {"method": "mse", "start_multiplier": 0.5, "stop_multiplier": 2.0, "step_size": 0.5}),
    ],
)
def test_modelopt_mse_algorithm(search, expected):
    assert modelopt_mse_algorithm(search) == expected


@pytest.mark.parametrize("search", [(1.5, 1.0), (1.0, 1.2, 1.5), (1.0, 1.0), (0.9,)])
def test_modelopt_mse_algorithm_refuses_what_modelopt_cannot_search(search):
    with pytest.raises(ValueError, match="ModelOpt's mse search"):
        modelopt_mse_algorithm(search)


# --- the 4/6 tie rule: equal errors keep scale 6 ---


def test_a_tied_block_is_stored_with_scale_6(made):
    reader = CheckpointReader(made / "ckpt")
    assert reader.get(f"{EXPERT0}.weight_scale")[0, 0].view(torch.uint8) == e4m3.cast(torch.tensor(256.0)).view(torch.uint8)
    assert torch.all(reader.get(f"{EXPERT0}.weight")[0, :8] == 0x77)  # E2M1 code 7 (+6.0)


def test_a_tied_block_reconstructs_exactly_with_either_scale(made, tie_as_4):
    six, four = (CheckpointReader(c) for c in (made / "ckpt", tie_as_4))
    g = six.get(f"{EXPERT0}.weight_scale_2")

    def first_block(r):
        codes = torch.stack([r.get(f"{EXPERT0}.weight")[0, :8] & 0xF, r.get(f"{EXPERT0}.weight")[0, :8] >> 4], -1).reshape(-1)
        return e2m1.decode(codes) * (r.get(f"{EXPERT0}.weight_scale")[0, 0].float() * g)

    assert torch.equal(first_block(six), first_block(four))


def test_a_tie_stored_as_4_fails_rederivation(made, tie_as_4):
    report = verify(tie_as_4, source=str(made / "source"))
    assert [(c.name, c.tensor) for c in report.checks if not c.ok] == [
        ("rederive", f"{EXPERT0}.weight"),
        ("rederive", f"{EXPERT0}.weight_scale"),
    ]


def test_a_tie_stored_as_4_fails_against_modelopt(made, tie_as_4):
    report = _against(tie_as_4, made / "source")
    assert [c.tensor for c in report.checks if not c.ok] == [f"{EXPERT0}.weight", f"{EXPERT0}.weight_scale"]


# --- tensor parallelism: FP8 and BF16 layers too, Mamba in_proj by its sub-blocks ---


def test_tensor_parallel_checks_every_format(made):
    tp4 = tensor_parallel(made / "ckpt", 4)
    assert tp4["problems"] == [
        f"{IN_PROJ} (FP8): Mamba in_proj N=328 = z 128 + x 128 + B 32 + C 32 + dt 8, each block split by tp=4: "
        "every block divides, but the engines need mamba_num_heads (8) and n_groups (2) divisible by tp",
        "backbone.layers.1.mixer.experts.0.down_proj (NVFP4): K=32 splits into 8 per rank, not a whole number of 16-element blocks",
        "backbone.layers.1.mixer.shared_experts.down_proj (NVFP4): K=48 splits into 12 per rank, not a whole number of 16-element blocks",
    ]
    assert tp4["count"] == 1 + 8 + 8 + 1 + 1  # in_proj, 8 experts in each of two MoE layers, 2 shared
    tp3 = tensor_parallel(made / "ckpt", 3, ep=True)
    assert tp3["problems"][1:] == [
        "backbone.layers.0.mixer.out_proj (FP8): K=128 does not split into 3 equal parts",
        "backbone.layers.2.mixer.o_proj (BF16): K=64 does not split into 3 equal parts",
        "attention: num_attention_heads=4 is not divisible by tp=3",
        "attention: num_key_value_heads=2 and tp=3: neither divides the other",
    ]
    assert tp3["problems"][0].startswith(f"{IN_PROJ} (FP8): Mamba in_proj N=328") and tp3["count"] == 5
    assert tensor_parallel(made / "ckpt", 2, ep=True)["problems"] == [
        "backbone.layers.1.mixer.shared_experts.down_proj (NVFP4): K=48 splits into 24 per rank, not a whole number of 16-element blocks"
    ]
    assert tensor_parallel(made / "ckpt", 1)["ok"] is True


NEMOTRON_3_NANO_MAMBA = {"mamba_num_heads": 16, "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 32}


def test_mamba_in_proj_splits_by_its_sub_blocks():
    fp8_tp3 = _mamba_in_proj("in_proj (FP8)", 1168, True, NEMOTRON_3_NANO_MAMBA, 3)
    assert fp8_tp3 == (
        "in_proj (FP8): Mamba in_proj N=1168 = z 512 + x 512 + B 64 + C 64 + dt 16, each block split by tp=3: "
        "z=512, x=512, B=64, C=64, dt=16 not divisible; the engines need mamba_num_heads (16) and n_groups (2) divisible by tp"
    )
    assert _mamba_in_proj("in_proj (FP8)", 1168, True, NEMOTRON_3_NANO_MAMBA, 2) is None
    one_group = {**NEMOTRON_3_NANO_MAMBA, "n_groups": 1}
    assert _mamba_in_proj("in_proj (BF16)", 1104, False, one_group, 2) is None  # the one group is replicated
    assert _mamba_in_proj("in_proj (FP8)", 1104, True, one_group, 2).endswith("n_groups (1) divisible by tp")
    assert _mamba_in_proj("in_proj (BF16)", 1168, False, {}, 3) == "in_proj (BF16): N=1168 does not split into 3 equal parts"


# --- k/v scales as vLLM keeps them, and the report's lines ---


def test_kv_scales_are_reported_with_their_bf16_values(made):
    reader = CheckpointReader(made / "ckpt")
    expected = []
    for name in ("backbone.layers.2.mixer.k_proj.k_scale", "backbone.layers.2.mixer.v_proj.v_scale"):
        v = reader.get(name)
        b = v.to(torch.bfloat16).float()
        expected.append({"tensor": name, "value": float(v), "bf16": float(b), "rel_change": float((b - v) / v)})
    assert kv_scales_as_bf16(made / "ckpt") == expected
    assert any(e["rel_change"] != 0 for e in expected)
    report = verify(made / "ckpt")
    assert report.ok and report.sections["kv_scales_bf16"] == expected
    info = [line for line in report.text().splitlines() if line.startswith("  info ")]
    assert info == [
        f"  info {e['tensor']}: {e['value']:.8g}, {e['bf16']:.8g} as vLLM's bf16 parameter ({e['rel_change']:+.3%})" for e in expected
    ]


def test_summary_lines_say_what_is_counted(made, tie_as_4):
    n = len(CheckpointReader(made / "ckpt").names())
    good = verify(made / "ckpt", source=str(made / "source"), tp=2, ep=True).text().splitlines()
    rederived = sum(1 for _ in verify(made / "ckpt", source=str(made / "source")).checks) - 1
    assert good[:4] == [
        f"fp4kit verify {made / 'ckpt'}: FAIL",
        f"  ok   conformance: 0 errors, 1 warning over {n} tensors",
        "       warning tokenizer [missing_file] none of ['tokenizer.json', 'tokenizer.model', 'tokenizer_config.json'] present",
        f"  ok   rederive: 0 of {rederived} tensors differ",
    ]
    assert good[4:6] == [
        "  FAIL tensor_parallel: TP=2 with expert parallelism: does NOT shard cleanly, 2 problems of 1 kind, the first of each shown",
        "       backbone.layers.1.mixer.shared_experts.down_proj (NVFP4): K=48 splits into 24 per rank, not a whole number of 16-element blocks",
    ]
    bad = verify(tie_as_4, source=str(made / "source")).text().splitlines()
    assert bad[0] == f"fp4kit verify {tie_as_4}: FAIL"
    assert bad[3:6] == [
        f"  FAIL rederive: 2 of {rederived} tensors differ",
        f"       {EXPERT0}.weight 8 of 1024 bytes differ",
        f"       {EXPERT0}.weight_scale 1 of 128 bytes differ",
    ]
