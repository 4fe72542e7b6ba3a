"""The CPU one-token attention (numba): equal to float64 attention with grouped heads and masked
positions for float32 and bfloat16 caches, and a decode through it picks SDPA's tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aqflow.inference import cpu_attention
from aqflow.inference.cpu_attention import IMPLEMENTATION, cpu_attention_enabled, one_token_attention
from aqflow.inference.decode import greedy_decode, new_static_cache, step_logits
from tests.inference.attention_cases import masked_grouped_case


def float64_attention(query, key, value, valid, scale):
    """[H, D] in float64 torch ops, each group of query heads on its key/value head."""
    group = query.shape[0] // key.shape[0]
    k = key.double().repeat_interleave(group, dim=0)
    v = value.double().repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hld->hl", query.double(), k) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid[None, :], float("-inf"))
    return torch.einsum("hl,hld->hd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_attention_equals_float64_attention(dtype):
    """6 query heads on 2 key/value heads, 150 positions with a hole and an unfilled tail masked, and no
    mask; a cache that is a view of a longer one (the static cache's layout)."""
    query, key, value, valid = masked_grouped_case(dtype)
    heads, dim = query.shape
    for mask in (valid, None):
        out = one_token_attention(query, key, value, mask, dim ** -0.5)
        expected = float64_attention(query, key, value, mask, dim ** -0.5)
        assert out.dtype == torch.float32 and out.shape == (heads, dim)
        assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    before = one_token_attention(query, key, value, valid, dim ** -0.5)
    for position in (15, 120):  # masked positions do not count
        key[:, position] = 100.0
        value[:, position] = 100.0
    assert torch.equal(one_token_attention(query, key, value, valid, dim ** -0.5), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_decode_through_it_gives_sdpas_logits_and_tokens(dtype, monkeypatch):
    calls = []
    original = cpu_attention.one_token_attention
    monkeypatch.setattr(cpu_attention, "one_token_attention", lambda *args: calls.append(1) or original(*args))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval().to(dtype)
    assert model.config._attn_implementation == "sdpa"
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        for fast in (False, True):
            cache = new_static_cache(model, 40)
            model(input_ids=prompt, position_ids=torch.arange(9)[None], past_key_values=cache, use_cache=True)
            if fast:
                with cpu_attention_enabled(model) as implementation:
                    assert implementation == IMPLEMENTATION
                    logits.append(step_logits(model, cache, torch.tensor([[5]]), torch.tensor([[9]])))
                assert len(calls) == config.num_hidden_layers  # the step's token; the prefill went to SDPA
            else:
                logits.append(step_logits(model, cache, torch.tensor([[5]]), torch.tensor([[9]])))
    assert model.config._attn_implementation == "sdpa"
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits[1].float(), logits[0].float(), rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:  # bf16's rounding may flip a near tie
        plain, plain_timings = greedy_decode(model, prompt, 8, fast_attention=False)
        fast, fast_timings = greedy_decode(model, prompt, 8)
        assert torch.equal(plain, fast)
        assert (plain_timings.attention, fast_timings.attention) == ("model's own", IMPLEMENTATION)
