"""evaluate / compare_recipes / the `eval` command on a small random Nemotron-H and Llama."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from fp4kit.cli import main as cli_main
from fp4kit.evaluate import (
    EMBEDDED_MODEL,
    compare_recipes,
    evaluate,
    stored_scale_rule,
    quality_markdown,
    token_rows,
    variant_recipe,
    weight_report,
)
from fp4kit.export.load import load_quantized
from fp4kit.export.modelopt import export_checkpoint
from fp4kit.formats import nvfp4
from fp4kit.models.tiny import tiny_model_path
from fp4kit.modules import FP8KVProjection, fake_quant_fp8
from fp4kit.quantize import quantize
from fp4kit.recipe import load_recipe

_spec = importlib.util.spec_from_file_location("pipeline_models", Path(__file__).parent / "pipeline" / "tiny_models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

VOCAB = 4096  # the bundled tokenizer's, so that text can be evaluated
SAMPLES = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
ROWS = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


def _with_tokenizer(folder: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_path() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(BF16 folder, its QuantizedModel under the default recipe, the checkpoint folder)."""
    root = tmp_path_factory.mktemp("eval")
    model = models.build_nemotron_h(vocab_size=VOCAB)
    model.save_pretrained(root / "bf16")
    _with_tokenizer(root / "bf16")
    qm = quantize(model, load_recipe("nemotron-h-w4a16-4o6"), SAMPLES, progress=False)
    return root / "bf16", qm, export_checkpoint(qm, root / "ckpt", progress=False)


def test_identical_models_have_exactly_zero_kl(pair):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.bfloat16).eval()
    res = evaluate(ref, ref, data=ROWS)
    assert res["kl_mean"] == res["kl_median"] == res["kl_p99"] == res["kl_max"] == 0.0
    assert res["top1_agreement"] == 1.0 and res["ppl_reference"] == res["ppl_quantized"]
    assert res["tokens"] == ROWS.numel() and res["layers"] == [] and res["frac4"] is None


def test_a_checkpoint_against_its_reference(pair, tmp_path):
    bf16_dir, qm, ckpt = pair
    res = evaluate(str(bf16_dir), str(ckpt), data=ROWS, out=tmp_path / "report")
    kl = res["kl_values"]
    assert kl.shape == (ROWS.numel(),) and bool((kl >= 0).all()) and res["kl_mean"] > 0
    assert res["kl_median"] <= res["kl_p99"] <= res["kl_max"]
    assert 0 < res["top1_agreement"] < 1
    assert math.isfinite(res["ppl_reference"]) and res["ppl_quantized"] != res["ppl_reference"]
    # One row per quantized weight, matching what the quantizer itself measured.
    by_module = {r["module"]: r for r in res["layers"]}
    assert len(by_module) == len(qm.quantized)
    for key, q in qm.quantized.items():
        module = q.target.disk_names[0] if not q.target.is_stack else qm.adapter.disk_name(key)
        row = by_module[module]
        assert row["format"] == q.algo
        assert row["sqnr_db"] == pytest.approx(q.sqnr_db, rel=1e-4)
        assert row["frac4"] == q.frac4  # the same blocks, recomputed from the stored scale bytes
    assert 0 < res["frac4"] < 1
    files = {p.name for p in (tmp_path / "report").iterdir()}
    assert {"eval.json", "eval.md", "sqnr.png", "kl_hist.png"} <= files
    saved = json.loads((tmp_path / "report" / "eval.json").read_text())
    assert saved["kl_mean"] == res["kl_mean"] and len(saved["layers"]) == len(qm.quantized)
    assert sum(saved["kl_histogram"]["counts"]) + saved["kl_histogram"]["zeros"] == ROWS.numel()
    for png in ("sqnr.png", "kl_hist.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = quality_markdown(res)
    assert f"{res['top1_agreement']:.2%}" in md and "KL p99" in md
    assert "FP8 KV cache with k/v scales rounded to bfloat16 as vLLM holds them" in md  # the report names the KV scale


def test_fp8_kv_cache_uses_the_scale_vllm_computes_with():
    stored = torch.tensor(0.00906808115541935)  # a k_scale of the embedded model's checkpoint (engines.json)
    held = stored.to(torch.bfloat16).float()  # vLLM's bf16 k_scale parameter: 0.00909423828125
    assert held.item() != stored.item()
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)
    kv = FP8KVProjection(nn.Identity(), stored.clone(), "k")
    got = kv(x)
    assert torch.equal(got, fake_quant_fp8(x, held)) and not torch.equal(got, fake_quant_fp8(x, stored))
    assert kv.k_scale.item() == stored.item()  # the buffer keeps the checkpoint's value
    assert torch.equal(kv(x.float()), fake_quant_fp8(x.float(), stored))  # a float32 model's parameter is exact
    sglang = FP8KVProjection(nn.Identity(), stored.clone(), "k", model_dtype_scale=False)
    assert torch.equal(sglang(x), fake_quant_fp8(x, stored))


def test_four_over_six_fraction_is_read_from_the_stored_scales():
    w = (torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    q46, choice = nvfp4.quantize(w, scale_rule="4o6", return_choice=True)
    assert stored_scale_rule(w, q46) == ("4o6", choice.double().mean().item())
    imp = torch.rand(3, 64, generator=torch.Generator().manual_seed(6))
    qi, choice_i = nvfp4.quantize(w, scale_rule="4o6", importance=imp, return_choice=True)
    assert stored_scale_rule(w, qi)[1] == choice_i.double().mean().item() != choice.double().mean().item()
    assert stored_scale_rule(w, nvfp4.quantize(w, scale_rule="6")) == ("6", None)
    # Either way of dividing by the constants (formats.arith) is recognised.
    for mode in ("cpu", "cuda"):
        q, c = nvfp4.quantize(w, scale_rule="4o6", arith=mode, return_choice=True)
        assert stored_scale_rule(w, q) == ("4o6", c.double().mean().item())
        assert stored_scale_rule(w, nvfp4.quantize(w, scale_rule="6", arith=mode)) == ("6", None)


def test_fused_groups_use_their_shared_amax():
    model = models.build_llama()
    recipe = variant_recipe(load_recipe("nvfp4-w4a16"), "4o6")
    qm = quantize(model, recipe, SAMPLES % 512, progress=False)
    # Rebuild a loaded model from the in-memory result, without a round trip through disk.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_quantized(export_checkpoint(qm, Path(tmp) / "c", progress=False))
        rows = {r["module"]: r for r in weight_report(model, loaded)}
    for key, q in qm.quantized.items():
        assert rows[q.target.disk_names[0]]["scale_rule"] == "4o6"
        assert rows[q.target.disk_names[0]]["frac4"] == q.frac4


def test_token_rows_put_eos_between_documents(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    docs = ["To be, or not to be, that is the question.", "Now is the winter of our discontent."]
    src = tmp_path / "docs.txt"
    src.write_text("\f".join(docs))  # the calibration sources' document separator
    ids = [*tok(docs[0], add_special_tokens=False)["input_ids"], tok.eos_token_id, *tok(docs[1], add_special_tokens=False)["input_ids"], tok.eos_token_id]
    rows, _ = token_rows(tok, str(src), tokens=len(ids), seq_len=4)
    assert rows.flatten().tolist() == ids[: (len(ids) // 4) * 4] and rows.shape[1] == 4
    bundled, described = token_rows(tok, None, tokens=1000, seq_len=300)
    assert bundled.shape == (3, 300) and "eval split" in described
    with pytest.raises(ValueError, match="fewer than one row"):
        token_rows(tok, str(src), tokens=4096, seq_len=4096)


def _recorded_temp_folders(monkeypatch) -> list:
    made, real = [], tempfile.TemporaryDirectory

    def recorded(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "TemporaryDirectory", recorded)
    return made


def test_compare_recipes_tabulates_every_variant(pair, tmp_path, monkeypatch):
    bf16_dir = pair[0]
    made = _recorded_temp_folders(monkeypatch)
    summary = compare_recipes(str(bf16_dir), calib="4x64", tokens=256, seq_len=128, out=tmp_path / "cmp", log=lambda m: None)
    rows = {r["variant"]: r for r in summary["rows"]}
    assert list(rows) == ["6", "4o6", "4o6-importance", "bf16"]
    assert rows["bf16"]["kl_mean"] == 0 and rows["bf16"]["top1_agreement"] == 1
    assert rows["6"]["frac4"] is None and 0 < rows["4o6"]["frac4"] < 1
    assert all(rows[v]["kl_mean"] > 0 for v in ("6", "4o6", "4o6-importance"))
    assert rows["4o6"]["weight_sqnr_db_mean"] > rows["6"]["weight_sqnr_db_mean"]  # 4/6 lowers the weight error
    assert "| NVFP4 4/6 |" in summary["markdown"]
    # --out gets the tables alone; the checkpoints went to a temporary folder, now removed.
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["cmp", "cmp/compare.json", "cmp/compare.md"]
    assert any(Path(t.name).name.startswith("fp4kit-compare-") for t in made)
    assert not any(Path(t.name).exists() for t in made)
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["command"] == f"fp4kit eval --compare-recipes --model {bf16_dir} --calib 4x64 --tokens 256 --seq-len 128 --out {tmp_path / 'cmp'}"
    assert {"python", "torch", "transformers", "fp4kit"} <= set(saved["versions"]) and saved["date"]


def test_compare_recipes_keeps_checkpoints_only_where_asked(pair, tmp_path, monkeypatch):
    import fp4kit.evaluate as ev

    monkeypatch.setattr(ev, "tiny_model_path", lambda: pair[0])  # stands in for the embedded model
    monkeypatch.chdir(tmp_path)
    compare_recipes(recipes=("6",), calib="2x64", tokens=128, seq_len=64, out="cmp", keep_checkpoints="keep", log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["compare.json", "compare.md"]
    assert (tmp_path / "keep" / "6" / "checkpoint" / "config.json").is_file() and (tmp_path / "keep" / "6" / "eval.json").is_file()
    text = (tmp_path / "cmp" / "compare.json").read_text() + (tmp_path / "cmp" / "compare.md").read_text()
    assert str(pair[0]) not in text  # the embedded model by its place in the source tree, not this machine's path
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["model"] == EMBEDDED_MODEL and [r["variant"] for r in saved["rows"]] == ["6"]
    assert saved["command"].startswith("fp4kit.evaluate.compare_recipes(recipes=['6']")


def _cli(argv):
    return cli_main(argv)


def test_eval_command(pair, tmp_path, capsys):
    bf16_dir, _, ckpt = pair
    rc = _cli(["eval", "--reference", str(bf16_dir), "--quantized", str(ckpt), "--tokens", "256", "--seq-len", "128",
               "--out", str(tmp_path / "o"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "top-1 agreement" in out and "backbone.layers.1.mixer.experts.up_proj" in out
    assert (tmp_path / "o" / "eval.json").is_file()
    assert _cli(["eval", "--compare-recipes", "--reference", str(bf16_dir)]) == 2
    assert _cli(["eval", "--reference", str(bf16_dir)]) == 2


def _bad_eval_inputs(bf16_dir: Path, ckpt: Path, tmp: Path) -> dict:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    return {
        "quantized missing": (["--reference", str(bf16_dir), "--quantized", str(tmp / "missing")], "quantized checkpoint"),
        "quantized not a checkpoint": (["--reference", str(bf16_dir), "--quantized", str(tmp)], "config.json"),
        "reference missing": (["--reference", str(tmp / "missing"), "--quantized", str(ckpt)], "reference model"),
        "data missing": (["--reference", str(bf16_dir), "--quantized", str(ckpt), "--data", str(tmp / "no.txt")], "no.txt"),
        "out is a file": (["--reference", str(bf16_dir), "--quantized", str(ckpt), "--out", str(a_file)], "not a folder"),
        "tokens below a row": (["--reference", str(bf16_dir), "--quantized", str(ckpt), "--tokens", "8"], "tokens"),
        "model missing": (["--compare-recipes", "--model", str(tmp / "missing")], "model"),
        "dataset missing": (["--compare-recipes", "--dataset", str(tmp / "no.txt")], "no.txt"),
        "recipe unknown": (["--compare-recipes", "--recipe", "no-such-recipe"], "no-such-recipe"),
        "calib malformed": (["--compare-recipes", "--calib", "12"], "12"),
        "keep is a file": (["--compare-recipes", "--keep-checkpoints", str(a_file)], "not a folder"),
    }


def test_eval_checks_every_path_before_loading(pair, tmp_path, capsys, monkeypatch):
    import fp4kit.evaluate as ev

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(ev, "load_model", no_load)
    monkeypatch.setattr(ev, "load_quantized", no_load)
    for case, (argv, named) in _bad_eval_inputs(pair[0], pair[2], tmp_path).items():
        assert _cli(["eval", *argv, "--no-progress"]) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], (case, err)


def test_quality_section_is_written_and_replaced(tmp_path):
    from fp4kit.export.card import set_quality_section

    (tmp_path / "README.md").write_text("# card\n\n## Calibration\n\n- x\n\n## Recipe\n\n```yaml\nname: r\n```\n")
    set_quality_section(tmp_path, "| KL | 0.1 |")
    set_quality_section(tmp_path, "| KL | 0.2 |")
    text = (tmp_path / "README.md").read_text()
    assert text.count("## Quality") == 1 and "0.2" in text and "0.1" not in text
    assert text.index("## Calibration") < text.index("## Quality") < text.index("## Recipe")
