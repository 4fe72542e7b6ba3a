"""`python -m aqflow <stage> ...`: every pipeline stage, runnable by hand."""

from __future__ import annotations

import importlib
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

USAGE = ("usage: python -m aqflow [--version] <stage> [options]   (`python -m aqflow <stage> --help`: its options)\n\n"
         "stages:\n  " + "\n  ".join(sorted(STAGES)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)  # asked for: stdout, exit 0
        return 0
    if argv and argv[0] == "--version":
        print(f"aqflow {__version__}")
        return 0
    if not argv or argv[0] not in STAGES:
        unknown = f"aqflow: error: unknown stage {argv[0]!r}\n" if argv else ""
        print(f"{unknown}{USAGE}", file=sys.stderr)  # a usage error: stderr, exit 2
        return 2
    return importlib.import_module(STAGES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    exit_now(main())
