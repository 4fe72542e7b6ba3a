"""A stage's call as a Snakemake job makes it, in whichever process runs it (the job's own, or a
warm worker of its card: `aqflow.jobs.warm_workers`): the stage's dataclasses from the rule's plain
values, the stale temporaries of the job's earlier, killed runs removed, and its output in the
rule's log headed by the equivalent `aqflow <stage>` command line.
"""

from __future__ import annotations

import contextlib
import importlib
import shlex
import traceback
from typing import Any, Mapping

from aqflow.stagekit import stage_cli
from aqflow.__main__ import STAGES


def stage_call(stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any]):
    """(stage module, settings dataclass, paths dataclass) of `aqflow <stage>` from plain values."""
    module = importlib.import_module(STAGES[stage])
    settings_class, paths_class = stage_cli.stage_classes(module.run)
    return module, stage_cli.from_dict(settings_class, settings), stage_cli.from_dict(paths_class, paths)


def execute_logged(stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any], log_path: str,
                   outputs: list[str], note: str = "") -> tuple[int, str]:
    """The stage's call as a job makes it: its output to `log_path` (headed by the equivalent
    command line, then `note` if given), the stale temporaries of `outputs` removed first. Returns
    (exit code, the job's failure message or ''); a bug's exception propagates after its traceback
    is logged."""
    try:
        module, settings_, paths_ = stage_call(stage, settings, paths)
    except ValueError as error:  # a settings class refusing a combination of values (__post_init__)
        with open(log_path, "w") as log:
            print(f"aqflow {stage}: error: {error}", file=log)
        return 2, f"aqflow {stage}: error: {error} (log: {log_path})"
    removed = remove_stale_outputs(outputs)
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("aqflow", stage, shlex.join(stage_cli.to_argv(settings_, paths_)), flush=True)
        if note:
            print(note, flush=True)
        for path in removed:
            print(f"removed {path} (left by an interrupted run)", flush=True)
        try:
            code = stage_cli.run_stage_module(module, settings_, paths_)
        except BaseException:
            traceback.print_exc()
            raise
    if code:
        return code, f"aqflow {stage} failed with exit code {code}: {last_error_line(log_path)} (log: {log_path})"
    return 0, ""


def remove_stale_outputs(outputs) -> list:
    """Remove the `.<name>.*.tmp` / `.<name>.*.partial` leftovers of earlier, killed writes of
    these outputs (Snakemake runs one job per output at a time, so none is a live writer's)."""
    from aqflow.io.artifacts import remove_stale_temporaries

    removed = []
    for output in outputs:
        removed += remove_stale_temporaries(output)
    return removed


def last_error_line(log_path) -> str:
    """The last `aqflow ...: error:` line of a log ('' if none)."""
    try:
        with open(log_path, errors="replace") as log:
            lines = [line.strip() for line in log if ": error: " in line]
    except OSError:
        return ""
    return lines[-1] if lines else ""
