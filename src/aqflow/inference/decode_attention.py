"""Attention for one new token on CUDA in two Triton kernels, for the decode harness (bf16 and 2-bit alike).

Why: in a compiled, graphed Llama-3.2-3B decode step on an H200, transformers' SDPA path costs five
kernels a layer (~13 us: cuDNN's flash kernel ~7.8 us plus four inductor kernels that expand the mask
and repeat the key/value heads for grouped-query attention), about a fifth of the whole step. One new
token against a static cache needs neither: each key/value head is read once for its group of query
heads.

- `decode_attention(query [H, D], key [Hkv, L, D], value [Hkv, L, D], valid [L] bool or None, scale)`
  -> [H, D]: split-L ("flash decoding"): program (kv head, split) takes BLOCK_L cache positions and
  all query heads of its group (scores and weighted values through tensor cores in tf32, fp32
  accumulation: the bf16 products are exact, the probabilities rounded to 10 bits where flash attention
  rounds them to bf16's 7), writing its running max, sum and partial output; a second kernel combines
  the splits per query head.
- `attention_forward`: a transformers attention function (the `AttentionInterface` signature) that
  takes that path for one query token at batch 1 with a boolean mask (or none), and hands everything
  else (prefill, dropout, soft-capping, sliding windows, other masks) to transformers' own SDPA path.
- Inside `dependent_launch.enabled()` both kernels are launched with programmatic dependent launch and
  wait for the kernels before them before reading.
- `decode_attention_enabled(model)`: a context manager that registers it (name IMPLEMENTATION, with
  SDPA's mask) and switches the model to it while decoding, when the model uses SDPA.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import triton
import triton.language as tl

from aqflow.inference import dependent_launch
from aqflow.inference.attention_switch import attention_switched

IMPLEMENTATION = "aqflow_decode"  # the attention implementation's name, in configs and in decode timings

BLOCK_L = 32  # cache positions per program: more programs, each one short round trip


@triton.jit
def _projected(x_ptr, scale_ptr, bias_ptr, offsets, ok, cache_ptr, FINISH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """x at offsets in fp32: as stored, or (FINISH: x holds a 2-bit GEMV's open sums, fp32) finished as the
    projection finishes them, sum * scale (+ bias) rounded to the cache's dtype (open_sums)."""
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    if FINISH:
        x = x * tl.load(scale_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        x = x.to(cache_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rotated(x_ptr, scale_ptr, bias_ptr, rows, row_ok, stride, cos, sin, cache_ptr, D: tl.constexpr,
             FINISH: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Rows `rows` of x [*, D] (stride apart; finished as _projected says) after the rotary embedding,
    x * cos + rotate_half(x) * sin, in fp32: [len(rows), D]."""
    d = tl.arange(0, D)
    partner = (d + D // 2) % D  # rotate_half: (-x[D/2:], x[:D/2])
    sign = tl.where(d < D // 2, -1.0, 1.0)
    x = _projected(x_ptr, scale_ptr, bias_ptr, rows[:, None] * stride + d[None, :], row_ok[:, None], cache_ptr,
                   FINISH, HAS_BIAS)
    other = _projected(x_ptr, scale_ptr, bias_ptr, rows[:, None] * stride + partner[None, :], row_ok[:, None],
                       cache_ptr, FINISH, HAS_BIAS)
    return x * cos[None, :] + sign[None, :] * other * sin[None, :]


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, max_ptr, sum_ptr, part_ptr,
                  length, splits, scale, stride_qh, stride_kh, stride_kl, stride_vh, stride_vl,
                  new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, position_ptr,
                  q_scale_ptr, k_scale_ptr, v_scale_ptr, q_bias_ptr, k_bias_ptr, v_bias_ptr,
                  GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_VALID: tl.constexpr, ROPE: tl.constexpr, FINISH: tl.constexpr, HAS_BIAS: tl.constexpr,
                  PDL: tl.constexpr):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D)
    pos = split * BLOCK + tl.arange(0, BLOCK)
    head_ok = g < GROUP
    in_range = pos < length
    heads = kv_head * GROUP + g
    if PDL:  # everything below reads what the kernels before wrote (the query, the cache)
        tl.extra.cuda.gdc_wait()
    k = tl.load(k_ptr + kv_head * stride_kh + pos[:, None] * stride_kl + d[None, :], mask=in_range[:, None],
                other=0.0)
    # requested before the scores need k: both loads in flight at once (a program is one round trip)
    v = tl.load(v_ptr + kv_head * stride_vh + pos[:, None] * stride_vl + d[None, :], mask=in_range[:, None],
                other=0.0)
    if ROPE:  # q, k as projected: rotated here; the new key and value go into the cache at `position`
        position = tl.load(position_ptr)
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32)
        # the query stays in fp32; the key is rounded as the cache holds it (once, as torch.compile rounds it)
        # (FINISH: q, k, v are the open sums of the fused 2-bit q/k/v GEMV, finished here as they are read)
        q = _rotated(q_ptr, q_scale_ptr, q_bias_ptr, heads, head_ok, stride_qh, cos, sin, k_ptr, D, FINISH, HAS_BIAS)
        one = tl.arange(0, 1)
        new_k = _rotated(new_k_ptr, k_scale_ptr, k_bias_ptr, kv_head + one, one == 0, D, cos, sin, k_ptr, D, FINISH,
                         HAS_BIAS).to(k_ptr.dtype.element_ty)  # [1, D]
        new_v = _projected(new_v_ptr, v_scale_ptr, v_bias_ptr, kv_head * D + d, d < D, k_ptr, FINISH,
                           HAS_BIAS).to(v_ptr.dtype.element_ty)[None, :]
        here = (pos == position)[:, None]
        k = tl.where(here, new_k, k)  # the cache row may still hold the last step's: use the new one
        v = tl.where(here, new_v, v)
        if position // BLOCK == split:  # the program whose positions hold it writes it
            tl.store(k_ptr + kv_head * stride_kh + position * stride_kl + d[None, :], new_k)
            tl.store(v_ptr + kv_head * stride_vh + position * stride_vl + d[None, :], new_v)
    else:
        q = tl.load(q_ptr + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
    # fp32 operands: tf32 products of bf16/fp16 values are exact on tensor cores (and Triton's interpreter,
    # which the CPU tests use, mis-multiplies bf16 operands)
    scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale  # [GROUP_P, BLOCK]
    valid = in_range
    if HAS_VALID:
        valid = valid & (tl.load(valid_ptr + pos, mask=in_range, other=0) != 0)
    elif ROPE:
        valid = valid & (pos <= position)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    top = tl.max(scores, axis=1)  # [GROUP_P]; -inf where the split has no valid position
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    p = tl.exp(scores - top_safe[:, None])
    total = tl.sum(p, axis=1)
    part = tl.dot(p, v.to(tl.float32))  # [GROUP_P, D]; p rounded to tf32 (10 bits) on tensor cores
    slot = heads * splits + split
    tl.store(max_ptr + slot, top, mask=head_ok)
    tl.store(sum_ptr + slot, total, mask=head_ok)
    tl.store(part_ptr + slot[:, None] * D + d[None, :], part, mask=head_ok[:, None])


@triton.jit
def _attention_combine_kernel(max_ptr, sum_ptr, part_ptr, out_ptr, splits, position_ptr, D: tl.constexpr,
                              BLOCK_S: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr):
    head = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = s < splits
    if PDL:
        tl.extra.cuda.gdc_wait()
    if ADVANCE:  # the cache's length moves on once every split has read it (they ran before this kernel)
        if head == 0:
            tl.store(position_ptr, tl.load(position_ptr) + 1)
    tops = tl.load(max_ptr + head * splits + s, mask=ok, other=float("-inf"))
    top = tl.max(tops, axis=0)
    weight = tl.where(tops == float("-inf"), 0.0, tl.exp(tops - top))
    total = tl.sum(weight * tl.load(sum_ptr + head * splits + s, mask=ok, other=0.0), axis=0)
    parts = tl.load(part_ptr + (head * splits + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(weight[:, None] * parts, axis=0) / total
    tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None) -> None:
    heads, dim = query.shape
    kv_heads, length, kv_dim = key.shape
    if value.shape != key.shape or kv_dim != dim or heads % kv_heads:
        raise ValueError(f"decode_attention: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}: expected [H, D], [Hkv, L, D] twice, H a multiple of Hkv")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"decode_attention: head dim {dim} must be a power of two >= 16")
    if valid is not None and (valid.dtype != torch.bool or valid.shape != (length,)):
        raise ValueError(f"decode_attention: valid must be bool [{length}], got {valid.dtype} {tuple(valid.shape)}")


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None, scale: float,
            rope: tuple[torch.Tensor, ...] | None,
            finish: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None] | None = None) -> torch.Tensor:
    """The two kernels: query [H, D], key/value [Hkv, L, D] -> [H, D] (query's dtype; key's with finish).
    rope: (new key [Hkv, D], new value [Hkv, D], cos [D], sin [D], position (one int64)) or None. finish
    (with rope): query, new key and new value are open sums (fp32), finished with ((q, k, v scales),
    (q, k, v biases) or None), each shaped as what it finishes."""
    heads, dim = query.shape
    kv_heads, length, _ = key.shape
    group = heads // kv_heads
    splits = triton.cdiv(length, BLOCK_L)
    stats = torch.empty(2, heads * splits, dtype=torch.float32, device=query.device)
    parts = torch.empty(heads * splits, dim, dtype=torch.float32, device=query.device)
    out = torch.empty(heads, dim, dtype=key.dtype if finish is not None else query.dtype, device=query.device)
    query = query if query.stride(1) == 1 else query.contiguous()
    pdl = dependent_launch.active() and query.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
    launch = {"launch_pdl": True} if pdl else {}  # Triton's interpreter takes no such option
    new_key, new_value, cos, sin, position = rope if rope is not None else (stats,) * 5
    scales, biases = finish if finish is not None else ((stats,) * 3, None)
    _attention_split_kernel[(kv_heads, splits)](
        query, key, value, valid if valid is not None else stats, stats[0], stats[1], parts,
        length, splits, scale, query.stride(0), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        new_key, new_value, cos, sin, position, *scales, *(biases if biases is not None else scales),
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), D=dim, BLOCK=BLOCK_L,
        HAS_VALID=valid is not None, ROPE=rope is not None, FINISH=finish is not None, HAS_BIAS=biases is not None,
        PDL=pdl, num_warps=4, **launch)
    _attention_combine_kernel[(heads,)](stats[0], stats[1], parts, out, splits, position, D=dim,
                                        BLOCK_S=max(2, triton.next_power_of_2(splits)), ADVANCE=rope is not None,
                                        PDL=pdl, num_warps=4, **launch)
    return out


@torch.library.custom_op("aqflow::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """query [H, D] (one token), key/value [Hkv, L, D] (unit stride along D), valid [L] bool or None
    (every position) -> [H, D] in query's dtype: softmax(scale q k^T over valid positions) v per head,
    query head h reading key/value head h // (H / Hkv)."""
    _check(query, key, value, valid)
    return _attend(query, key, value, valid, scale, None)


@decode_attention.register_fake
def _(query, key, value, valid, scale):
    return torch.empty_like(query)


@torch.library.custom_op("aqflow::rope_cache_attention", mutates_args=("key_cache", "value_cache", "position"))
def rope_cache_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, position: torch.Tensor, valid: torch.Tensor | None,
                         scale: float, qkv_scales: torch.Tensor | None = None,
                         qkv_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token's attention with its rotary embedding and cache write in the same two kernels: qkv
    [H * D + 2 * Hkv * D] the query, key and value as projected (one after another), cos/sin [D] (the
    token's), key_cache/value_cache [1, Hkv, L, D] (a static cache layer), position (0-d int64: the token's
    place in the cache, its length so far) -> [H, D] = decode_attention(rope(query), cache with rope(key)
    and value written at position, valid, scale); position + 1 after. valid [L] bool, or None: the
    positions up to `position`. qkv_scales (and qkv_bias, or None), shaped as qkv: qkv holds the open sums
    (fp32) of a fused 2-bit q/k/v GEMV, and the kernel finishes them as open_packed_matmul would,
    (qkv * qkv_scales + qkv_bias) rounded to the cache's dtype (`open_sums`: no kernel of its own)."""
    _, kv_heads, _, dim = key_cache.shape
    query_size = qkv.numel() - 2 * kv_heads * dim
    finishing = [t for t in (qkv_scales, qkv_bias) if t is not None]
    if qkv.dim() != 1 or query_size <= 0 or query_size % dim or cos.shape != (dim,) or sin.shape != (dim,) \
            or position.numel() != 1 or position.dtype != torch.int64 or value_cache.shape != key_cache.shape \
            or any(t.shape != qkv.shape for t in finishing) or (qkv_bias is not None and qkv_scales is None) \
            or (qkv_scales is not None and qkv.dtype != torch.float32):
        raise ValueError(f"rope_cache_attention: qkv {qkv.dtype} {tuple(qkv.shape)}, cos/sin {tuple(cos.shape)}/"
                         f"{tuple(sin.shape)}, position {position.dtype} {tuple(position.shape)}, caches "
                         f"{tuple(key_cache.shape)}/{tuple(value_cache.shape)}, scales/bias "
                         f"{[tuple(t.shape) for t in finishing]}: expected [H * D + 2 * Hkv * D], [D] twice, one "
                         f"int64, [1, Hkv, L, D] twice, and scales (then fp32 sums in qkv) and bias shaped as qkv")
    keys, values = key_cache[0], value_cache[0]
    query, key, value = _split_heads(qkv.contiguous(), query_size, kv_heads, dim)
    _check(query, keys, values, valid)
    finish = None
    if qkv_scales is not None:
        scales = _split_heads(qkv_scales.contiguous(), query_size, kv_heads, dim)
        biases = _split_heads(qkv_bias.contiguous(), query_size, kv_heads, dim) if qkv_bias is not None else None
        finish = (scales, biases)
    return _attend(query, keys, values, valid, scale, (key, value, cos.contiguous(), sin.contiguous(), position),
                   finish)


def _split_heads(qkv: torch.Tensor, query_size: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """qkv [H * D + 2 * Hkv * D] contiguous -> views query [H, D], key [Hkv, D], value [Hkv, D] (no copy)."""
    key, value = qkv[query_size:].view(2, kv_heads, dim)
    return qkv[:query_size].view(-1, dim), key, value


@rope_cache_attention.register_fake
def _(qkv, cos, sin, key_cache, value_cache, position, valid, scale, qkv_scales=None, qkv_bias=None):
    dim = key_cache.shape[-1]
    dtype = key_cache.dtype if qkv_scales is not None else qkv.dtype  # as _attend makes it
    return qkv.new_empty(((qkv.numel() - 2 * key_cache.shape[1] * dim) // dim, dim), dtype=dtype)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """decode_attention in float64 torch ops: [H, D]."""
    group = query.shape[0] // key.shape[0]
    k = key.double().repeat_interleave(group, dim=0)  # [H, L, D]
    v = value.double().repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hld->hl", query.double(), k) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid[None, :], float("-inf"))
    return torch.einsum("hl,hld->hd", scores.softmax(dim=-1), v)


def kernels_run_here(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _decodable(query, key, attention_mask, dropout, kwargs) -> bool:
    """One query token, batch 1, where the kernels run, a bool [1, 1, 1, L] mask or none, and nothing the
    kernels do not do (dropout, soft-capping, sliding windows, sinks)."""
    if query.shape[0] != 1 or query.shape[2] != 1 or dropout or not kernels_run_here(query):
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "sliding_window", "s_aux")):
        return False
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape[-1] != key.shape[2]
                                       or attention_mask.numel() != key.shape[2]):
        return False
    head_dim = query.shape[-1]
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and query.shape[1] % key.shape[1] == 0


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, Hkv, L, D] ->
    ([B, q, H, D], None). One token at batch 1 goes through decode_attention, the rest through SDPA."""
    if not _decodable(query, key, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    valid = None if attention_mask is None else attention_mask.reshape(-1)
    out = decode_attention(query[0, :, 0, :], key[0], value[0], valid, float(scale))
    return out.view(1, 1, *out.shape), None


@contextlib.contextmanager
def decode_attention_enabled(model: torch.nn.Module, enabled: bool = True) -> Iterator[str | None]:
    """Within the block the model (and its sub-configs) use IMPLEMENTATION instead of SDPA; yields
    IMPLEMENTATION if it switched, None if not (models on other attention implementations, or not enabled)."""
    if not enabled:
        yield None
        return
    with attention_switched(model, IMPLEMENTATION, attention_forward) as switched:
        yield switched
