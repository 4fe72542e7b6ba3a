"""The one-token attention kernels (run here by Triton's interpreter): equal to float64 attention with
grouped heads, ragged splits and masked positions, and a decode through them gives SDPA's logits."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aqflow.inference import decode_attention as decode_attention_module
from aqflow.inference.decode import greedy_decode, new_static_cache, step_logits
from aqflow.inference.decode_attention import (BLOCK_L, IMPLEMENTATION, decode_attention,
                                               decode_attention_enabled, reference_attention)
from tests.inference.attention_cases import masked_grouped_case


def test_decode_attention_equals_float64_reference():
    """6 query heads on 2 key/value heads (groups of 3, padded to 16 in the kernel), 150 positions
    (3 splits, the last ragged), a hole and an unfilled tail masked, and no mask at all."""
    query, key, value, valid = masked_grouped_case(torch.bfloat16)
    heads, dim = query.shape
    assert key.shape[1] % BLOCK_L and key.shape[1] > 2 * BLOCK_L
    for mask in (valid, None):
        out = decode_attention(query, key, value, mask, dim ** -0.5)
        expected = reference_attention(query, key, value, mask, dim ** -0.5)
        assert out.dtype == torch.bfloat16 and out.shape == (heads, dim)
        # bf16 output rounding (2^-9 of the value) and tf32 probabilities (2^-11 of the weights)
        assert ((out.double() - expected).abs() <= 2 ** -8 * expected.abs() + 2 ** -10).all()
    # masked positions do not count: changing their keys and values changes nothing
    before = decode_attention(query, key, value, valid, dim ** -0.5)
    for position in (15, 120):
        key[:, position] = 100.0
        value[:, position] = 100.0
    assert torch.equal(decode_attention(query, key, value, valid, dim ** -0.5), before)


def llama_head_dim_16(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def test_decode_step_through_the_kernels_gives_sdpa_logits(monkeypatch):
    """After the same prefill, one step's logits through decode_attention equal SDPA's (each layer's
    attention went through the kernels); the switch is undone afterwards; greedy_decode with it makes
    SDPA's tokens and says which attention ran."""
    calls = []
    kernels = decode_attention_module.decode_attention
    monkeypatch.setattr(decode_attention_module, "decode_attention",
                        lambda *args: calls.append(args[0].shape) or kernels(*args))
    model = llama_head_dim_16()
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    for fast in (False, True):
        cache = new_static_cache(model, 80)  # 80 slots: the 9 filled in the first split, two splits unfilled
        model(input_ids=prompt, position_ids=torch.arange(9)[None], past_key_values=cache, use_cache=True)
        with decode_attention_enabled(model, fast) as implementation:
            assert implementation == (IMPLEMENTATION if fast else None)
            logits.append(step_logits(model, cache, torch.tensor([[5]]), torch.tensor([[9]])))
    assert model.config._attn_implementation == "sdpa"
    assert calls == [(4, 16)] * 2  # one token, 4 heads of 16, in each of the 2 layers; none in the prefill
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)

    plain, plain_timings = greedy_decode(model, prompt, 6, fast_attention=False)
    fast, fast_timings = greedy_decode(model, prompt, 6, fast_attention=True)
    assert torch.equal(plain, fast)
    assert (plain_timings.attention, fast_timings.attention) == ("model's own", IMPLEMENTATION)


def test_asking_for_the_kernels_where_they_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = llama_head_dim_16()
    prompt = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="fast_attention=True.*cpu"):
        greedy_decode(model, prompt, 2, fast_attention=True)
    _, timings = greedy_decode(model, prompt, 2)  # the default on a CPU: the numba kernel (cpu_attention)
    assert timings.attention == "aqflow_cpu_decode"
    _, timings = greedy_decode(model, prompt, 2, fast_attention=False)
    assert timings.attention == "model's own"
