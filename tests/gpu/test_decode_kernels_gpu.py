"""The decode step's one-launch kernels on a CUDA GPU, on Nemotron-3-Nano's shapes: the router
(`kernels.router.route`: logits, sigmoid, pick, weights) and the Mamba step between the
projections (`kernels.mamba.mamba_step`), eagerly and replayed from a CUDA graph, and
`generate(step_ops="triton")` against the eager step; the attention kernel
(`kernels.attention.decode_attention`) is in tests/gpu/test_generate_gpu.py beside the step's
grouped sdpa.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from fp4kit.kernels import mamba, router  # noqa: E402
from fp4kit.kernels.tiles import split_counters  # noqa: E402

from .helpers import eager_and_replayed, write_late  # noqa: E402

pytestmark = pytest.mark.gpu


def graphed(fn):
    """fn's outputs from a CUDA graph of it (captured after a warm-up), replayed twice."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    first = [t.clone() for t in out] if isinstance(out, tuple) else out.clone()
    graph.replay()
    torch.cuda.synchronize()
    return first, out


@pytest.mark.parametrize("t", [1, 7, 16, 64])
def test_the_one_launch_router_on_nano_shapes(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn((t, 2688), device="cuda", generator=g).bfloat16()
    w = torch.randn((128, 2688), device="cuda", generator=g) * 0.02
    bias = torch.randn(128, device="cuda", generator=g) * 0.01
    logits, weights, chosen = router.route(x, w, bias, 6, norm=True, scale=2.5)
    want = router.route_reference(x, w, bias, 6, norm=True, scale=2.5)
    bound = 2688 * 2**-24 * (x.float().abs() @ w.abs().T).max().item()
    assert (logits - want[0]).abs().max().item() <= bound
    own = router.topk_gather_reference(logits.sigmoid(), bias, 6)
    assert torch.equal(chosen, own[0])
    picked = own[1] / (own[1].sum(-1, keepdim=True) + 1e-20) * 2.5
    assert torch.allclose(weights, picked, rtol=1e-6, atol=0)
    assert not split_counters(x.device, t)[:t].any()
    first, replayed = graphed(lambda: router.route(x, w, bias, 6, norm=True, scale=2.5))
    for a, b, c in zip(first, replayed, (logits, weights, chosen)):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_the_one_launch_mamba_step_on_nano_shapes(batch):
    # Nemotron-3-Nano's mixer: 64 heads of 64, 8 groups, N = 128, 4 taps, bf16, fp32 parameters
    # as a checkpoint stores them. libdevice's exp, log1p and rsqrt are the functions torch's CUDA
    # operators call: both states equal the reference's bit for bit; the output is within one
    # bf16 unit (the sums over N and over each group run in another order).
    g = torch.Generator(device="cuda").manual_seed(batch)
    heads, head_dim, size, groups = 64, 64, 128, 8
    inter = heads * head_dim
    channels = inter + 2 * groups * size

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)

    proj = rand(batch, inter + channels + heads, scale=2.0)
    proj[:, -heads:] -= 3.0  # dt + bias around softplus's bend
    args = (proj, rand(batch, channels, 4), rand(batch, heads, head_dim, size, dtype=torch.float32),
            rand(channels, 4, scale=0.5), rand(channels, scale=0.1), rand(heads, dtype=torch.float32),
            rand(heads, dtype=torch.float32), rand(heads, dtype=torch.float32), rand(inter, scale=0.1) + 1)
    kernel = [a.clone() for a in args]
    reference = [a.clone() for a in args]
    out = mamba.mamba_step(*kernel, 1e-5, groups)
    want = mamba.mamba_step_reference(*reference, 1e-5, groups)
    assert torch.equal(kernel[1], reference[1]) and torch.equal(kernel[2], reference[2])
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0 ** -126))) - 7)
    assert ((out.float() - want.float()).abs() <= ulp).all()
    assert not split_counters(proj.device, batch * groups)[:batch * groups].any()
    replay = [a.clone() for a in args]
    states = [a.clone() for a in args[1:3]]

    def step():
        for t, s in zip(replay[1:3], states):
            t.copy_(s)
        return mamba.mamba_step(*replay, 1e-5, groups)

    first, replayed = graphed(step)
    assert torch.equal(first, out) and torch.equal(replayed, out)
    assert torch.equal(replay[1], kernel[1]) and torch.equal(replay[2], kernel[2])
    # out_proj's FP8 input from the same launch: FP8Linear's quantization of that output, bytes.
    from fp4kit.modules import e4m3_cast

    scale = (out.float().abs().amax() / 448).reshape(1)
    q = mamba.mamba_step(*[a.clone() for a in args], 1e-5, groups, scale)
    assert torch.equal(q.view(torch.uint8), e4m3_cast(out.float() / scale).view(torch.uint8))


@pytest.mark.parametrize("batch", [1, 16])
def test_the_programmatic_dependent_mamba_step_reads_proj_only_after_the_launch_before(batch):
    # pdl: the SSM state rows and the head's parameters are requested before the wait for the
    # launch before. Here that launch lets the step start at once and writes its proj late: the
    # output and both states are those of the new proj, the plain launch's bytes, eagerly and over
    # replays of a CUDA graph (a program that read proj before its wait would see the old one).
    assert mamba.backend.pdl(torch.device("cuda"), mamba._mamba_step_kernel)
    g = torch.Generator(device="cuda").manual_seed(70 + batch)
    heads, head_dim, size, groups = 64, 64, 128, 8
    inter = heads * head_dim
    channels = inter + 2 * groups * size

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)

    old, new = rand(batch, inter + channels + heads, scale=2.0), rand(batch, inter + channels + heads, scale=2.0)
    rest = (rand(batch, channels, 4), rand(batch, heads, head_dim, size, dtype=torch.float32),
            rand(channels, 4, scale=0.5), rand(channels, scale=0.1), rand(heads, dtype=torch.float32),
            rand(heads, dtype=torch.float32), rand(heads, dtype=torch.float32), rand(inter, scale=0.1) + 1)
    plain = [new.clone(), *(a.clone() for a in rest)]
    want = mamba.mamba_step(*plain, 1e-5, groups, pdl=False)
    states = [a.clone() for a in rest[:2]]
    proj = old.clone()
    work = [proj, *(a.clone() for a in rest)]

    def step():
        for t, s in zip(work[1:3], states):
            t.copy_(s)
        proj.copy_(old)
        write_late(new, proj)
        return mamba.mamba_step(*work, 1e-5, groups, pdl=True)

    def check(got):
        assert torch.equal(got, want)
        assert torch.equal(work[1], plain[1]) and torch.equal(work[2], plain[2])

    eager_and_replayed(step, check)


def test_the_triton_step_ops_give_the_eager_steps_tokens():
    """generate(step_ops="triton") on the embedded model, graphed and compiled: the tokens of the
    eager step with the "fp4kit" ops (the trained model's greedy margins are wide)."""
    from fp4kit.decode import generate
    from fp4kit.models.tiny import load_tiny_model

    model, tok = load_tiny_model(device="cuda")
    prompts = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach, dear friends, once more"]
    want = generate(model, tok, prompts, 24, graph=False).tokens
    assert generate(model, tok, prompts, 24, graph=True, step_ops="triton").tokens == want
    assert generate(model, tok, prompts, 24, graph=True, compile=True, step_ops="triton").tokens == want
