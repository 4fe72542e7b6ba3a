"""The one-token attention of Llama-style layers on CUDA with the rotary embedding and the static cache's
write done inside the attention's own two kernels.

Why: in a compiled, graphed decode step each layer's attention module runs, around its projections, four
small kernels before the two of `decode_attention`: the rotary embedding of the query, that of the key
with its write into the static cache, the value's write, and the mask. On an H200 such a kernel costs
~1-1.5 us in the step's chain, ~0.15 ms of a Llama-3.2-3B step of 1.45 ms (2-bit) or 2.55 ms (bf16).
`decode_attention.rope_cache_attention` instead rotates the query and the new key in its split kernel,
uses them, and has the program whose cache positions hold the new token write key and value; its combine
kernel then moves the cache layer's length on. q, k and v reach the op as one buffer (the fused product
itself), and a 2-bit product computed with open sums (`open_sums`) as its unfinished sums, which the split
kernel finishes as it reads them: no kernel of the step only finishes q, k and v.

`cuda_layers_enabled(model)` replaces, for the block, the forward of every Llama, Mistral and Qwen2
attention module without a sliding window: one token at batch 1 with a filled static cache goes the
fused way (the projections stay the model's modules, dense or 2-bit, fused or not); anything else (a
prompt, another cache, a mask that is not bool) goes through the module's own forward. Outputs equal the
modules' own but for rounding: the rotary embedding is computed in float32 and rounded once, as
torch.compile computes it (transformers' eager code rounds after each operation)."""

from __future__ import annotations

import contextlib

import torch

from aqflow.inference.attention_switch import forwards_replaced
from aqflow.inference.static_cache import static_layer

ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention"})


def query_key_value(module: torch.nn.Module,
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The module's q, k and v projections of hidden [1, 1, N] as one tensor [Hq * D + 2 * Hkv * D], with the
    scales and bias (or None) that finish it, or two Nones where it is finished. One tensor: the fused
    product itself where the three are one (decode.fuse_projections), so it reaches the attention as one
    buffer (torch.compile would otherwise write each part with a kernel of its own); else concatenated.
    Where that product is a 2-bit GEMV with open sums (open_sums), its sums unfinished: the attention's
    kernels finish them as they read them, and the step has no kernel that only finishes q, k and v."""
    members = (module.q_proj, module.k_proj, module.v_proj)
    shared = [getattr(m, "shared_product", None) for m in members]
    if all(s is not None for s in shared):
        products = [s() for s in shared]
        compute = products[0][0]
        if all(p[0] is compute for p in products) and [p[1] for p in products] == [0, 1, 2] and products[0][2] == 3:
            site = getattr(compute, "open_sums", None)
            if site is not None:
                return site.unfinished(hidden).reshape(-1), site.packed.scales, site.packed.bias
            return compute(hidden).reshape(-1), None, None
    return torch.cat([m(hidden).reshape(-1) for m in members]), None, None


def attention_forward_for(module: torch.nn.Module, original):
    """A forward for a Llama-style attention module: for one token with a static cache, the projections as
    they are and one rope_cache_attention call between them; `original` for the rest."""
    from aqflow.inference.decode_attention import kernels_run_here, rope_cache_attention  # Triton: where used

    def forward(hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        one_token = hidden_states.dim() == 3 and hidden_states.shape[:2] == (1, 1) and kernels_run_here(hidden_states)
        layer = static_layer(past_key_values, module.layer_idx, hidden_states.dtype) \
            if one_token and position_embeddings is not None else None
        if layer is None:
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        cos, sin = position_embeddings
        length = layer.keys.shape[2]
        mask_ok = attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.numel() == length)
        if not mask_ok or cos.numel() != module.head_dim or sin.numel() != module.head_dim \
                or layer.cumulative_length.dtype != torch.int64 or layer.cumulative_length.numel() != 1:
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        qkv, scales, bias = query_key_value(module, hidden_states)
        valid = None if attention_mask is None else attention_mask.reshape(-1)
        out = rope_cache_attention(qkv, cos.reshape(-1), sin.reshape(-1), layer.keys, layer.values,
                                   layer.cumulative_length, valid, float(module.scaling), scales, bias)
        return module.o_proj(out.view(1, 1, -1)), None
    return forward


def _recognized(module: torch.nn.Module):
    """attention_forward_for for an attention module this file handles, else None."""
    if (type(module).__name__ in ATTENTIONS and getattr(module, "sliding_window", None) is None
            and hasattr(module, "head_dim") and module.head_dim % 2 == 0):
        return attention_forward_for
    return None


def cuda_layers_enabled(model: torch.nn.Module) -> contextlib.AbstractContextManager[int]:
    """Within the block the model's attention modules that this file recognizes run their one-token forward
    through rope_cache_attention; yields how many it switched. Restored after."""
    return forwards_replaced(model, _recognized)
