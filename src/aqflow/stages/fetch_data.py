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

import argparse
from pathlib import Path

from aqflow.corpus_catalog import HUB_CORPORA, STANDIN_CORPORA
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow fetch-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True,
                        help=f"one of {sorted(HUB_CORPORA + STANDIN_CORPORA)}, or a user corpus name with --file")
    parser.add_argument("--output", required=True, type=Path, help="corpus .parquet")
    parser.add_argument("--calibration-fraction", type=float, default=0.5, help="stand-ins and user files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split by document (stand-ins and user files)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="registry download cache (stand-ins)")
    user = parser.add_argument_group("user corpus (a local file)")
    user.add_argument("--file", type=Path, default=None, help="plain text, JSON lines or Parquet")
    user.add_argument("--format", dest="file_format", choices=("text", "jsonl", "parquet"), default=None,
                      help="default: from the file name")
    user.add_argument("--text-column", default="text", help="JSON lines / Parquet: the column holding the text")
    user.add_argument("--id-column", default=None, help="JSON lines / Parquet: a column of unique document ids")
    user.add_argument("--separator", default=None, help="plain text: the string between documents (default: blank lines)")
    return parser


def fetch(args: argparse.Namespace):
    """Read, split and write the corpus; the split frame."""
    if args.file is not None:
        if args.corpus in HUB_CORPORA + STANDIN_CORPORA:
            raise ValueError(f"--corpus {args.corpus} is a built-in corpus; give a user corpus another name")
        from aqflow.data.user_text import prepare_user_corpus

        return prepare_user_corpus(args.corpus, args.file, args.output, args.calibration_fraction, args.seed,
                                   args.text_column, args.id_column, args.separator, args.file_format)
    if args.corpus in HUB_CORPORA:
        from aqflow.data.hub_text import prepare_hub_corpus

        return prepare_hub_corpus(args.corpus, args.output)
    if args.corpus in STANDIN_CORPORA:
        from aqflow.data.offline_text import prepare_corpus
        from aqflow.fetching import default_cache_dir

        return prepare_corpus(args.corpus, args.cache_dir or default_cache_dir(), args.output,
                              args.calibration_fraction, args.seed)
    raise ValueError(f"unknown corpus {args.corpus!r}; known: {sorted(HUB_CORPORA + STANDIN_CORPORA)}, "
                     "or a user corpus with --file")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        split = fetch(args)
    except (*EXPECTED_ERRORS, KeyError, ValueError) as error:
        return report_error("fetch-data", error)
    counts = split["role"].value_counts().to_dict()
    print(f"{args.corpus}: {len(split)} documents {counts} -> {args.output}")
    return 0
