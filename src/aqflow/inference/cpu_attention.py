"""Attention for one new token on a CPU in one numba call, for the decode harness (fp and 2-bit alike).

Why: an eager CPU decode step of a Llama-3.2-3B-shaped model calls SDPA once a layer, ~80 us a call on
the 2-core box (torch's flash kernel for CPUs, built for long queries), ~2 ms of a ~100 ms token. One
query token against a static cache needs one pass over the cached keys and values of each head.

- `attend_one_token(query [H, D] f32, key/value [Hkv, L, D] f32 or bf16 bits as uint16, valid [L] bool,
  scale, out [H, D] f32)`: one thread a query head (numba's threads); scores in float32, the softmax
  with its maximum subtracted, positions not valid left out; key/value read in place (no copy of the
  cache, bf16 widened as read).
- `attention_forward`: a transformers attention function (the `AttentionInterface` signature) that
  takes that path for one query token at batch 1 on a CPU with a float32 or bfloat16 cache and a
  boolean mask (or none); everything else (prefill, dropout, soft-capping, sliding windows, other
  masks or dtypes) goes to transformers' own SDPA path.
- `cpu_attention_enabled(model)`: a context manager that registers it (name IMPLEMENTATION, with SDPA's
  mask) and switches the model to it while decoding, when the model uses SDPA.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from aqflow.inference.attention_switch import attention_switched
from aqflow.inference.cpu_kernels import _bf16_widen

IMPLEMENTATION = "aqflow_cpu_decode"  # the attention implementation's name, in configs and in decode timings


def as_float32(value):
    """A cache element as float32: a float32 itself, a bfloat16 given as its uint16 bits widened."""
    raise NotImplementedError("called from numba-compiled code only")


@overload(as_float32)
def _as_float32(value):
    if value == types.uint16:
        return lambda value: _bf16_widen(value)
    return lambda value: np.float32(value)


# fastmath without its no-infinities flag: the running maximum starts at -inf
FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@njit(fastmath=FASTMATH, cache=True)
def attend_head(query, key, value, valid, scale, out):
    """out = softmax(scale * key . query over the valid positions) . value for one query head.

    query [D] f32, key and value [L, D] f32 or uint16 (bf16 bits), valid [L] bool, out [D] f32."""
    length, dim = key.shape
    scores = np.empty(length, dtype=np.float32)
    top = np.float32(-np.inf)
    for position in range(length):
        if not valid[position]:
            continue
        total = np.float32(0.0)
        for d in range(dim):
            total += query[d] * as_float32(key[position, d])
        scores[position] = total * scale
        top = max(top, scores[position])
    for d in range(dim):
        out[d] = 0.0
    weight_sum = np.float32(0.0)
    for position in range(length):
        if not valid[position]:
            continue
        weight = np.exp(scores[position] - top)
        weight_sum += weight
        for d in range(dim):
            out[d] += weight * as_float32(value[position, d])
    for d in range(dim):
        out[d] /= weight_sum


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def attend_one_token(query, key, value, valid, scale, out):
    """out[h] = softmax(scale * key[g] . query[h] over the valid positions) . value[g], g = h's key/value
    head (heads // kv_heads query heads a group).

    query [H, D] f32, key and value [Hkv, L, D] f32 or uint16 (bf16 bits), valid [L] bool, out [H, D] f32."""
    heads = query.shape[0]
    group = heads // key.shape[0]
    for h in prange(heads):
        attend_head(query[h], key[h // group], value[h // group], valid, scale, out[h])


def as_numba(tensor: torch.Tensor) -> np.ndarray:
    """A CPU float32 or bfloat16 tensor as the numba kernels read it (bf16 as its uint16 bits), without a
    copy where its last dim is dense."""
    if tensor.dtype == torch.bfloat16:
        return tensor.detach().view(torch.int16).numpy().view(np.uint16)
    return tensor.detach().numpy()


def one_token_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """query [H, D], key/value [Hkv, L, D] (float32 or bfloat16, on the CPU), valid [L] bool or None (all)
    -> [H, D] float32 through attend_one_token."""
    heads, dim = query.shape
    length = key.shape[1]
    valid_np = np.ones(length, dtype=np.bool_) if valid is None else valid.detach().numpy()
    out = np.empty((heads, dim), dtype=np.float32)
    attend_one_token(np.ascontiguousarray(query.detach().to(torch.float32).numpy()), as_numba(key),
                     as_numba(value), valid_np, np.float32(scale), out)
    return torch.from_numpy(out)


def _one_token_case(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """One query token at batch 1 on the CPU, a float32 or bfloat16 cache of one dtype, a bool
    [1, 1, 1, L] mask or none, and nothing else asked of the attention (dropout, soft-capping, sliding
    windows, sinks)."""
    if query.shape[0] != 1 or query.shape[2] != 1 or dropout or query.device.type != "cpu":
        return False
    if key.dtype not in (torch.float32, torch.bfloat16) or value.dtype != key.dtype or key.stride(-1) != 1 \
            or value.stride(-1) != 1:
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "sliding_window", "s_aux")):
        return False
    if attention_mask is not None and (attention_mask.dtype != torch.bool
                                       or attention_mask.numel() != key.shape[2]):
        return False
    return query.shape[1] % key.shape[1] == 0


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, Hkv, L, D] ->
    ([B, q, H, D], None). One token at batch 1 on a CPU goes through attend_one_token, the rest
    through SDPA."""
    if not _one_token_case(query, key, value, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    valid = None if attention_mask is None else attention_mask.reshape(-1)
    out = one_token_attention(query[0, :, 0, :], key[0], value[0], valid, scale).to(query.dtype)
    return out.view(1, 1, *out.shape), None


def cpu_attention_enabled(model: torch.nn.Module) -> contextlib.AbstractContextManager[str | None]:
    """Within the block the model's configs on SDPA use IMPLEMENTATION instead; yields IMPLEMENTATION if
    it switched, None if not (a model on another attention implementation)."""
    return attention_switched(model, IMPLEMENTATION, attention_forward)
