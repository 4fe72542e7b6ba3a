"""Perplexity of a causal LM on fixed token windows (the GPTQ/AQLM WikiText-2 protocol).

Each window is scored independently (no state carried between windows): token t is predicted
from tokens < t of its own window, so a window of T tokens contributes T - 1 predictions. The
perplexity is exp of the mean negative log-likelihood over all predictions; with equal-length
windows this equals the protocol's exp(mean over windows of the window's mean NLL).
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from aqflow.evaluation.logits_budget import (DEFAULT_LOGITS_BUDGET_BYTES, logits_shape_bytes, score_in_pieces,
                                             sequences_within_budget)


@torch.no_grad()
def window_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token negative log-likelihood (nats) of each window.

    model: a causal LM whose output `.logits` is [batch, T, vocab] in its compute dtype.
    input_ids: [batch, T] int64 on the model's device.
    Returns nll_nats: [batch] float64 on the model's device, each the sum over the T - 1 predicted tokens.
    """
    logits = model(input_ids=input_ids).logits  # [batch, T, vocab]
    nll = []
    # One window at a time in float32: the float32 log-probabilities of a whole batch of long
    # windows (T x vocab x 4 bytes each, ~0.8 GB at 4096 x 49k) would dwarf the model's own memory.
    for window_logits, window_ids in zip(logits, input_ids):
        log_probs = torch.log_softmax(window_logits[:-1].float(), dim=-1)  # fp16 log-softmax loses digits
        nll.append(-log_probs.gather(-1, window_ids[1:].unsqueeze(-1)).double().sum())
    return torch.stack(nll)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 1, progress: bool = True,
               logits_budget_bytes: int | None = DEFAULT_LOGITS_BUDGET_BYTES) -> float:
    """exp(mean next-token NLL) of `model` over `windows` [num_windows, T] int64 (any device;
    moved to the model's `batch_size` windows at a time, fewer where their logits would exceed
    `logits_budget_bytes`), as a Python float."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [num_windows, T >= 2], got shape {tuple(windows.shape)}")
    device = next(model.parameters()).device
    batch_size = sequences_within_budget(batch_size, windows.shape[1], *logits_shape_bytes(model), logits_budget_bytes)

    def score(start: int, stop: int) -> list[torch.Tensor]:
        return list(window_nll(model, windows[start:stop].to(device)).cpu())

    with tqdm(total=windows.shape[0], desc="perplexity", unit="window", disable=not progress) as bar:
        nll, _ = score_in_pieces(score, windows.shape[0], batch_size, bar.update)
    total_nats = float(torch.stack(nll).sum())
    num_predictions = windows.shape[0] * (windows.shape[1] - 1)
    return math.exp(total_nats / num_predictions)
