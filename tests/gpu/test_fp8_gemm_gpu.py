"""fp4kit.kernels.fp8_gemm on a CUDA GPU: the hardware E4M3 conversion decodes every byte exactly,
the GEMV on Nemotron-3-Nano's Mamba projection shapes is within fp32 summation error of the exact
sums and close to torch._scaled_mm, the matrix-unit kernel is exact on small integers and close
to the exact sums on full-range operands, and FP8Linear compiled (the operator) computes what it does
eagerly (the launcher); launched as a programmatic dependent, the GEMV reads its input only after
the launch before it has written it.

Run: python -m pytest -q tests/gpu   (skipped without CUDA)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


from fp4kit.formats import e4m3  # noqa: E402
from fp4kit.kernels import fp8_gemm as fg  # noqa: E402
from fp4kit.kernels import launch  # noqa: E402
from fp4kit.modules import FP8Linear  # noqa: E402

from .helpers import eager_and_replayed, write_late  # noqa: E402

pytestmark = pytest.mark.gpu


def _e4m3(*shape, seed, spread):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * spread).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scale(v):
    return torch.tensor(v, dtype=torch.float32, device="cuda")


def test_every_byte_decodes_exactly_on_the_gpu():
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    w = torch.zeros((256, 64), dtype=torch.uint8, device="cuda")
    w[:, 0] = codes
    one = torch.zeros((1, 64), dtype=torch.float8_e4m3fn, device="cuda")
    one[0, 0] = 1.0
    values = e4m3.decode(codes.cpu().view(torch.float8_e4m3fn)).float()
    for cfg in ({"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 2}, {"BLOCK_N": 1, "BLOCK_K": 32, "num_warps": 1}):
        got = fg.fp8_matmul(one, w.view(torch.float8_e4m3fn), _scale(1.0), _scale(1.0), torch.float32, cfg=cfg)[0].cpu()
        assert torch.equal(got.isnan(), values.isnan())
        assert torch.equal(got[~values.isnan()], values[~values.isnan()])


@pytest.mark.parametrize("n,k", [(10304, 2688), (2688, 4096), (1000, 200)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_gemv_on_mamba_shapes(n, k, m):
    xq, w = _e4m3(m, k, seed=m, spread=32.0), _e4m3(n, k, seed=n, spread=64.0)
    xs, ws = _scale(0.0317), _scale(0.0123)
    got = fg.fp8_matmul(xq, w, xs, ws, torch.float32).double()
    exact = (xq.double() @ w.double().t()) * float(xs * ws)
    mags = (xq.double().abs() @ w.double().abs().t()) * float(xs * ws)
    assert bool(((got - exact).abs() <= mags * k * 2.0**-24 + exact.abs() * 2.0**-22).all())
    # bf16 output: the same sums rounded once more
    assert torch.equal(fg.fp8_matmul(xq, w, xs, ws, torch.bfloat16), got.float().to(torch.bfloat16))
    if k % 16 == 0 and n % 16 == 0:
        # The library's FP8 matrix units on Hopper accumulate with fewer bits than fp32: on an H200
        # it is 1.2e-4 - 1.3e-4 (relative, Frobenius) from these sums, which meet the bound above.
        lib = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.float32).double()
        assert float((got - lib).norm() / lib.norm()) < 5e-4


def test_fp8_linear_compiled_calls_the_operator_with_the_same_result():
    w = _e4m3(512, 256, seed=3, spread=64.0)
    layer = FP8Linear(w, _scale(0.0123), _scale(0.05), None, backend="triton", name="mixer.out_proj")
    rows = max(1, launch.table("fp8")["GEMV"]["max_m"])
    x = torch.randn((rows, 256), device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
    if fg.use_gemv(rows, x.device):  # the GEMV's values, not the library's
        xq = (x.float() / _scale(0.05)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(layer(x), fg.fp8_matmul(xq, w, _scale(0.05), _scale(0.0123), torch.bfloat16))


MMA_TABLE = launch.freeze({"GEMV": {"max_m": 0}, "MMA": {"max_m": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                                          "num_stages": 3, "programs_per_sm": 1, "max_parts": 4}})


@pytest.mark.parametrize("n,k", [(10304, 2688), (2688, 4096), (1000, 200)])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_matrix_unit_kernel_on_mamba_shapes(n, k, m):
    # Small integers (|x|, |w| <= 4): every sum of 32 products fits 10 bits, so the FP8 matrix units'
    # narrow in-instruction sums are exact, and so are the fp32 sums across instructions: the output
    # is the exact product, bit for bit, with or without split-K.
    g = torch.Generator(device="cuda").manual_seed(m)
    xi = torch.randint(-4, 5, (m, k), device="cuda", generator=g).float().to(torch.float8_e4m3fn)
    wi = torch.randint(-4, 5, (n, k), device="cuda", generator=g).float().to(torch.float8_e4m3fn)
    for cfg in ({}, {"max_parts": 1}):
        got = fg.fp8_matmul(xi, wi, _scale(0.5), _scale(0.25), torch.float32, tables=MMA_TABLE, cfg=cfg)
        assert torch.equal(got, (xi.double() @ wi.double().t() * 0.125).float())
    # Full-range operands: within the matrix units' sums (1e-3 of the magnitudes, loose against the
    # 2^-13 seen) of the exact sums, and as close to torch._scaled_mm as the GEMV is.
    xq, w = _e4m3(m, k, seed=m, spread=32.0), _e4m3(n, k, seed=n, spread=64.0)
    xs, ws = _scale(0.0317), _scale(0.0123)
    got = fg.fp8_matmul(xq, w, xs, ws, torch.float32, tables=MMA_TABLE).double()
    exact = (xq.double() @ w.double().t()) * float(xs * ws)
    mags = (xq.double().abs() @ w.double().abs().t()) * float(xs * ws)
    assert bool(((got - exact).abs() <= mags * 1e-3 + exact.abs() * 2.0**-22).all())
    assert float((got - exact).norm() / exact.norm()) < 5e-4
    assert torch.equal(fg.fp8_matmul(xq, w, xs, ws, torch.bfloat16, tables=MMA_TABLE), got.float().to(torch.bfloat16))


@pytest.mark.parametrize("n,k,m", [(10304, 2688, 1), (2688, 4096, 1), (1000, 200, 2)])
def test_the_programmatic_dependent_gemv_reads_its_input_only_after_the_launch_before(n, k, m):
    # "pdl": the GEMV's first weight tile is requested before it waits for the launch before it.
    # Here that launch lets it start at once and writes the GEMV's input late: the output is that
    # of the new input, bit for bit the plain launch's, eagerly and over replays of a CUDA graph
    # (a program that read x before its wait would see the old input, and differ).
    assert fg.backend.pdl(torch.device("cuda"), fg._fp8_gemv_kernel)
    xs, ws = _scale(0.0317), _scale(0.0123)
    w = _e4m3(n, k, seed=n + 1, spread=64.0)
    old, new = _e4m3(m, k, seed=40, spread=32.0), _e4m3(m, k, seed=41, spread=32.0)
    cfg = dict(fg.config(m, k, torch.device("cuda")), pdl=False)
    want = fg.fp8_matmul(new, w, xs, ws, torch.float32, cfg=cfg)
    assert not torch.equal(want, fg.fp8_matmul(old, w, xs, ws, torch.float32, cfg=cfg))
    x = old.clone()

    def step():
        x.copy_(old)
        write_late(new, x)
        return fg.fp8_matmul(x, w, xs, ws, torch.float32, cfg=dict(cfg, pdl=True))

    def check(got):
        assert torch.equal(got, want)

    eager_and_replayed(step, check)
