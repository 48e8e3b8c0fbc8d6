import math

import torch

from fp4kit.formats.metrics import sqnr_db


def test_sqnr_db():
    w = torch.tensor([3.0, 4.0])
    assert sqnr_db(w, w) == math.inf
    assert sqnr_db(w, torch.tensor([3.0, 3.0])) == 10 * math.log10(25.0)
    assert sqnr_db(torch.zeros(2), torch.ones(2)) == -math.inf


def test_sqnr_db_is_the_same_figure_for_every_dtype_and_size():
    # Float64 sums: a bf16 tensor and its fp32 copy give one figure, bit for bit.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
    w_hat = (w.float() + 1e-2 * torch.randn(1024, 1024, generator=g)).to(torch.bfloat16)
    assert sqnr_db(w, w_hat) == sqnr_db(w.float(), w_hat.float())


def test_sqnr_terms_of_parts_add_up_to_the_whole():
    from fp4kit.formats.metrics import sqnr_db_of, sqnr_terms

    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 32, generator=g)
    w_hat = w + 0.1 * torch.randn(6, 32, generator=g)
    parts = [sqnr_terms(w[i : i + 2], w_hat[i : i + 2]) for i in range(0, 6, 2)]
    signal = sum(float(s) for s, _ in parts)
    noise = sum(float(n) for _, n in parts)
    whole = sqnr_db(w, w_hat)
    assert abs(sqnr_db_of(signal, noise) - whole) < 1e-12
    assert sqnr_terms(w, w_hat)[0].dtype == torch.float64


def test_terms_add_their_partial_sums_in_float64():
    from fp4kit.formats.metrics import Terms

    one = Terms.of(torch.tensor(2.5, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64), 3, 8)
    assert one.part.shape == (1, 3) and one.frac4 == 3 / 8 and one.sums.tolist() == [2.5, 0.25, 3.0]
    # float64 sums of fp32 rows: 2^24 + 1 + 1 is exact only in float64
    rows = Terms(torch.tensor([[2.0**24, 1.0, 4.0], [1.0, 0.0, 0.0], [1.0, 0.5, 1.0]]), 10)
    assert rows.signal.dtype == torch.float64 and float(rows.signal) == 2.0**24 + 2
    assert float(rows.noise) == 1.5 and rows.frac4 == 0.5
