"""The one-token CPU layers (numba): RMSNorm and rotary + cache + attention equal the transformers
modules they replace (bf16 rounded at the same points), a decode through them gives the stock decode's
logits, cache and tokens, and everything but one token with a static cache falls back."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from aqflow.inference import cpu_layers
from aqflow.inference.cpu_attention import as_numba, cpu_attention_enabled
from aqflow.inference.cpu_layers import cpu_layers_enabled, rms_norm
from aqflow.inference.decode import greedy_decode, new_static_cache, step_logits

BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16 values


def tiny_llama(dtype, cls=LlamaForCausalLM, config_cls=LlamaConfig, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    return cls(config).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_module(dtype):
    """Within one rounding step everywhere (float32 statistics summed in another order), and bf16 equal
    almost everywhere: rounding the normalized value before the weight, as torch does, matters for ~1/4
    of the elements."""
    model = tiny_llama(dtype)
    norm = type(model.model.layers[0].input_layernorm)(3072, eps=1e-5).to(dtype)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(3072, generator=generator) * 2)
        x = (torch.randn(3072, generator=generator) * 3).to(dtype)
        expected = norm(x)
        out = torch.empty_like(x)
        rms_norm(as_numba(x), as_numba(norm.weight), np.float32(norm.variance_epsilon), as_numba(out))
    limit = 1e-6 if dtype == torch.float32 else BF16_ULP
    assert ((out.float() - expected.float()).abs() <= limit * expected.float().abs() + 1e-30).all()
    if dtype == torch.bfloat16:
        assert (out == expected).float().mean() >= 0.99


def decode_steps(model, prompt, steps, lean):
    """Logits of `steps` greedy steps after the prompt, through the stock modules with the numba
    attention or through cpu_layers; and the first layer's cache keys after them."""
    cache = new_static_cache(model, prompt.shape[1] + steps + 3)
    logits = []
    with torch.no_grad(), cpu_attention_enabled(model):
        model(input_ids=prompt, position_ids=torch.arange(prompt.shape[1])[None], past_key_values=cache,
              use_cache=True)
        token = prompt[:, -1:]
        with cpu_layers_enabled(model) if lean else torch.no_grad():
            for position in range(prompt.shape[1], prompt.shape[1] + steps):
                step = step_logits(model, cache, token, torch.tensor([[position]]))
                logits.append(step.float())
                token = step.argmax(-1, keepdim=True)
    return torch.stack(logits), cache.layers[0].keys.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_decode_through_the_cpu_layers_gives_the_modules_logits_and_cache(dtype, family, monkeypatch):
    calls = []
    original = cpu_layers.rope_cache_attend
    monkeypatch.setattr(cpu_layers, "rope_cache_attend", lambda *args: calls.append(1) or original(*args))
    model = tiny_llama(dtype) if family == "llama" else tiny_llama(dtype, Qwen2ForCausalLM, Qwen2Config)
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    stock, stock_keys = decode_steps(model, prompt, 6, lean=False)
    lean, lean_keys = decode_steps(model, prompt, 6, lean=True)
    assert len(calls) == 6 * model.config.num_hidden_layers  # every step's attention, not the prefill's
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lean, stock, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lean_keys.float(), stock_keys.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(lean.argmax(-1), stock.argmax(-1))
    assert all("forward" not in module.__dict__ for module in model.modules())  # restored


def test_a_prompt_and_a_dynamic_cache_take_the_modules_own_forward(monkeypatch):
    monkeypatch.setattr(cpu_layers, "rope_cache_attend", lambda *args: pytest.fail("one-token path taken"))
    model = tiny_llama(torch.float32)
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=prompt).logits
        with cpu_layers_enabled(model) as switched:
            assert switched == 2 * 3 + 1  # per layer two norms and the attention; the final norm
            got = model(input_ids=prompt).logits  # a prompt, a dynamic cache
            one = model(input_ids=prompt[:, :1]).logits  # one token, a dynamic cache
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(one, model(input_ids=prompt[:, :1]).logits, rtol=1e-6, atol=1e-6)


def test_greedy_decode_takes_the_cpu_layers_by_default_with_the_same_tokens():
    model = tiny_llama(torch.float32)
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    stock, stock_timings = greedy_decode(model, prompt, 8, cpu_layers=False)
    lean, lean_timings = greedy_decode(model, prompt, 8)
    assert torch.equal(stock, lean)
    assert (stock_timings.cpu_layers, lean_timings.cpu_layers) == (0, 7)
    with pytest.raises(ValueError, match="cpu_layers=True"):
        greedy_decode(model, prompt, 2, cpu_layers=True, fast_attention=False)
