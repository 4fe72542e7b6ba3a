"""One error path for every stage CLI: expected failures are one line, bugs keep their traceback.

Expected: a bad or corrupt input (ArtifactError, StageInputError, ModelFolderError, the library's
typed input errors a stage lists in its INPUT_ERRORS) and what the
machine does to a job (disk full, read-only folder, no permission, a missing file: every
OSError). Each becomes `aqflow <stage>: error: <file>: <cause>` on stderr (a rule's log, when
Snakemake runs the stage) and exit code 2. Anything else propagates: a bug, with its traceback.
"""

from __future__ import annotations

import sys

from aqflow.io.artifacts import ArtifactError
from aqflow.models.folder import ModelFolderError


class StageInputError(ValueError):
    """A bad input or setting given to a stage; the message names it."""


# a model folder that is not what a stage needs (not AQLM, a linear without its scales) is an input
# error of every stage that reads one
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ArtifactError, OSError, StageInputError, ModelFolderError)
INPUT_EXIT_CODE = 2


def describe(error: BaseException) -> str:
    """One line naming the file (where the error knows it) and the cause."""
    if isinstance(error, OSError) and not isinstance(error, ArtifactError) and error.strerror:
        names = [str(name) for name in (error.filename, error.filename2) if name]
        text = f"{' -> '.join(names)}: {error.strerror}" if names else error.strerror
    else:
        text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(text.split())


def report(stage: str, error: BaseException) -> int:
    """Print the one-line error of `stage` to stderr; the exit code for it."""
    print(f"aqflow {stage}: error: {describe(error)}", file=sys.stderr, flush=True)
    return INPUT_EXIT_CODE
