"""`python -m aqflow clean [FOLDER ...]`: remove the temporaries that killed jobs left behind.

Every aqflow writer stages its output as `.<name>.<random>.tmp` (a file) or
`.<name>.<random>.partial` (a folder) beside it and renames it into place when whole, so these
are never finished artifacts; nor is a checksum sidecar whose file is gone. The next run of a rule removes its own outputs' leftovers; this
command removes all of them under the given folders (default: results and resources). Run it when
no Snakemake run uses the folder: a running job's temporaries look the same. A Snakemake lock in
the working directory makes it refuse (unless --force).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import stale_temporaries
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "clean"
INPUT_ERRORS = EXPECTED_ERRORS


@dataclass(frozen=True)
class CleanSettings:
    force: bool = field(default=False, metadata=option("even while .snakemake/locks holds a lock"))
    dry_run: bool = field(default=False, metadata=option("list, remove nothing", aliases=("-n",)))


@dataclass(frozen=True)
class CleanPaths:
    folders: tuple[Path, ...] = field(default=(Path("results"), Path("resources")),
                                      metadata=option("folders to clean", positional=True))


def run(settings: CleanSettings, paths: CleanPaths) -> dict:
    """Remove (or with dry_run list) the temporaries under the folders; what was found where."""
    locks = Path(".snakemake") / "locks"
    if not settings.force and locks.is_dir() and any(locks.iterdir()):
        raise StageInputError(f"{locks} holds a lock: a Snakemake run may be writing here "
                              "(if none is, `snakemake --unlock` first, or pass --force)")
    found = [path for folder in paths.folders if folder.is_dir() for path in stale_temporaries(folder)]
    for path in found:
        print(("would remove " if settings.dry_run else "removed ") + str(path))
        if not settings.dry_run:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return {"found": found, "dry_run": settings.dry_run, "folders": list(paths.folders)}


def summary(result: dict) -> str:
    return (f"{'found' if result['dry_run'] else 'removed'} {len(result['found'])} temporaries under "
            f"{', '.join(map(str, result['folders']))}")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
