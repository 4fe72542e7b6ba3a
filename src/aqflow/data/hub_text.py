"""The hub corpora WikiText-2 and C4, read file by file through the Hugging Face cache.

Each file is fetched with `huggingface_hub.hf_hub_download(repo_id, filename, repo_type="dataset")`,
so an ordinary hub cache serves it (`HF_HOME`, default ~/.cache/huggingface; with
`HF_HUB_OFFLINE=1` nothing is downloaded and a missing file is an error naming it).

* `wikitext2`: dataset `Salesforce/wikitext`, file `wikitext-2-raw-v1/test-00000-of-00001.parquet`
  (column `text`, one row per line of the original test file). Every row is an evaluation
  document, in file order; the GPTQ/AQLM protocol joins them with "\\n\\n".
* `c4`: dataset `allenai/c4`, AQLM's files: `en/c4-train.00000-of-01024.json.gz` (calibration
  role: calibration windows and PV-tuning samples) and `en/c4-validation.00000-of-00008.json.gz`
  (evaluation role: AQLM's 256 seeded windows), JSON lines with `text`, `timestamp`, `url`.

Roles come from the file, not from a seeded split; document ids are "<file stem>/<row>" with the
row zero-padded, so sorting by id keeps file order (the C4 protocol draws by row index). The
split JSON records repo, file, revision, sha256 and row count of every file per role.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from aqflow.io.artifacts import file_sha256
from .offline_text import CALIBRATION, COLUMNS, EVALUATION, CorpusError, write_split_corpus


@dataclass(frozen=True)
class HubFile:
    """One file of a hub dataset and the role its rows serve."""

    repo_id: str
    filename: str
    role: str
    file_format: str  # "parquet" or "jsonl.gz"


WIKITEXT2_TEST = HubFile("Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet", EVALUATION, "parquet")
C4_TRAIN = HubFile("allenai/c4", "en/c4-train.00000-of-01024.json.gz", CALIBRATION, "jsonl.gz")
C4_VALIDATION = HubFile("allenai/c4", "en/c4-validation.00000-of-00008.json.gz", EVALUATION, "jsonl.gz")

HUB_CORPUS_FILES: dict[str, tuple[HubFile, ...]] = {
    "wikitext2": (WIKITEXT2_TEST,),
    "c4": (C4_TRAIN, C4_VALIDATION),
}


class HubFileError(FileNotFoundError):
    """A hub file could not be had (offline and not cached, gated, missing); the message says what to do."""


def download_hub_file(hub_file: HubFile) -> Path:
    """Local path of `hub_file`, from the hub cache or downloaded into it.

    Raises HubFileError naming the repo id, the file and what to do.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(hub_file.repo_id, hub_file.filename, repo_type="dataset"))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        offline = constants.HF_HUB_OFFLINE
        how = ("HF_HUB_OFFLINE is set, so nothing is downloaded: unset it on a machine with a network, or copy a "
               "filled hub cache here" if offline else "check the network and the repo id")
        raise HubFileError(
            f"cannot get file {hub_file.filename!r} of the hub dataset {hub_file.repo_id!r} "
            f"({type(error).__name__}). {how}; to fetch it ahead of time run "
            f"`hf download --repo-type dataset {hub_file.repo_id} {hub_file.filename}`. "
            f"Hub cache: {constants.HF_HUB_CACHE} (set HF_HOME to move it)"
        ) from None


def snapshot_revision(path: Path) -> str | None:
    """The commit a cached file belongs to: the folder after `snapshots/` in its path (None if absent)."""
    parts = Path(path).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None


def read_texts(path: Path, hub_file: HubFile) -> list[str]:
    """The `text` column of a hub file, in file order; a ValueError names the file when it has none."""
    where = f"{hub_file.repo_id}/{hub_file.filename} ({path})"
    if hub_file.file_format == "parquet":
        frame = pd.read_parquet(path)
        if "text" not in frame.columns:
            raise CorpusError(f"{where} has no 'text' column; it has {list(frame.columns)}")
        texts = frame["text"].tolist()
    else:
        texts = []
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, 1):
                try:
                    texts.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise CorpusError(f"{where} line {line_number} is not a JSON object with 'text' ({error})") from None
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise CorpusError(f"{where} row {bad}: text is {type(texts[bad]).__name__}, not a string")
    return texts


def file_documents(texts: list[str], hub_file: HubFile, corpus: str) -> pd.DataFrame:
    """Rows of one file as documents (doc_id "<file stem>/<zero-padded row>", text, source, role)."""
    stem = hub_file.filename.split(".json")[0].removesuffix(".parquet")
    width = max(6, len(str(len(texts))))
    return pd.DataFrame({
        "doc_id": [f"{stem}/{row:0{width}d}" for row in range(len(texts))],
        "text": texts,
        "source": corpus,
        "role": hub_file.role,
    }, columns=list(COLUMNS) + ["role"])


def load_hub_corpus(name: str) -> tuple[pd.DataFrame, dict]:
    """(documents with roles, origin record) of hub corpus `name` ("wikitext2" or "c4").

    The origin record lists, per file: repo_id, filename, revision, sha256, role and rows.
    """
    if name not in HUB_CORPUS_FILES:
        raise KeyError(f"unknown hub corpus {name!r}; known: {sorted(HUB_CORPUS_FILES)}")
    frames, files = [], []
    for hub_file in HUB_CORPUS_FILES[name]:
        path = download_hub_file(hub_file)
        texts = read_texts(path, hub_file)
        if not texts:
            raise CorpusError(f"{hub_file.repo_id}/{hub_file.filename} ({path}) has no rows")
        frames.append(file_documents(texts, hub_file, name))
        files.append({"repo_id": hub_file.repo_id, "filename": hub_file.filename, "repo_type": "dataset",
                      "revision": snapshot_revision(path), "sha256": file_sha256(path), "role": hub_file.role,
                      "rows": len(texts)})
    origin = {"kind": "hub", "corpus": name, "split": "by file", "files": files}
    return pd.concat(frames, ignore_index=True), origin


def prepare_hub_corpus(name: str, parquet_path: str | os.PathLike) -> pd.DataFrame:
    """Read hub corpus `name` and write it like the stand-ins (Parquet with roles + split JSON)."""
    split, origin = load_hub_corpus(name)
    write_split_corpus(split, parquet_path, seed=None, calibration_fraction=None, origin=origin)
    return split
