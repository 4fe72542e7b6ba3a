"""How many sequences one forward pass may score: the logits a batch holds are batch x length x
vocabulary, and a large vocabulary makes them the biggest tensor of an evaluation by far (Gemma 3's
262k vocabulary: 2.1 GB of bfloat16 logits per 4096-token window, 69 GB for a batch of 32; SmolLM2's
49k: 13 GB for 32). A batch is cut to what fits the budget, so one setting suits every model; the
metrics do not depend on the batch, since every sequence is scored on its own.
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

import torch
import torch.nn as nn

Scored = TypeVar("Scored")

# 16 GiB keeps SmolLM2's 4096-token batch of 32 (12.9 GB) whole, as the paper grid's earlier cells
# ran, and leaves most of an 80 GB card to the jobs that share it.
DEFAULT_LOGITS_BUDGET_BYTES = 16 * 2**30


def logits_shape_bytes(model: nn.Module) -> tuple[int, int]:
    """(vocabulary size, bytes per logit) of a causal LM's output layer (its lm_head, never quantized)."""
    head = model.get_output_embeddings().weight
    return int(head.shape[0]), head.element_size()


def sequences_within_budget(requested: int, tokens: int, vocab: int, bytes_per_logit: int,
                            logits_budget_bytes: int | None) -> int:
    """The most sequences of `tokens` tokens (at most `requested`, at least 1) whose logits
    [sequences, tokens, vocab] fit `logits_budget_bytes` (None: no budget)."""
    if requested < 1 or tokens < 1:
        raise ValueError(f"requested ({requested}) and tokens ({tokens}) must be >= 1")
    if logits_budget_bytes is None:
        return requested
    return max(1, min(requested, logits_budget_bytes // (tokens * vocab * bytes_per_logit)))


def score_in_pieces(score: Callable[[int, int], list[Scored]], count: int, piece: int,
                    done: Callable[[int], None] | None = None) -> tuple[list[Scored], int]:
    """`score(start, stop)` over items 0..count in consecutive pieces of at most `piece` items,
    concatenated, and the piece size that held to the end.

    The budget assumes the card's memory is there; on a card shared with other jobs (two 3B
    evaluations beside layer jobs on one H100 ran out) it may not be. A piece that runs out of
    memory is scored again in halves, down to one item, and later pieces keep the smaller size: the
    metrics do not depend on the piece, since every item is scored on its own. `done(n)` is told
    of each finished piece's item count (a progress bar).
    """
    if count < 0 or piece < 1:
        raise ValueError(f"count ({count}) must be >= 0 and piece ({piece}) >= 1")
    results: list[Scored] = []
    start = 0
    while start < count:
        stop = min(count, start + piece)
        try:
            scored = score(start, stop)
        except torch.OutOfMemoryError:
            if stop - start == 1:
                raise
            ran_out = stop - start
        else:
            results.extend(scored)
            if done is not None:
                done(stop - start)
            start = stop
            continue
        # out of the except block, so the failed pass's tensors (held by its traceback) are freed
        piece = (ran_out + 1) // 2
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"out of card memory scoring {ran_out} sequences in one pass (another job on the card?): "
              f"going on with {piece}", file=sys.stderr, flush=True)
    return results, piece
