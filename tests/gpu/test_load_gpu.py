"""fp4kit.load_quantized on a CUDA GPU: the Triton kernels, torch._scaled_mm and the native FP8
cast inside a transformers model, against the exact CPU emulation of the same checkpoint.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fp4kit.export.load import load_quantized  # noqa: E402
from fp4kit.modules import native_e4m3  # noqa: E402
from fp4kit.export.modelopt import export_checkpoint  # noqa: E402
from fp4kit.formats import e4m3  # noqa: E402
from fp4kit.models.tiny import corpus_path, load_tiny_model  # noqa: E402
from fp4kit.quantize import quantize  # noqa: E402
from fp4kit.recipe import load_recipe  # noqa: E402

pytestmark = pytest.mark.gpu


def test_native_e4m3_cast_on_cuda_equals_the_emulator():
    bits = torch.arange(-2**31, 2**31, 241, dtype=torch.int64).to(torch.int32)
    q = bits.view(torch.float32)
    assert torch.equal(native_e4m3(q.cuda()).view(torch.uint8).cpu(), e4m3.encode(q))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The embedded trained model under the default recipe (W4A16 4/6 experts, FP8 Mamba
    projections, FP8 KV cache), quantized on the GPU, and held-out token rows."""
    model, tok = load_tiny_model(device="cuda")
    ids = torch.tensor(tok(corpus_path("eval").read_text()[:40000])["input_ids"][: 4 * 256]).reshape(4, 256)
    calib = torch.tensor(tok(corpus_path("calibration").read_text()[:40000])["input_ids"][: 4 * 256]).reshape(4, 256)
    folder = tmp_path_factory.mktemp("tiny") / "nvfp4"
    export_checkpoint(quantize(model, load_recipe("nemotron-h-w4a16-4o6"), calib.cuda(), progress=False),
                      folder, progress=False)
    return folder, ids


def test_load_quantized_on_cuda_matches_the_cpu_emulation(tiny_checkpoint):
    # The GPU path computes with bf16 activations and fp32 accumulation in other orders than the
    # CPU emulation: logits agree to bf16 rounding, and the predicted tokens almost everywhere.
    folder, ids = tiny_checkpoint
    gpu = load_quantized(folder, device="cuda")
    cpu = load_quantized(folder, device="cpu")
    modules = {type(m).__name__ for m in gpu.modules()}
    assert {"NVFP4Experts", "FP8Linear", "FP8KVProjection"} <= modules
    with torch.inference_mode():
        lg = gpu(input_ids=ids.cuda()).logits.float().cpu()
        lc = cpu(input_ids=ids).logits.float()
    rel = float((lg - lc).norm() / lc.norm())
    agree = float((lg.argmax(-1) == lc.argmax(-1)).float().mean())
    assert rel < 3e-2, rel
    assert agree > 0.97, agree


def test_load_quantized_generates_on_cuda(tiny_checkpoint):
    folder, ids = tiny_checkpoint
    model = load_quantized(folder, device="cuda")
    out = model.generate(ids[:2, :32].cuda(), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.shape == (2, 48)
    assert torch.equal(out[:, :32].cpu(), ids[:2, :32])


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_blocks_with_the_shared_expert_on_a_second_stream(tiny_checkpoint, tokens, one_launch):
    # load_quantized on CUDA runs each MoE block's shared expert on a second stream beside the
    # routed experts (models.nemotron_h.overlap_shared_experts): the block's output is its own
    # forward's bit for bit, eagerly and replayed from a CUDA graph. one_launch: within generate's
    # routing (the router as one launch, inside the block's call, the shared expert's launches
    # queued before the router's).
    import contextlib

    from fp4kit.models import nemotron_h

    folder, ids = tiny_checkpoint
    model = load_quantized(folder, device="cuda")
    block_class = nemotron_h._classes().NemotronHMoE
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    assert blocks and all(type(b).__name__ == "NemotronHMoEOverlapped" for b in blocks)
    block = blocks[0]
    x = torch.randn((1, tokens, model.config.hidden_size), device="cuda", generator=torch.Generator("cuda").manual_seed(tokens)).bfloat16()
    routing = contextlib.ExitStack()
    if one_launch:
        assert routing.enter_context(nemotron_h.single_group_routing(model)) == len(blocks)
        routing.enter_context(nemotron_h.one_launch_routing())
        assert nemotron_h._one_launch_router(block.gate, x.view(-1, x.shape[-1])) is not None
    with routing, torch.inference_mode():
        overlapped = block(x)
        own = block_class.forward(block, x)
        assert torch.equal(overlapped, own)
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block(static_x)  # warm-up off the capture: kernels compiled, launches kept
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(static_x)
        static_x.copy_(x * 2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, block_class.forward(block, x * 2))
