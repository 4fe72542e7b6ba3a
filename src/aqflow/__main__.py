"""`python -m aqflow <stage> ...`: every pipeline stage, runnable by hand."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys

from aqflow import __version__
from aqflow.stagekit.processes import exit_now

STAGES = {
    "fetch-model": "aqflow.stages.fetch_model",
    "fetch-data": "aqflow.stages.fetch_data",
    "calibrate": "aqflow.stages.calibrate",
    "calibrate-block": "aqflow.stages.calibrate_block",
    "finetune-block": "aqflow.stages.finetune_block",
    "quantize-layer": "aqflow.stages.quantize_layer",
    "stitch": "aqflow.stages.stitch",
    "pvtune": "aqflow.stages.pvtune",
    "evaluate": "aqflow.stages.evaluate",
    "report": "aqflow.stages.report",
    "domain-distances": "aqflow.stages.domain_distances",
    "paper-tables": "aqflow.stages.paper_tables",
    "clean": "aqflow.stages.clean",
    "generate": "aqflow.stages.generate",  # stream text from a model folder (fp or AQLM), with tokens/s
    "speed": "aqflow.stages.speed",  # decode/prefill tokens/s and weight memory of a model folder -> speed.json
}


def stage_summary(module: str) -> str:
    """The first sentence of a stage module's docstring (its first paragraph may wrap), without its
    leading "`python -m aqflow X`: ", read from the source (importing the stages would load torch
    for a help text)."""
    spec = importlib.util.find_spec(module)
    try:
        with open(spec.origin, encoding="utf-8") as handle:
            doc = ast.get_docstring(ast.parse(handle.read())) or ""
    except (OSError, SyntaxError, TypeError):
        return ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    summary = re.sub(r"^`python -m aqflow [^`]*`:\s*", "", paragraph)
    return re.split(r"(?<=[.:;])\s", summary, maxsplit=1)[0]


def usage() -> str:
    width = max(map(len, STAGES))
    lines = [f"  {name:<{width}}  {stage_summary(STAGES[name])}".rstrip() for name in sorted(STAGES)]
    return ("usage: python -m aqflow [--version] <stage> [options]   (`python -m aqflow <stage> --help`: its options)\n\n"
            "stages:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())  # asked for: stdout, exit 0
        return 0
    if argv and argv[0] == "--version":
        print(f"aqflow {__version__}")
        return 0
    if not argv or argv[0] not in STAGES:
        unknown = f"aqflow: error: unknown stage {argv[0]!r}\n" if argv else ""
        print(f"{unknown}{usage()}", file=sys.stderr)  # a usage error: stderr, exit 2
        return 2
    return importlib.import_module(STAGES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    exit_now(main())
