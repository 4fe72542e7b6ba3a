"""A synthetic split corpus for the PV-tuning benchmarks: documents of random words, half of them
calibration documents. Imports of aqflow stay inside the function, so the same module serves a
benchmark's "before" and "after" source trees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

WORDS = ("the quick brown fox jumps over lazy dog additive quantization codebook group weight model token "
         "calibration evaluation split document beam search").split()


def synthetic_corpus(path: Path, documents: int, words: int) -> Path:
    """Write `documents` documents of `words` random words each as a split corpus (.parquet)."""
    from aqflow.data.offline_text import split_documents, write_split_corpus

    rng = np.random.default_rng(0)
    docs = pd.DataFrame({"doc_id": [f"doc{i:03d}" for i in range(documents)],
                         "text": [" ".join(rng.choice(WORDS, words)) for _ in range(documents)], "source": "synthetic"})
    write_split_corpus(split_documents(docs, 0.5, 0), path, 0, 0.5)
    return path
