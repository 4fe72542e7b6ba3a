"""What a Snakemake job hands its stage, and how it runs it.

Every rule's script is one line, `run_job(snakemake, "<stage>")`. The stage's function below reads
the job's params (the settings `aqflow.jobs.plan` gives the rule, shaped as Snakemake compares
them), inputs, outputs and wildcards, and returns the stage's settings and paths as plain values
shaped like its two dataclasses (a nested dataclass as a nested mapping). `aqflow.jobs.stage_jobs`
builds the dataclasses from them and calls the stage's `run`: in this process, in a warm worker of
the job's card (`aqflow.jobs.warm_workers`), or under torchrun with one process per GPU. No command
line in between. The stage's stdout and stderr (progress bars included) go to the rule's log,
headed by the equivalent `aqflow <stage>` command; a failing stage fails the job with the log's
path in the message.

These functions are the one mapping from a rule to its stage, tested against the stages'
dataclasses (tests/jobs/test_workflow_glue.py: every key the config schema allows in a section lands
in the field it names). Most config keys are the stage field of the same name; the exceptions are
spelled out where they happen.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from aqflow.io.artifacts import read_json
from aqflow.jobs import warm_workers
from aqflow.jobs.gpu_pool import pin_job_gpus, pool_folder
from aqflow.jobs.stage_jobs import execute_logged, last_error_line, stage_call
from aqflow.stagekit import stage_cli

# config `pvtune` keys that are the pvtune stage's own settings (its data); every other key the
# rule passes is a setting of the loop, the stage's nested `training` (aqflow.pvtune.train.PVSettings)
PVTUNE_DATA_KEYS = ("num_samples", "heldout_samples", "window_tokens", "heldout_fraction", "data_seed")
# config `corpora.<name>` keys that are fetch-data settings, under the stage's names
USER_CORPUS_KEYS = {"format": "file_format", "text_column": "text_column", "id_column": "id_column",
                    "separator": "separator"}


@dataclass(frozen=True)
class StageCall:
    """A job's stage call: its settings and paths (plain values), run on `processes` processes (more
    than one: under torchrun, one per GPU of the job) or in a warm worker of the job's card that
    waits `warm_worker_idle_seconds` for its next job (None: in the job's own process)."""

    settings: dict
    paths: dict
    processes: int = 1
    warm_worker_idle_seconds: float | None = None


# --- what each stage's job hands it ----------------------------------------------------------------

def job_gpus(job) -> int:
    """The rule's `gpu` resource (0 when it has none)."""
    return int(getattr(job.resources, "gpu", 0) or 0)


def files(named) -> list[str]:
    """A named input of any number of files as a list of paths (one file comes as a str)."""
    return [named] if isinstance(named, str) else [str(path) for path in named]


def file_or_none(named) -> str | None:
    """A named input of at most one file: its path, or None (Snakemake gives none as an empty list)."""
    return str(named) if named else None


def fetch_model(job) -> StageCall:
    """The plan's request for the model (`models.<name>`); a local folder's `path` is an input path."""
    request = job.params.request
    settings = {key: value for key, value in request.items() if key != "path"}
    return StageCall(settings, {"output_dir": job.output[0], "path": request.get("path")})


def fetch_data(job) -> StageCall:
    """The job's corpus, the share of its documents given to calibration and the split seed
    (`data`); of a user corpus's `corpora` entry (`params.user`, {} for built-ins) its file and how
    to read it, under the stage's names."""
    user = job.params.user
    settings = {"corpus": job.wildcards.corpus, "calibration_fraction": job.params.calibration_fraction,
                "seed": job.params.seed}
    settings.update({field: user[key] for key, field in USER_CORPUS_KEYS.items() if user.get(key) is not None})
    return StageCall(settings, {"output": job.output.corpus, "file": user.get("path")})


def calibrate(job) -> StageCall:
    """`calibration` (the plan's subset); in fp mode sharded over the job's GPUs (the same XᵀX).
    Its progress bars go to the job's log (a 3B calibration takes minutes)."""
    settings = dict(job.params.settings)
    if settings["propagation"] == "fp":
        settings["num_devices"] = max(1, job_gpus(job))
    paths = {"model_dir": job.input.model, "corpus": job.input.corpus, "output_dir": job.output[0]}
    return StageCall(settings, paths)


def calibrate_block(job) -> StageCall:
    """`calibration` (the plan's subset) for the job's block, on the previous block's quantized
    layers (block 1 reads no stored inputs: the embeddings are recomputed)."""
    p = job.params
    paths = {"model_dir": job.input.model, "calibration_dir": job.input.calibration,
             "previous_layers_dir": p.previous_layers_dir, "output_dir": job.output.calibration,
             "inputs_output": job.output.inputs, "previous_inputs": file_or_none(job.input.previous_inputs),
             "previous_block_tensors": p.previous_block_tensors or None}
    return StageCall({**p.settings, "block": int(job.wildcards.block), "quiet": True}, paths)


def finetune_block(job) -> StageCall:
    """`calibration.block_finetune` (less `enabled`) is the stage's `tuning`; block 0 reads no
    stored inputs (the embeddings are recomputed)."""
    settings = {"block": int(job.wildcards.block), "tuning": dict(job.params.settings), "quiet": True}
    paths = {"model_dir": job.input.model, "calibration_dir": job.input.calibration,
             "layers_dir": job.params.layers_dir, "output_dir": job.output[0],
             "inputs": file_or_none(job.input.inputs)}
    return StageCall(settings, paths)


def quantize_layer(job) -> StageCall:
    """The variant's quantizer settings (`quantization`, the bit rate and the path) are the stage's
    `quantizer`; where `execution.warm_workers` wants it (`warm_workers.wanted`: true, or "auto" on a
    GPU machine outside a batch scheduler's job) the call runs in a warm worker of the job's card."""
    execution = job.params.execution
    paths = {"model_dir": job.input.model, "calibration_dir": job.input.calibration, "layer": job.wildcards.layer,
             "output": job.output.layer, "metrics": job.output.metrics}
    return StageCall({"quantizer": dict(job.params.settings)}, paths,
                     warm_worker_idle_seconds=(execution.warm_worker_idle_seconds
                                               if warm_workers.wanted(execution.warm_workers) else None))


def stitch(job) -> StageCall:
    p = job.params
    settings = {"num_codebooks": p.num_codebooks, "nbits": p.nbits, "group_size": p.group_size}
    paths = {"model_dir": job.input.model, "layers_dir": p.layers_dirs, "replace_tensors": p.replace_tensors,
             "output_dir": job.output[0]}
    return StageCall(settings, paths)


def pvtune(job) -> StageCall:
    """`pvtune` as the plan passes it: its data keys (PVTUNE_DATA_KEYS) at the top, the loop's under
    `training`, and `execution`'s pvtune options (how often it saves its state, how long it waits
    for a full card's memory). More than one GPU of the job: under torchrun, data-parallel. Its progress bar (steps done and left) goes to the job's log."""
    section = job.params.settings
    settings = {key: section[key] for key in PVTUNE_DATA_KEYS if key in section}
    settings["training"] = {key: value for key, value in section.items() if key not in PVTUNE_DATA_KEYS}
    settings.update(job.params.execution.stage_options("pvtune"))
    out = job.output
    paths = {"model_dir": job.input.model, "checkpoint_dir": job.input.checkpoint, "corpus": job.input.corpus,
             "output_dir": out.model, "train_log": out.train_log, "metrics": out.metrics,
             # beside the outputs, not among them: Snakemake deletes a failed job's outputs, not
             # this, so a rerun resumes
             "state_dir": str(Path(out.metrics).parent / "state")}
    return StageCall(settings, paths, processes=job_gpus(job))


def evaluate(job) -> StageCall:
    """`evaluation` with the job's label, the upstream record eval.json embeds (`upstream_record`)
    and the logits budget and AQLM kernels of `execution` (how the job runs: they change no metric
    beyond float rounding); one perplexity
    domain per evaluation corpus of the model's text (none: no perplexity). Its progress bars
    (perplexity batches, zero-shot requests) go to the job's log."""
    p = job.params
    domains = [(name, protocol, corpus) for (name, protocol), corpus in zip(p.domains, files(job.input.get("corpora", [])))]
    settings = {**p.evaluation, "label": p.label, "upstream": upstream_record(job), **p.execution.stage_options("evaluate")}
    if not domains:
        settings["perplexity"] = []
    pvtune_record = job.input.get("pvtune")
    paths = {"model_dir": job.input.model, "output": job.output[0], "domain": domains or None,
             "pre_pv": job.input.pre_pv if pvtune_record else None}
    return StageCall(settings, paths)


def upstream_record(job) -> dict:
    """What an evaluation records of how its model was made: the rule's quantizer, calibration and
    evaluation settings, each layer's metrics, block fine-tuning, and a PV-tuned model's training
    record."""
    wildcards = dict(job.wildcards)
    layers = layer_summaries(files(job.input.layer_metrics))
    record = {
        "model": wildcards["model"],
        "bpp": int(wildcards["bpp"]) if "bpp" in wildcards else None,
        "quantizer": dict(job.params.settings),
        "calibration": dict(job.params.calibration),
        "evaluation": dict(job.params.evaluation),
        "layers": layers,
        "block_finetune": block_finetune_summaries(files(job.input.tuned_blocks)),
        "quantization_seconds": sum(layer["total_seconds"] for layer in layers) if layers else None,
    }
    pvtune_record = job.input.get("pvtune")
    if pvtune_record:
        record["pvtune"] = json.loads(Path(pvtune_record).read_text())
    return record


def layer_summaries(metric_files: list[str]) -> list[dict]:
    """The per-layer facts the report plots, from quantize-layer metrics JSONs (in the given order)."""
    keys = ("layer", "out_features", "in_features", "rho", "bits_per_parameter", "init_relative_mse",
            "final_relative_mse", "init_seconds", "total_seconds", "stopped_because")
    summaries = []
    for path in metric_files:
        metrics = read_json(path, required=False)
        summaries.append({key: metrics.get(key) for key in keys} | {"epochs": len(metrics.get("epochs", []))})
    return summaries


def block_finetune_summaries(tuned_block_dirs: list[str]) -> list[dict]:
    """Per block: relative output error before and after block fine-tuning, from each tuned block
    folder's finetune.json (an empty list when fine-tuning is off)."""
    keys = ("block", "relative_mse_before", "relative_mse_after", "best_epoch", "seconds")
    summaries = []
    for folder in tuned_block_dirs:
        record = read_json(Path(folder) / "finetune.json", required=False)
        summaries.append({key: record.get(key) for key in keys})
    return summaries


def domain_distances(job) -> StageCall:
    paths = {"model_dir": job.input.model, "calibration": job.input.calibration, "corpora": files(job.input.corpora),
             "output": job.output[0]}
    return StageCall({"quiet": True}, paths)


def paper_tables(job) -> StageCall:
    """The grid's domains; one domains.json per model, in the order of `params.models`."""
    distances = [f"{model}={path}" for model, path in zip(job.params.models, files(job.input.distances), strict=True)]
    paths = {"out_dir": Path(job.output.readme).parent, "expected_cells": job.input.grid,
             "domain_distances": distances}
    return StageCall({"domains": job.params.domains}, paths)


def speed(job) -> StageCall:
    """`speed` as the plan passes it (less `enabled`), every key the stage field of the same name, and
    the job's CPU threads (its `threads:`, config resources.speed.cpus: the cores Snakemake gave the
    job, which a CPU measurement uses and records)."""
    return StageCall({**job.params.settings, "threads": job.threads},
                     {"model_dir": job.input.model, "output": job.output[0]})


def report(job) -> StageCall:
    """The speed figure is an output only with `speed.enabled`."""
    out = job.output
    paths = {"evals": job.input.evals, "csv": out.table, "parquet": out.parquet, "pareto": out.pareto,
             "layers": out.layers, "pv_curves": out.pv_curves, "pv_logs": job.input.pv_logs,
             "speeds": job.input.speeds, "speed_plot": out.get("speed"),
             "stage_times": out.stage_times, "benchmarks": job.params.benchmarks}
    return StageCall({}, paths)


# stage -> the function that reads its call from a job (the stage names of aqflow.__main__.STAGES)
JOB_CALLS: dict[str, Callable[[Any], StageCall]] = {
    "fetch-model": fetch_model, "fetch-data": fetch_data, "calibrate": calibrate, "calibrate-block": calibrate_block,
    "finetune-block": finetune_block, "quantize-layer": quantize_layer, "stitch": stitch, "pvtune": pvtune,
    "evaluate": evaluate, "speed": speed, "domain-distances": domain_distances, "paper-tables": paper_tables,
    "report": report,
}


# --- running it -------------------------------------------------------------------------------------

def run_job(job, stage: str) -> None:
    """Run `aqflow <stage>` as the rule's job `job` (a rule script's `snakemake` object): the call
    JOB_CALLS[stage] reads from it, under torchrun when it asks for several processes."""
    call = JOB_CALLS[stage](job)
    if call.processes > 1:
        run_stage_on_gpus(job, stage, call.settings, call.paths, call.processes)
    else:
        run_stage(job, stage, call.settings, call.paths, call.warm_worker_idle_seconds)


def run_stage(job, stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any],
              warm_worker_idle_seconds: float | None = None) -> None:
    """Run stage `stage` (`run(settings, paths)`) for the job, logging to the rule's log.

    A stage's one-line input error (exit 2) is in the log and in the job's failure message; a bug's
    traceback is written to the log too before it propagates. A GPU job is pinned to the least-busy
    card of the node (`gpu_pool`) before the stage (and torch) is imported, and the stale temporaries
    of this job's earlier, killed runs are removed first. The stage runs in this process, or, given
    `warm_worker_idle_seconds`, in a warm worker of the job's card (`aqflow.jobs.warm_workers`).
    Call it last: see `skip_exit_collection`."""
    pin_job_gpus(job_gpus(job))
    log_path = str(job.log[0])
    outputs = [str(output) for output in getattr(job, "output", [])]
    outcome = None
    if warm_worker_idle_seconds is not None:
        outcome = run_in_warm_worker(stage, settings, paths, log_path, outputs, warm_worker_idle_seconds)
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
                       outputs: list[str], idle_seconds: float) -> tuple[int, str] | None:
    """`execute_logged` in a warm worker of the job's card (`aqflow.jobs.warm_workers`); None where
    workers are not supported or none could be started (the caller then runs it in process)."""
    if not warm_workers.supported():
        return None
    request = {"stage": stage, "settings": settings, "paths": paths, "log": log_path, "outputs": outputs,
               "cwd": str(Path.cwd())}
    return warm_workers.run_in_worker(request, pool_folder(), float(idle_seconds))


def skip_exit_collection() -> None:
    """The job's process ends after its stage: let the interpreter's exit skip collecting the
    objects alive now (torch's alone take ~0.35 s of a layer job's ~1 s of fixed cost on a CPU).
    Only garbage cycles left at exit are affected (their finalizers do not run); every artifact
    and the log are closed by then."""
    gc.freeze()


def run_stage_on_gpus(job, stage: str, settings: Mapping[str, Any], paths: Mapping[str, Any], num_gpus: int) -> None:
    """`run_stage`, or with num_gpus > 1 the stage under torchrun with one process per GPU of the
    job (each process joins the group torchrun describes), its output going to the rule's log. The
    processes get the stage's command line, written from its dataclasses (`stage_cli.to_argv`)."""
    if num_gpus <= 1:
        run_stage(job, stage, settings, paths)
        return
    import subprocess

    pin_job_gpus(num_gpus)  # torchrun's processes inherit the chosen cards

    from aqflow.calibration.sharded import torchrun_command
    from aqflow.stagekit.processes import die_with_parent

    _, settings_, paths_ = stage_call(stage, settings, paths)
    command = torchrun_command(num_gpus, "aqflow", [stage, *stage_cli.to_argv(settings_, paths_)])
    log_path = job.log[0]
    with open(log_path, "w") as log:
        print(" ".join(command), file=log, flush=True)
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent).returncode
    if code:
        raise SystemExit(f"aqflow {stage} on {num_gpus} GPUs failed with exit code {code}: "
                         f"{last_error_line(log_path)} (log: {log_path})")
