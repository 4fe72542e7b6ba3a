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
    """Run `python -m aqflow <stage> argv` in this process, logging to the rule's log; a GPU job is
    first pinned to the least-busy card of the node (`gpu_pool`)."""
    pin_job_gpus(job_gpus(snakemake))
    module = importlib.import_module(STAGES[stage])
    log_path = snakemake.log[0]
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print("aqflow", stage, " ".join(argv), flush=True)
        code = module.main(argv)
    if code:
        raise SystemExit(f"aqflow {stage} failed with exit code {code}; see {log_path}")


def block_finetune_summaries(tuned_block_dirs) -> list[dict]:
    """Per block: relative output error before and after block fine-tuning, from each tuned block
    folder's finetune.json (an empty list when fine-tuning is off). A single folder may come as a str."""
    import json
    from pathlib import Path

    dirs = [tuned_block_dirs] if isinstance(tuned_block_dirs, str) else list(tuned_block_dirs)
    keys = ("block", "relative_mse_before", "relative_mse_after", "best_epoch", "seconds")
    summaries = []
    for folder in dirs:
        record = json.loads((Path(folder) / "finetune.json").read_text())
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

    command = torchrun_command(num_gpus, "aqflow", [stage, *argv])
    log_path = snakemake.log[0]
    with open(log_path, "w") as log:
        print(" ".join(command), file=log, flush=True)
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"aqflow {stage} on {num_gpus} GPUs failed with exit code {code}; see {log_path}")


def layer_summaries(metric_files) -> list[dict]:
    """The per-layer facts the report plots, from quantize-layer metrics JSONs (in the given order)."""
    import json

    keys = ("layer", "out_features", "in_features", "rho", "bits_per_parameter", "init_relative_mse",
            "final_relative_mse", "init_seconds", "total_seconds", "stopped_because")
    summaries = []
    for path in metric_files:
        with open(path) as handle:
            metrics = json.load(handle)
        summaries.append({key: metrics.get(key) for key in keys} | {"epochs": len(metrics.get("epochs", []))})
    return summaries
