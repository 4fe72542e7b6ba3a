"""What the Snakemake rule scripts share: turn a rule's `snakemake` object into a stage call.

A rule script gathers the stage's settings and paths from the rule's params/input/output (plain
values: the validated config's) and calls `run_stage`, which builds the stage's two dataclasses
from them and calls its `run` in this process: no command line in between. The stage's stdout and
stderr (progress bars included) go to the rule's log, headed by the equivalent `aqflow <stage>`
command; a failing stage fails the job with the log's path in the message.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Mapping

from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import read_json
from aqflow.jobs.gpu_pool import pin_job_gpus
from aqflow.jobs.stage_settings import Execution
from aqflow.jobs.stage_jobs import execute_logged, last_error_line, stage_call


def job_gpus(snakemake) -> int:
    """The rule's `gpu` resource (0 when it has none)."""
    return int(getattr(snakemake.resources, "gpu", 0) or 0)


def run_stage(snakemake, stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any],
              execution: Execution | None = None) -> None:
    """Run stage `stage` (`run(settings, paths)`) for the rule, logging to the rule's log.

    A stage's one-line input error (exit 2) is in the log and in the job's failure message; a bug's
    traceback is written to the log too before it propagates. A GPU job is pinned to the least-busy
    card of the node (`gpu_pool`) before the stage (and torch) is imported, and the stale temporaries
    of this job's earlier, killed runs are removed first. The stage runs in this process, or, with
    `execution.warm_workers` (the rule's `execution` param, config `execution`) on, in a warm worker of
    the job's card (`aqflow.jobs.warm_workers`). Call it last: see `skip_exit_collection`."""
    pin_job_gpus(job_gpus(snakemake))
    log_path = str(snakemake.log[0])
    outputs = [str(output) for output in getattr(snakemake, "output", [])]
    outcome = None
    if execution is not None and execution.warm_workers:
        outcome = run_in_warm_worker(stage, settings, paths, log_path, outputs, execution)
    code, message = outcome if outcome is not None else execute_logged(stage, settings, paths, log_path, outputs)
    if code:
        raise SystemExit(message)
    journal_outputs(outputs)
    skip_exit_collection()


def journal_outputs(outputs: list[str]) -> None:
    """What the job wrote, with the digests its stage recorded, for the next DAG build's integrity
    check (aqflow.io.integrity.journal_written): it then need not hash the files again."""
    from aqflow.io.integrity import journal_written
    from aqflow.jobs.currency import digest_cache_path

    journal_written(outputs, digest_cache_path())


def run_in_warm_worker(stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any], log_path: str,
                       outputs: list[str], execution: Execution) -> tuple[int, str] | None:
    """`execute_logged` in a warm worker of the job's card (`aqflow.jobs.warm_workers`); None where
    workers are not supported or none could be started (the caller then runs it in process)."""
    from aqflow.jobs import warm_workers
    from aqflow.jobs.gpu_pool import pool_folder

    if not warm_workers.supported():
        return None
    request = {"stage": stage, "settings": settings, "paths": paths, "log": log_path, "outputs": outputs,
               "cwd": str(Path.cwd())}
    return warm_workers.run_in_worker(request, pool_folder(), float(execution.warm_worker_idle_seconds))


def skip_exit_collection() -> None:
    """The job's process ends after its stage: let the interpreter's exit skip collecting the
    objects alive now (torch's alone take ~0.35 s of a layer job's ~1 s of fixed cost on a CPU).
    Only garbage cycles left at exit are affected (their finalizers do not run); every artifact
    and the log are closed by then."""
    gc.freeze()


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


def run_stage_on_gpus(snakemake, stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any],
                      num_gpus: int) -> None:
    """`run_stage`, or with num_gpus > 1 the stage under torchrun with one process per GPU of the
    job (each process joins the group torchrun describes), its output going to the rule's log. The
    processes get the stage's command line, written from its dataclasses (`stage_cli.to_argv`)."""
    if num_gpus <= 1:
        run_stage(snakemake, stage, settings, paths)
        return
    import subprocess

    pin_job_gpus(num_gpus)  # torchrun's processes inherit the chosen cards

    from aqflow.calibration.sharded import torchrun_command
    from aqflow.stagekit.processes import die_with_parent

    _, settings_, paths_ = stage_call(stage, settings, paths)
    command = torchrun_command(num_gpus, "aqflow", [stage, *stage_cli.to_argv(settings_, paths_)])
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
