"""The repository stands on its own: nothing in it sends users to files outside the checkout."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE_POINTERS = ("../shared", "/work/shared", "/work/main")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    files = [REPO / name for name in names.decode().split("\0") if name]
    return [path for path in files if path.is_file() and path.suffix not in (".png", ".parquet", ".gz", ".npz")]


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="ignore")
        offenders += [f"{path.relative_to(REPO)}: {needle}" for needle in OUTSIDE_POINTERS if needle in text]
    assert not offenders, f"files pointing outside the repository: {offenders}"
