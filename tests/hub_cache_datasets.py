"""Write a Hugging Face hub cache holding tiny WikiText-2 and C4 files under their real repo ids
and file names, so that `hf_hub_download(repo_id, filename, repo_type="dataset")` resolves them
with HF_HUB_OFFLINE=1 and no network.

Layout (huggingface_hub's cache, under `<HF_HOME>/hub`):

    datasets--Salesforce--wikitext/
        refs/main                                   the snapshot's commit hash (no newline)
        blobs/<sha256 of the file>                  the bytes
        snapshots/<commit>/wikitext-2-raw-v1/test-00000-of-00001.parquet -> ../../../blobs/<sha256>
    datasets--allenai--c4/ ... en/c4-train.00000-of-01024.json.gz, en/c4-validation.00000-of-00008.json.gz

The files have the real formats: WikiText-2 a Parquet file with one `text` column, one row per
line of the original (headings " = Title = ", blank rows, paragraphs ending in " \\n"); C4 gzipped
JSON lines with `text`, `timestamp` and `url`. Train and validation documents use disjoint words
(`TRAIN_WORD`, `VALIDATION_WORD` in every document) so a test can tell which file a window is from.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
from pathlib import Path

import pandas as pd

WIKITEXT_REPO, WIKITEXT_FILE = "Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet"
C4_REPO = "allenai/c4"
C4_TRAIN_FILE, C4_VALIDATION_FILE = "en/c4-train.00000-of-01024.json.gz", "en/c4-validation.00000-of-00008.json.gz"
WIKITEXT_REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"  # any 40-hex commit: the fixture's own
C4_REVISION = "1588ec454efa1a09f29cd18ddd04fe05fc8653a2"
TRAIN_WORD, VALIDATION_WORD = "trainonly", "validonly"

_WORDS = ("river stone bright window quietly across winter garden number seven music paper city light "
          "north table green open early morning voice").split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def wikitext_rows(num_articles: int = 6, seed: int = 0) -> list[str]:
    """Rows shaped like wikitext-2-raw-v1 test: blank rows, " = Title = " headings, paragraphs."""
    rng = random.Random(seed)
    rows = [""]
    for article in range(num_articles):
        rows += [f" = Article {article} = \n", ""]
        for _ in range(3):
            rows += [" " + " ".join(_sentence(rng, 12) for _ in range(4)) + " \n", ""]
    return rows


def c4_documents(num_documents: int, marker: str, seed: int) -> list[dict]:
    """C4-shaped JSON objects; every third document is long (many sentences), the rest short."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_documents):
        sentences = 40 if i % 3 == 0 else 3
        text = "\n".join(f"{marker} {_sentence(rng, 10)}" for _ in range(sentences))
        docs.append({"text": text, "timestamp": f"2019-04-{1 + i % 28:02d}T12:00:00Z",
                     "url": f"https://example.org/{marker}/{i}"})
    return docs


def _parquet_bytes(rows: list[str]) -> bytes:
    buffer = io.BytesIO()
    pd.DataFrame({"text": rows}).to_parquet(buffer, index=False)
    return buffer.getvalue()


def _jsonl_gz_bytes(docs: list[dict]) -> bytes:
    return gzip.compress("".join(json.dumps(doc) + "\n" for doc in docs).encode("utf-8"), mtime=0)


def write_cached_file(hub_dir: Path, repo_type: str, repo_id: str, revision: str, filename: str, data: bytes) -> Path:
    """Store `data` as `filename` of `repo_id` at `revision` in the cache at `hub_dir`, as
    huggingface_hub does: a blob named by its sha256, a relative symlink in the snapshot, refs/main."""
    repo_dir = hub_dir / f"{repo_type}s--{repo_id.replace('/', '--')}"
    blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = repo_dir / "snapshots" / revision / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return link


def write_hub_dataset_cache(hf_home: str | os.PathLike, include: tuple[str, ...] | None = None) -> dict:
    """Fill `<hf_home>/hub` with the tiny WikiText-2 and C4 files; return what was written.

    include: the file names to write (default: all three), so a test can leave one out.
    Returns {"wikitext_rows": [...], "c4_train": [docs], "c4_validation": [docs], "hub_dir": Path}.
    """
    hub_dir = Path(hf_home) / "hub"
    written = {"wikitext_rows": wikitext_rows(), "c4_train": c4_documents(24, TRAIN_WORD, seed=1),
               "c4_validation": c4_documents(12, VALIDATION_WORD, seed=2), "hub_dir": hub_dir}
    files = {
        WIKITEXT_FILE: ("dataset", WIKITEXT_REPO, WIKITEXT_REVISION, _parquet_bytes(written["wikitext_rows"])),
        C4_TRAIN_FILE: ("dataset", C4_REPO, C4_REVISION, _jsonl_gz_bytes(written["c4_train"])),
        C4_VALIDATION_FILE: ("dataset", C4_REPO, C4_REVISION, _jsonl_gz_bytes(written["c4_validation"])),
    }
    for filename, (repo_type, repo_id, revision, data) in files.items():
        if include is None or filename in include:
            write_cached_file(hub_dir, repo_type, repo_id, revision, filename, data)
    return written
