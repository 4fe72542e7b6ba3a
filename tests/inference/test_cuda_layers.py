"""The one-token attention with the rotary embedding and the cache write inside its kernels (run here by
Triton's interpreter; on a GPU machine with TRITON_INTERPRET=0 the kernel test runs on the GPU): equal to
rotating, writing and attending one after another, and a decode through it makes the stock layers' tokens."""

import os

import pytest
import torch

from aqflow.inference.decode import greedy_decode, new_static_cache, step_logits
from aqflow.inference.cuda_layers import cuda_layers_enabled
from aqflow.inference.decode_attention import (decode_attention_enabled, reference_attention,
                                               rope_cache_attention)
from tests.inference.attention_cases import DIM, KV_HEADS, LENGTH, masked_grouped_case
from tests.inference.test_decode_attention import llama_head_dim_16


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] * cos + rotate_half(x) * sin in float32 (float64 for a float64 x), rounded once to x's dtype."""
    half = x.shape[-1] // 2
    wide = x.double() if x.dtype == torch.float64 else x.float()
    turned = torch.cat([-wide[..., half:], wide[..., :half]], dim=-1)
    return (wide * cos.to(wide.dtype) + turned * sin.to(wide.dtype)).to(x.dtype)


def kernel_device() -> str:
    """Where the Triton kernels run in this test session: the GPU with TRITON_INTERPRET=0, else the CPU."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA GPU: nowhere to run the kernels")
    return "cuda"


def one_bf16_step(expected: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 at each element (Triton's interpreter rounds its float32 to bf16
    casts otherwise than torch)."""
    return 2.0 ** (torch.floor(torch.log2(expected.float().abs().clamp_min(1e-30))) - 7)


def test_rope_cache_attention_equals_rotating_writing_and_attending():
    """6 query heads on 2 key/value heads, 150 cache positions in 3 splits; the new token at 99 (masked
    hole and tail), at 40 and at 5 (no mask: the positions up to it): the output is float64 attention over the
    rotated query and the cache with the rotated key and the value written at the position, the cache
    holds those afterwards (the rotated key within its rounding, nothing else changed), and the position
    moved on by one."""
    device = kernel_device()
    query, cache_keys, cache_values, valid = (t.to(device) for t in masked_grouped_case(torch.bfloat16))
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(KV_HEADS, DIM, generator=generator).to(device, torch.bfloat16)
    value = torch.randn(KV_HEADS, DIM, generator=generator).to(device, torch.bfloat16)
    angles = torch.rand(DIM // 2, generator=generator) * 6.0
    cos = torch.cat([angles, angles]).cos().to(device, torch.bfloat16)
    sin = torch.cat([angles, angles]).sin().to(device, torch.bfloat16)
    for at, mask in ((99, valid), (40, None), (5, None)):
        keys, values = cache_keys[None].clone(), cache_values[None].clone()
        position = torch.tensor(at, device=device)
        qkv = torch.cat([query.reshape(-1), key.reshape(-1), value.reshape(-1)])
        out = rope_cache_attention(qkv, cos, sin, keys, values, position, mask, DIM ** -0.5)
        expected_keys, expected_values = cache_keys.clone(), cache_values.clone()
        expected_keys[:, at], expected_values[:, at] = rotated(key, cos, sin), value
        others = torch.arange(LENGTH, device=device) != at
        assert torch.equal(keys[0][:, others], expected_keys[:, others]) and torch.equal(values[0], expected_values)
        new_key = expected_keys[:, at]
        assert ((keys[0][:, at].float() - new_key.float()).abs() <= one_bf16_step(new_key)).all()
        assert int(position) == at + 1
        reference_mask = mask if mask is not None else torch.arange(LENGTH, device=device) <= at
        # attention reads the key as the kernel rounded it (the interpreter's rounding, on the CPU)
        expected_keys[:, at] = keys[0][:, at]
        # and the query rotated exactly (the kernel keeps it in float32)
        expected = reference_attention(rotated(query.double(), cos, sin), expected_keys, expected_values,
                                       reference_mask, DIM ** -0.5)
        assert out.dtype == torch.bfloat16 and out.shape == query.shape
        # bf16 output rounding (one unit, 2^-7 of the value: the interpreter truncates) and tf32 probabilities
        assert ((out.double() - expected).abs() <= 2 ** -7 * expected.abs() + 2 ** -10).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_cache_attention_finishes_open_sums_as_the_projection_would(with_bias):
    """q/k/v handed over as a 2-bit GEMV's open sums (fp32) with their scales (and bias): the same output
    and cache as q/k/v finished first, (sums * scales + bias) rounded to bf16 (within a few bf16 steps where
    the kernel's rounding or multiply-add may differ: the interpreter truncates); scales without fp32 sums are
    refused by name."""
    device = kernel_device()
    query, cache_keys, cache_values, valid = (t.to(device) for t in masked_grouped_case(torch.bfloat16))
    generator = torch.Generator().manual_seed(5)
    rows = query.numel() + 2 * KV_HEADS * DIM
    sums = (torch.randn(rows, generator=generator) * 4).to(device)
    scales = (torch.rand(rows, generator=generator) * 0.5 + 0.1).to(device, torch.bfloat16)
    bias = torch.randn(rows, generator=generator).to(device, torch.bfloat16) if with_bias else None
    finished = sums * scales.float() + (bias.float() if with_bias else 0.0)
    finished = finished.to(torch.bfloat16)
    angles = torch.rand(DIM // 2, generator=generator) * 6.0
    cos = torch.cat([angles, angles]).cos().to(device, torch.bfloat16)
    sin = torch.cat([angles, angles]).sin().to(device, torch.bfloat16)
    results = []
    for qkv, finishing in ((finished, (None, None)), (sums, (scales, bias))):
        keys, values = cache_keys[None].clone(), cache_values[None].clone()
        position = torch.tensor(99, device=device)
        out = rope_cache_attention(qkv, cos, sin, keys, values, position, valid, DIM ** -0.5, *finishing)
        results.append((out, keys[0], values[0]))
        assert out.dtype == torch.bfloat16 and int(position) == 100
    (out_a, keys_a, values_a), (out_b, keys_b, values_b) = results
    others = torch.arange(LENGTH, device=device) != 99
    assert torch.equal(keys_a[:, others], keys_b[:, others]) and torch.equal(values_a[:, others], values_b[:, others])
    # the new key and value, and the output, within a few bf16 steps of each head's largest entry (the rotation
    # mixes entries rounded apart; 2^-8 relative on a GPU, where both round to nearest)
    for a, b in ((keys_a[:, 99], keys_b[:, 99]), (values_a[:, 99], values_b[:, 99]), (out_a, out_b)):
        largest = a.float().abs().amax(dim=-1, keepdim=True)
        assert ((a.float() - b.float()).abs() <= 2 ** -5 * largest).all()
    with pytest.raises(ValueError, match="rope_cache_attention"):
        rope_cache_attention(finished, cos, sin, cache_keys[None].clone(), cache_values[None].clone(),
                             torch.tensor(99, device=device), valid, DIM ** -0.5, scales, bias)


@torch.inference_mode()
def test_a_decode_through_the_fused_layers_makes_the_stock_tokens():
    """After the same prefill, one step's logits with the fused layers equal those through the stock layers
    (the same attention kernels); greedy_decode makes the same tokens either way, counts the modules it
    switched, and gives the forwards back."""
    device = kernel_device()
    model = llama_head_dim_16().to(device)
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    logits = []
    for fused in (False, True):
        cache = new_static_cache(model, 80)
        model(input_ids=prompt.to(device), position_ids=torch.arange(9, device=device)[None], past_key_values=cache,
              use_cache=True)
        with decode_attention_enabled(model), (cuda_layers_enabled(model) if fused else decode_attention_enabled(
                model, False)) as switched:
            assert switched == (2 if fused else None)
            logits.append(step_logits(model, cache, torch.tensor([[5]], device=device),
                                      torch.tensor([[9]], device=device)))
            assert int(cache.layers[0].cumulative_length) == 10
    assert all("forward" not in vars(m) for m in model.modules())
    assert torch.allclose(logits[0], logits[1], rtol=1e-3, atol=1e-3)
    stock, stock_timings = greedy_decode(model, prompt, 6, fast_attention=True, cuda_layers=False, compile=False)
    fused, fused_timings = greedy_decode(model, prompt, 6, fast_attention=True, compile=False)
    assert torch.equal(stock, fused)
    assert (stock_timings.cuda_layers, fused_timings.cuda_layers) == (0, 2)
