"""Token windows: the perplexity protocol and seeded calibration sampling.

Perplexity follows the protocol of GPTQ/AQLM on WikiText-2: the evaluation documents are joined
with "\\n\\n", tokenised once, and cut into consecutive non-overlapping windows of the context
length; the remainder shorter than a window is dropped. Calibration windows are sampled inside
single calibration documents (never across a document boundary), without overlap, with a numpy
generator seeded by the caller, so the same seed gives the same windows on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from .offline_text import CorpusError

PERPLEXITY_JOINER = "\n\n"
TOKENIZE_CHUNK = 1024  # documents tokenised per call when sampling calibration windows


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # verbose=False silences the "longer than the model's maximum length" warning: windows are cut
    # afterwards, the model never sees the whole sequence.
    return tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]


def perplexity_windows(texts: Sequence[str], tokenizer, context_tokens: int,
                       max_windows: int | None = None, add_special_tokens: bool = True) -> torch.Tensor:
    """Cut the joined evaluation text into non-overlapping windows.

    texts: evaluation documents, in a fixed order (e.g. sorted by doc_id).
    Returns input_ids: [num_windows, context_tokens] int64, window w holding tokens
    [w * context_tokens, (w + 1) * context_tokens) of the joined text; the remainder is dropped.
    `max_windows` keeps only the first windows (for quick checks).
    """
    if context_tokens < 2:
        raise CorpusError(f"context_tokens must be >= 2 to predict anything, got {context_tokens}")
    if not texts:
        raise CorpusError("no evaluation texts given")
    ids = torch.tensor(_encode(tokenizer, PERPLEXITY_JOINER.join(texts), add_special_tokens), dtype=torch.long)
    num_windows = ids.numel() // context_tokens
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise CorpusError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {context_tokens}")
    return ids[: num_windows * context_tokens].view(num_windows, context_tokens)


@dataclass(frozen=True)
class CalibrationWindows:
    """Sampled calibration windows and where each came from.

    input_ids: [num_windows, window_tokens] int64
    doc_ids:   [num_windows] document of each window
    starts:    [num_windows] offset of each window's first token inside its document's tokens
    """

    input_ids: torch.Tensor
    doc_ids: tuple[str, ...]
    starts: tuple[int, ...]

    def to_frame(self) -> pd.DataFrame:
        """Provenance table (window, doc_id, start_token, num_tokens), e.g. to record as Parquet."""
        return pd.DataFrame(
            {
                "window": np.arange(len(self.doc_ids)),
                "doc_id": list(self.doc_ids),
                "start_token": list(self.starts),
                "num_tokens": self.input_ids.shape[1],
            }
        )


def sample_calibration_windows(doc_ids: Sequence[str], texts: Sequence[str], tokenizer, num_windows: int,
                               window_tokens: int, seed: int = 0, allow_fewer: bool = False) -> CalibrationWindows:
    """Draw `num_windows` non-overlapping windows of `window_tokens` tokens from calibration documents.

    Each document of T tokens is tiled by floor(T / window_tokens) slots that start at a random
    offset in [0, T mod window_tokens]; `num_windows` slots are then drawn without replacement from
    all documents' slots. Windows therefore never cross a document boundary and never overlap.
    Documents are processed in sorted doc_id order, so the result depends only on the documents,
    the tokenizer and the seed. Tokens are encoded without special tokens: a window starts at an
    arbitrary position in a document, where a BOS token would never occur.

    If the documents hold fewer than `num_windows` slots this raises, unless `allow_fewer`, in
    which case every slot is returned (at least one must exist).
    """
    if len(doc_ids) != len(texts):
        raise CorpusError(f"{len(doc_ids)} doc_ids but {len(texts)} texts")
    if num_windows < 1 or window_tokens < 1:
        raise CorpusError(f"num_windows and window_tokens must be >= 1, got {num_windows}, {window_tokens}")
    rng = np.random.default_rng(seed)
    order = sorted(range(len(doc_ids)), key=lambda i: doc_ids[i])
    # Only documents holding a window are kept, as int32 arrays (not Python int lists): the hub's C4
    # train shard is hundreds of thousands of documents.
    token_arrays: list[np.ndarray] = []
    kept_docs: list[int] = []  # position in `order` of each kept document
    slots: list[tuple[int, int]] = []  # (position in token_arrays, start)
    longest = 0
    for chunk_start in range(0, len(order), TOKENIZE_CHUNK):
        chunk = order[chunk_start:chunk_start + TOKENIZE_CHUNK]
        # one call per chunk: fast tokenizers encode a batch on all cores
        encoded = tokenizer([texts[i] for i in chunk], add_special_tokens=False, verbose=False)["input_ids"]
        for position, ids in enumerate(encoded, chunk_start):
            longest = max(longest, len(ids))
            num_slots = len(ids) // window_tokens
            if num_slots == 0:
                continue
            offset = int(rng.integers(0, len(ids) - num_slots * window_tokens + 1))
            token_arrays.append(np.asarray(ids, dtype=np.int32))
            kept_docs.append(position)
            slots.extend((len(token_arrays) - 1, offset + k * window_tokens) for k in range(num_slots))
    if allow_fewer and 0 < len(slots) < num_windows:
        num_windows = len(slots)
    if len(slots) < num_windows:
        raise CorpusError(
            f"asked for {num_windows} calibration windows of {window_tokens} tokens but the "
            f"{len(doc_ids)} calibration documents hold only {len(slots)} such windows "
            f"(longest document: {longest} tokens); use shorter or fewer windows, or more documents"
        )
    chosen = sorted(rng.choice(len(slots), size=num_windows, replace=False).tolist())
    rows = np.stack([token_arrays[slots[c][0]][slots[c][1]: slots[c][1] + window_tokens] for c in chosen])
    return CalibrationWindows(
        input_ids=torch.from_numpy(rows).long(),
        doc_ids=tuple(doc_ids[order[kept_docs[slots[c][0]]]] for c in chosen),
        starts=tuple(slots[c][1] for c in chosen),
    )
