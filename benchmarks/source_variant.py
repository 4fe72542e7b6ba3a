"""A copy of the package's source with a few exact edits: the variants that benchmarks/decode_ab.sh times
against the code as committed (the floor experiments, kernel settings).

    python3 benchmarks/source_variant.py SRC DEST FILE OLD NEW [OLD NEW ...]

copies the folder SRC to DEST and, in DEST/FILE, replaces each OLD by its NEW. Each OLD must occur exactly
once, or nothing is written and the error names the file and the text: a variant made from source that
has moved on since its script was written fails instead of timing something else.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def edited(text: str, edits: list[tuple[str, str]], where: str) -> str:
    """text with each (old, new) of edits applied; every old must occur exactly once (else ValueError)."""
    for old, new in edits:
        count = text.count(old)
        if count != 1:
            raise ValueError(f"{where}: {count} occurrences of {old!r}, expected exactly one")
        text = text.replace(old, new)
    return text


def source_variant(src: Path, dest: Path, relative: str, edits: list[tuple[str, str]]) -> Path:
    """dest: a copy of src whose file `relative` has the edits applied (checked before anything is copied)."""
    text = edited((src / relative).read_text(), edits, str(src / relative))
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / relative).write_text(text)
    return dest


def main(argv: list[str]) -> None:
    if len(argv) < 5 or len(argv) % 2 == 0:
        raise SystemExit(__doc__)
    src, dest, relative, *pairs = argv
    source_variant(Path(src), Path(dest), relative, list(zip(pairs[0::2], pairs[1::2])))


if __name__ == "__main__":
    main(sys.argv[1:])
