"""PV-tuning text: training and held-out windows, both from calibration-role documents.

The evaluation documents of the corpus are never read. The calibration documents are split
once more, by document, into a training part and a held-out part (a seeded permutation of the
sorted doc ids; at least one document on each side), and windows are sampled inside single
documents of each part with `sample_calibration_windows`. Held-out windows therefore share no
text with the training windows, and neither shares text with WikiText-2 or C4 evaluation text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..data.offline_text import CALIBRATION, CorpusError, load_split_corpus, role_texts
from ..data.windows import CalibrationWindows, sample_calibration_windows


@dataclass(frozen=True)
class PVData:
    train: CalibrationWindows  # input_ids [num_samples, window_tokens] int64 (fewer rows where the text runs out)
    heldout: CalibrationWindows  # input_ids [heldout_samples, window_tokens] int64
    record: dict  # what was used, for the metrics JSON


def split_heldout_documents(doc_ids: Sequence[str], heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Positions of the training and held-out documents among `doc_ids` (by a seeded permutation of
    the sorted ids; round(fraction * n) held out, at least one on each side)."""
    if len(doc_ids) < 2:
        raise CorpusError(f"a held-out split needs at least 2 calibration documents, got {len(doc_ids)}")
    if not 0.0 < heldout_fraction < 1.0:
        raise CorpusError(f"heldout_fraction must lie strictly between 0 and 1, got {heldout_fraction}")
    order = sorted(range(len(doc_ids)), key=lambda i: doc_ids[i])
    permuted = [order[i] for i in np.random.default_rng(seed).permutation(len(order))]
    num_heldout = min(max(int(round(heldout_fraction * len(doc_ids))), 1), len(doc_ids) - 1)
    return sorted(permuted[num_heldout:]), sorted(permuted[:num_heldout])


def pv_windows(corpus: str | os.PathLike, tokenizer, num_samples: int, heldout_samples: int, window_tokens: int,
               heldout_fraction: float, seed: int) -> PVData:
    """Training and held-out windows from the calibration documents of a split corpus (.parquet):
    train.input_ids [<= num_samples, window_tokens] int64, heldout.input_ids [<= heldout_samples,
    window_tokens] int64.

    Where the documents hold fewer windows than asked, all of them are used and the record says
    so (the offline stand-ins are far smaller than the paper's 10K x 4096 tokens of C4).
    """
    doc_ids, texts = role_texts(load_split_corpus(corpus), CALIBRATION)
    train_docs, heldout_docs = split_heldout_documents(doc_ids, heldout_fraction, seed)
    parts = {}
    for name, positions, count in (("train", train_docs, num_samples), ("heldout", heldout_docs, heldout_samples)):
        try:
            parts[name] = sample_calibration_windows([doc_ids[i] for i in positions], [texts[i] for i in positions],
                                                     tokenizer, count, window_tokens, seed=seed, allow_fewer=True)
        except ValueError as error:
            raise CorpusError(f"{corpus}: {name} windows: {error}") from None
    record = {
        "corpus": str(corpus), "role": CALIBRATION, "window_tokens": window_tokens, "seed": seed,
        "heldout_fraction": heldout_fraction,
        "requested_samples": num_samples, "samples": int(parts["train"].input_ids.shape[0]),
        "requested_heldout_samples": heldout_samples, "heldout_samples": int(parts["heldout"].input_ids.shape[0]),
        "train_documents": len(train_docs), "heldout_documents": len(heldout_docs),
        "heldout_doc_ids": sorted(doc_ids[i] for i in heldout_docs),
    }
    return PVData(train=parts["train"], heldout=parts["heldout"], record=record)
