"""The KL with its head gradient taken in the forward pass (aqflow.pvtune.loss.head_kl_sum)
against autograd through the full logits, with and without soft-capping."""

import pytest
import torch
import torch.nn.functional as F

from aqflow.pvtune.loss import chunk_kl_and_logit_gradient, head_kl_nll_sum, head_kl_sum


@pytest.mark.parametrize("cap,compiled", [(None, False), (3.0, False), (3.0, True)])
def test_head_kl_and_its_gradients_equal_autograd_through_the_full_logits(cap, compiled):
    """compiled: the chunks' elementwise work traced by torch.compile (aot_eager: its graphs
    without inductor's code generation) as the loop's compiled blocks run it."""
    generator = torch.Generator().manual_seed(0)
    tokens, width, vocab = 37, 16, 50
    hidden = torch.randn(tokens, width, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.randn(vocab, width, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    teacher_head = torch.randn(vocab, width, generator=generator, dtype=torch.float64)
    kernel = torch.compile(chunk_kl_and_logit_gradient, backend="aot_eager", dynamic=False) if compiled else None
    fused = head_kl_sum(hidden, head, teacher_hidden, teacher_head, cap, 10, kernel)  # 4 chunks, one short
    (2.5 * fused).backward()
    ours = hidden.grad.clone(), head.grad.clone()
    hidden.grad = head.grad = None

    def capped(logits):
        return cap * torch.tanh(logits / cap) if cap else logits

    full = F.kl_div(F.log_softmax(capped(hidden @ head.T), -1), F.log_softmax(capped(teacher_hidden @ teacher_head.T), -1),
                    log_target=True, reduction="sum")
    (2.5 * full).backward()
    torch.testing.assert_close(fused, full, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours[0], hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1], head.grad, rtol=1e-10, atol=1e-12)
    assert full.item() > 0 and ours[1].abs().sum() > 0


def test_a_head_that_does_not_train_gets_no_gradient_and_the_hidden_states_still_do():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(8, 4, generator=generator, requires_grad=True)
    head = torch.randn(6, 4, generator=generator)  # frozen
    kl = head_kl_sum(hidden, head, torch.randn(8, 4, generator=generator), torch.randn(6, 4, generator=generator), None, 3)
    kl.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0 and head.grad is None


@pytest.mark.parametrize("cap", [None, 3.0])
def test_evaluation_takes_kl_and_next_token_nll_from_one_head_pass(cap):
    generator = torch.Generator().manual_seed(2)
    tokens, width, vocab = 23, 8, 40
    hidden, head = torch.randn(tokens, width, generator=generator, dtype=torch.float64), torch.randn(
        vocab, width, generator=generator, dtype=torch.float64)
    teacher_hidden, teacher_head = torch.randn(tokens, width, generator=generator, dtype=torch.float64), torch.randn(
        vocab, width, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[[6, 22]] = -1  # positions that predict nothing (each window's last)
    kl, nll = head_kl_nll_sum(hidden, head, teacher_hidden, teacher_head, cap, targets, chunk_tokens=5)
    logits = hidden @ head.T
    logits = cap * torch.tanh(logits / cap) if cap else logits
    wanted = targets >= 0
    torch.testing.assert_close(nll, F.cross_entropy(logits[wanted], targets[wanted], reduction="sum"), rtol=1e-12, atol=0)
    torch.testing.assert_close(kl, head_kl_sum(hidden, head, teacher_hidden, teacher_head, cap, 5), rtol=1e-12, atol=0)
