"""NVFP4 behaviour: Four-Over-Six quality anchors, importance weighting, bad input, zero tensors."""

import pytest
import torch

from fp4kit.formats import FormatError, e2m1, nvfp4, pack_nibbles, unpack_nibbles
from fp4kit.formats.nvfp4 import block_sum16


def test_pack_layout_low_nibble_is_even_element():
    codes = torch.tensor([[0x7, 0x9]], dtype=torch.uint8)  # (+6, -0.5)
    assert pack_nibbles(codes).tolist() == [[0x97]]
    g = torch.Generator().manual_seed(0)
    random_codes = torch.randint(0, 16, (5, 3, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(random_codes)), random_codes)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_nibbles(torch.tensor([16, 0], dtype=torch.uint8))


def test_block_sum16_order_is_fixed():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0] + [0.0] * 12)
    # (i, i+8) -> (i, i+4) -> (i, i+2) -> (i, i+1): ((1e8 + -1e8) + (1 + 1)) = 2
    assert block_sum16(x).item() == 2.0
    y = torch.randn(100, 16, dtype=torch.float64)
    assert torch.allclose(block_sum16(y), y.sum(-1))


def mse(q: nvfp4.NVFP4Tensor, w: torch.Tensor) -> float:
    return ((q.dequantize() - w.float()) ** 2).mean().item()


def test_four_over_six_anchor_on_randn():
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    plain = nvfp4.quantize(w)
    q46, choice = nvfp4.quantize(w, scale_rule="4o6", return_choice=True)
    ratio = mse(q46, w) / mse(plain, w)
    frac4 = choice.float().mean().item()
    print(f"4/6 MSE ratio {ratio:.4f}, blocks choosing 4: {frac4:.4f}")
    assert ratio <= 0.84
    assert 0.40 <= frac4 <= 0.50
    assert q46.global_scale.item() == (w.abs().max().float() / 1536).item()


def test_four_over_six_never_worse_per_block():
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.03).to(torch.bfloat16)
    q46, choice = nvfp4.quantize(w, scale_rule="4o6", return_choice=True)
    err46 = block_sum16(((q46.dequantize() - w.float()) ** 2).view(256, 32, 16))
    # Re-quantize with the opposite choice everywhere: it must never be strictly better.
    block_amax = w.view(256, 32, 16).abs().amax(-1).float()
    flipped = nvfp4.quantize_static(w, block_amax * torch.where(choice, 1.0, 1.5), w.abs().amax().float(), fp8_norm=256.0)
    err_flip = block_sum16(((flipped.dequantize() - w.float()) ** 2).view(256, 32, 16))
    assert bool((err46 <= err_flip).all())


def test_fouroversix_reference_agreement():
    pytest.importorskip("fouroversix")
    from fouroversix.quantize.pytorch.reference import quantize_to_nvfp4, select_fouroversix
    from fouroversix.utils import ScaleRule

    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    blocks = w.reshape(-1, 16).float()
    amax = w.abs().max().float()
    scaled6, s6 = quantize_to_nvfp4(blocks, amax, scale_rule=ScaleRule.mse)
    scaled4, s4 = quantize_to_nvfp4(blocks, amax, scale_rule=ScaleRule.mse, scale_expansion_factor=1.5)
    _, chosen = select_fouroversix(blocks, scaled6, s6, scaled4, s4, amax, scale_rule=ScaleRule.mse)
    theirs4 = (chosen.reshape(-1).view(torch.uint8) == s4.view(torch.uint8)) & (s4 != s6)
    _, ours4 = nvfp4.quantize(w, scale_rule="4o6", return_choice=True)
    agreement = (theirs4 == ours4.reshape(-1)).float().mean().item()
    print(f"fouroversix block-choice agreement: {agreement:.5f} over {theirs4.numel()} blocks")
    assert agreement >= 0.999


def test_importance_weighting_lowers_the_weighted_error():
    # Half of each block's channels matter 100x more; the importance-aware choice must never be
    # worse on the weighted error, and strictly better in total.
    g = torch.Generator().manual_seed(2)
    w = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    importance = torch.ones(256)
    importance[torch.arange(256) % 16 < 8] = 100.0
    plain46 = nvfp4.quantize(w, scale_rule="4o6")
    weighted46 = nvfp4.quantize(w, scale_rule="4o6", importance=importance)
    imp = importance.view(1, 16, 16)

    def weighted_err(q):
        return block_sum16(((q.dequantize() - w.float()) ** 2).view(512, 16, 16) * imp)

    e_plain, e_weighted = weighted_err(plain46), weighted_err(weighted46)
    assert bool((e_weighted <= e_plain).all())
    assert e_weighted.sum().item() < 0.99 * e_plain.sum().item()


def test_importance_for_expert_stacks_and_zero_importance():
    w = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(4))
    per_expert = torch.rand(3, 64, generator=torch.Generator().manual_seed(5))
    q = nvfp4.quantize(w, scale_rule="4o6", importance=per_expert)
    for e in range(3):
        single = nvfp4.quantize(w[e], scale_rule="4o6", importance=per_expert[e])
        assert torch.equal(q.packed[e], single.packed)
    # all-zero importance: every error ties at 0, so every block keeps 6
    _, choice = nvfp4.quantize(w, scale_rule="4o6", importance=torch.zeros(64), return_choice=True)
    assert not bool(choice.any())


def test_shared_global_amax_for_fused_siblings():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g) * 3
    shared = torch.maximum(a.abs().max(), b.abs().max())
    for rule in ("6", "4o6"):
        qa = nvfp4.quantize(a, scale_rule=rule, global_amax=shared)
        qb = nvfp4.quantize(b, scale_rule=rule, global_amax=shared)
        assert torch.equal(qa.global_scale, qb.global_scale)
        assert torch.equal(qb.packed, nvfp4.quantize(b, scale_rule=rule).packed)  # b holds the max
    with pytest.raises(FormatError, match="below the tensor's own"):
        nvfp4.quantize(b, global_amax=a.abs().max())


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_all_zero_tensor_and_expert(rule):
    w = torch.zeros(3, 16, 32, dtype=torch.bfloat16)
    w[1] = torch.randn(16, 32).to(torch.bfloat16)
    q = nvfp4.quantize(w, scale_rule=rule)
    for e in (0, 2):
        assert bool((q.packed[e] == 0).all())
        assert bool((q.block_scale[e].float() == 1.0).all())
        assert q.global_scale[e].item() == 1.0
        assert bool((q.dequantize()[e] == 0).all())
    assert torch.equal(q.packed[1], nvfp4.quantize(w[1], scale_rule=rule).packed)


def test_dequantize_formula_and_shape():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(8))
    q = nvfp4.quantize(w)
    step = q.block_scale.float() * q.global_scale
    expected = e2m1.decode(q.codes()).view(8, 4, 16) * step.unsqueeze(-1)
    assert torch.equal(q.dequantize(), expected.view(8, 64))
    assert q.shape == (8, 64) and q.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("w", "kwargs", "message"),
    [
        (torch.randn(4, 24), {}, "K=24 .* not a multiple of the 16"),
        (torch.randn(0, 16), {}, "empty"),
        (torch.ones(4, 16, dtype=torch.int32), {}, "dtype torch.int32 is not supported"),
        (torch.ones(4, 16, dtype=torch.float64), {}, "dtype torch.float64 is not supported"),
        (torch.tensor(1.0), {}, "0-d"),
        (torch.randn(4, 16), {"scale_rule": "8"}, "scale_rule must be one of"),
        (torch.randn(4, 16), {"importance": torch.ones(16)}, "importance only applies"),
        (torch.randn(4, 16), {"scale_rule": "4o6", "importance": torch.ones(8)}, "importance shape"),
        (torch.randn(4, 16), {"scale_rule": "4o6", "importance": -torch.ones(16)}, "finite and >= 0"),
        (torch.randn(4, 16), {"global_amax": float("inf")}, "finite"),
    ],
)
def test_bad_input_names_the_problem(w, kwargs, message):
    with pytest.raises(FormatError, match=message):
        nvfp4.quantize(w, **kwargs)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(value):
    w = torch.randn(4, 32)
    w[2, 17] = value
    with pytest.raises(FormatError, match=r"first at index \(2, 17\)"):
        nvfp4.quantize(w)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="torch.Tensor"):
        nvfp4.quantize([[1.0] * 16])


def test_activation_quantization_is_the_plain_nvfp4_rule():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 64, generator=g) * torch.logspace(-2, 1, 64)).to(torch.bfloat16)
    amax = x.abs().amax().float()
    ref = nvfp4.quantize(x, scale_rule="6", global_amax=amax)
    got = nvfp4.quantize_activations(x, amax / 2688)
    assert torch.equal(got.packed, ref.packed)
    assert torch.equal(got.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
    assert torch.equal(got.global_scale, ref.global_scale)
    # Above the calibrated amax it saturates instead of refusing: scales at 448, elements at 6.
    big = nvfp4.quantize_activations(x * 1000, amax / 2688)
    assert big.block_scale.float().max() == 448 and big.dequantize().abs().max() == 6 * 448 * float(amax / 2688)


def test_activation_quantization_bytes_on_every_range():
    # The rule written out in its own order: block scale e4m3(clamp(amax / (6 * gs), 2^-9, 448)),
    # codes E2M1(x / (scale * gs)); leading dims are flattened to rows, zero blocks get scale 1.
    from fp4kit.formats import e4m3

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 48, generator=g) * torch.logspace(-12, 4, 48)
    x[0, 0, :16] = 0
    gs = torch.tensor(0.0123)
    got = nvfp4.quantize_activations(x.to(torch.bfloat16), gs)
    blocks = x.to(torch.bfloat16).float().reshape(15, 3, 16)
    s = blocks.abs().amax(-1) / (6 * gs)
    scale = e4m3.cast(torch.where(s == 0, torch.ones_like(s), s).clamp(2.0**-9, 448))
    codes = e2m1.encode(blocks / (scale.float() * gs).unsqueeze(-1)).reshape(15, 48)
    assert got.shape == (15, 48)
    assert torch.equal(got.block_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(got.codes(), codes)
    with pytest.raises(FormatError, match="K=40 is not a multiple of 16"):
        nvfp4.quantize_activations(torch.zeros(2, 40), gs)


@pytest.mark.parametrize("arith", ["cuda", "cpu"])
def test_four_over_six_choice_reads_the_quantizer_choice_back(arith):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 256)).to(torch.bfloat16)
    imp = torch.rand(256, generator=g)
    for importance in (None, imp):
        q, choice = nvfp4.quantize(w, scale_rule="4o6", importance=importance, return_choice=True, arith=arith)
        six, four = nvfp4.four_over_six_candidates(nvfp4.block_amax(w), w.abs().amax().float(), arith)
        chose4, explained = nvfp4.four_over_six_choice(q.block_scale, nvfp4.block_amax(w), w.abs().amax().float(), arith)
        assert bool(explained.all())
        # Where both candidates are one byte the quantizer's choice cannot be read back: it is moot.
        distinct = six.view(torch.uint8) != four.view(torch.uint8)
        assert torch.equal(chose4, choice & distinct)
    other = q.block_scale.view(torch.uint8) ^ 0x40  # a byte neither candidate has
    _, explained = nvfp4.four_over_six_choice(other.view(torch.float8_e4m3fn), nvfp4.block_amax(w), w.abs().amax().float(), arith)
    assert not bool(explained.any())


def test_global_scale_of_each_rule():
    w = torch.randn(32, 64).to(torch.bfloat16)
    g = w.abs().amax().float()
    for rule in nvfp4.SCALE_RULES:
        for arith in ("cuda", "cpu"):
            q = nvfp4.quantize(w, scale_rule=rule, arith=arith)
            assert torch.equal(q.global_scale, nvfp4.global_scale_of(g, rule, arith))
