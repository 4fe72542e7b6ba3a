"""A one-token attention case both kernels' tests use (Triton's on CUDA, numba's on a CPU)."""

import torch

HEADS, KV_HEADS, LENGTH, DIM = 6, 2, 150, 32  # groups of 3 query heads


def masked_grouped_case(dtype: torch.dtype, seed: int = 0):
    """(query [6, 32], key and value [2, 150, 32] as views of one cache tensor, valid [150]) with a hole
    (10..19) and an unfilled tail (100..) masked."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(HEADS, DIM, generator=generator).to(dtype)
    cache = torch.randn(2, KV_HEADS, LENGTH, DIM, generator=generator).to(dtype)
    valid = torch.ones(LENGTH, dtype=torch.bool)
    valid[10:20] = False
    valid[100:] = False
    return query, cache[0], cache[1], valid
