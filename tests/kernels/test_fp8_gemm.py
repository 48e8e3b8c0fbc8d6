"""fp4kit.kernels.fp8_gemm: the FP8 GEMV and the matrix-unit kernel in Triton's interpreter against
their fp64 reference, every E4M3 byte decoded exactly, the launch rule, and FP8Linear's use of it.
tests/gpu/test_kernels_gpu.py runs it compiled on real shapes."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4kit.formats import e4m3  # noqa: E402
from fp4kit.kernels import fp8_gemm as fg  # noqa: E402
from fp4kit.kernels import launch, ops  # noqa: E402
from fp4kit.modules import FP8Linear  # noqa: E402

TABLE = launch.freeze({"GEMV": {"max_m": 4, "1": {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1},
                                "2": {"BLOCK_N": 8, "BLOCK_K": 16, "num_warps": 1},
                                "4": {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 1}}})


def _ints(*shape, seed, low=-12, high=13) -> torch.Tensor:
    """float8_e4m3fn integers in [low, high): every one is exact in E4M3 (3 mantissa bits)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float().to(torch.float8_e4m3fn)


def _e4m3(*shape, seed, spread=64.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * spread).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scale(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 13, 96), (2, 16, 48), (3, 9, 200), (4, 7, 64), (5, 5, 40)])
def test_integer_sums_equal_the_reference_exactly(m, n, k):
    # Integer operands and power-of-two scales: every partial sum is exact in fp32, so the kernel's
    # order of summation cannot show and its output equals the reference bit for bit. Ragged N and
    # K (masks, the clamped last rows), the K loop over several tiles, and 3-5 rows (padded to a
    # power of two) are all taken.
    xq, w = _ints(m, k, seed=m), _ints(n, k, seed=10 + n)
    xs, ws = _scale(0.25), _scale(8.0)
    for out_dtype in (torch.float32, torch.float16):
        got = fg.fp8_matmul(xq, w, xs, ws, out_dtype, tables=TABLE)
        want = fg.fp8_matmul(xq, w, xs, ws, out_dtype, backend="torch")
        assert got.dtype == out_dtype and got.shape == (m, n)
        assert torch.equal(got, want)
        exact = (xq.double() @ w.double().t() * 2.0).to(out_dtype)  # the scales' product is 2
        assert torch.equal(got, exact)


MMA = launch.freeze({"GEMV": {"max_m": 4, "1": {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1}},
                     "MMA": {"max_m": 8, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1,
                             "programs_per_sm": 1, "max_parts": 3}})


@pytest.mark.parametrize("m,n,k", [(1, 13, 96), (3, 40, 200), (8, 20, 64), (5, 5, 40)])
def test_matrix_unit_kernel_sums_equal_the_reference_exactly(m, n, k):
    # The matrix-unit kernel (here emulated: fp32 operands, an fp32 dot) on integer operands, with
    # and without split-K (the slices' partials added in order, then scaled), ragged N and K.
    xq, w = _ints(m, k, seed=m), _ints(n, k, seed=10 + n)
    assert fg.use_mma(m, MMA)
    for cfg in ({}, {"max_parts": 1}):
        got = fg.fp8_matmul(xq, w, _scale(0.25), _scale(8.0), torch.float32, tables=MMA, cfg=cfg)
        assert torch.equal(got, (xq.double() @ w.double().t() * 2.0).float())
    assert fg.mma_config(m, n, k, torch.device("cpu"), tables=MMA)["SPLIT"] > 1 or n > 16


def test_matrix_unit_launch_rule():
    cpu = torch.device("cpu")
    # the rows it takes: up to its max_m (at most 16, its dot's N side), the GEMV's beyond
    assert [fg.use_mma(m, MMA) for m in (0, 1, 8, 9)] == [False, True, True, False]
    assert [fg.use_gemv(m, cpu, MMA) for m in (1, 8, 9)] == [True, True, False]
    assert not fg.use_mma(1, TABLE) and fg.use_mma(16, launch.freeze({**MMA, "MMA": {**MMA["MMA"], "max_m": 64}}))
    assert not fg.use_mma(17, launch.freeze({**MMA, "MMA": {**MMA["MMA"], "max_m": 64}}))
    # split-K: up to programs_per_sm programs per multiprocessor (4 on the CPU), at most max_parts
    c = fg.mma_config(1, 16, 320, cpu, tables=MMA)
    assert (c["SPLIT"], c["k_per_split"]) == (3, 128)  # one N tile: 4 wanted, 3 allowed; 10 K tiles in 3 slices
    assert fg.mma_config(1, 64, 320, cpu, tables=MMA)["SPLIT"] == 1  # four N tiles fill the four
    assert fg.mma_config(1, 16, 20, cpu, {"BLOCK_K": 256}, MMA)["BLOCK_K"] == 32  # at least one FP8 wgmma's K
    with pytest.raises(ValueError, match="unknown launch keys"):
        fg.mma_config(1, 16, 64, cpu, {"BLOCK_M": 16}, MMA)
    with pytest.raises(ValueError, match="powers of two"):
        fg.mma_config(1, 16, 64, cpu, {"BLOCK_N": 8}, MMA)
    with pytest.raises(ValueError, match="no MMA entry"):
        fg.mma_config(1, 16, 64, cpu, tables=TABLE)
    live = launch.table("fp8")
    assert 0 <= live["MMA"]["max_m"] <= fg.MMA_ROWS or not fg.use_mma(fg.MMA_ROWS + 1, live)


def test_every_e4m3_byte_is_decoded_exactly():
    # Weight row n holds byte n at column 0 (and zeros elsewhere); x is one at column 0: output n
    # is byte n's value, exactly, NaN for 0x7F and 0xFF. The activations' decoding: the same with
    # x and w swapped (256 rows of x, one weight row).
    k = 32
    codes = torch.arange(256, dtype=torch.uint8)
    w = torch.zeros((256, k), dtype=torch.uint8)
    w[:, 0] = codes
    one = torch.zeros((1, k), dtype=torch.float8_e4m3fn)
    one[0, 0] = 1.0
    values = e4m3.decode(codes.view(torch.float8_e4m3fn)).float()
    got = fg.fp8_matmul(one, w.view(torch.float8_e4m3fn), _scale(1.0), _scale(1.0), torch.float32, tables=TABLE)[0]
    assert torch.equal(got.isnan(), values.isnan())
    assert torch.equal(got[~values.isnan()], values[~values.isnan()])
    got = fg.fp8_matmul(one, w.view(torch.float8_e4m3fn), _scale(1.0), _scale(1.0), torch.float32, tables=MMA)[0]
    assert torch.equal(got.isnan(), values.isnan())
    assert torch.equal(got[~values.isnan()], values[~values.isnan()])
    table = launch.freeze({"GEMV": {"max_m": 256, "256": {"BLOCK_N": 1, "BLOCK_K": 32, "num_warps": 1}}})
    got = fg.fp8_matmul(w.view(torch.float8_e4m3fn), one, _scale(1.0), _scale(1.0), torch.float32, tables=table)[:, 0]
    assert torch.equal(got.isnan(), values.isnan())
    assert torch.equal(got[~values.isnan()], values[~values.isnan()])


def test_random_operands_are_within_fp32_summation_error():
    # Full-range operands: the kernel's fp32 sums against the fp64 ones; the bound is K fp32
    # roundings of the running sum of magnitudes.
    m, n, k = 2, 24, 320
    xq, w = _e4m3(m, k, seed=1), _e4m3(n, k, seed=2)
    xs, ws = _scale(0.0371), _scale(0.00213)
    got = fg.fp8_matmul(xq, w, xs, ws, torch.float32, tables=TABLE).double()
    exact = (xq.double() @ w.double().t()) * (0.0371 * 0.00213)
    bound = (xq.double().abs() @ w.double().abs().t()) * (0.0371 * 0.00213) * k * 2.0**-24 + exact.abs() * 2.0**-22
    assert bool(((got - exact).abs() <= bound).all())
    assert not torch.equal(got, torch.zeros_like(got))


def test_leading_dims_and_strided_rows():
    xq_wide = _ints(3, 2, 80, seed=4)
    xq = xq_wide[..., :64]  # rows 80 bytes apart
    w = _ints(10, 64, seed=5)
    got = fg.fp8_matmul(xq, w, _scale(1.0), _scale(0.5), torch.float32, tables=TABLE)
    assert got.shape == (3, 2, 10)
    want = fg.fp8_matmul(xq.contiguous().reshape(6, 64), w, _scale(1.0), _scale(0.5), torch.float32, tables=TABLE)
    assert torch.equal(got.reshape(6, 10), want)


def test_nan_in_a_weight_row_reaches_only_its_outputs():
    xq, w = _ints(1, 48, seed=6), _ints(6, 48, seed=7)
    w.view(torch.uint8)[3, 17] = 0x7F
    got = fg.fp8_matmul(xq, w, _scale(1.0), _scale(1.0), torch.float32, tables=TABLE)
    assert got.isnan().tolist() == [[False, False, False, True, False, False]]


def test_empty_problems():
    w = _ints(4, 32, seed=8)
    assert fg.fp8_matmul(_ints(0, 32, seed=9), w, _scale(1.0), _scale(1.0), tables=TABLE).shape == (0, 4)
    z = fg.fp8_matmul(torch.zeros((2, 0), dtype=torch.float8_e4m3fn), torch.zeros((3, 0), dtype=torch.float8_e4m3fn),
                      _scale(1.0), _scale(1.0), torch.float32, tables=TABLE)
    assert torch.equal(z, torch.zeros(2, 3))


@pytest.mark.parametrize("bad,match", [
    (dict(xq=torch.zeros(1, 32)), "xq must be a float8_e4m3fn"),
    (dict(weight=torch.zeros(4, 32, dtype=torch.bfloat16)), "weight must be a float8_e4m3fn"),
    (dict(xq=torch.zeros(1, 16, dtype=torch.float8_e4m3fn)), r"does not end in K=32"),
    (dict(weight=torch.zeros(32, 4, dtype=torch.float8_e4m3fn).t()), "contiguous"),
    (dict(input_scale=torch.tensor([1.0, 2.0])), "input_scale must be a one-element fp32"),
    (dict(weight_scale=torch.tensor(1.0, dtype=torch.bfloat16)), "weight_scale must be a one-element fp32"),
    (dict(out_dtype=torch.int32), "out_dtype must be one of"),
])
def test_bad_inputs_are_named(bad, match):
    args = dict(xq=torch.zeros(1, 32, dtype=torch.float8_e4m3fn), weight=torch.zeros(4, 32, dtype=torch.float8_e4m3fn),
                input_scale=_scale(1.0), weight_scale=_scale(1.0), out_dtype=torch.bfloat16)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fg.fp8_matmul(**args)


def test_launch_rule():
    cpu = torch.device("cpu")
    assert [fg.use_gemv(m, cpu, TABLE) for m in (0, 1, 4, 5)] == [False, True, True, False]
    assert fg.config(1, 1024, cpu, tables=TABLE) == {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "pdl": False}
    assert fg.config(1, 1024, cpu, {"pdl": True}, TABLE)["pdl"]  # the interpreter takes the early first tile
    assert fg.config(3, 1024, cpu, tables=TABLE)["BLOCK_N"] == 2  # row class 4
    assert fg.config(9, 1024, cpu, tables=TABLE)["BLOCK_N"] == 2  # 4 rows per program from 4 on
    assert fg.config(1, 20, cpu, {"BLOCK_K": 256}, TABLE)["BLOCK_K"] == 32  # at most K rounded up
    with pytest.raises(ValueError, match="unknown launch keys"):
        fg.config(1, 64, cpu, {"BLOCK_M": 4}, TABLE)
    with pytest.raises(ValueError, match="powers of two"):
        fg.config(1, 64, cpu, {"BLOCK_N": 3}, TABLE)
    live = launch.table("fp8")["GEMV"]
    reach = max([live["max_m"], *live.get("shapes", {}).values()])
    assert live["max_m"] >= 0 and all(str(fg.row_class(m)) in live for m in range(1, reach + 1))


def test_the_reach_is_per_weight_shape_where_the_table_has_it():
    # The sweep's shapes carry their own reach; any other shape takes max_m (the rows up to which
    # the GEMV won on every swept shape). An MMA entry's max_m still counts for every shape.
    cpu = torch.device("cpu")
    table = launch.freeze({"GEMV": {**TABLE["GEMV"], "max_m": 0, "shapes": {"2688x4096": 2, "10304x2688": 0}}})
    assert fg.shape_key(2688, 4096) == "2688x4096"
    assert [fg.use_gemv(m, cpu, table, n=2688, k=4096) for m in (1, 2, 3)] == [True, True, False]
    assert not fg.use_gemv(1, cpu, table, n=10304, k=2688)
    assert not fg.use_gemv(1, cpu, table, n=64, k=64) and not fg.use_gemv(1, cpu, table)
    with_mma = launch.freeze({**table, "MMA": {**MMA["MMA"], "max_m": 4}})
    assert fg.use_gemv(4, cpu, with_mma, n=10304, k=2688)


@pytest.mark.parametrize("m,n,k,tile", [(1, 13, 200, (4, 32, 1)), (2, 9, 96, (8, 16, 1)), (3, 7, 64, (2, 64, 1)),
                                        (5, 6, 40, (4, 32, 1)), (1, 5, 16, (4, 16, 1))])
def test_the_programmatic_dependent_launch_is_the_plain_one_bit_for_bit(m, n, k, tile):
    # "pdl": the first K tile's weights are loaded before the loop (on a GPU, before the wait for
    # the launch before): the same tiles summed in the same order, so full-range operands (whose
    # sums depend on their order) give the plain launch's bytes. One, several and ragged K tiles.
    xq, w = _e4m3(m, k, seed=20 + m), _e4m3(n, k, seed=30 + n)
    cfg = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), tile))
    plain = fg.fp8_matmul(xq, w, _scale(0.0371), _scale(0.00213), torch.float32, cfg=dict(cfg, pdl=False), tables=TABLE)
    early = fg.fp8_matmul(xq, w, _scale(0.0371), _scale(0.00213), torch.float32, cfg=dict(cfg, pdl=True), tables=TABLE)
    assert torch.equal(plain.view(torch.int32), early.view(torch.int32))
    xi, wi = _ints(m, k, seed=m), _ints(n, k, seed=10 + n)  # exact sums: each tile counted once
    got = fg.fp8_matmul(xi, wi, _scale(0.25), _scale(8.0), torch.float32, cfg=dict(cfg, pdl=True), tables=TABLE)
    assert torch.equal(got, (xi.double() @ wi.double().t() * 2.0).float())


def test_operator_is_the_launcher():
    xq, w = _e4m3(2, 64, seed=11), _e4m3(8, 64, seed=12)
    args = (xq, w, _scale(0.5), _scale(0.25), torch.float32)
    assert torch.equal(ops.fp8_matmul(*args), fg.fp8_matmul(*args))
    torch.library.opcheck(torch.ops.fp4kit.fp8_matmul.default, args, test_utils=("test_faketensor",))


def test_fp8_linear_runs_the_gemv_up_to_max_m_and_the_library_past_it(monkeypatch):
    w = _e4m3(16, 32, seed=13)
    layer = FP8Linear(w, _scale(0.01), _scale(0.02), None, backend="triton", name="mixer.in_proj")
    calls = []

    def library(a, b, scale_a, scale_b, out_dtype):
        calls.append(a.shape[0])
        return (a.float() @ b.float()) * (scale_a * scale_b)

    monkeypatch.setattr(torch, "_scaled_mm", library)
    live = launch.table
    monkeypatch.setattr(launch, "table", lambda kernel, device=None: TABLE if kernel == "fp8" else live(kernel, device))
    limit = TABLE["GEMV"]["max_m"]
    x = torch.randn(limit + 1, 32, generator=torch.Generator().manual_seed(14))
    few = layer(x[:1])
    assert calls == []  # one row: the GEMV
    xq = e4m3.cast(x[:1] / 0.02)
    assert torch.equal(few, fg.fp8_matmul(xq, w, _scale(0.02), _scale(0.01), torch.float32))
    layer(x)
    assert calls == [limit + 1]


def test_fp8_linear_asks_for_the_reach_of_its_own_shape(monkeypatch):
    # A table whose GEMV won only on one swept shape: that layer runs it, one of another shape
    # calls the library; compiled (fullgraph) as eagerly.
    table = launch.freeze({"GEMV": {**TABLE["GEMV"], "max_m": 0, "shapes": {"16x32": 1}}})
    live = launch.table
    monkeypatch.setattr(launch, "table", lambda kernel, device=None: table if kernel == "fp8" else live(kernel, device))
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, scale_a, scale_b, out_dtype:
                        calls.append(tuple(b.shape)) or (a.float() @ b.float()) * (scale_a * scale_b))
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(19))
    swept = FP8Linear(_e4m3(16, 32, seed=20), _scale(0.01), _scale(0.02), None, backend="triton", name="in_proj")
    other = FP8Linear(_e4m3(32, 32, seed=21), _scale(0.01), _scale(0.02), None, backend="triton", name="out_proj")
    for compiled in (False, True):
        torch._dynamo.reset()
        run = (lambda layer: torch.compile(layer, fullgraph=True, backend="aot_eager")) if compiled else (lambda layer: layer)
        calls.clear()
        assert torch.equal(run(swept)(x), fg.fp8_matmul(e4m3.cast(x / 0.02), swept.weight, _scale(0.02), _scale(0.01),
                                                        torch.float32))
        assert calls == []
        run(other)(x)
        assert calls == [(32, 32)]


def test_a_compiled_fp8_linear_calls_the_operator(monkeypatch):
    # Under torch.compile (fullgraph: no break at the launch rule) the GEMV is the opaque operator,
    # with eager's result. aot_eager: inductor's CPU code for the E4M3 emulation is not what this tests.
    w = _e4m3(16, 32, seed=15)
    layer = FP8Linear(w, _scale(0.01), _scale(0.02), None, backend="triton", name="mixer.out_proj")
    live = launch.table
    monkeypatch.setattr(launch, "table", lambda kernel, device=None: TABLE if kernel == "fp8" else live(kernel, device))
    calls = []
    real = ops.fp8_matmul
    monkeypatch.setattr(ops, "fp8_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(16))
    eager = layer(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert calls == [torch.Size([2, 32])]
    assert torch.equal(compiled, eager)


def test_a_compiled_fp8_linear_reads_the_live_table_without_a_break():
    # The launch rule reads the tuning file; under torch.compile that read happens outside the
    # traced code (a constant to the graph), so a model's compiled step does not break at every
    # FP8 linear: fullgraph tracing of the layer with the package's own table succeeds.
    w = _e4m3(16, 32, seed=17)
    layer = FP8Linear(w, _scale(0.01), _scale(0.02), None, backend="triton", name="mixer.in_proj")
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(18))
    eager = layer(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), eager)
