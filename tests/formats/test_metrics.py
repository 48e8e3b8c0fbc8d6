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
