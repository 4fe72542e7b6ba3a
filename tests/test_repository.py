"""The repository stands on its own: nothing in it sends users to files outside the checkout."""

import re
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


MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_in_the_readme_and_docs_point_at_files_that_exist():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in MARKDOWN_LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor in the same page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert len(pages) > 1 and not broken, f"links to missing files: {broken}"
