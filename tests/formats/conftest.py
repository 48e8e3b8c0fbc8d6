import pytest
import torch


def make_weight(shape, dtype, *, seed: int, magnitude: float) -> torch.Tensor:
    """Gaussian weight with a few outliers, some all-zero blocks and some blocks far under the max."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * magnitude
    flat = w.view(-1, 16)
    n = flat.shape[0]
    idx = torch.randperm(n, generator=g)
    flat[idx[: max(1, n // 16)]] = 0.0  # all-zero blocks
    flat[idx[n // 16 : n // 16 + max(1, n // 16)]] *= 1e-7  # blocks whose scale falls under 2^-9
    flat[idx[-1], 3] = 40.0 * magnitude  # an outlier sets the global amax
    return w.to(dtype)


@pytest.fixture
def weight_factory():
    return make_weight
