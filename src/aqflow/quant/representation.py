"""The AQLM weight layout, and what follows from it (bits per parameter, rho).

A weight W [out, in] is cut into groups of g consecutive input weights. Each group is the sum of
M codewords, one from each codebook, times a per-output-row scale:

    W[o, j*g:(j+1)*g] = scales[o] * sum_m codebooks[m, codes[o, j, m], 0, :]

Shapes follow the `aqlm` package so that a checkpoint loads there unchanged:
    codes      [out, in/g, M]   (int8 for nbits <= 8, int16 up to 16; values >= 2^(nbits-1) wrap negative)
    codebooks  [M, K, 1, g]     (K = 2^nbits; the 1 is AQLM's out_group_size)
    scales     [out, 1, 1, 1]
Inside aqflow codes are int64 in [0, K); `pack_codes` / `unpack_codes` convert at the file boundary.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable

import torch
import torch.nn.functional as F

MAX_NBITS = 16
# input weights per group when none is given: AQLM's layout (2 codebooks of 8 bits over 8 weights
# store 2 bits per weight); QuantizerSettings, stitch and fetch-model take their default from here
GROUP_SIZE = 8


def codebook_size(nbits: int) -> int:
    """K = 2^nbits codewords per codebook."""
    return 1 << nbits


def aqlm_code_dtype(nbits: int) -> torch.dtype:
    """The signed integer dtype the `aqlm` package stores codes of `nbits` bits in."""
    if nbits <= 8:
        return torch.int8
    if nbits <= 16:
        return torch.int16
    raise ValueError(f"nbits={nbits} is out of range: the AQLM format stores at most {MAX_NBITS}-bit codes")


def pack_codes(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """codes [out, G, M] in [0, K) -> the AQLM signed dtype, values >= 2^(nbits-1) wrapped negative."""
    wrapped = torch.where(codes >= (1 << (nbits - 1)), codes - (1 << nbits), codes)
    return wrapped.to(aqlm_code_dtype(nbits))


def unpack_codes(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: AQLM signed codes -> int64 in [0, K)."""
    return packed.to(torch.int64) % (1 << nbits)


def group_reconstruction(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Unscaled sum of codewords per group.

    codes [out, G, M] int64, codebooks [M, K, g] -> [out, G, g]
    """
    num_codebooks, num_codewords, group_size = codebooks.shape
    offsets = torch.arange(num_codebooks, device=codes.device) * num_codewords  # [M]
    flat = codebooks.reshape(num_codebooks * num_codewords, group_size)  # [M*K, g]
    # embedding_bag gathers and sums the M codewords in one kernel (plain indexing then .sum was
    # the slowest kernel of an Adam step on the GPU)
    bags = F.embedding_bag((codes + offsets).reshape(-1, num_codebooks), flat, mode="sum")  # [out*G, g]
    return bags.view(*codes.shape[:-1], group_size)


def dequantize_weight(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight the AQLM layout represents. Differentiable in codebooks and scales.

    codes [out, G, M] int64 in [0, K), codebooks [M, K, 1, g] (or [M, K, g]), scales [out, 1, 1, 1] (or [out])
    -> weight [out, G*g]
    """
    if codebooks.dim() == 4:
        codebooks = codebooks[:, :, 0, :]
    num_rows, num_groups, _ = codes.shape
    groups = group_reconstruction(codes, codebooks) * scales.reshape(num_rows, 1, 1)
    return groups.reshape(num_rows, num_groups * codebooks.shape[-1])


def bits_per_parameter(
    out_features: int,
    in_features: int,
    num_codebooks: int,
    nbits: int,
    group_size: int = GROUP_SIZE,
    codebook_value_bits: int = 16,
    scale_bits: int = 16,
) -> float:
    """Bits stored per weight: codes + codebooks + per-row scales, over out*in weights."""
    num_weights = out_features * in_features
    code_bits = num_weights // group_size * num_codebooks * nbits
    codebook_bits = num_codebooks * codebook_size(nbits) * group_size * codebook_value_bits
    return (code_bits + codebook_bits + out_features * scale_bits) / num_weights


def layer_rho(out_features: int, in_features: int, num_codebooks: int, nbits: int, group_size: int = GROUP_SIZE) -> float:
    """Representational ratio rho = N / K^M with N = out * in / g weight groups (paper, Definition 1)."""
    num_groups = out_features * in_features // group_size
    return num_groups / float(codebook_size(nbits)) ** num_codebooks


def model_rho(
    layer_shapes: Iterable[tuple[int, int]], num_codebooks: int, nbits: int, group_size: int = GROUP_SIZE
) -> dict[str, float]:
    """rho over a model's quantized linears, given their (out, in) shapes.

    Returns min / median / max over layers and the mean weighted by each layer's group count
    (the rho an average weight group sees).
    """
    shapes = list(layer_shapes)
    if not shapes:
        raise ValueError("model_rho needs at least one layer shape")
    rhos = [layer_rho(o, i, num_codebooks, nbits, group_size) for o, i in shapes]
    groups = [o * i // group_size for o, i in shapes]
    weighted = sum(r * n for r, n in zip(rhos, groups)) / sum(groups)
    return {
        "min": min(rhos),
        "median": statistics.median(rhos),
        "max": max(rhos),
        "group_weighted_mean": weighted,
        "num_layers": float(len(rhos)),
        "log2_capacity": math.log2(codebook_size(nbits)) * num_codebooks,
    }
