"""What the Snakemake rule scripts share: turn a rule's `snakemake` object into a stage call.

A rule script builds the stage's argv from input/output/params and calls `run_stage`; the stage's
stdout and stderr (progress bars included) go to the rule's log, and a failing stage fails the job
with the log's path in the message.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from typing import Any, Mapping

from aqflow.__main__ import STAGES
from aqflow.artifacts import read_json
from aqflow.gpu_pool import pin_job_gpus


def settings_argv(settings: Mapping[str, Any]) -> list[str]:
    """{"beam_size": 8, "init": "oaem"} -> ["--beam-size", "8", "--init", "oaem"]"""
    argv: list[str] = []
    for key, value in settings.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def flags_argv(settings: Mapping[str, Any]) -> list[str]:
    """Like `settings_argv`, for stages with on/off switches and optional values:
    {"update_codes": False, "max_steps": None, "lr": 3e-4} -> ["--no-update-codes", "--lr", "0.0003"]
    (True -> --key, False -> --no-key, None -> left out: the stage's default)."""
    argv: list[str] = []
    for key, value in settings.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            argv += [f"--{flag}", str(value)]
    return argv


def job_gpus(snakemake) -> int:
    """The rule's `gpu` resource (0 when it has none)."""
    return int(getattr(snakemake.resources, "gpu", 0) or 0)


def run_stage(snakemake, stage: str, argv: list[str]) -> None:
    """Run `python -m aqflow <stage> argv` in this process, logging to the rule's log.

    A stage's one-line error (exit 2) is in the log and in the job's failure message; a bug's
    traceback is written to the log too before it propagates. The stale temporaries of this job's
    earlier, killed runs are removed first, and a GPU job is pinned to the least-busy card of the
    node (`gpu_pool`)."""
    pin_job_gpus(job_gpus(snakemake))
    module = importlib.import_module(STAGES[stage])
    log_path = snakemake.log[0]
    removed = remove_stale_outputs(getattr(snakemake, "output", []))
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("aqflow", stage, " ".join(argv), flush=True)
        for path in removed:
            print(f"removed {path} (left by an interrupted run)", flush=True)
        try:
            code = module.main(argv)
        except BaseException:
            traceback.print_exc()
            raise
    if code:
        raise SystemExit(f"aqflow {stage} failed with exit code {code}: {last_error_line(log_path)} (log: {log_path})")


def remove_stale_outputs(outputs) -> list:
    """Remove the `.<name>.*.tmp` / `.<name>.*.partial` leftovers of earlier, killed writes of
    these outputs (Snakemake runs one job per output at a time, so none is a live writer's)."""
    from aqflow.artifacts import remove_stale_temporaries

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


def block_finetune_summaries(tuned_block_dirs) -> list[dict]:
    """Per block: relative output error before and after block fine-tuning, from each tuned block
    folder's finetune.json (an empty list when fine-tuning is off). A single folder may come as a str."""
    from pathlib import Path

    dirs = [tuned_block_dirs] if isinstance(tuned_block_dirs, str) else list(tuned_block_dirs)
    keys = ("block", "relative_mse_before", "relative_mse_after", "best_epoch", "seconds")
    summaries = []
    for folder in dirs:
        record = read_json(Path(folder) / "finetune.json", required=False)
        summaries.append({key: record.get(key) for key in keys})
    return summaries


def run_stage_on_gpus(snakemake, stage: str, argv: list[str], num_gpus: int) -> None:
    """`run_stage`, or with num_gpus > 1 the stage under torchrun with one process per GPU of the
    job (each process joins the group torchrun describes), its output going to the rule's log."""
    if num_gpus <= 1:
        run_stage(snakemake, stage, argv)
        return
    import subprocess

    pin_job_gpus(num_gpus)  # torchrun's processes inherit the chosen cards

    from aqflow.calibration.sharded import torchrun_command
    from aqflow.processes import die_with_parent

    command = torchrun_command(num_gpus, "aqflow", [stage, *argv])
    log_path = snakemake.log[0]
    with open(log_path, "w") as log:
        print(" ".join(command), file=log, flush=True)
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent).returncode
    if code:
        raise SystemExit(f"aqflow {stage} on {num_gpus} GPUs failed with exit code {code}: "
                         f"{last_error_line(log_path)} (log: {log_path})")


def layer_summaries(metric_files) -> list[dict]:
    """The per-layer facts the report plots, from quantize-layer metrics JSONs (in the given order)."""

    keys = ("layer", "out_features", "in_features", "rho", "bits_per_parameter", "init_relative_mse",
            "final_relative_mse", "init_seconds", "total_seconds", "stopped_because")
    summaries = []
    for path in metric_files:
        metrics = read_json(path, required=False)
        summaries.append({key: metrics.get(key) for key in keys} | {"epochs": len(metrics.get("epochs", []))})
    return summaries
