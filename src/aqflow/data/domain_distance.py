"""How far an evaluation text is from the calibration text: Jensen-Shannon divergence of token unigrams.

The paper's last claim is that OA-EM's advantage over greedy initialisation grows with the distance
of the evaluation text from the calibration text. To test it on measured rather than hand-ranked
distances, each evaluation domain gets one number:

    JS(P, Q) = 1/2 KL(P || M) + 1/2 KL(Q || M),   M = (P + Q) / 2          (nats)

where P is the unigram distribution of the calibration text's tokens and Q that of the domain's
evaluation text, both under the model's own tokenizer (the units its XᵀX and its perplexity are
counted in). Why this measure:

* It is defined for any two distributions: M covers the support of both, so no smoothing constant
  has to be chosen (KL(Q || P) is infinite as soon as one evaluation token never occurs in the
  calibration text, and a smoothed KL depends on the pseudo-count).
* It is symmetric, 0 exactly for equal distributions and bounded by ln 2 (disjoint supports), so
  distances of different domains share one scale.
* Unigrams are what the quantized model's inputs see most directly: which embedding rows, and so
  which directions of XᵀX, the text exercises. Longer n-grams would need far more text than the
  smallest domains hold (a Brown genre is about 10k tokens).

The plug-in estimate from counts is biased upwards, the more the fewer tokens it sees (unseen
words make two samples of one distribution look different). So that domains of different sizes are
comparable, every domain's evaluation tokens are subsampled without replacement to the same
number of tokens (by default the smallest domain's), several times with a seeded generator, and the
divergence is averaged over these draws; their sd says how much of a difference between two
domains is subsampling noise (not how much another choice of the domain's documents would move it:
the texts are taken as given). The calibration side keeps all its (capped) tokens: it is the same for
every domain, so its share of the bias is too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

TOKENIZE_CHUNK = 64  # documents per tokenizer call


def token_counts(sequences: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in `sequences` (lists of token ids).

    Returns counts: [vocab_size] int64. An id outside [0, vocab_size) is a ValueError naming it.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in sequences:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0]
            raise ValueError(f"token id {int(bad)} outside the vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def jensen_shannon(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """Jensen-Shannon divergence (nats, in [0, ln 2]) between the distributions of two count vectors.

    p_counts, q_counts: [vocab] non-negative counts (or weights) over the same vocabulary; each is
    normalised to sum 1. 0 log 0 is taken as 0.
    """
    p, q = (np.asarray(counts, dtype=np.float64) for counts in (p_counts, q_counts))
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"need two count vectors of one vocabulary, got shapes {p.shape} and {q.shape}")
    if (p < 0).any() or (q < 0).any() or p.sum() <= 0 or q.sum() <= 0:
        raise ValueError("counts must be non-negative with a positive total")
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl_to_m(x: np.ndarray) -> float:
        seen = x > 0  # m > 0 wherever x > 0
        return float(np.sum(x[seen] * np.log(x[seen] / m[seen])))

    # rounding can leave a hair below 0 or above ln 2
    return min(max(0.5 * kl_to_m(p) + 0.5 * kl_to_m(q), 0.0), math.log(2))


def subsample_counts(counts: np.ndarray, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """The counts of `num_tokens` tokens drawn without replacement from the tokens that `counts`
    counts (a multivariate hypergeometric draw). counts: [vocab] int64 -> [vocab] int64."""
    total = int(counts.sum())
    if not 0 < num_tokens <= total:
        raise ValueError(f"cannot draw {num_tokens} tokens from a text of {total}")
    if num_tokens == total:
        return counts.copy()
    seen = np.flatnonzero(counts)  # the draw's cost grows with the colours: only the tokens that occur
    drawn = np.zeros_like(counts)
    drawn[seen] = rng.multivariate_hypergeometric(counts[seen], num_tokens)
    return drawn


@dataclass(frozen=True)
class Distance:
    """A domain's divergence from the calibration text: mean and sd over the subsampling draws."""

    mean: float
    sd: float
    draws: int
    sample_tokens: int


def sampled_distance(calibration: np.ndarray, evaluation: np.ndarray, sample_tokens: int, draws: int,
                     seed: int) -> Distance:
    """JS divergence of the calibration counts from `draws` subsamples of `sample_tokens` tokens of
    the evaluation counts (both [vocab] int64); mean and sample sd over the draws. Seeded: the
    same inputs give the same result on every machine."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    rng = np.random.default_rng(seed)
    values = [jensen_shannon(calibration, subsample_counts(evaluation, sample_tokens, rng)) for _ in range(draws)]
    sd = float(np.std(values, ddof=1)) if draws > 1 else 0.0
    return Distance(float(np.mean(values)), sd, draws, sample_tokens)


def text_token_counts(texts: Sequence[str], encode: Callable[[list[str]], list[list[int]]], vocab_size: int,
                      max_tokens: int | None, seed: int, progress: Callable | None = None) -> tuple[np.ndarray, int, int]:
    """Unigram counts of a text's documents, read in a seeded random order until `max_tokens`.

    texts: the documents; encode: documents -> their token ids (no special tokens); max_tokens:
    stop once this many are counted (the last document cut), None for all. A large corpus (the
    hub C4 training shard) is so read from a random sample of its documents, not its first files.
    Returns (counts [vocab_size] int64, tokens counted, documents read).
    """
    order = np.random.default_rng(seed).permutation(len(texts))
    counts = np.zeros(vocab_size, dtype=np.int64)
    total = documents = 0
    for start in range(0, len(order), TOKENIZE_CHUNK):
        chunk = [texts[i] for i in order[start:start + TOKENIZE_CHUNK]]
        for ids in encode(chunk):
            if max_tokens is not None:
                ids = ids[: max_tokens - total]
            counts += token_counts([ids], vocab_size)
            total += len(ids)
            documents += 1
            if max_tokens is not None and total >= max_tokens:
                return counts, total, documents
        if progress is not None:
            progress(len(chunk))
    return counts, total, documents


def near_to_far(distances: dict[str, Distance]) -> list[str]:
    """Domain names ordered by mean distance, nearest first (ties by name, so the order is stable)."""
    return sorted(distances, key=lambda name: (distances[name].mean, name))
