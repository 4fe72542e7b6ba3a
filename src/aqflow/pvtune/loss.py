"""Token-level KL(teacher || student) and next-token NLL, chunked over tokens.

The logits of a window are [T, vocab]: for a 128k vocabulary and T = 4096 that is 2 GiB in
float32 per sequence, per model, plus the same again for log-softmax and its gradient. The
losses here take the final hidden states [N, d] instead and run the output head chunk by chunk;
each chunk's KL is wrapped in activation checkpointing, so at most one chunk of logits exists at
a time in the forward and in the backward pass. For one token with teacher distribution p and
student distribution q over the vocabulary,

    KL(p || q) = sum_v p_v (log p_v - log q_v),

summed over tokens here; the caller divides by the token count of the whole batch, so that
micro-batches and processes add up to the batch mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output head on final hidden states (with its logit soft-capping, if any).

    hidden [N, d] in the head's dtype (or autocast's) -> logits [N, vocab] float32
    """
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def final_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final (normalised) hidden states of a causal LM, before the output head.

    input_ids [B, T] int64 -> hidden [B, T, d] in the model's compute dtype (autocast's, if on)
    """
    return model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state


def _kl_sum(student: nn.Module, teacher: nn.Module, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """sum over the n tokens of KL(teacher || student): student_hidden [n, d], teacher_hidden [n, d] -> scalar float32"""
    log_q = F.log_softmax(output_logits(student, student_hidden), dim=-1)
    with torch.no_grad():
        log_p = F.log_softmax(output_logits(teacher, teacher_hidden), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum")


def chunked_kl_sum(student: nn.Module, teacher: nn.Module, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                   chunk_tokens: int) -> torch.Tensor:
    """Sum over tokens of KL(teacher || student), the heads run `chunk_tokens` tokens at a time.

    student_hidden [N, d] (differentiable), teacher_hidden [N, d], each in its model's compute
    dtype -> scalar float32 (nats; the logits are float32 whatever the hidden states' dtype)
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, student_hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and student_hidden.requires_grad:
            total = total + checkpoint(_kl_sum, student, teacher, student_hidden[part], teacher_hidden[part],
                                       use_reentrant=False)
        else:
            total = total + _kl_sum(student, teacher, student_hidden[part], teacher_hidden[part])
    return total


@torch.no_grad()
def chunked_nll_sum(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Summed next-token negative log-likelihood (nats), the head run `chunk_tokens` at a time.

    hidden [N, d] in the model's compute dtype (positions that predict), targets [N] int64 (the
    tokens they predict) -> scalar float64 on hidden's device
    """
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = output_logits(model, hidden[start:start + chunk_tokens])
        total += F.cross_entropy(logits, targets[start:start + chunk_tokens], reduction="sum").double()
    return total
