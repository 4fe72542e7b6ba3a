"""FastQuantizedLinear in a model loaded by transformers + aqlm: logits equal those of the same
checkpoint with dense dequantized layers, through the lookup tables (few tokens) and the
dequantized chunks (many), on each CPU kernel this machine has, and the model keeps only codes,
codebooks and scales."""

from __future__ import annotations

import pytest
import torch

from aqflow.evaluation.dense_aqlm import dequantize_aqlm_linears
from aqflow.inference import fast_linear
from aqflow.inference.decode import greedy_decode
from aqflow.inference.fast_linear import FastQuantizedLinear, install_fast_linears
from aqflow.models import build_tiny_llama
from aqflow.models.fetch import load_causal_lm
from tests.inference.aqlm_checkpoints import write_random_aqlm_checkpoint


@pytest.fixture(scope="module")
def tiny_aqlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-linear")
    fp_dir = build_tiny_llama(root / "fp", hidden_size=64, intermediate_size=128, num_layers=2, seed=0)
    write_random_aqlm_checkpoint(fp_dir, root / "aqlm", num_codebooks=2, nbits=8, group_size=8)
    return root / "aqlm"


def _load(folder):
    import transformers.quantizers  # noqa: F401  (before aqlm's integration)

    return load_causal_lm(folder, dtype="float32", device="cpu")


def test_install_replaces_every_aqlm_layer_and_keeps_only_the_codes(tiny_aqlm):
    model = _load(tiny_aqlm)
    names = install_fast_linears(model)
    assert len(names) == 7 * model.config.num_hidden_layers
    assert not any(type(m).__name__ == "QuantizedLinear" for m in model.modules())
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, FastQuantizedLinear)
        assert {n for n, _ in layer.named_buffers()} == {"codes", "codebooks", "scales"}
        assert not list(layer.parameters()) and layer.codes.dtype == torch.uint8
        assert layer.codes.numel() == layer.out_features * layer.in_features // 8 * 2  # 2 bits per weight
    assert install_fast_linears(model) == []  # nothing left to replace


@pytest.mark.parametrize("tokens", [1, 3, fast_linear.LUT_MAX_TOKENS + 13])
def test_logits_equal_the_dequantized_reference(tiny_aqlm, tokens, cpu_kernel):
    """Few tokens go through the kernel's tables, more through dequantized_matmul: both equal the model
    whose AQLM layers were replaced by their dequantized weights, within float32 rounding."""
    reference = _load(tiny_aqlm)
    dequantize_aqlm_linears(reference)
    fast = _load(tiny_aqlm)
    install_fast_linears(fast)
    ids = torch.randint(0, fast.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        expected, got = reference(ids).logits, fast(ids[:1]).logits
    torch.testing.assert_close(got, expected[:1], rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # a batch of 2 x tokens rows: the kernel sees 2*tokens rows at once
        torch.testing.assert_close(fast(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_through_the_tables_picks_the_reference_tokens(tiny_aqlm, cpu_kernel):
    reference = _load(tiny_aqlm)
    dequantize_aqlm_linears(reference)
    fast = _load(tiny_aqlm)
    install_fast_linears(fast)
    prompt = torch.randint(0, fast.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    expected, _ = greedy_decode(reference, prompt, 12)
    got, timings = greedy_decode(fast, prompt, 12)
    assert torch.equal(got, expected) and timings.new_tokens == 12


def test_a_layer_after_aqlms_cpu_kernel_is_refused_by_name(tiny_aqlm):
    model = _load(tiny_aqlm)
    layer = model.model.layers[0].mlp.down_proj
    layer.codes.data = layer.codes.data.permute(1, 0, 2).contiguous()  # what aqlm's CPU kernel leaves
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj"):
        install_fast_linears(model)


def test_bf16_linears_through_numba_keep_the_tied_head_and_the_logits(tmp_path):
    """install_cpu_bf16_linears swaps the bf16 nn.Linears (the tied lm_head here) for
    CpuBf16Linear holding the same Parameters: the head stays tied, no bytes are added, and the
    logits equal torch's bf16 ones within bf16 rounding of the output (the kernel sums in float32)."""
    from aqflow.inference.fast_linear import CpuBf16Linear, install_cpu_bf16_linears
    from aqflow.inference.runtime import resident_weight_bytes

    fp_dir = build_tiny_llama(tmp_path / "fp", hidden_size=64, intermediate_size=128, num_layers=2, seed=0)
    reference = load_causal_lm(fp_dir, dtype="bfloat16", device="cpu")
    model = load_causal_lm(fp_dir, dtype="bfloat16", device="cpu")
    before = resident_weight_bytes(model)
    names = install_cpu_bf16_linears(model)
    assert "lm_head" in names and len(names) == 7 * model.config.num_hidden_layers + 1
    assert isinstance(model.lm_head, CpuBf16Linear)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert resident_weight_bytes(model) == before
    ids = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_projections_on_a_cpu_leave_the_logits_bit_for_bit(tiny_aqlm, tmp_path, dtype, cpu_kernel):
    """fuse_projections on a CPU (greedy_decode's default): where a compiled kernel runs, the 2-bit
    layers held as column tiles (gate/up here) become one kernel product; under numba (no compiled
    kernel) they stay one numba call a layer and nothing of the 2-bit model is fused; bf16 linears
    become one numba GEMV. The logits of a decode step and of a short prompt are those of the unfused
    model, bit for bit."""
    from aqflow.inference.decode import FusedProjectionMember, fuse_projections
    from aqflow.inference.fast_linear import CpuBf16Linear, FusedColumnsLinear, install_cpu_bf16_linears

    import transformers.quantizers  # noqa: F401  (before aqlm's integration)

    quantized = load_causal_lm(tiny_aqlm, dtype=dtype, device="cpu")
    install_fast_linears(quantized)
    install_cpu_bf16_linears(quantized)
    dense = load_causal_lm(build_tiny_llama(tmp_path / "fp", hidden_size=64, intermediate_size=128, num_layers=2,
                                            seed=0), dtype=dtype, device="cpu")
    install_cpu_bf16_linears(dense)
    compiled = cpu_kernel != "numba"
    for model in (quantized, dense):
        ids = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            before = [model(ids).logits, model(ids[:, :1]).logits]
            fused = fuse_projections(model)
            after = [model(ids).logits, model(ids[:, :1]).logits]
        assert bool(fused) == (compiled or model is dense)
        if model is dense and dtype == "float32":  # torch's fp32 GEMV of the fused weight: rounding may differ
            torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        else:
            assert [(a - b).abs().max().item() for a, b in zip(after, before)] == [0.0, 0.0], (model is dense, fused)
        up = model.model.layers[0].mlp.up_proj
        assert isinstance(up, FusedProjectionMember) == bool(fused)
    if compiled:
        assert isinstance(quantized.model.layers[0].mlp.gate_proj.fused, FusedColumnsLinear)
    else:
        gate = quantized.model.layers[0].mlp.gate_proj
        assert isinstance(gate, FastQuantizedLinear) and gate.layout == "tiles"
    assert isinstance(dense.model.layers[0].mlp.gate_proj.fused, CpuBf16Linear if dtype == "bfloat16" else torch.nn.Module)
