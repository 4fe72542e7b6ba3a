"""The ρ sweep's codebook geometries at 2 bits per weight (other group sizes and codebook counts
than AQLM's 2x8 over groups of 8) stitch into checkpoints that transformers + aqlm load, with the
logits of our own dequantized reference."""

import pytest
import torch
import transformers.quantizers  # noqa: F401  (must precede transformers.integrations.aqlm)
from aqlm import QuantizedLinear
from transformers import AutoModelForCausalLM

from aqflow import checkpoint
from aqflow.models import build_tiny_llama, load_tokenizer
from aqflow.stages.quantize_layer import quantize_every_linear
from aqflow.quant.representation import layer_rho


@pytest.mark.parametrize("group_size,num_codebooks,nbits", [(6, 2, 6), (4, 1, 8)])
def test_geometry_stitches_and_loads_with_equal_logits(tmp_path, group_size, num_codebooks, nbits):
    assert num_codebooks * nbits / group_size == 2  # the same bit rate as 2x8 over groups of 8
    model_dir = build_tiny_llama(tmp_path / "model", hidden_size=48, intermediate_size=96, seed=0)
    layers = tmp_path / "layers"
    names = quantize_every_linear(model_dir, layers, nbits, num_codebooks=num_codebooks, group_size=group_size)
    out = checkpoint.write_aqlm_checkpoint(model_dir, layers, tmp_path / "aqlm", num_codebooks=num_codebooks, nbits=nbits,
                                           group_size=group_size, dtype="float32")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    for name in names:
        module = loaded.get_submodule(name)
        assert isinstance(module, QuantizedLinear)
        assert (module.in_group_size, module.num_codebooks, module.nbits_per_codebook) == (group_size, num_codebooks, nbits)
    ids = load_tokenizer(model_dir)("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = checkpoint.dequantized_model(model_dir, layers)(ids).logits
        got = loaded(ids).logits
    assert float((got - expected).abs().max()) < 1e-4 * float(expected.abs().max())


def test_rho_grows_as_the_codebooks_shrink_at_a_fixed_bit_rate():
    # SmolLM2's q_proj (576 x 576), as in the ρ sweep: g8 M2 K256, g6 M2 K64, g4 M1 K256
    rhos = [layer_rho(576, 576, m, bits, g) for g, m, bits in ((8, 2, 8), (6, 2, 6), (4, 1, 8))]
    assert rhos == pytest.approx([0.6328, 13.5, 324.0], rel=1e-3)
