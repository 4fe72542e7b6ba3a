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

`head_kl_sum` is the training path: the heads' logits of a chunk exist once, in the forward pass,
which also takes the KL's gradient with respect to the student's hidden states and head weight
(for z the student's logits of a token, dKL/dz = q - p); the backward pass only scales what the
forward kept. `chunked_kl_sum` recomputes both heads in the backward pass instead (two of six
head matmuls more) and serves heads that are not one bias-free linear.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output head on final hidden states (with its logit soft-capping, if any).

    hidden [N, d] in the head's dtype (or autocast's) -> logits [N, vocab] float32
    """
    logits = model.get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def final_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final (normalised) hidden states of a causal LM, before the output head.

    input_ids [B, T] int64 -> hidden [B, T, d] in the model's compute dtype (autocast's, if on)
    """
    return model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state


def softcap(model: nn.Module) -> float | None:
    """The model's final logit soft-capping (Gemma 2's), or None."""
    return getattr(model.config, "final_logit_softcapping", None) or None


def fusable_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head where `head_kl_sum` can take it (one linear without bias), else None."""
    head = model.get_output_embeddings()
    return head if isinstance(head, nn.Linear) and head.bias is None else None


_ADDMM_INTO_FLOAT32 = True  # until this torch build's CUDA addmm refuses a float32 output of bf16 operands


def add_matmul_float32(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """accumulator [a, c] float32 += left [a, b] @ right [b, c], the product summed in float32
    (bf16/fp16 operands give a float32 result straight from the matmul where the backend can)."""
    global _ADDMM_INTO_FLOAT32
    if left.dtype == accumulator.dtype:
        accumulator.addmm_(left, right)
        return
    if accumulator.is_cuda and _ADDMM_INTO_FLOAT32:
        try:  # one pass: the GEMM adds into the accumulator (beta = 1) instead of a product then an add
            torch.addmm(accumulator, left, right, out_dtype=accumulator.dtype, out=accumulator)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_INTO_FLOAT32 = False
    try:
        accumulator.add_(torch.mm(left, right, out_dtype=accumulator.dtype))
    except (RuntimeError, TypeError, NotImplementedError):
        accumulator.add_(torch.mm(left, right).to(accumulator.dtype))


def compute_dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """What a matmul on `tensor` computes in: autocast's dtype where it is on, else the tensor's."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def _capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return cap * torch.tanh(logits / cap) if cap else logits


def _log_softmaxes(student_logits: torch.Tensor, teacher_logits: torch.Tensor, cap: float | None,
                   exact: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of both heads' logits [c, vocab] as their matmuls gave them -> (the student's
    soft-capped logits, its log-softmax, the teacher's log-softmax), each [c, vocab] `exact`."""
    capped = _capped(student_logits.to(exact), cap)
    return capped, F.log_softmax(capped, dim=-1), F.log_softmax(_capped(teacher_logits.to(exact), cap), dim=-1)


def chunk_kl_and_logit_gradient(student_logits: torch.Tensor, teacher_logits: torch.Tensor, cap: float | None,
                                exact: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's KL and its gradient: student_logits, teacher_logits [c, vocab] as the heads'
    matmuls gave them -> (sum over the chunk of KL(p || q) [] `exact`, dKL/dlogits [c, vocab]
    in the logits' dtype: q - p, through the soft-capping). Elementwise passes and two row
    reductions only, which `compiled` fuses into a few kernels on a GPU."""
    capped, log_q, log_p = _log_softmaxes(student_logits, teacher_logits, cap, exact)
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum()
    grad_logits = log_q.exp_().sub_(p)  # dKL/dz, in log_q's storage
    if cap:  # through z = cap tanh(u / cap): dz/du = 1 - (z / cap)^2
        grad_logits.mul_(1 - (capped / cap).square())
    return kl, grad_logits.to(student_logits.dtype)


class _HeadKL(torch.autograd.Function):
    """sum over tokens of KL(teacher || student) from both heads, its gradients taken in the forward
    pass chunk by chunk (see `head_kl_sum`)."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, cap, chunk_tokens, chunk_kernel):
        dtype = compute_dtype_of(student_hidden)
        exact = torch.promote_types(student_weight.dtype, torch.float32)  # logits, softmaxes and sums
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        kernel = chunk_kernel or chunk_kl_and_logit_gradient
        with torch.autocast(student_hidden.device.type, enabled=False):
            hidden = student_hidden.detach().to(dtype)
            weight = student_weight.detach().to(dtype)
            teacher = teacher_hidden.detach().to(dtype)
            teacher_head = teacher_weight.detach().to(dtype)
            grad_hidden = torch.empty_like(student_hidden) if want_hidden else None
            grad_weight = torch.zeros(student_weight.shape, dtype=exact, device=student_weight.device) \
                if want_weight else None
            total = torch.zeros((), dtype=exact, device=student_hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                part = slice(start, start + chunk_tokens)
                kl, grad_logits = kernel(hidden[part] @ weight.T, teacher[part] @ teacher_head.T, cap, exact)
                total += kl
                if want_hidden:
                    grad_hidden[part] = (grad_logits @ weight).to(grad_hidden.dtype)
                if want_weight:
                    add_matmul_float32(grad_weight, grad_logits.T, hidden[part])
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = student_weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden = None if grad_hidden is None else grad_hidden * grad_total.to(grad_hidden.dtype)
        weight = None if grad_weight is None else (grad_weight * grad_total).to(ctx.weight_dtype)
        return hidden, weight, None, None, None, None, None


def head_kl_sum(student_hidden: torch.Tensor, student_head: torch.Tensor, teacher_hidden: torch.Tensor,
                teacher_head: torch.Tensor, cap: float | None, chunk_tokens: int,
                chunk_kernel: Callable | None = None) -> torch.Tensor:
    """Sum over tokens of KL(teacher || student), both heads bias-free linears run `chunk_tokens`
    tokens at a time, with the gradient taken in the forward pass.

    student_hidden [N, d] (differentiable), student_head [vocab, d] (differentiable where it
    trains), teacher_hidden [N, d], teacher_head [vocab, d]; cap: the logits' soft-capping or None
    -> scalar float32 (nats). The matmuls run in autocast's dtype where it is on (else the hidden
    states'), logits and softmaxes in float32, the head's gradient summed in float32 (float64
    for a float64 head). Holds at most
    one chunk of logits per model, and dKL/dhidden [N, d] and dKL/dhead [vocab, d] float32 until
    the backward pass. chunk_kernel: `chunk_kl_and_logit_gradient` or a compiled copy of it.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _HeadKL.apply(student_hidden, student_head, teacher_hidden, teacher_head, cap, chunk_tokens, chunk_kernel)


@torch.no_grad()
def head_kl_nll_sum(student_hidden: torch.Tensor, student_head: torch.Tensor, teacher_hidden: torch.Tensor,
                    teacher_head: torch.Tensor, cap: float | None, targets: torch.Tensor,
                    chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out evaluation's `head_kl_sum` with the next-token NLL from the same student logits
    (one head pass instead of two): targets [N] int64, the token each position predicts, -1 where
    it predicts none (a window's last) -> (KL sum float32, NLL sum float64 over targets >= 0)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    dtype = compute_dtype_of(student_hidden)
    exact = torch.promote_types(student_head.dtype, torch.float32)
    kl = torch.zeros((), dtype=exact, device=student_hidden.device)
    nll = torch.zeros((), dtype=torch.float64, device=student_hidden.device)
    with torch.autocast(student_hidden.device.type, enabled=False):
        hidden, weight = student_hidden.to(dtype), student_head.to(dtype)
        teacher, teacher_weight = teacher_hidden.to(dtype), teacher_head.to(dtype)
        for start in range(0, hidden.shape[0], chunk_tokens):
            part = slice(start, start + chunk_tokens)
            _, log_q, log_p = _log_softmaxes(hidden[part] @ weight.T, teacher[part] @ teacher_weight.T, cap, exact)
            kl += (log_p.exp() * (log_p - log_q)).sum()
            wanted = targets[part] >= 0
            picked = log_q.gather(1, targets[part].clamp(min=0)[:, None])[:, 0]
            nll -= picked[wanted].double().sum()
    return kl, nll


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
