"""Stitching per-layer AQLM results into a checkpoint that transformers + aqlm load unchanged.

Tiny models (tied and untied Llama, Qwen2 with q/k/v biases) are quantized layer by layer by
the quantize-layer stage itself, stitched, loaded with `from_pretrained`, and their logits
compared with our own dequantized reference.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers.quantizers  # noqa: F401  (must precede transformers.integrations.aqlm)
from aqlm import QuantizedLinear
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.quantizers.quantizers_utils import should_convert_module

from aqflow.io import artifacts
from aqflow import checkpoint
from aqflow.models import build_tiny_llama, load_causal_lm, load_tokenizer
from aqflow.models.folder import stored_bits_per_parameter
from aqflow.stages.quantize_layer import quantize_every_linear
from aqflow.quant.representation import bits_per_parameter, pack_codes
from aqflow.stages import stitch

TEXT = "Additive quantization represents each group of weights as a sum of codewords. The quick brown fox."


# --- models and their layer artifacts ----------------------------------------------------------

def _save_model(folder, config, tokenizer_dir, seed: int = 0):
    """Save a random model of `config` with the tokenizer of `tokenizer_dir`. Every parameter is
    perturbed so that norms and biases (initialised to ones and zeros) are not trivially right."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    load_tokenizer(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> model folder: tied Llama (as SmolLM2), untied Llama, Qwen2 with q/k/v biases."""
    root = tmp_path_factory.mktemp("models")
    tied = build_tiny_llama(root / "llama-tied", hidden_size=64, intermediate_size=128, seed=0)
    vocab_size = len(load_tokenizer(tied))
    small = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    untied = _save_model(root / "llama-untied", LlamaConfig(**small, tie_word_embeddings=False), tied, seed=1)
    qwen = _save_model(root / "qwen2-bias", Qwen2Config(**small, tie_word_embeddings=False), tied, seed=2)
    return {"llama-tied": tied, "llama-untied": untied, "qwen2-bias": qwen}


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    """(model name, nbits) -> layers folder; nbits 8 runs aqlm's numba CPU kernel, 4 its dequantize path."""
    root = tmp_path_factory.mktemp("layers")
    layers = {}
    for name, folder in models.items():
        for nbits in (4, 8):
            layers[name, nbits] = root / f"{name}-{nbits}"
            quantize_every_linear(folder, layers[name, nbits], nbits)
    return layers


def token_ids(model_dir) -> torch.Tensor:
    return load_tokenizer(model_dir)(TEXT, return_tensors="pt")["input_ids"]  # [1, tokens]


def load_aqlm(folder, dtype=None):
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **({"dtype": dtype} if dtype else {})).eval()


# --- tests -------------------------------------------------------------------------------------

def test_layer_artifact_path_is_the_full_module_name(tmp_path):
    assert checkpoint.layer_artifact_path(tmp_path, "model.layers.0.self_attn.q_proj") == \
        tmp_path / "model.layers.0.self_attn.q_proj.safetensors"


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied", "qwen2-bias"])
@pytest.mark.parametrize("nbits", [4, 8])
def test_float32_checkpoint_loads_as_aqlm_and_matches_the_dequantized_reference(models, quantized, tmp_path, name, nbits):
    model_dir, layers_dir, out = models[name], quantized[name, nbits], tmp_path / "aqlm"
    checkpoint.write_aqlm_checkpoint(model_dir, layers_dir, out, num_codebooks=2, nbits=nbits, dtype="float32")
    original, reference, loaded = load_causal_lm(model_dir), checkpoint.dequantized_model(model_dir, layers_dir), load_aqlm(out)

    names = checkpoint.quantized_linear_names(original)
    assert len(names) == 14
    for module_name in names:
        module = loaded.get_submodule(module_name)
        assert isinstance(module, QuantizedLinear), module_name  # not silently dequantized or replaced
        assert (module.num_codebooks, module.nbits_per_codebook, module.in_group_size) == (2, nbits, 8)
        assert module.codebooks.dtype == torch.float32
        if original.get_submodule(module_name).bias is not None:
            assert torch.equal(module.bias, original.get_submodule(module_name).bias)
    assert name != "qwen2-bias" or loaded.model.layers[1].self_attn.k_proj.bias is not None

    head = loaded.lm_head
    assert type(head) is nn.Linear and torch.equal(head.weight, original.lm_head.weight)
    tied = loaded.config.tie_word_embeddings
    assert tied == (name == "llama-tied")
    assert (head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert ("lm_head.weight" in keys) != tied
    assert not any(f"{module_name}.weight" in keys for module_name in names)

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in config.items() if k != "linear_weights_not_to_quantize"} == {
        "quant_method": "aqlm", "in_group_size": 8, "out_group_size": 1, "num_codebooks": 2, "nbits_per_codebook": nbits}
    skipped = config["linear_weights_not_to_quantize"]
    assert {"lm_head", "lm_head.weight", "model.embed_tokens", "model.norm", "model.layers.0.input_layernorm"} <= set(skipped)
    assert not should_convert_module("lm_head", skipped)
    assert all(should_convert_module(module_name, skipped) for module_name in names)

    ids = token_ids(model_dir)
    with torch.no_grad():
        expected, got = reference(ids).logits, loaded(ids).logits
    assert not torch.allclose(expected, original(ids).logits, atol=1e-3)  # quantization did change the model
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) < 1e-4 * scale
    for item in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "aqflow_model.json"):
        assert (out / item).is_file()


@pytest.mark.parametrize("nbits", [4, 8])
def test_float16_checkpoint_matches_within_half_precision(models, quantized, tmp_path, nbits):
    model_dir, layers_dir, out = models["llama-tied"], quantized["llama-tied", nbits], tmp_path / "aqlm16"
    checkpoint.write_aqlm_checkpoint(model_dir, layers_dir, out, num_codebooks=2, nbits=nbits, dtype="float16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("model.layers.0.mlp.up_proj.codebooks").dtype == torch.float16
        assert handle.get_tensor("model.layers.0.mlp.up_proj.codes").dtype == torch.int8
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    # aqlm's CPU kernel for 8-bit codebooks computes in float32 only; 4-bit codes run in float16
    loaded = load_aqlm(out, dtype=torch.float32 if nbits == 8 else None)
    assert loaded.model.layers[0].self_attn.o_proj.codebooks.dtype == (torch.float32 if nbits == 8 else torch.float16)
    assert isinstance(loaded.model.layers[0].self_attn.o_proj, QuantizedLinear)
    ids = token_ids(model_dir)
    with torch.no_grad():
        expected, got = checkpoint.dequantized_model(model_dir, layers_dir)(ids).logits, loaded(ids).logits.float()
    assert float((got - expected).abs().max()) < 1e-2 * float(expected.abs().max())


def test_missing_or_mismatched_artifact_names_module_and_file(models, quantized, tmp_path):
    layers_dir = tmp_path / "layers"
    shutil.copytree(quantized["llama-untied", 4], layers_dir)
    missing = checkpoint.layer_artifact_path(layers_dir, "model.layers.1.mlp.down_proj")
    missing.unlink()
    artifacts.save_safetensors(checkpoint.layer_artifact_path(layers_dir, "model.layers.0.self_attn.q_proj"),
                               artifacts.load_safetensors(checkpoint.layer_artifact_path(layers_dir, "model.layers.0.mlp.up_proj")))
    out = tmp_path / "aqlm"
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.write_aqlm_checkpoint(models["llama-untied"], layers_dir, out, num_codebooks=2, nbits=4)
    message = str(caught.value)
    assert "2 of 14" in message
    assert "model.layers.1.mlp.down_proj" in message and str(missing) in message
    assert "model.layers.0.self_attn.q_proj" in message and "does not fit the linear [64, 64]" in message
    with pytest.raises(checkpoint.CheckpointError, match="model.layers.1.mlp.down_proj"):
        checkpoint.dequantized_model(models["llama-untied"], layers_dir)
    with pytest.raises(checkpoint.CheckpointError, match=r"other settings: \{'nbits': '4 \(expected 8\)'\}"):
        checkpoint.write_aqlm_checkpoint(models["llama-tied"], quantized["llama-tied", 4], out, num_codebooks=2, nbits=8)
    assert list(tmp_path.iterdir()) == [layers_dir]  # no output, no staging folder


def test_cli_writes_a_checkpoint_or_an_error_and_nothing_else(models, quantized, tmp_path, capsys):
    model_dir, layers_dir = models["llama-tied"], quantized["llama-tied", 8]
    args = ["--model-dir", str(model_dir), "--layers-dir", str(layers_dir), "--num-codebooks", "2", "--nbits", "8"]
    assert stitch.main([*args, "--output-dir", str(tmp_path / "ok")]) == 0
    # the dtype defaults to the model folder's (this tiny model is float32); --dtype chooses another
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["dtype"] == "float32"
    assert "stored bits per quantized weight" in capsys.readouterr().out
    assert stitch.main([*args, "--output-dir", str(tmp_path / "half"), "--dtype", "float16"]) == 0
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == "float16"
    capsys.readouterr()
    shutil.rmtree(tmp_path / "half")

    assert stitch.main([*args, "--output-dir", str(tmp_path / "ok")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aqflow stitch: error:") and "already exists" in err
    bad = ["--model-dir", str(model_dir), "--layers-dir", str(tmp_path / "nope"), "--num-codebooks", "2", "--nbits", "8"]
    assert stitch.main([*bad, "--output-dir", str(tmp_path / "bad")]) == 2
    assert "aqflow stitch: error:" in capsys.readouterr().err
    assert stitch.main([*args, "--group-size", "16", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "group_size" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


def test_stored_bits_per_parameter_is_about_two_for_two_8bit_codebooks(tmp_path):
    """One block of 1024x1024 linears, random codes: 2 bits of codes + fp16 codebooks and scales."""
    model_dir = build_tiny_llama(tmp_path / "wide", hidden_size=1024, intermediate_size=1024, num_layers=1,
                                 num_heads=8, num_kv_heads=8)
    layers_dir, generator = tmp_path / "layers", torch.Generator().manual_seed(0)
    layers_dir.mkdir()
    names = checkpoint.quantized_linear_names(load_causal_lm(model_dir))
    for name in names:
        artifacts.save_safetensors(checkpoint.layer_artifact_path(layers_dir, name), {
            "codes": pack_codes(torch.randint(0, 256, (1024, 128, 2), generator=generator), 8),
            "codebooks": torch.randn(2, 256, 1, 8, generator=generator),
            "scales": torch.ones(1024, 1, 1, 1)})
    out = checkpoint.write_aqlm_checkpoint(model_dir, layers_dir, tmp_path / "aqlm", num_codebooks=2, nbits=8)
    bits = stored_bits_per_parameter(out)["bits_per_parameter"]
    assert bits == pytest.approx(bits_per_parameter(1024, 1024, num_codebooks=2, nbits=8))
    assert 2.0 < bits < 2.1
    assert json.loads((out / "aqflow_model.json").read_text())["stored_bits_per_parameter"] == pytest.approx(bits)
