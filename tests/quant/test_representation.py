"""The AQLM layout: our dequantization equals the `aqlm` package's, codes round-trip, rho and bits."""

import math

import pytest
import torch

from aqflow.quant.representation import (
    bits_per_parameter,
    dequantize_weight,
    group_reconstruction,
    layer_rho,
    model_rho,
    pack_codes,
    unpack_codes,
)


def random_layer(out_features, in_features, num_codebooks, nbits, generator, g=8):
    k = 1 << nbits
    codes = torch.randint(0, k, (out_features, in_features // g, num_codebooks), generator=generator)
    codebooks = torch.randn(num_codebooks, k, 1, g, generator=generator)
    scales = torch.rand(out_features, 1, 1, 1, generator=generator) + 0.5
    return codes, codebooks, scales


@pytest.mark.parametrize("nbits", [1, 4, 8, 9, 16])
def test_pack_unpack_round_trip(nbits, rng):
    codes = torch.randint(0, 1 << nbits, (5, 7, 3), generator=rng)
    packed = pack_codes(codes, nbits)
    assert packed.dtype == (torch.int8 if nbits <= 8 else torch.int16)
    assert torch.equal(unpack_codes(packed, nbits), codes)


def test_dequantize_by_hand(rng):
    codes, codebooks, scales = random_layer(3, 16, 2, 2, rng)
    weight = dequantize_weight(codes, codebooks, scales)
    o, j = 2, 1
    expected = scales[o, 0, 0, 0] * (codebooks[0, codes[o, j, 0], 0] + codebooks[1, codes[o, j, 1], 0])
    torch.testing.assert_close(weight[o, 8:16], expected)


@pytest.mark.parametrize("num_codebooks,nbits", [(2, 8), (1, 8), (3, 8), (2, 4), (2, 10)])
def test_matches_aqlm_quantized_linear(num_codebooks, nbits, rng):
    """aqlm's QuantizedLinear applied to the identity returns Wᵀ: it must be our weight exactly."""
    from aqlm import QuantizedLinear

    out_features, in_features = 24, 64
    codes, codebooks, scales = random_layer(out_features, in_features, num_codebooks, nbits, rng)
    layer = QuantizedLinear(in_features, out_features, 8, 1, num_codebooks, nbits, bias=False)
    layer.codes.data = pack_codes(codes, nbits)
    layer.codebooks.data = codebooks
    layer.scales.data = scales
    with torch.no_grad():
        theirs = layer(torch.eye(in_features)).T
    ours = dequantize_weight(codes, codebooks, scales)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_rho_matches_paper_llama3b():
    # Llama-3.2-3B q_proj is 3072x3072: N = 3072*3072/8 = 1,179,648 groups.
    assert layer_rho(3072, 3072, 2, 8) == pytest.approx(18.0)
    assert layer_rho(3072, 3072, 3, 8) == pytest.approx(0.0703, rel=1e-3)


def test_model_rho_aggregates():
    summary = model_rho([(576, 576), (1536, 576), (576, 1536)], 2, 8)
    assert summary["min"] == pytest.approx(576 * 576 / 8 / 65536)
    assert summary["max"] == pytest.approx(1536 * 576 / 8 / 65536)
    assert summary["min"] <= summary["group_weighted_mean"] <= summary["max"]
    assert summary["log2_capacity"] == 16


def test_bits_per_parameter_close_to_nominal():
    assert bits_per_parameter(4096, 4096, 2, 8) == pytest.approx(2.0, abs=0.01)
    assert bits_per_parameter(4096, 4096, 3, 8) == pytest.approx(3.0, abs=0.01)
    assert bits_per_parameter(576, 576, 2, 8) > 2.0  # codebooks are not free on small layers
    assert math.isfinite(bits_per_parameter(192, 576, 2, 8))


@pytest.mark.parametrize("num_codebooks", [1, 2, 3])
def test_codeword_sum_kernel_equals_group_reconstruction(num_codebooks):
    """The Triton codeword-sum kernel (interpreted on the CPU here), a ragged last block included,
    gives group_reconstruction's sums bit for bit (same order of additions)."""
    from aqflow.quant.gather_kernels import codeword_sums

    generator = torch.Generator().manual_seed(0)
    codebooks = torch.randn(num_codebooks, 16, 8, generator=generator)
    codes = torch.randint(0, 16, (7, 45, num_codebooks), generator=generator)
    fused = codeword_sums(codes, codebooks, fused=True)
    assert fused.shape == (7, 45, 8)
    assert torch.equal(fused, group_reconstruction(codes, codebooks))
