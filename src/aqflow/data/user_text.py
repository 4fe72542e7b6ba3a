"""User corpora: a local text file named in config.yaml, read as documents.

Formats (from the file name unless `file_format` is given):

* plain text (`.txt`, `.text`, `.md`): documents separated by `separator` (default: one or more
  blank lines, i.e. paragraphs); surrounding whitespace of each document is stripped.
* JSON lines (`.jsonl`, `.json`, optionally `.gz`): one JSON object per line, one document each,
  its text in `text_column`.
* Parquet (`.parquet`): one row per document, its text in `text_column`.

Document ids are "<name>/<row>" (row zero-padded, so sorting keeps file order) or, when
`id_column` is given (JSON lines / Parquet), "<name>/<that column's value>". Empty documents are
dropped. The documents are then split into calibration and evaluation roles like the stand-ins.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pandas as pd

from aqflow.io.artifacts import file_sha256
from .offline_text import COLUMNS, CorpusError, split_documents, write_split_corpus

FORMATS = ("text", "jsonl", "parquet")
SUFFIX_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
                  ".parquet": "parquet"}
BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")


def file_format_of(path: Path, file_format: str | None = None) -> str:
    """The format of a user corpus file: `file_format` if given, else from its suffix (".gz" looked through)."""
    if file_format is not None:
        if file_format not in FORMATS:
            raise CorpusError(f"corpus file {path}: format {file_format!r} is not one of {list(FORMATS)}")
        return file_format
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    if not suffixes or suffixes[-1] not in SUFFIX_FORMATS:
        raise CorpusError(f"corpus file {path}: cannot tell its format from the name; name it .txt, .jsonl or "
                         f".parquet, or give `format: {'|'.join(FORMATS)}`")
    return SUFFIX_FORMATS[suffixes[-1]]


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix.lower() == ".gz" else open(path, encoding="utf-8")


def read_plain_text(path: Path, separator: str | None = None) -> list[str]:
    """Documents of a plain text file: split on `separator`, or on blank lines when None."""
    with _open_text(path) as handle:
        text = handle.read().replace("\r\n", "\n")
    parts = BLANK_LINES.split(text) if separator is None else text.split(separator)
    return [part.strip() for part in parts]


def read_json_lines(path: Path, text_column: str, id_column: str | None) -> tuple[list[str], list | None]:
    """(texts, ids or None) of a JSON lines file; errors name the file, the line and the column."""
    texts, ids = [], []
    with _open_text(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"corpus file {path} line {line_number} is not JSON ({error})") from None
            if not isinstance(row, dict) or text_column not in row:
                keys = list(row) if isinstance(row, dict) else type(row).__name__
                raise CorpusError(f"corpus file {path} line {line_number} has no text column {text_column!r} "
                                 f"(it has {keys}); set `text_column`")
            if id_column is not None and id_column not in row:
                raise CorpusError(f"corpus file {path} line {line_number} has no id column {id_column!r}")
            texts.append(row[text_column])
            ids.append(row[id_column] if id_column is not None else None)
    return texts, (ids if id_column is not None else None)


def read_parquet_texts(path: Path, text_column: str, id_column: str | None) -> tuple[list[str], list | None]:
    frame = pd.read_parquet(path)
    for role, column in (("text", text_column), ("id", id_column)):
        if column is not None and column not in frame.columns:
            raise CorpusError(f"corpus file {path} has no {role} column {column!r}; it has {list(frame.columns)}")
    return frame[text_column].tolist(), (frame[id_column].tolist() if id_column is not None else None)


def read_user_corpus(name: str, path: str | os.PathLike, text_column: str = "text", id_column: str | None = None,
                     separator: str | None = None, file_format: str | None = None) -> tuple[pd.DataFrame, dict]:
    """(documents, origin record) of a user corpus file; ValueError/FileNotFoundError name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {name!r}: file {path} does not exist")
    file_format = file_format_of(path, file_format)
    if file_format == "text":
        if id_column is not None:
            raise CorpusError(f"corpus {name!r}: id_column applies to JSON lines and Parquet files, not plain text {path}")
        texts, ids = read_plain_text(path, separator), None
    elif file_format == "jsonl":
        texts, ids = read_json_lines(path, text_column, id_column)
    else:
        texts, ids = read_parquet_texts(path, text_column, id_column)
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise CorpusError(f"corpus file {path}: document {bad} in column {text_column!r} is "
                         f"{type(texts[bad]).__name__}, not text")
    width = max(6, len(str(len(texts))))
    doc_ids = [f"{name}/{i:0{width}d}" if ids is None else f"{name}/{ids[i]}" for i in range(len(texts))]
    frame = pd.DataFrame({"doc_id": doc_ids, "text": texts, "source": name}, columns=list(COLUMNS))
    frame = frame[frame["text"].str.strip() != ""].reset_index(drop=True)
    if len(frame) < 2:
        raise CorpusError(f"corpus {name!r}: {path} holds {len(frame)} non-empty document(s); at least 2 are needed "
                         "to give both calibration and evaluation documents (plain text: separate documents by "
                         "blank lines or set `separator`)")
    repeated = frame["doc_id"][frame["doc_id"].duplicated()].unique()
    if len(repeated):
        raise CorpusError(f"corpus file {path}: id column {id_column!r} repeats {list(repeated[:5])}")
    origin = {"kind": "user", "corpus": name, "path": str(path), "format": file_format, "sha256": file_sha256(path),
              "text_column": text_column if file_format != "text" else None, "id_column": id_column,
              "separator": separator if file_format == "text" else None, "documents": len(frame)}
    return frame, origin


def prepare_user_corpus(name: str, path: str | os.PathLike, parquet_path: str | os.PathLike,
                        calibration_fraction: float = 0.5, seed: int = 0, text_column: str = "text",
                        id_column: str | None = None, separator: str | None = None,
                        file_format: str | None = None) -> pd.DataFrame:
    """Read a user corpus file, split it by document (seeded, like the stand-ins) and write it."""
    docs, origin = read_user_corpus(name, path, text_column, id_column, separator, file_format)
    split = split_documents(docs, calibration_fraction, seed)
    write_split_corpus(split, parquet_path, seed, calibration_fraction, origin=origin)
    return split
