"""What the Snakemake rule scripts share: turn a rule's `snakemake` object into a stage call.

A rule script builds the stage's argv from input/output/params and calls `run_stage`; the stage's
stdout and stderr (progress bars included) go to the rule's log, and a failing stage fails the job
with the log's path in the message.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Mapping

from aqflow.__main__ import STAGES


def settings_argv(settings: Mapping[str, Any]) -> list[str]:
    """{"beam_size": 8, "init": "oaem"} -> ["--beam-size", "8", "--init", "oaem"]"""
    argv: list[str] = []
    for key, value in settings.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def run_stage(snakemake, stage: str, argv: list[str]) -> None:
    """Run `python -m aqflow <stage> argv` in this process, logging to the rule's log."""
    module = importlib.import_module(STAGES[stage])
    log_path = snakemake.log[0]
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("aqflow", stage, " ".join(argv), flush=True)
        code = module.main(argv)
    if code:
        raise SystemExit(f"aqflow {stage} failed with exit code {code}; see {log_path}")
