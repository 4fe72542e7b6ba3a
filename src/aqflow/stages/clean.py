"""`python -m aqflow clean [FOLDER ...]`: remove the temporaries that killed jobs left behind.

Every aqflow writer stages its output as `.<name>.<random>.tmp` (a file) or
`.<name>.<random>.partial` (a folder) beside it and renames it into place when whole, so these
are never finished artifacts; nor is a checksum sidecar whose file is gone. The next run of a rule removes its own outputs' leftovers; this
command removes all of them under the given folders (default: results and resources). Run it when
no Snakemake run uses the folder: a running job's temporaries look the same. A Snakemake lock in
the working directory makes it refuse (unless --force).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from aqflow.artifacts import stale_temporaries
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aqflow clean", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", type=Path, default=[Path("results"), Path("resources")])
    parser.add_argument("--force", action="store_true", help="even while .snakemake/locks holds a lock")
    parser.add_argument("--dry-run", "-n", action="store_true", help="list, remove nothing")
    args = parser.parse_args(argv)
    locks = Path(".snakemake") / "locks"
    if not args.force and locks.is_dir() and any(locks.iterdir()):
        print(f"aqflow clean: error: {locks} holds a lock: a Snakemake run may be writing here "
              "(if none is, `snakemake --unlock` first, or pass --force)", flush=True)
        return 2
    try:
        found = [path for folder in args.folders if folder.is_dir() for path in stale_temporaries(folder)]
        for path in found:
            print(("would remove " if args.dry_run else "removed ") + str(path))
            if not args.dry_run:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    except EXPECTED_ERRORS as error:
        return report_error("clean", error)
    print(f"{'found' if args.dry_run else 'removed'} {len(found)} temporaries under {', '.join(map(str, args.folders))}")
    return 0
