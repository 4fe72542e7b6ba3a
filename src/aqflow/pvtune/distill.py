"""The teacher and the student as the modules PV-tuning runs: each a root whose forward is all a
step asks of that model, so that FSDP2 (several processes, `aqflow.pvtune.distributed`) gathers a
model's embeddings, final norm and head around it like any unit's parameters.

`TeacherHidden(input_ids)` is the teacher's final hidden states; `StudentKL(input_ids,
teacher_hidden, teacher)` the student's summed token KL to them, the heads run chunk by chunk
(`loss.head_kl_sum` where both heads are one bias-free linear, `loss.chunked_kl_sum` otherwise),
and with `with_nll` also the summed next-token NLL (held-out evaluation; from the KL's own student
logits where the heads are fused, `loss.head_kl_nll_sum`).
"""

from __future__ import annotations

import torch
from torch import nn

from .loss import (chunked_kl_sum, chunked_nll_sum, final_hidden, fusable_head, head_kl_nll_sum, head_kl_sum,
                   softcap)


class TeacherHidden(nn.Module):
    """The teacher's final hidden states: input_ids [B, T] int64 -> [B, T, d] in its compute dtype."""

    def __init__(self, teacher: nn.Module):
        super().__init__()
        self.model = teacher

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return final_hidden(self.model, input_ids)


class StudentKL(nn.Module):
    """The student's summed token KL(teacher || student) on input_ids [B, T] int64, given the
    teacher's final hidden states [B, T, d] and the teacher model (its head, whole by then): a
    scalar float32 (nats), and with `with_nll` also the summed next-token NLL (float64, nats)."""

    def __init__(self, student: nn.Module):
        super().__init__()
        self.model = student
        self.chunk_kernel = None  # the KL's per-chunk elementwise work compiled (`compiled`), or None: eager

    def forward(self, input_ids: torch.Tensor, teacher_hidden: torch.Tensor, teacher: nn.Module, chunk_tokens: int,
                with_nll: bool = False):
        hidden = final_hidden(self.model, input_ids)
        width = hidden.shape[-1]
        flat, flat_teacher = hidden.reshape(-1, width), teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
        student_head, teacher_head = fusable_head(self.model), fusable_head(teacher)
        fused = student_head is not None and teacher_head is not None and softcap(self.model) == softcap(teacher)
        if with_nll and fused and not torch.is_grad_enabled():  # evaluation: KL and NLL from one head pass
            targets = torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), -1)], 1).reshape(-1)
            return head_kl_nll_sum(flat, student_head.weight, flat_teacher, teacher_head.weight, softcap(self.model),
                                   targets, chunk_tokens)
        if fused:
            kl = head_kl_sum(flat, student_head.weight, flat_teacher, teacher_head.weight, softcap(self.model),
                             chunk_tokens, self.chunk_kernel)
        else:
            kl = chunked_kl_sum(self.model, teacher, flat, flat_teacher, chunk_tokens)
        if not with_nll:
            return kl
        nll = chunked_nll_sum(self.model, hidden[:, :-1].reshape(-1, width), input_ids[:, 1:].reshape(-1), chunk_tokens)
        return kl, nll
