"""fp4kit.kernels.attention: one query position of grouped-query attention over a static cache,
split over the cache in one launch, in Triton's interpreter against float64 attention.
tests/gpu/test_generate_gpu.py runs it compiled on Nemotron-3-Nano's shapes."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.kernels import attention  # noqa: E402


def _inputs(b, heads, heads_kv, slots, d, seed, mask="bool", dtype=torch.bfloat16):
    """query [B, H, 1, D] (the strided view transformers passes), key / value [B, H_kv, S, D], a
    mask that closes the last third of the cache and the first 5 slots of row 0 (left padding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, heads, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(b, heads_kv, slots, d, generator=g).to(dtype)
    v = torch.randn(b, heads_kv, slots, d, generator=g).to(dtype)
    keep = torch.zeros(b, 1, 1, slots, dtype=torch.bool)
    keep[..., : max(1, slots * 2 // 3)] = True
    keep[0, ..., :5] = False
    keep[0, ..., slots // 2] = True
    m = {"bool": keep, "float": torch.where(keep, 0.0, float("-inf")).to(dtype), None: None}[mask]
    return q, k, v, m


def _exact(q, k, v, m, scale):
    b, heads, _, d = q.shape
    rows = q.double().reshape(b, k.shape[1], heads // k.shape[1], d)
    mask = m if m is None or m.dtype == torch.bool else m.double()
    out = torch.nn.functional.scaled_dot_product_attention(rows, k.double(), v.double(), attn_mask=mask, scale=scale)
    return out.reshape(b, heads, 1, d).transpose(1, 2)


@pytest.mark.parametrize("mask", ["bool", "float", None])
@pytest.mark.parametrize("b,heads,heads_kv,slots,d", [(1, 32, 2, 1024, 128), (2, 8, 2, 100, 64), (3, 4, 4, 70, 32),
                                                      (2, 6, 2, 300, 80), (1, 16, 1, 9, 16)])
def test_the_kernel_is_attention_rounded_once(b, heads, heads_kv, slots, d, mask):
    # fp16: fp32 arithmetic, then one rounding: within half an fp16 step of the exact value (and a
    # little more for the fp32 sums' own error)
    q, k, v, m = _inputs(b, heads, heads_kv, slots, d, seed=slots + d, mask=mask, dtype=torch.float16)
    scale = d ** -0.5
    out = attention.decode_attention(q, k, v, m, scale)
    assert out.shape == (b, 1, heads, d) and out.dtype == q.dtype and out.is_contiguous()
    exact = _exact(q, k, v, m, scale)
    assert ((out.double() - exact).abs() <= 2**-11 * exact.abs() * (1 + 2**-8) + 2**-24).all()
    # The reference is torch's fp32 attention rounded once: its fp16 output is its fp32 output
    # rounded, and that fp32 output is within a few fp32 roundings of the largest value from the
    # exact one (how few depends on the CPU's kernel: rounding it can then land past half a step
    # where the exact value sits near a midpoint, so it is not held to the kernel's bound above).
    ref = attention.decode_attention_reference(q, k, v, m, scale)
    ref32 = attention.decode_attention_reference(q.float(), k.float(), v.float(), m, scale)
    assert torch.equal(ref, ref32.to(torch.float16))
    assert ((ref32.double() - exact).abs() <= 2**-21 * v.double().abs().max()).all()


@pytest.mark.parametrize("b,heads,heads_kv,slots,d", [(1, 32, 2, 1024, 128), (2, 6, 2, 300, 80)])
def test_bf16_is_attention_within_a_bf16_step(b, heads, heads_kv, slots, d):
    # the interpreter rounds fp32 to bf16 toward zero (compiled kernels round to nearest), so
    # within one bf16 step here
    q, k, v, m = _inputs(b, heads, heads_kv, slots, d, seed=slots + d)
    out = attention.decode_attention(q, k, v, m, d ** -0.5)
    exact = _exact(q, k, v, m, d ** -0.5)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= 2**-7 * exact.abs() * (1 + 2**-8) + 2**-24).all()


def test_closed_slots_are_left_out_and_open_ones_count():
    q, k, v, m = _inputs(1, 4, 2, 200, 32, seed=1)
    scale = 32 ** -0.5
    out = attention.decode_attention(q, k, v, m, scale)
    changed = v.clone()
    changed[..., ~m[0, 0, 0], :] = 100.0  # closed slots: no effect
    assert torch.equal(attention.decode_attention(q, k, changed, m, scale), out)
    changed = v.clone()
    changed[..., 50, :] += 1.0  # an open slot
    assert not torch.equal(attention.decode_attention(q, k, changed, m, scale), out)


def test_the_kernel_leaves_its_counters_at_zero_and_repeats_itself():
    from fp4kit.kernels.tiles import split_counters

    q, k, v, m = _inputs(2, 8, 2, 300, 32, seed=2)
    first = attention.decode_attention(q, k, v, m, 0.2)
    assert not split_counters(q.device, 4)[:4].any()
    assert torch.equal(attention.decode_attention(q, k, v, m, 0.2), first)


def test_bad_inputs_are_named():
    q, k, v, m = _inputs(2, 8, 2, 64, 32, seed=3)
    with pytest.raises(ValueError, match="takes one query position"):
        attention.decode_attention(torch.cat([q, q], 2), k, v, m, 1.0)
    with pytest.raises(ValueError, match="share a 16-bit dtype"):
        attention.decode_attention(q.float(), k.float(), v.float(), m, 1.0)
    with pytest.raises(ValueError, match=r"a multiple of H_kv"):
        attention.decode_attention(q, k[:, :1].expand(2, 3, 64, 32), v[:, :1].expand(2, 3, 64, 32), m, 1.0)
    with pytest.raises(ValueError, match=r"mask must be a bool or float \[2, 1, 1, 64\]"):
        attention.decode_attention(q, k, v, m[..., :63], 1.0)
    with pytest.raises(ValueError, match=r"mask must be a bool or float"):
        attention.decode_attention(q, k, v, m.long(), 1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        attention.decode_attention(q, k, v, m, 1.0, backend="cuda")


def test_the_operator_is_the_launcher():
    from fp4kit.kernels import ops

    q, k, v, m = _inputs(1, 8, 2, 96, 32, seed=4)
    assert torch.equal(ops.decode_attention(q, k, v, m, 0.25), attention.decode_attention(q, k, v, m, 0.25))
    torch.library.opcheck(torch.ops.fp4kit.decode_attention.default, (q, k, v, m, 0.25),
                          test_utils=("test_faketensor",))
