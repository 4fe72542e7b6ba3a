"""`python -m aqflow fetch-data`: one text corpus as Parquet with document ids and roles.

Every corpus is written the same way (columns doc_id, text, source, role; a `.split.json` next
to it records the roles and where the text came from), so later stages do not care which it is:

* hub corpora (`wikitext2`, `c4`): read through the Hugging Face cache (`aqflow.data.hub_text`);
  roles come from the files (WikiText-2 test: evaluation; C4 train shard: calibration, C4
  validation shard: evaluation).
* offline stand-ins from package registries (`wikitext2-standin`, `c4-standin`) and user files
  (`--file`, any other name): split by document into calibration and evaluation roles that never
  overlap, seeded by --seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aqflow.stagekit import stage_cli
from aqflow.data.corpus_catalog import HUB_CORPORA, STANDIN_CORPORA
from aqflow.data.offline_text import CorpusError
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "fetch-data"
INPUT_ERRORS = (*EXPECTED_ERRORS, CorpusError)


@dataclass(frozen=True)
class FetchDataSettings:
    corpus: str = field(metadata=option(
        f"one of {sorted(HUB_CORPORA + STANDIN_CORPORA)}, or a user corpus name with --file"))
    calibration_fraction: float = field(default=0.5, metadata=option("stand-ins and user files"))
    seed: int = field(default=0, metadata=option("seed of the split by document (stand-ins and user files)"))
    # a user corpus (a local file): how to read it
    file_format: str | None = field(default=None, metadata=option(
        "user file: text, jsonl or parquet (default: from the file name)", flag="--format",
        choices=("text", "jsonl", "parquet")))
    text_column: str = field(default="text", metadata=option("user JSON lines / Parquet: the column holding the text"))
    id_column: str | None = field(default=None, metadata=option("user JSON lines / Parquet: a column of unique document ids"))
    separator: str | None = field(default=None, metadata=option(
        "user plain text: the string between documents (default: blank lines)"))


@dataclass(frozen=True)
class FetchDataPaths:
    output: Path = field(metadata=option("corpus .parquet"))
    file: Path | None = field(default=None, metadata=option("a user corpus: plain text, JSON lines or Parquet"))
    cache_dir: Path | None = field(default=None, metadata=option("registry download cache (stand-ins)"))


def run(settings: FetchDataSettings, paths: FetchDataPaths):
    """Read, split and write the corpus; the split frame."""
    if paths.file is not None:
        if settings.corpus in HUB_CORPORA + STANDIN_CORPORA:
            raise StageInputError(f"--corpus {settings.corpus} is a built-in corpus; give a user corpus another name")
        from aqflow.data.user_text import prepare_user_corpus

        return prepare_user_corpus(settings.corpus, paths.file, paths.output, settings.calibration_fraction,
                                   settings.seed, settings.text_column, settings.id_column, settings.separator,
                                   settings.file_format)
    if settings.corpus in HUB_CORPORA:
        from aqflow.data.hub_text import prepare_hub_corpus

        return prepare_hub_corpus(settings.corpus, paths.output)
    if settings.corpus in STANDIN_CORPORA:
        from aqflow.data.offline_text import prepare_corpus
        from aqflow.io.fetching import default_cache_dir

        return prepare_corpus(settings.corpus, paths.cache_dir or default_cache_dir(), paths.output,
                              settings.calibration_fraction, settings.seed)
    raise StageInputError(f"unknown corpus {settings.corpus!r}; known: {sorted(HUB_CORPORA + STANDIN_CORPORA)}, "
                          "or a user corpus with --file")


def summary(split) -> str:
    return f"{len(split)} documents {split['role'].value_counts().to_dict()}"


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
