"""`python -m aqflow <stage> ...`: every pipeline stage, runnable by hand."""

from __future__ import annotations

import importlib
import sys

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
    "paper-tables": "aqflow.stages.paper_tables",
    "clean": "aqflow.stages.clean",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        known = "\n  ".join(sorted(STAGES))
        print(f"usage: python -m aqflow <stage> [options]\n\nstages:\n  {known}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(STAGES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
