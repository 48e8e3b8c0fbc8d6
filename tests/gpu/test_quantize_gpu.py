"""fp4kit.kernels on a CUDA GPU: bf16 inputs and real Nemotron-3-Nano shapes.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing the kernels: their decorators must not run here without CUDA
    # (tests/kernels may need them under TRITON_INTERPRET=1).
    pytest.skip("needs a CUDA device", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4kit.formats import nvfp4  # noqa: E402
from fp4kit.formats.constants import E2M1_MAGNITUDES  # noqa: E402
from fp4kit.kernels import backend, launch, quantize as kquant  # noqa: E402

from .helpers import DEV, _randn, _same  # noqa: E402

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------------------------
# quantize: identical bytes to the reference (fp4kit.formats.nvfp4.quantize on the CPU)
# --------------------------------------------------------------------------------------------
def _members(t: nvfp4.NVFP4Tensor, idx) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(t.packed[idx], t.block_scale[idx], t.global_scale[idx])


@pytest.mark.parametrize("rule", ["6", "4o6"])
@pytest.mark.parametrize("shape", [(4, 1856, 2688), (4, 2688, 1856), (2688, 1856)])
def test_quantize_bf16_expert_shapes(rule, shape):
    w = _randn(*shape, seed=1)
    w[1, :7] = 0.0  # zero rows / blocks
    got, got_choice = kquant.quantize(w, scale_rule=rule, return_choice=True)
    ref, ref_choice = nvfp4.quantize(w.cpu(), scale_rule=rule, return_choice=True)
    assert _same(got, ref)
    assert torch.equal(got_choice.cpu(), ref_choice)


def test_quantize_4o6_importance_and_shared_amax_bf16():
    w = _randn(8, 512, 1024, seed=2)
    imp = torch.rand((8, 1024), device=DEV)
    g = w.abs().amax().float() * 1.25
    for kw in (dict(importance=imp), dict(importance=imp[0]), dict(global_amax=g)):
        got, gc = kquant.quantize(w, scale_rule="4o6", return_choice=True, **kw)
        ref, rc = nvfp4.quantize(w.cpu(), scale_rule="4o6", return_choice=True,
                                 **{k: v.cpu() for k, v in kw.items()})
        assert _same(got, ref) and torch.equal(gc.cpu(), rc)


def test_quantize_full_expert_stack_one_launch():
    # The Nano layer's full 128-expert stack in one call; members quantize independently, so a
    # sample of them is checked against the CPU reference.
    w = _randn(128, 1856, 2688, seed=4)
    got = kquant.quantize(w, scale_rule="4o6")
    assert got.global_scale.shape == (128,)
    idx = torch.tensor([0, 1, 63, 127])
    assert _same(_members(got, idx.to(DEV)), nvfp4.quantize(w[idx.to(DEV)].cpu(), scale_rule="4o6"))


def _stack_table(**stack):
    """The device's launch table with some STACK entries replaced."""
    return launch.override(launch.table("quantize", torch.device(DEV)), STACK=stack)


@pytest.mark.parametrize("schedule", [{}, dict(lag=1, max_tiles=8, quant_tiles=4)])
@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_stack_kernel_against_two_launches(rule, schedule):
    # 96 members of 128 tiles each in one `_stack_kernel` launch, whose quantize items wait on
    # other programs' max items: every call gives the two-launch path's bytes and choices, with
    # the picked schedule and others (lag 1: most quantize items wait).
    tables = _stack_table(**schedule)
    w = _randn(96, 256, 1024, seed=21)
    w[5] *= 1000.0
    w[6] = 0.0
    assert kquant.fused_stack(w, 96, 256 * 1024 // 16, tables)
    assert not kquant.fused_stack(torch.empty(2, 8192, 8192, dtype=torch.bfloat16, device=DEV), 2, 8192 * 512)
    runs = [kquant.quantize(w, scale_rule=rule, return_choice=True, tables=tables) for _ in range(4)]
    two, two_choice = kquant.quantize(w, scale_rule=rule, return_choice=True,
                                      tables=_stack_table(max_member_bytes=None))
    for qt, choice in runs:
        assert _same(qt, two) and torch.equal(choice, two_choice)
    idx = torch.tensor([0, 5, 6, 95], device=DEV)
    assert _same(_members(two, idx), nvfp4.quantize(w[idx].cpu(), scale_rule=rule))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_stack_max_on_bit_patterns(dtype):
    # The stack kernel's max items on 16-bit weights (`_max_pair`, max.u16x2 on CUDA): a negative
    # maximum beside a smaller positive one in its word, a member of subnormals only, an all-zero
    # member with -0.0, the largest finite value; NaN and Inf flagged as +Inf in the member maxima.
    info = torch.finfo(dtype)
    w = _randn(16, 256, 1024, dtype=dtype, seed=23)
    w[0, 9, 20], w[0, 9, 21] = -7.5, 7.0
    w[1] = (torch.arange(256 * 1024, device=DEV).reshape(256, 1024) % 7 - 3).to(dtype) * (info.smallest_normal / 8)
    w[2] = 0.0
    w[2, ::2, 1::3] = -0.0
    w[3, -1, -1] = -info.max
    got, _, own = kquant.launch(w, "6")
    assert torch.equal(own, w.float().abs().amax(dim=(1, 2)))
    idx = torch.tensor([0, 1, 2, 3, 15], device=DEV)
    assert _same(_members(got, idx), nvfp4.quantize(w[idx].cpu(), scale_rule="6"))
    for bad in (float("nan"), float("inf"), -float("inf")):
        v = w.clone()
        v[7, 100, 513] = bad
        flagged = kquant.launch(v, "6")[2]
        assert flagged[7] == float("inf") and torch.equal(flagged[:7], own[:7])


def test_quantize_stack_kernel_in_a_cuda_graph():
    # The stack kernel (its counters zeroed by a captured memset) replays from a CUDA graph, as the bench times it.
    w = _randn(8, 1856, 2688, seed=22)
    ref = kquant.quantize(w, scale_rule="4o6")
    kquant.launch(w, "4o6")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, own = kquant.launch(w, "4o6")
    for _ in range(3):
        out.packed.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert _same(out, ref)
    assert torch.equal(own, w.float().abs().amax(dim=(1, 2)))


@pytest.mark.parametrize("rule", ["6", "4o6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256,), (1, 16), (8, 32), (4, 496), (16, 128), (130, 16)])
def test_quantize_one_small_tensor(rule, dtype, shape, monkeypatch):
    # One member of fewer 16-blocks than a program takes (TUNING["blocks"]), exactly one
    # program's, and a little more. Outputs are allocated poisoned (every byte 0xFF): a global
    # scale or byte the kernel does not write shows (the global scale was once left unwritten
    # for a member shorter than a program: a modulo by zero blocks // BLOCKS, which the
    # interpreter evaluates to 0 and the GPU does not).
    w = _randn(*shape, dtype=dtype, seed=90, scale=1.0)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        t.reshape(-1).view(torch.uint8).fill_(0xFF)
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned)
        got, choice = kquant.quantize(w, scale_rule=rule, return_choice=True)
    ref, ref_choice = nvfp4.quantize(w.cpu(), scale_rule=rule, return_choice=True)
    assert _same(got, ref) and torch.equal(choice.cpu(), ref_choice)


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_matches_reference_run_on_gpu(rule):
    # The same bytes as the reference evaluated on this GPU, and as on the CPU.
    w = _randn(16, 1856, 2688, seed=12)
    got = kquant.quantize(w, scale_rule=rule)
    ref_gpu = nvfp4.quantize(w, scale_rule=rule)
    ref_cpu = nvfp4.quantize(w.cpu(), scale_rule=rule)
    assert _same(ref_gpu, ref_cpu), "the reference itself differs between this GPU and the CPU"
    assert _same(got, ref_gpu)


@pytest.mark.parametrize("blocks,warps", [(64, 2), (128, 4), (256, 4), (256, 8)])
def test_quantize_launch_shapes(blocks, warps):
    # Bytes must not depend on the launch shape (TUNING, which scripts/sweeps/quantize.py sweeps).
    w = _randn(4, 1856, 2688, seed=13)
    tables = launch.override(launch.table("quantize", w.device), TUNING={"blocks": blocks, "num_warps": warps})
    got = {rule: kquant.quantize(w, scale_rule=rule, return_choice=True, tables=tables) for rule in ("6", "4o6")}
    for rule, (qt, choice) in got.items():
        ref, ref_choice = nvfp4.quantize(w.cpu(), scale_rule=rule, return_choice=True)
        assert _same(qt, ref) and torch.equal(choice.cpu(), ref_choice), rule


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_edge_values_fp32_and_fp16(rule):
    values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.25])
    g = torch.Generator().manual_seed(3)
    ties = values[torch.randint(0, 16, (256, 256), generator=g)]
    ties[:, ::16] = 6.0
    ties = ties * 2.0 ** torch.randint(-3, 3, (256, 1), generator=g).float()
    cases = [ties, ties.half(), torch.zeros(64, 64), torch.randn(3, 64, 64, generator=g) * 1e-39,
             torch.randn(64, 64, generator=g) * 1e37]
    cases[3][1] = 0.0
    for w in cases:
        assert _same(kquant.quantize(w.to(DEV), scale_rule=rule), nvfp4.quantize(w, scale_rule=rule))


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_every_bf16_value(rule):
    # Every finite bf16 bit pattern, shuffled into 16-element blocks: once as is (global amax
    # near bf16's max: steps too large for the fast quotient, the per-element division path),
    # and once with |x| <= 1 and each row scaled by 2^-100..2^0 (global amax <= 1: the fast
    # quotient, with quotients over the whole E2M1 range and far below it, subnormals included).
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    vals = bits.view(torch.bfloat16)
    vals = vals[torch.isfinite(vals.float())]
    g = torch.Generator().manual_seed(14)
    vals = vals[torch.randperm(vals.numel(), generator=g)]
    vals = vals[: vals.numel() // 256 * 256].reshape(-1, 256)
    amax = vals.float().abs().max()
    for global_amax in (None, amax * 1.003):
        got = kquant.quantize(vals.to(DEV), scale_rule=rule, global_amax=global_amax)
        assert _same(got, nvfp4.quantize(vals, scale_rule=rule, global_amax=global_amax)), global_amax
    scales = 2.0 ** torch.randint(-100, 1, (vals.shape[0], 1), generator=g).float()
    small = vals.float().clamp(-1.0, 1.0)
    for w in ((small * scales).to(torch.bfloat16), small.to(torch.bfloat16)):
        got, choice = kquant.quantize(w.to(DEV), scale_rule=rule, return_choice=True)
        ref, ref_choice = nvfp4.quantize(w, scale_rule=rule, return_choice=True)
        assert _same(got, ref) and torch.equal(choice.cpu(), ref_choice)


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_quantize_given_amax_one_launch_equals_own(rule):
    # With a given global amax (one launch, member maxima folded in atomically) equal to the
    # members' own maxima, the bytes are those of the two-launch path; the own maxima come back.
    w = _randn(24, 512, 1024, seed=15)
    w[3] = 0.0
    w[7, 5, 9] = 1.5  # one expert with an outlier
    own = w.float().abs().amax(dim=(1, 2))
    one = kquant.quantize(w, scale_rule=rule, return_choice=True, global_amax=own)
    two = kquant.quantize(w, scale_rule=rule, return_choice=True)
    assert _same(one[0], two[0]) and torch.equal(one[1], two[1])
    qt, _, got_own = kquant.launch(w, rule, global_amax=own)
    assert torch.equal(got_own, own)
    ref, ref_choice = nvfp4.quantize(w.cpu(), scale_rule=rule, return_choice=True)
    assert _same(one[0], ref) and torch.equal(one[1].cpu(), ref_choice)


@triton.jit
def _codes_probe(x_ptr, idx_ptr, out_ptr, n, VALUES: tl.constexpr, ASM: tl.constexpr, BLOCKS: tl.constexpr):
    rows = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    ok = rows < n
    at = rows * 8 + tl.arange(0, 8)[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    idx = tl.load(idx_ptr + at, mask=ok, other=0)
    tl.store(out_ptr + rows, kquant._codes(x, idx, True, 0, ASM, BLOCKS, SAT=True, VALUES=VALUES), mask=ok)


def codes_probe(x: torch.Tensor, idx: torch.Tensor, asm: bool) -> torch.Tensor:
    """The fast path's code packing (`_codes`) on its own, compiled as the quantize kernel
    compiles it: x fp32 [n, 8], idx [n, 8] int32 indices 0..8 or fp32 E2M1 values; asm: the
    inline-PTX sign word (the kernel's choice on CUDA) or the per-element route."""
    n = x.shape[0]
    out = torch.empty(n, dtype=torch.int32, device=x.device)
    _codes_probe[(triton.cdiv(n, 128),)](x.contiguous(), idx.contiguous(), out, n, VALUES=idx.is_floating_point(),
                                         ASM=asm, BLOCKS=128, num_warps=4, **backend.launch_options())
    return out


def test_quantize_sign_word_asm_on_every_bf16_pattern():
    # The fast path's inline-PTX sign word (`_sign_word`) against the per-element route
    # (`_sign8`, checked against x < 0 in tests/kernels/test_quantize.py): every bf16 bit
    # pattern but NaN, both zeros included, with indices 0..8 and with E2M1 values.
    every = (torch.arange(0, 1 << 16, dtype=torch.int32, device=DEV) << 16).view(torch.float32)
    x = every[~torch.isnan(every)]
    x = torch.cat([x, x.flip(0)])[: (2 * x.numel()) // 8 * 8].reshape(-1, 8)
    g = torch.Generator(device=DEV).manual_seed(5)
    idx = torch.randint(0, 9, x.shape, generator=g, device=DEV, dtype=torch.int32)
    values = torch.tensor(E2M1_MAGNITUDES, device=DEV)[idx.clamp(max=7)]
    for i in (idx, values):
        assert torch.equal(codes_probe(x, i, asm=True), codes_probe(x, i, asm=False))


def test_quantize_given_amax_below_own_is_an_error():
    w = _randn(8, 256, 512, seed=18)
    with pytest.raises(Exception, match="below"):
        kquant.quantize(w, scale_rule="4o6", global_amax=w.float().abs().amax() * 0.5)


def test_quantize_flags_nan_and_inf():
    w = _randn(8, 256, 512, seed=16)
    w[2, 3, 4] = float("nan")
    with pytest.raises(Exception, match="finite|NaN|nan"):
        kquant.quantize(w, scale_rule="4o6")
    w[2, 3, 4] = float("inf")
    with pytest.raises(Exception, match="finite|inf|Inf"):
        kquant.quantize(w, scale_rule="4o6")


# --------------------------------------------------------------------------------------------
# error: the SQNR terms of a quantized weight, against the reference's float64 sums
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(8, 1856, 2688), (2688, 1856), (3, 48)])
def test_error_terms_on_expert_shapes(shape):
    from fp4kit.formats.metrics import sqnr_terms
    from fp4kit.kernels.error import nvfp4_error_terms

    w = _randn(*shape, seed=5)
    qt = kquant.quantize(w, scale_rule="4o6")
    signal, noise = nvfp4_error_terms(w, qt)
    ref_signal, ref_noise = sqnr_terms(w.cpu(), qt.to("cpu").dequantize())
    assert signal.device.type == "cuda" and signal.dtype == torch.float64
    assert float(signal) == pytest.approx(float(ref_signal), rel=2e-6)
    assert float(noise) == pytest.approx(float(ref_noise), rel=2e-6)


@pytest.mark.parametrize("rule,importance", [("4o6", False), ("4o6", True), ("6", False)])
@pytest.mark.parametrize("shape", [(16, 1856, 2688), (2688, 1856), (3, 48)])
def test_terms_summed_while_quantizing_on_expert_shapes(rule, importance, shape):
    # The quantize stage's SQNR terms and 4/6 fraction, summed by the quantizing kernels (the
    # stack kernel's max pass for the signal, its quantize items for the error): the bytes of
    # the plain launch, and the reference's float64 sums of the result within fp32's partial sums.
    from fp4kit.formats.metrics import sqnr_terms

    w = _randn(*shape, seed=6)
    imp = torch.rand(shape[-1], device=DEV, generator=torch.Generator(device=DEV).manual_seed(7)) if importance else None
    terms: list = []
    qt, choice = kquant.quantize(w, scale_rule=rule, importance=imp, return_choice=True, terms=terms)
    plain = kquant.quantize(w, scale_rule=rule, importance=imp)
    assert _same(qt, plain)
    (entry,) = terms
    ref_signal, ref_noise = sqnr_terms(w.cpu(), qt.to("cpu").dequantize())
    assert float(entry.signal) == pytest.approx(float(ref_signal), rel=1e-5)
    assert float(entry.noise) == pytest.approx(float(ref_noise), rel=1e-5)
    assert entry.blocks == choice.numel() and entry.frac4 == float(choice.cpu().double().mean())
    if rule == "4o6":
        assert 0 < entry.frac4 < 1
