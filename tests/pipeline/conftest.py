"""Fixtures: small random models and a batch of calibration tokens."""

import pytest
import torch

from tiny_models import build_llama, build_nemotron_h


@pytest.fixture
def nemotron_h_model():
    return build_nemotron_h()


@pytest.fixture
def llama_model():
    return build_llama()


@pytest.fixture
def token_samples():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (4, 64), generator=g)
