"""Scales, shapes and refusals of NVFP4 and FP8, down to the lines a mutation run showed no other
test pinning: the arithmetic mode reaching every division, 1-D and 4-D weights, fp32 conversion of
a caller's amax, the exact wording of every refusal, and ModelOpt's `mse` range search."""

import math

import pytest
import torch

from fp4kit.formats import FormatError, e4m3, fp8, nvfp4
from fp4kit.formats.arith import div_const
from fp4kit.formats.errors import check_float_tensor

META = torch.device("meta")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> bool:
    return (torch.equal(a.packed, b.packed) and torch.equal(u8(a.block_scale), u8(b.block_scale))
            and torch.equal(a.global_scale, b.global_scale))


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- refusals: each names its function, and the offending dtype, shape or value ---

REFUSERS = {
    "nvfp4.quantize": lambda w: nvfp4.quantize(w),
    "nvfp4.quantize_static": lambda w: nvfp4.quantize_static(w, torch.ones(2, 1), 1.0),
    "fp8.quantize_per_tensor": lambda w: fp8.quantize_per_tensor(w),
}


@pytest.mark.parametrize("what", REFUSERS)
def test_refusals_name_the_function(what):
    call = REFUSERS[what]
    with pytest.raises(TypeError) as err:
        call([1.0])
    assert str(err.value) == f"{what}: expected a torch.Tensor, got list"
    with pytest.raises(FormatError) as err:
        call(torch.zeros(2, 16, dtype=torch.float64))
    assert str(err.value) == f"{what}: dtype torch.float64 is not supported; expected float32, float16 or bfloat16"
    w = torch.zeros(2, 16)
    w[0, 1], w[1, 0], w[1, 3] = float("nan"), float("inf"), float("nan")
    with pytest.raises(FormatError) as err:
        call(w)
    assert str(err.value) == (f"{what}: 2 NaN and 1 Inf values (first at index (0, 1)); "
                              "non-finite weights cannot be quantized")


def test_check_float_tensor_names_the_type_it_got():
    with pytest.raises(TypeError) as err:
        check_float_tensor((1.0,), "f")
    assert str(err.value) == "f: expected a torch.Tensor, got tuple"


def test_the_block_constraint_is_on_k_alone():
    with pytest.raises(FormatError) as err:
        nvfp4.quantize(torch.zeros(2, 16, 40))
    assert str(err.value) == ("nvfp4.quantize: last dim K=40 of shape (2, 16, 40) is not a multiple of "
                              "the 16-element block")
    w = rand(2, 20, 32)  # N = 20 is no multiple of 16, and needs not be
    q = nvfp4.quantize(w)
    assert q.shape == (2, 20, 32) and all(same(nvfp4.quantize(w[e]), q_e) for e, q_e in
                                          ((e, nvfp4.NVFP4Tensor(q.packed[e], q.block_scale[e], q.global_scale[e])) for e in range(2)))


def test_a_global_amax_that_does_not_broadcast_is_named():
    with pytest.raises(FormatError) as err:
        nvfp4.quantize(torch.ones(2, 16, 32), global_amax=torch.ones(3))
    assert str(err.value) == ("nvfp4.quantize: global_amax of shape (3,) does not broadcast to the batch "
                              "shape (2,)")


def test_a_callers_global_amax_is_taken_in_fp32():
    # A float64 amax a hair under max|w| is max|w| once in fp32, as ModelOpt holds amax.
    w = rand(4, 32)
    m = float(w.abs().max())
    g64 = torch.tensor(m, dtype=torch.float64) - 1e-12
    assert float(g64) < m
    assert same(nvfp4.quantize(w, global_amax=g64), nvfp4.quantize(w, global_amax=m))


def test_importance_must_match_the_batch_dims():
    w = rand(2, 16, 32)
    with pytest.raises(FormatError) as err:
        nvfp4.quantize(w, scale_rule="4o6", importance=torch.ones(1, 32))
    assert str(err.value) == ("nvfp4.quantize: importance shape (1, 32) must be [K] or (2, 32) for a weight "
                              "of shape (2, 16, 32)")


def test_importance_of_a_4d_stack_weights_each_member():
    w = rand(2, 3, 16, 32, seed=1)
    imp = rand(2, 3, 32, seed=2).abs()
    q = nvfp4.quantize(w, scale_rule="4o6", importance=imp)
    for i in range(2):
        for j in range(3):
            ref = nvfp4.quantize(w[i, j], scale_rule="4o6", importance=imp[i, j])
            assert same(ref, nvfp4.NVFP4Tensor(q.packed[i, j], q.block_scale[i, j], q.global_scale[i, j]))


@pytest.mark.parametrize("rule", ["6", "4o6"])
def test_a_1d_weight_is_one_row(rule):
    w = rand(64, seed=3)
    q = nvfp4.quantize(w, scale_rule=rule)
    row = nvfp4.quantize(w[None], scale_rule=rule)
    assert q.global_scale.shape == () and q.block_scale.shape == (4,)
    assert torch.equal(q.packed, row.packed[0]) and torch.equal(u8(q.block_scale), u8(row.block_scale[0]))
    assert torch.equal(q.global_scale, row.global_scale)


def test_the_plain_rule_reports_no_block_choosing_4():
    q, choice = nvfp4.quantize(rand(8, 64), return_choice=True)
    assert choice.dtype == torch.bool and choice.shape == (8, 4) and not bool(choice.any())


# --- the arithmetic mode reaches the Four-Over-Six candidates ---

def test_four_over_six_candidates_follow_the_arith_mode():
    # Global amax 2.5 and a block whose max is 0.9765625: that block's scale is one E4M3 code
    # apart between the CPU and the CUDA division.
    w = torch.zeros(1, 32, dtype=torch.bfloat16)
    w[0, 0], w[0, 16], w[0, 17] = 2.5, 0.9765625, 0.3
    ba, g = nvfp4.block_amax(w), torch.tensor(2.5)
    got = {}
    for arith in ("cpu", "cuda"):
        q, choice = nvfp4.quantize(w, scale_rule="4o6", arith=arith, return_choice=True)
        six, four = nvfp4.four_over_six_candidates(ba, g, arith)
        assert torch.equal(u8(q.block_scale), torch.where(choice, u8(four), u8(six)))
        chose4, explained = nvfp4.four_over_six_choice(q.block_scale, ba, g, arith)
        assert bool(explained.all()) and torch.equal(chose4, choice & (u8(four) != u8(six)))
        got[arith] = u8(q.block_scale)
    assert got["cpu"][0, 0] == got["cuda"][0, 0] and got["cpu"][0, 1] != got["cuda"][0, 1]


# --- the static path ---

def test_static_path_refusals_name_the_expected_shape_and_norm():
    with pytest.raises(FormatError) as err:
        nvfp4.quantize_static(torch.zeros(2, 4, 32), torch.zeros(2, 4, 3), 1.0)
    assert str(err.value) == "nvfp4.quantize_static: block_amax shape (2, 4, 3) should be (2, 4, 2)"
    with pytest.raises(FormatError) as err:
        nvfp4.quantize_static(torch.zeros(2, 32), torch.zeros(2, 2), 1.0, fp8_norm=300.0)
    assert str(err.value) == "nvfp4.quantize_static: fp8_norm must be 448.0 or 256.0, got 300.0"


def test_static_path_quantizes_each_expert_of_a_stack():
    w = rand(2, 4, 32, seed=4)
    ba, g = nvfp4.block_amax(w), w.abs().amax(dim=(-2, -1))
    q = nvfp4.quantize_static(w, ba, g)
    for e in range(2):
        assert same(nvfp4.quantize_static(w[e], ba[e], g[e]),
                    nvfp4.NVFP4Tensor(q.packed[e], q.block_scale[e], q.global_scale[e]))


def test_static_path_zero_rule_is_for_a_zero_amax_only():
    w = rand(2, 32, seed=5) * 0.1
    q = nvfp4.quantize_static(w, nvfp4.block_amax(w), 1.0)
    assert torch.equal(q.global_scale, div_const(torch.tensor(1.0), 2688.0, "cuda"))
    # An amax that is zero in fp32 is zero, whatever precision the caller handed it in.
    z = nvfp4.quantize_static(torch.zeros(2, 32), torch.zeros(2, 2), torch.tensor(1e-50, dtype=torch.float64))
    assert z.global_scale.item() == 1.0 and bool((z.block_scale.float() == 1.0).all()) and not bool(z.packed.any())


@pytest.mark.gpu
def test_on_cuda_results_stay_there_with_the_cpus_bytes():
    """A CUDA weight with the caller's amax and importance on the CPU: every part of the result on
    the GPU, bit for bit the CPU's, in both arithmetic modes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w = rand(2, 8, 64, seed=8, dtype=torch.bfloat16)
    imp = rand(2, 64, seed=9).abs()
    # global amaxes whose quotients by 2688, 1536 and 6 differ between the two arithmetics
    g = torch.tensor([4.4593825340271, 5.213738441467285])
    for c in (2688.0, 1536.0, 6.0):
        assert not bool((div_const(g, c, "cpu") == div_const(g, c, "cuda")).any())
    for arith in ("cpu", "cuda"):
        runs = {
            "4o6": lambda x: nvfp4.quantize(x, scale_rule="4o6", global_amax=g, importance=imp, arith=arith),
            "6": lambda x: nvfp4.quantize(x, global_amax=g, arith=arith),
            "static": lambda x: nvfp4.quantize_static(x, nvfp4.block_amax(x), g, fp8_norm=256.0, arith=arith),
        }
        for name, run in runs.items():
            ref, got = run(w), run(w.cuda())
            for r, x in zip((ref.packed, u8(ref.block_scale), ref.global_scale),
                            (got.packed, u8(got.block_scale), got.global_scale)):
                assert x.device.type == "cuda" and torch.equal(x.cpu(), r), (name, arith)


# --- NVFP4Tensor ---

def tensor_parts(n=2, k=32, batch=()):
    return (torch.zeros(*batch, n, k // 2, dtype=torch.uint8),
            e4m3.cast(torch.ones(*batch, n, k // 16)), torch.ones(batch))


def test_nvfp4_tensor_refusals_name_the_wrong_part():
    packed, scale, g = tensor_parts()
    cases = [
        ((packed.to(torch.int8), scale, g), "NVFP4Tensor.packed must be uint8, got torch.int8"),
        ((packed, scale.float(), g), "NVFP4Tensor.block_scale must be float8_e4m3fn, got torch.float32"),
        ((packed, scale, g.double()), "NVFP4Tensor.global_scale must be float32, got torch.float64"),
        ((packed, scale[:, :1], g), "NVFP4Tensor: block_scale shape (2, 1) does not fit packed shape (2, 16) "
                                    "(expected (2, 2))"),
        ((packed, scale, torch.ones(2)), "NVFP4Tensor: global_scale shape (2,) should be ()"),
        # K = 8 is no whole block even when the scale shape is the (2, 0) that 8 // 16 gives
        ((packed[:, :4], scale[:, :0], g), "NVFP4Tensor: block_scale shape (2, 0) does not fit packed shape "
                                           "(2, 4) (expected (2, 0))"),
    ]
    for args, message in cases:
        with pytest.raises(FormatError) as err:
            nvfp4.NVFP4Tensor(*args)
        assert str(err.value) == message


def test_nvfp4_tensor_moves_all_three_parts():
    q = nvfp4.quantize(rand(3, 4, 32, seed=6))
    moved = q.to(META)
    for before, after in zip((q.packed, q.block_scale, q.global_scale),
                             (moved.packed, moved.block_scale, moved.global_scale)):
        assert after.device == META and after.dtype == before.dtype and after.shape == before.shape
    assert same(q.to("cpu"), q)


# --- W4A4 activation scale ---

def test_input_scale_is_amax_over_2688_in_the_arith_mode():
    amax = 2.6406097412109375  # an fp32 value whose two divisions differ in the last bit
    cpu, cuda = nvfp4.input_scale_from_amax(amax, "cpu"), nvfp4.input_scale_from_amax(amax, "cuda")
    assert cpu.dtype == torch.float32 and cpu.shape == ()
    assert torch.equal(cpu, div_const(torch.tensor(amax), 2688.0, "cpu"))
    assert torch.equal(cuda, div_const(torch.tensor(amax), 2688.0, "cuda")) and not torch.equal(cpu, cuda)
    assert torch.equal(nvfp4.input_scale_from_amax(amax), cuda)  # ModelOpt on CUDA by default
    per_expert = nvfp4.input_scale_from_amax([0.5, amax], "cpu")
    assert per_expert.shape == (2,) and per_expert[1] == cpu


@pytest.mark.parametrize("amax", [0.0, -1.0, float("nan"), float("inf"), torch.tensor(1e-50, dtype=torch.float64)],
                         ids=["zero", "negative", "nan", "inf", "zero-in-fp32"])
def test_input_scale_refuses_an_amax_that_is_not_positive_and_finite(amax):
    with pytest.raises(FormatError, match=r"^nvfp4.input_scale_from_amax: activation amax must be finite and > 0, got "):
        nvfp4.input_scale_from_amax(amax)


# --- FP8 ---

def test_fp8_scale_refuses_a_negative_amax():
    with pytest.raises(FormatError, match=r"^fp8.scale_from_amax: amax must be finite and >= 0, got "):
        fp8.scale_from_amax(-1.0)


def test_fake_quant_is_modelopts_scaled_cast():
    amax = torch.tensor(3.0)
    x = torch.tensor([3.0, -1.5, 0.1, 1e-3, -2.9, 0.0])
    s = 448.0 / amax  # ModelOpt's expression: torch forms it as 448 * (1 / amax)
    want = (x * s).to(torch.float8_e4m3fn).float() * (1.0 / s)  # torch's own cast is the oracle
    assert torch.equal(fp8.fake_quant_modelopt(x, amax), want)


def test_the_searched_range_is_rounded_to_the_weight_dtype():
    w = (rand(32, 64, seed=0) * 0.02).to(torch.bfloat16)
    mults = (1.0, 1.3)
    amax, best, errors = fp8.search_amax(w, mults)
    top = w.abs().amax().float()
    assert best == 1 and errors[1] < errors[0]
    assert amax.item() == 0.1064453125 == (top * 1.3).to(torch.bfloat16).item() != (top * 1.3).item()
    q, scale = fp8.quantize_per_tensor(w, amax_multipliers=mults)
    assert torch.equal(scale, fp8.scale_from_amax(amax)) and not torch.equal(scale, fp8.scale_from_amax(top))


def test_the_range_search_on_a_zero_and_a_unit_tensor():
    assert fp8.search_amax(torch.zeros(4, 16), (1.0, 0.5)) == (torch.tensor(0.0), 0, [0.0, 0.0])
    unit = torch.full((4, 16), 0.3)
    unit[0, 0] = 1.0
    amax, best, errors = fp8.search_amax(unit, (1.0, 0.5))
    assert amax.item() == 1.0 and best == 0 and errors[0] > 0 and errors[1] > errors[0]


def test_fp8_dequantize_returns_the_asked_dtype():
    q, scale = fp8.quantize_per_tensor(rand(4, 16, seed=7))
    out = fp8.dequantize_per_tensor(q, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, (e4m3.decode(q) * scale).to(torch.bfloat16))


# --- SQNR ---

def test_sqnr_db_of_values():
    from fp4kit.formats.metrics import sqnr_db_of

    assert sqnr_db_of(100.0, 1.0) == 20.0
    assert sqnr_db_of(0.5, 0.005) == pytest.approx(20.0, abs=1e-12)  # a signal under 1 is still a signal
    assert sqnr_db_of(0.0, 1.0) == -math.inf and sqnr_db_of(0.5, 0.0) == math.inf
