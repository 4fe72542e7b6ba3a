import os

# aqlm's numba CPU kernel for 8-bit codebooks races with more than one thread (wrong outputs).
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
# Triton kernels run on the CPU through Triton's interpreter (only where a test asks for them).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def anisotropic_xtx(in_features: int, tokens: int, generator: torch.Generator, spread: float = 30.0) -> torch.Tensor:
    """XᵀX of correlated inputs whose feature scales span `spread`x, as real activations do
    (a few outlier channels dominate). Returns [in, in] float64."""
    scales = torch.logspace(0, torch.log10(torch.tensor(spread)).item(), in_features, dtype=torch.float64)
    scales = scales[torch.randperm(in_features, generator=generator)]
    mixing = torch.eye(in_features, dtype=torch.float64) + 0.3 * torch.randn(in_features, in_features, generator=generator, dtype=torch.float64) / in_features**0.5
    x = torch.randn(tokens, in_features, generator=generator, dtype=torch.float64) @ mixing * scales
    return x.T @ x
