"""The perplexity protocol of GPTQ/AQLM: which token windows WikiText-2 and C4 perplexity use.

WikiText-2: all evaluation text joined with "\\n\\n" (on the hub: the rows of wikitext-2-raw-v1
test, as AQLM joins them), tokenised once, cut into consecutive non-overlapping windows of
`context_tokens`; the remainder is dropped (`aqflow.data.windows.perplexity_windows`).

C4: a fixed set of `num_windows` (256) windows drawn exactly as AQLM's `get_c4(eval_mode=True)`
draws them from the `en/c4-validation.00000-of-00008` shard, with Python's `random` seeded by
`seed` (0): for each window, draw documents uniformly (with replacement) until one has at least
`context_tokens` tokens (tokenised alone, with the tokenizer's special tokens), then take the
window starting at a uniform offset in [0, T - context_tokens - 1] (offset 0 when T equals the
context). Windows may therefore repeat a document or, rarely, overlap. The same code runs on the
hub shard and on the evaluation-role documents of the offline C4 stand-in, so the stand-in
follows the same protocol; each window's document id and start token are recorded.

Both read the evaluation-role documents of a corpus written by `fetch-data` (the hub files are
read through the Hugging Face cache there, `aqflow.data.hub_text`), sorted by document id; the hub
corpora's ids keep file order, so the windows are those of AQLM's loaders.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ..data.windows import perplexity_windows

DEFAULT_C4_WINDOWS = 256
DEFAULT_C4_SEED = 0


@dataclass(frozen=True)
class SampledWindows:
    """Windows drawn from documents, with where each came from.

    input_ids: [num_windows, context_tokens] int64
    doc_ids:   [num_windows] document of each window
    starts:    [num_windows] offset of each window's first token in its document's tokens
    eligible_documents: how many documents had at least context_tokens tokens
    """

    input_ids: torch.Tensor
    doc_ids: tuple[str, ...]
    starts: tuple[int, ...]
    eligible_documents: int

    def sources(self) -> list[list]:
        """[[doc_id, start_token], ...] per window, for a JSON record."""
        return [[doc_id, start] for doc_id, start in zip(self.doc_ids, self.starts)]


def wikitext2_windows(texts: Sequence[str], tokenizer, context_tokens: int,
                      max_windows: int | None = None) -> torch.Tensor:
    """WikiText-2 protocol: [num_windows, context_tokens] int64, consecutive, remainder dropped.

    texts: the evaluation documents (or hub test rows) in their fixed order; `max_windows` keeps
    only the first windows (quick runs).
    """
    return perplexity_windows(texts, tokenizer, context_tokens, max_windows=max_windows)


def c4_windows(doc_ids: Sequence[str], texts: Sequence[str], tokenizer, context_tokens: int,
               num_windows: int = DEFAULT_C4_WINDOWS, seed: int = DEFAULT_C4_SEED) -> SampledWindows:
    """C4 protocol (AQLM's): `num_windows` seeded windows of `context_tokens` from single documents:
    input_ids [num_windows, context_tokens] int64 (CPU), with each window's document and start.

    Documents are used in the given order (the hub shard's, or sorted doc ids for the stand-in),
    which together with the tokenizer and seed fixes the result. Raises ValueError if no document
    is long enough (AQLM would loop forever).
    """
    if len(doc_ids) != len(texts):
        raise ValueError(f"{len(doc_ids)} doc_ids but {len(texts)} texts")
    if context_tokens < 2 or num_windows < 1:
        raise ValueError(f"need context_tokens >= 2 and num_windows >= 1, got {context_tokens}, {num_windows}")
    token_lists = tokenizer(list(texts), verbose=False)["input_ids"] if texts else []  # batched: fast tokenizers run it in parallel
    eligible = sum(len(ids) >= context_tokens for ids in token_lists)
    if eligible == 0:
        longest = max((len(ids) for ids in token_lists), default=0)
        raise ValueError(f"no C4 evaluation document has {context_tokens} tokens (the longest of {len(texts)} has "
                         f"{longest}); use a shorter context or longer documents")
    rng = random.Random(seed)
    rows, chosen_docs, starts = [], [], []
    for _ in range(num_windows):
        # Rejection sampling, call for call as AQLM, so hub windows match its published numbers.
        while True:
            index = rng.randint(0, len(texts) - 1)
            if len(token_lists[index]) >= context_tokens:
                break
        num_tokens = len(token_lists[index])
        start = 0 if num_tokens == context_tokens else rng.randint(0, num_tokens - context_tokens - 1)
        rows.append(token_lists[index][start:start + context_tokens])
        chosen_docs.append(doc_ids[index])
        starts.append(start)
    return SampledWindows(torch.tensor(rows, dtype=torch.long), tuple(chosen_docs), tuple(starts), eligible)


def windows_sha256(windows: torch.Tensor) -> str:
    """sha256 of the windows' token ids [num_windows, T] (any integer dtype, on the CPU), as int64
    row-major: names exactly the tokens evaluated."""
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def texts_sha256(texts: Sequence[str]) -> str:
    """sha256 of the texts, each UTF-8 encoded and terminated by a NUL byte."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    return digest.hexdigest()

