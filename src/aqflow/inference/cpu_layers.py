"""The one-token attention and RMSNorm of Llama-style decoder layers on a CPU, each one numba call.

Why: in an eager CPU decode step the attention module, around its projections, is ~20 small torch
operations a layer (rotary embedding of query and key, the static cache's update, the attention call,
reshapes), each a few microseconds of dispatch on one core, as many for the dense as for the 2-bit
model. Here:

- attention: `rope_cache_attend` applies the rotary embedding to the new query and key (rounded after
  each product and the sum, as torch does in bfloat16), writes key and value into the static cache at
  the next position and attends over the valid positions, one thread a query head;
- RMSNorm: `rms_norm` (float32 statistics, the normalized value rounded to the model's dtype, then
  times the weight, rounded: transformers' order), a little cheaper than torch's five operations.

(A numba SiLU gate was tried and dropped: with scalar exponentials it took ~130 us for 8192 values
against torch's ~10.) The projections stay the model's modules (dense, 2-bit, fused or not).
`cpu_layers_enabled(model)` replaces, for the block, the forward of every module it recognizes (Llama,
Mistral and Qwen2 RMSNorm, and attention without a sliding window; float32 or bfloat16); each falls
back to the module's own forward for anything else (a prompt, batch > 1, a cache that is not a static
one, a sliding-window layer). Outputs equal the modules' own up to float32 rounding of the sums
(tests/inference/test_cpu_layers.py).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from aqflow.inference.cpu_attention import FASTMATH, as_float32, as_numba, attend_head
from aqflow.inference.cpu_kernels import _bits_of_float32, _float32_from_bits
from aqflow.inference.attention_switch import forwards_replaced
from aqflow.inference.static_cache import static_layer

NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention"})
DTYPES = (torch.float32, torch.bfloat16)


@njit(cache=True)
def _bf16_rounded_bits(value):
    """The bfloat16 nearest to a float32 (ties to even), as the float32's bits with the low half zero."""
    bits = _bits_of_float32(np.float32(value))
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


def stored(value, like):
    """`value` (float32) as an element of `like`'s dtype holds it: bf16 bits (uint16) or float32."""
    raise NotImplementedError("called from numba-compiled code only")


@overload(stored)
def _stored(value, like):
    if like == types.uint16:
        return lambda value, like: np.uint16(_bf16_rounded_bits(value) >> np.uint32(16))
    return lambda value, like: np.float32(value)


def rounded(value, like):
    """`value` (float32) rounded to `like`'s dtype (bf16 bits: bfloat16; float32: itself), as a float32."""
    raise NotImplementedError("called from numba-compiled code only")


@overload(rounded)
def _rounded(value, like):
    if like == types.uint16:
        return lambda value, like: _float32_from_bits(_bf16_rounded_bits(value))
    return lambda value, like: np.float32(value)


@njit(cache=True)
def rms_norm(x, weight, eps, out):
    """out = weight * (x / sqrt(mean(x^2) + eps) rounded to x's dtype), rounded: transformers' RMSNorm.

    x, weight, out [N]: float32, or bf16 bits as uint16 (one dtype for all three)."""
    size = x.shape[0]
    total = 0.0
    for i in range(size):
        value = as_float32(x[i])
        total += value * value
    scale = np.float32(1.0 / math.sqrt(np.float32(total / size) + eps))
    for i in range(size):
        normalized = rounded(as_float32(x[i]) * scale, x[0])
        out[i] = stored(as_float32(weight[i]) * normalized, x[0])


@njit(cache=True)
def _rotated(x, row, d, cos, sin, like):
    """Element d of row `row` of x [rows, D] after the rotary embedding (halves rotated), each product and
    the sum rounded to `like`'s dtype as torch computes it in that dtype."""
    half = x.shape[1] // 2
    partner = -as_float32(x[row, d + half]) if d < half else as_float32(x[row, d - half])
    return rounded(rounded(as_float32(x[row, d]) * as_float32(cos[d]), like)
                   + rounded(partner * as_float32(sin[d]), like), like)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def rope_cache_attend(query, key, value, cos, sin, keys, values, position, valid, scale, out):
    """The new token's attention: key and value (key rotated) written into the cache at `position`,
    then out[h] = softmax(scale * keys[g] . rotated query[h] over the valid positions) . values[g],
    g = h's key/value head, one thread a query head.

    query [H, D], key and value [Hkv, D], cos and sin [D], keys and values [Hkv, L, D], out [H, D]: all
    float32 or all bf16 bits (uint16); valid [L] bool (`position` among them)."""
    heads, dim = query.shape
    kv_heads = key.shape[0]
    for g in range(kv_heads):
        for d in range(dim):
            keys[g, position, d] = stored(_rotated(key, g, d, cos, sin, query[0, 0]), query[0, 0])
            values[g, position, d] = value[g, d]
    group = heads // kv_heads
    for h in prange(heads):
        rotated = np.empty(dim, dtype=np.float32)
        for d in range(dim):
            rotated[d] = _rotated(query, h, d, cos, sin, query[0, 0])
        sums = np.empty(dim, dtype=np.float32)
        attend_head(rotated, keys[h // group], values[h // group], valid, scale, sums)
        for d in range(dim):
            out[h, d] = stored(sums[d], query[0, 0])


def _one_cpu_token(hidden: torch.Tensor) -> bool:
    """hidden [1, 1, N] of a float32 or bfloat16 model on the CPU, laid out densely."""
    return (hidden.device.type == "cpu" and hidden.dim() == 3 and hidden.shape[0] == 1 and hidden.shape[1] == 1
            and hidden.dtype in DTYPES and hidden.is_contiguous())


def norm_forward_for(module: torch.nn.Module, original):
    """A forward for an RMSNorm module: one rms_norm call for one token, `original` for the rest."""
    epsilon = np.float32(module.variance_epsilon)
    held = {"pointer": None, "view": None}  # the weight's numba view, made again only if its storage changes

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if not _one_cpu_token(hidden_states) or weight.dtype != hidden_states.dtype or weight.device.type != "cpu":
            return original(hidden_states)
        if held["pointer"] != weight.data_ptr():
            held["pointer"], held["view"] = weight.data_ptr(), as_numba(weight)
        out = torch.empty_like(hidden_states)
        rms_norm(as_numba(hidden_states.view(-1)), held["view"], epsilon, as_numba(out.view(-1)))
        return out
    return forward


def attention_forward_for(module: torch.nn.Module, original):
    """A forward for a Llama-style attention module: for one token with a static cache, the projections
    as they are and one rope_cache_attend call between them; `original` for the rest."""
    def forward(hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, past_key_values=None,
                **kwargs):
        layer = static_layer(past_key_values, module.layer_idx, hidden_states.dtype) \
            if _one_cpu_token(hidden_states) and position_embeddings is not None else None
        cos, sin = position_embeddings if layer is not None else (None, None)
        if layer is None or cos.dtype != hidden_states.dtype or cos.shape[-1] != module.head_dim \
                or (attention_mask is not None and attention_mask.dtype != torch.bool):
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        position = int(layer.cumulative_length)
        length = layer.keys.shape[2]
        if position >= length or (attention_mask is not None and attention_mask.numel() != length):
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        dim = module.head_dim
        query = module.q_proj(hidden_states).reshape(-1, dim)
        key = module.k_proj(hidden_states).reshape(-1, dim)
        value = module.v_proj(hidden_states).reshape(-1, dim)
        if not (query.dtype == key.dtype == value.dtype == hidden_states.dtype):
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        if attention_mask is None:
            valid = np.arange(length) <= position
        else:
            valid = attention_mask.reshape(-1).numpy()
        out = torch.empty_like(query)
        rope_cache_attend(as_numba(query.contiguous()), as_numba(key.contiguous()), as_numba(value.contiguous()),
                          as_numba(cos.reshape(-1)), as_numba(sin.reshape(-1)), as_numba(layer.keys[0]),
                          as_numba(layer.values[0]), position, valid, np.float32(module.scaling), as_numba(out))
        layer.cumulative_length.add_(1)
        return module.o_proj(out.view(1, 1, -1)), None
    return forward


def _recognized(module: torch.nn.Module):
    """The lean forward maker for a module this file handles, else None."""
    name = type(module).__name__
    if name in NORMS and hasattr(module, "variance_epsilon"):
        return norm_forward_for
    if name in ATTENTIONS and getattr(module, "sliding_window", None) is None and hasattr(module, "head_dim") \
            and module.head_dim % 2 == 0:
        return attention_forward_for
    return None


def cpu_layers_enabled(model: torch.nn.Module) -> contextlib.AbstractContextManager[int]:
    """Within the block the model's RMSNorm and attention modules that this file recognizes run
    their one-token forward through its kernels; yields how many modules it switched. Restored after."""
    return forwards_replaced(model, _recognized)
