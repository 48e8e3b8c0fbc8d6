"""The pipeline on a CUDA GPU: quantized tensors stay on the device and the export streams them
through a ring of small pinned buffers; the checkpoint bytes equal the CPU pipeline's.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import re

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from safetensors.torch import load_file, save_file  # noqa: E402

from fp4kit.export import writer as writer_mod  # noqa: E402

from fp4kit.export.checkpoint import CheckpointReader  # noqa: E402
from fp4kit.export.modelopt import export_checkpoint  # noqa: E402
from fp4kit.export.writer import ShardWriter  # noqa: E402
from fp4kit.models.tiny import load_tiny_model  # noqa: E402
from fp4kit.quantize import quantize  # noqa: E402
from fp4kit.recipe import load_recipe  # noqa: E402

pytestmark = pytest.mark.gpu


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def _assert_weights_identical(folder_a, folder_b) -> None:
    """The same tensor names, and every tensor byte for byte but the activation statistics (input
    and KV scales), which two calibration forwards may round apart in the last bit."""
    a, b = CheckpointReader(folder_a), CheckpointReader(folder_b)
    assert sorted(a.names()) == sorted(b.names())
    differ = [n for n in a.names() if not torch.equal(_raw(a.get(n)), _raw(b.get(n)))]
    assert not [n for n in differ if not n.endswith(("input_scale", "k_scale", "v_scale"))], differ


def test_shard_writer_streams_gpu_tensors_through_pinned_memory(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "a": torch.randn(333, 17, device="cuda", generator=g).to(torch.bfloat16),  # odd byte count
        "b": torch.randint(0, 256, (5, 7), device="cuda", dtype=torch.uint8, generator=g),
        "c": torch.randn(48, device="cuda", generator=g).to(torch.float8_e4m3fn),
        "d": torch.tensor(0.37, device="cuda"),
        "e": torch.randn(3, 64, 32, device="cuda", generator=g).unbind(0)[1],  # a view into a stack
        "f": torch.empty(0, device="cuda"),
        "g": torch.randn(10, 10),  # a CPU tensor beside them
    }
    writer = ShardWriter(tmp_path, max_shard_bytes=4096)  # several shards, the stage reused
    for k, v in tensors.items():
        writer.add(k, v)
    files = writer.close()
    assert len([f for f in files if f.endswith(".safetensors")]) > 2
    got = {}
    for f in tmp_path.glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(_raw(got[k]), _raw(v)), k


@pytest.mark.parametrize("buffer_bytes", [1000, 4096, 64 << 20])
def test_gpu_tensors_stream_to_save_files_bytes(tmp_path, monkeypatch, buffer_bytes):
    """Chunks cross tensor boundaries, a tensor spans several buffers and the ring wraps."""
    monkeypatch.setattr(writer_mod._Stage, "BUFFER_BYTES", buffer_bytes)
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = {f"w{i}": torch.randn(37 + 50 * i, 29, device="cuda", generator=g).to(torch.bfloat16) for i in range(6)}
    tensors.update({"s": torch.rand(7, device="cuda", generator=g), "cpu": torch.arange(300, dtype=torch.int16),
                    "t": torch.randn(64, 16, device="cuda", generator=g).t(), "z": torch.tensor(2.5, device="cuda")})
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp_path / "ref.safetensors", {"format": "pt"})
    writer_mod.write_safetensors(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_gpu_pipeline_writes_the_cpu_pipelines_bytes(tmp_path):
    """Triton kernels on the GPU, tensors exported from the device: every tensor byte-equal to
    the torch reference run on the CPU (arith cuda for both)."""
    recipe = load_recipe("nemotron-h-w4a16-4o6")
    g = torch.Generator().manual_seed(0)
    folders = {}
    for device in ("cpu", "cuda"):
        model, _ = load_tiny_model(device=device)
        samples = torch.randint(0, model.config.vocab_size, (2, 128), generator=g.manual_seed(0))
        qm = quantize(model, recipe, samples, backend="triton" if device == "cuda" else "torch", progress=False)
        if device == "cuda":
            assert all(t.device.type == "cuda" for q in qm.quantized.values() for ts in q.tensors.values() for t in ts
                       if t.dim() > 0)
        folders[device] = export_checkpoint(qm, tmp_path / device, progress=False)
    # The calibration forward runs on two devices, so activation statistics (input and KV
    # scales) may differ in the last bit; every weight tensor must be identical.
    _assert_weights_identical(folders["cpu"], folders["cuda"])


def test_batch_size_auto_measures_one_sample_then_fills_the_device():
    from fp4kit.calibrate import Statistics
    from fp4kit.quantize import _forward_samples

    model, _ = load_tiny_model(device="cuda")
    samples = torch.randint(0, model.config.vocab_size, (9, 64), generator=torch.Generator().manual_seed(0))
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        used = _forward_samples(model, samples, "auto", False, Statistics())
    finally:
        hook.remove()
    # the tiny model's sample is a few MiB on a GPU of tens of GiB: the rest goes in one batch
    assert used == 8 and seen == [1, 8]


@pytest.mark.parametrize("recipe", ["nemotron-h-w4a16-4o6", "modelopt-lightning", "nvfp4-w4a4", "fp8"])
def test_queueing_the_weights_never_waits_for_the_gpu(monkeypatch, recipe):
    """Every weight's quantization, error terms and data checks are queued without one host
    synchronisation (torch raises on any in its sync-debug mode); the results are read back
    afterwards by waiting on the events of their asynchronous copies alone (which that mode does
    not count), never by a synchronising copy or `.item()`."""
    import fp4kit.quantize as q

    def strict(real, settle):
        def run(*args, **kwargs):
            if settle:
                torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    monkeypatch.setattr(q, "queue_weights", strict(q.queue_weights, True))
    monkeypatch.setattr(q, "_read_back_results", strict(q._read_back_results, False))
    model, _ = load_tiny_model(device="cuda")
    samples = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    qm = q.quantize(model, load_recipe(recipe), samples, progress=False)
    assert qm.quantized and all(t.sqnr_db == t.sqnr_db for t in qm.quantized.values())


@pytest.mark.parametrize("recipe", ["nemotron-h-w4a16-4o6", "fp8"])
def test_a_nan_weight_is_named_after_the_single_read_back(recipe):
    """The deferred data checks still name the checkpoint tensor, the expert and the position."""
    from fp4kit.formats import FormatError
    from fp4kit.models import adapter_for
    from fp4kit.plan import plan_targets

    model, _ = load_tiny_model(device="cuda")
    plan, _ = plan_targets(model, load_recipe(recipe), adapter_for(model))
    target = next(p.target for p in plan if p.rule is not None and (p.target.is_stack or recipe == "fp8"))
    with torch.no_grad():
        w = target.weight
        where = (1, 2, 3) if target.is_stack else (2, 3)
        w[where] = float("nan")
    samples = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    name = target.disk_names[1] if target.is_stack else target.disk_names[0]
    expected = re.escape(f"{name}.weight (") + r".*" + re.escape(f"): 1 NaN and 0 Inf values (first at {where[-2:]})")
    with pytest.raises(FormatError, match=expected):
        quantize(model, load_recipe(recipe), samples, progress=False)


def test_a_model_spread_over_the_gpu_and_the_cpu_gets_the_weights_of_one_on_the_gpu(tmp_path):
    """`--device auto --max-memory`: accelerate puts the layers that do not fit the GPU's cap on the
    CPU; the Triton kernels still quantize every weight (each CPU weight copied over for its turn),
    and every weight tensor equals the all-GPU run's (activation scales come from a forward that
    ran partly on the CPU, so they may differ in the last bit)."""
    from fp4kit.quantize import QuantizeJob, run

    base = dict(calib="2x128", progress=False)
    run(QuantizeJob(device="cuda", output=str(tmp_path / "gpu"), **base), log=lambda m: None)
    lines: list[str] = []
    run(QuantizeJob(device="auto", max_memory="0=12MiB,cpu=2GiB", output=str(tmp_path / "spread"), **base),
        log=lines.append)
    placed = [line for line in lines if line.startswith("placed over")]
    assert placed and "cpu" in placed[0] and "cuda:0" in placed[0], lines
    _assert_weights_identical(tmp_path / "gpu", tmp_path / "spread")


def test_the_calibration_rate_is_timed_on_the_gpu_without_a_wait_per_batch():
    import fp4kit.quantize as q

    model, _ = load_tiny_model(device="cuda")
    samples = torch.randint(0, model.config.vocab_size, (6, 64), generator=torch.Generator().manual_seed(0))
    clock = q.BatchClock(torch.device("cuda"))
    q._forward_samples(model, samples, 2, False, q.Statistics(), clock=clock)
    assert all(isinstance(m, torch.cuda.Event) for m in clock.marks) and clock.rows == [2, 2, 2]
    each = clock.per_sample()
    assert len(each) == 3 and all(t > 0 for t in each)
    qm = q.quantize(model, load_recipe("nemotron-h-w4a16-4o6"), samples, progress=False)
    assert qm.calibrate_s_per_sample > 0
