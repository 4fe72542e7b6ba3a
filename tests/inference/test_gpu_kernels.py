"""The Triton kernels against the dense reference, run here by Triton's interpreter (TRITON_INTERPRET=1
from tests/conftest.py); the same kernels run compiled on a GPU in benchmarks/inference_gpu.py."""

import pytest
import torch

from aqflow.inference import gpu_kernels as gk
from aqflow.inference.packed import can_pack, can_tile, in_tiles, pack_weights, packed_dense_weight, row_major_codes
from aqflow.inference.layout import QuantizedWeights, code_container, reference_linear


def random_weights(out: int, groups: int, codebooks: int, nbits: int, group_size: int, bias: bool,
                   generator: torch.Generator, dtype=torch.float32) -> QuantizedWeights:
    codewords = 1 << nbits
    return QuantizedWeights(
        codes=torch.randint(0, codewords, (out, groups, codebooks), generator=generator).to(code_container(nbits)),
        codebooks=torch.randn(codebooks, codewords, group_size, generator=generator).to(dtype),
        scales=(torch.rand(out, generator=generator) + 0.5).to(dtype),
        bias=torch.randn(out, generator=generator).to(dtype) if bias else None, nbits=nbits)


def exact_reference(x: torch.Tensor, w: QuantizedWeights) -> torch.Tensor:
    """The dense product in float64."""
    as64 = QuantizedWeights(w.codes, w.codebooks.double(), w.scales.double(),
                            None if w.bias is None else w.bias.double(), w.nbits)
    return reference_linear(x.double(), as64)


def run_poisoned(x: torch.Tensor, packed: gk.PackedWeights, config: gk.KernelConfig) -> torch.Tensor:
    """The kernel's output into a NaN-filled buffer: any element it does not write stays NaN."""
    out = torch.full((x.shape[0], packed.rows), float("nan"), dtype=x.dtype)
    gk._launch(x.contiguous(), packed, config, out)
    return out


# (out, groups, codebooks, nbits, group size): the pipeline's geometries, shrunk
GEOMETRIES = {"2x8 g8": (24, 6, 2, 8, 8), "3x8 g8": (20, 5, 3, 8, 8), "2x6 g6": (17, 7, 2, 6, 6),
              "1x8 g4": (19, 9, 1, 8, 4), "1x16 g8": (12, 4, 1, 16, 8)}
CONFIGS = {"one program per row block": gk.KernelConfig("direct", 16, 4, 1, 4),
           "split-K, ragged rows": gk.KernelConfig("direct", 8, 2, 3, 4),
           "lut split-K": gk.KernelConfig("lut", 16, 2, 2, 4),
           "16-bit group sums": gk.KernelConfig("direct16", 8, 4, 2, 4)}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_kernel_equals_dense_reference(geometry, config_name, tokens, rng):
    config = CONFIGS[config_name]
    out, groups, codebooks, nbits, group_size = GEOMETRIES[geometry]
    w = random_weights(out, groups, codebooks, nbits, group_size, bias=tokens == 1, generator=rng)
    packed = gk.as_packed(w)
    if config.variant == "lut" and not gk.lut_applies(packed, tokens):
        with pytest.raises(ValueError, match="lut variant"):
            run_poisoned(torch.randn(tokens, w.in_features, generator=rng), packed, config)
        return
    x = torch.randn(tokens, w.in_features, generator=rng)
    result = run_poisoned(x, packed, config)
    torch.testing.assert_close(result.double(), exact_reference(x, w), rtol=1e-5, atol=1e-5)


def test_fused_matrices_equal_each_alone(rng):
    """q/k/v-like: three matrices of different heights, biases on two, packed into one launch."""
    ws = [random_weights(rows, 6, 2, 8, 8, bias=bias, generator=rng) for rows, bias in ((20, True), (8, False), (8, True))]
    packed = gk.pack_weights(ws)
    assert packed.out_sizes == (20, 8, 8) and packed.bounds() == [20, 28, 36]
    x = torch.randn(2, 48, generator=rng)
    expected = torch.cat([exact_reference(x, w) for w in ws], dim=-1)
    for config in (gk.KernelConfig("direct", 16, 2, 2, 4), gk.KernelConfig("direct", 8, 8, 1, 4)):
        torch.testing.assert_close(run_poisoned(x, packed, config).double(), expected, rtol=1e-5, atol=1e-5)
    lut = run_poisoned(x[:1], packed, gk.KernelConfig("lut", 8, 4, 2, 4))
    torch.testing.assert_close(lut.double(), expected[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gk.fused_quantized_matmul(x, ws).double(), expected, rtol=1e-5, atol=1e-5)


def test_tiled_codes_hold_each_tile_contiguous(rng):
    """in_tiles: tile (a, b) is rows 256a.. x groups 16b.., in the CUDA kernel's thread order (thread q, i takes
    rows q + 32s, s < 8, groups 2i, 2i+1: 32 contiguous bytes); the row-major codes come back; operands whose
    matrices or groups are not whole tiles stay as they are."""
    ws = [random_weights(rows, 48, 2, 8, 8, bias=False, generator=rng) for rows in (256, 512)]
    packed = pack_weights(ws)
    tiled = in_tiles(packed)
    assert tiled.tiled and tiled.codes.shape == (3, 3, 32, 8, 8, 2, 2) and tiled.codes.is_contiguous()
    assert (tiled.rows, tiled.num_groups, tiled.num_codebooks) == (768, 48, 2)
    q, i = 5, 3  # rows 512 + 5 + 32s, groups 16 + 6, 7 of tile (2, 1)
    thread = packed.codes[512 + q:768:32, 16 + 2 * i:16 + 2 * i + 2]  # [8 slots, 2 groups, 2 codebooks]
    assert torch.equal(tiled.codes[2, 1, q, i], thread)
    flat = tiled.codes.flatten()
    start = ((2 * 3 + 1) * 32 + q) * 8 * 32 + i * 32  # bytes: tile (2, 1), thread q, word pair i
    assert torch.equal(flat[start:start + 32], thread.flatten())
    assert torch.equal(row_major_codes(tiled), packed.codes)
    torch.testing.assert_close(packed_dense_weight(tiled), packed_dense_weight(packed), rtol=0, atol=0)
    for rows, groups in ((320, 48), (256, 40)):
        untileable = gk.as_packed(random_weights(rows, groups, 2, 8, 8, bias=False, generator=rng))
        assert not can_tile(untileable) and in_tiles(untileable) is untileable
    assert not can_tile(pack_weights([random_weights(rows, 16, 2, 8, 8, bias=False, generator=rng)
                                      for rows in (384, 128)]))  # 512 rows, but the first matrix straddles tiles


# (config, tokens): row blocks across and within tiles (a ragged last one), group steps across tiles
TILED_CASES = [(gk.KernelConfig("direct", 512, 16, 2, 4), 3), (gk.KernelConfig("direct", 64, 32, 1, 4), 1),
               (gk.KernelConfig("lut", 64, 8, 2, 4), 1), (gk.KernelConfig("direct16", 128, 16, 1, 4), 1), (None, 12)]


@pytest.mark.parametrize("config, tokens", TILED_CASES,
                         ids=[f"{c.label() if c else 'dense'}-{t}" for c, t in TILED_CASES])
def test_tiled_codes_give_the_same_outputs(config, tokens, rng):
    """The kernels (and, past 8 tokens, the dense product) read tiled codes to the same bits as row-major ones."""
    ws = [random_weights(rows, 32, 2, 8, 8, bias=bias, generator=rng) for rows, bias in ((256, True), (512, False))]
    packed = pack_weights(ws)
    x = torch.randn(tokens, packed.in_features, generator=rng)
    if config is None:
        assert torch.equal(gk.packed_matmul(x, in_tiles(packed)), gk.packed_matmul(x, packed))
    else:
        assert torch.equal(run_poisoned(x, in_tiles(packed), config), run_poisoned(x, packed, config))


def test_pack_refuses_mixed_geometries(rng):
    a = random_weights(8, 6, 2, 8, 8, bias=False, generator=rng)
    b = random_weights(8, 6, 1, 8, 8, bias=False, generator=rng)
    assert not can_pack([a, b])
    with pytest.raises(ValueError, match="share groups"):
        pack_weights([a, b])


@pytest.mark.parametrize("split", [4, gk.ATOMIC_SPLIT])
def test_split_k_state_is_left_at_zero(split, rng):
    """The last program of each row block resets its counter (and the atomic accumulator), so
    back-to-back launches stay right."""
    w = random_weights(24, 16, 2, 8, 8, bias=True, generator=rng)
    packed = gk.as_packed(w)
    x = torch.randn(2, 128, generator=rng)
    for variant in ("direct", "lut"):
        tokens = 1 if variant == "lut" else 2
        config = gk.KernelConfig(variant, 8, 2, split, 4)
        first = run_poisoned(x[:tokens], packed, config)
        second = run_poisoned(x[:tokens], packed, config)
        assert torch.equal(first, second)
        torch.testing.assert_close(first.double(), exact_reference(x[:tokens], w), rtol=1e-5, atol=1e-5)
        assert int(gk._counters(x.device).abs().sum()) == 0
        if split >= gk.ATOMIC_SPLIT:
            assert float(gk._accumulator(x.device, 1).abs().sum()) == 0.0


def test_bfloat16_within_bf16_rounding(rng):
    """bf16 in and out: the fp32 kernels are off by less than one bf16 step per element (their only
    error is the output's rounding; the interpreter truncates where the GPU rounds to nearest); the
    16-bit group sums of direct16 add their own rounding, bounded in norm (fp16 here)."""
    w = random_weights(64, 16, 2, 8, 8, bias=True, generator=rng, dtype=torch.bfloat16)
    x = torch.randn(1, 128, generator=rng).to(torch.bfloat16)
    reference = exact_reference(x.float(), w)
    step = 2.0 ** (torch.floor(torch.log2(reference.abs())) - 7)  # one bf16 step at each value
    for config in (gk.KernelConfig("direct", 16, 4, 2, 4), gk.KernelConfig("lut", 16, 4, 1, 4)):
        result = run_poisoned(x, gk.as_packed(w), config)
        assert result.dtype == torch.bfloat16
        assert ((result.double() - reference).abs() <= step).all(), config
    # the interpreter has no bf16 arithmetic (numpy): direct16 here in fp16, in bf16 on the GPU benchmark
    half = QuantizedWeights(w.codes, w.codebooks.half(), w.scales.half(), w.bias.half(), w.nbits)
    result = run_poisoned(x.half(), gk.as_packed(half), gk.KernelConfig("direct16", 16, 4, 2, 4))
    assert gk.relative_error(result, exact_reference(x.half().float(), half)) < 1e-2


def test_public_entry_points(rng):
    """quantized_matmul (leading axes kept, default configuration), many tokens through the dense path,
    and the custom op's registrations (schema, fake tensor)."""
    w = random_weights(12, 4, 2, 8, 8, bias=True, generator=rng)
    x = torch.randn(2, 1, 32, generator=rng)
    torch.testing.assert_close(gk.quantized_matmul(x, w).double(), exact_reference(x, w), rtol=1e-5, atol=1e-5)
    many = torch.randn(gk.MAX_KERNEL_TOKENS + 3, 32, generator=rng)
    torch.testing.assert_close(gk.quantized_matmul(many, w).double(), exact_reference(many, w), rtol=1e-5, atol=1e-5)
    packed = gk.as_packed(w)
    torch.library.opcheck(gk._packed_matmul_op, (x[0], packed.codes, packed.codebooks, packed.scales, packed.bias,
                                                 list(packed.out_sizes), []),
                          test_utils=("test_schema", "test_faketensor"))


def test_tune_records_the_fastest_correct_candidate(rng, monkeypatch):
    w = random_weights(16, 8, 2, 8, 8, bias=False, generator=rng)
    packed = gk.as_packed(w)
    timings = {"direct": 2e-6, "lut": 1e-6}
    monkeypatch.setattr(gk, "time_config", lambda x, p, config: timings[config.variant] * config.block_rows)
    candidates = [gk.KernelConfig("direct", 8, 4, 1, 4), gk.KernelConfig("lut", 16, 4, 1, 4),
                  gk.KernelConfig("lut", 8, 4, 1, 4), gk.KernelConfig("nonsense", 8, 4, 1, 4)]
    results = gk.tune(packed, 1, configs=candidates)
    assert [seconds for _, seconds, _ in results] == [16e-6, 16e-6, 8e-6, None]
    assert "unknown kernel variant" in results[-1][2]
    assert gk.config_for(packed, 1) == candidates[2]
