"""`python -m aqflow <stage> ...`: every pipeline stage, runnable by hand."""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from typing import NoReturn

from aqflow import __version__

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


def exit_now(code: int) -> NoReturn:
    """End this process with `code`, skipping the interpreter's teardown of every module.

    With torch and transformers imported, that teardown takes about a second (benchmarks/
    eval_overhead.py, "process exit"), after a stage has written and closed its outputs. atexit
    callbacks (logging's flush, multiprocessing's joins) still run and the standard streams are
    flushed. A process in a torch.distributed group (a torchrun worker) exits the ordinary way."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
