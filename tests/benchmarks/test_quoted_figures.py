"""Every figure the README and docs/speed.md quote is the value of a committed result file.

benchmarks/results/README.md lists each quoted figure (page, quoted text, file, key); here each quoted
text must still be in its page, the page must name the file, and the file's value at the key, rounded
to the decimals printed, must be the quoted number. A figure edited in the page, or a result file
changed or moved, fails here."""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")  # not the 16 of bf16


def table_cells(line: str) -> list[str]:
    """The cells of a markdown table row, `\\|` kept as a literal bar and each cell's backticks removed."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [re.sub(r"^`(.*)`$", r"\1", cell.strip()).replace("\\|", "|") for cell in cells]


def quoted_figures() -> list[tuple[str, str, str, str]]:
    """(page, quoted, file, key) rows of the index's "Figures quoted" table."""
    text = (RESULTS / "README.md").read_text()
    section = text.split("## Figures quoted in the README and docs/speed.md", 1)[1].split("\n## ", 1)[0]
    rows = [table_cells(line) for line in section.splitlines() if line.startswith("| ")]
    return [tuple(row) for row in rows[1:] if row and not set(row[0]) <= {"-"}]


def lookup(record, path: str) -> float:
    """The number at a dotted path (list items by index) of a JSON record."""
    for part in path.split("."):
        record = record[int(part)] if isinstance(record, list) else record[part]
    return float(record)


def evaluate(record, expression: str) -> float:
    """`a`, or `a op b op c ...` with op in + - * / evaluated left to right; operands are paths or numbers."""
    tokens = expression.split()
    operand = lambda token: float(token) if re.fullmatch(r"[\d.e+-]+", token) else lookup(record, token)
    value = operand(tokens[0])
    for op, token in zip(tokens[1::2], tokens[2::2]):
        right = operand(token)
        value = {"+": value + right, "-": value - right, "*": value * right, "/": value / right}[op]
    return value


def printed_number(quoted: str) -> tuple[float, int]:
    """The first number of the quoted text and its decimals ("1,091 s" -> (1091.0, 0))."""
    found = NUMBER.search(quoted).group(0).replace(",", "")
    return float(found), len(found.split(".")[1]) if "." in found else 0


FIGURES = quoted_figures()


def test_the_index_lists_the_figures_of_both_pages():
    pages = {page for page, *_ in FIGURES}
    assert pages == {"README.md", "docs/speed.md"} and len(FIGURES) > 40


@pytest.mark.parametrize("page, quoted, file, key", FIGURES, ids=[f"{p}:{q}" for p, q, *_ in FIGURES])
def test_a_quoted_figure_is_its_result_files_value(page, quoted, file, key):
    text = (REPO / page).read_text()
    assert quoted in text, f"{page} no longer says {quoted!r}"
    assert file in text, f"{page} quotes {quoted!r} without naming benchmarks/results/{file}"
    record = json.loads((RESULTS / file).read_text())
    value = evaluate(record, key)
    number, decimals = printed_number(quoted)
    assert round(value, decimals) == pytest.approx(number), f"{file}: {key} = {value}, quoted {quoted!r}"


def test_every_result_file_the_pages_name_exists():
    """A results path in any doc, the README or a published README points at a file that is there."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "results" / "published").rglob("*.md"))]
    named = {(page, match) for page in pages
             for match in re.findall(r"benchmarks/results/([\w./-]+\.(?:json|md|txt))", page.read_text())}
    missing = [f"{page.relative_to(REPO)}: {name}" for page, name in named if not (RESULTS / name).is_file()]
    assert named and not missing, missing
