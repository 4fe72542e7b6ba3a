"""From a rule's params to its stage's settings: where config.yaml's sections meet the stages, and
how a job runs (`Execution`).

A rule passes config sections as the plan gives them (`aqflow.jobs.plan`: the values Snakemake
compares to decide reruns, so their shape stays as written). Each function here returns one
stage's settings as plain values shaped like its settings dataclass, a nested dataclass as a
nested mapping, which `stage_cli.from_dict` builds without guessing where a key belongs. Most
config keys are the stage field of the same name; the exceptions are spelled out below, and
tests/jobs/test_stage_settings.py checks that every key the config schema allows lands in a field.

Pure Python, importing nothing of aqflow: rule scripts call it before the stage (and torch) is
imported, and every job's script unpickles its `Execution` param (Snakemake's script preamble).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# config `pvtune` keys that are the pvtune stage's own settings (its data); every other key is a
# setting of the loop, the stage's nested `training` (aqflow.pvtune.train.PVSettings)
PVTUNE_DATA_KEYS = ("num_samples", "heldout_samples", "window_tokens", "heldout_fraction", "data_seed")
# config `corpora.<name>` keys that are fetch-data settings, under the stage's names
USER_CORPUS_KEYS = {"format": "file_format", "text_column": "text_column", "id_column": "id_column",
                    "separator": "separator"}


@dataclass(frozen=True)
class Execution:
    """How jobs run, not what they compute: config `execution`, and `pvtune.save_state_every`.

    Rules pass it whole as a param: Snakemake's rerun check compares only params of builtin types,
    so this one reaches the job's script without a changed value rerunning finished jobs."""

    warm_workers: bool
    warm_worker_idle_seconds: float
    logits_budget_gib: float
    cell_order: tuple[str, ...]
    save_state_every: int | None  # None: PV-tuning not configured

    @classmethod
    def from_config(cls, config: Mapping) -> "Execution":
        section = config["execution"]
        return cls(warm_workers=section["warm_workers"], warm_worker_idle_seconds=section["warm_worker_idle_seconds"],
                   logits_budget_gib=section["logits_budget_gib"], cell_order=tuple(section["cell_order"]),
                   save_state_every=(config.get("pvtune") or {}).get("save_state_every"))


def fetch_model(request: Mapping[str, Any]) -> dict:
    """fetch-model's settings: the plan's request for the model, but a local folder's `path` (an input)."""
    return {key: value for key, value in request.items() if key != "path"}


def fetch_data(corpus: str, user: Mapping[str, Any], calibration_fraction: float, seed: int) -> dict:
    """fetch-data's settings for `corpus`; `user`: its config `corpora` entry ({} for built-ins)."""
    settings = {"corpus": corpus, "calibration_fraction": calibration_fraction, "seed": seed}
    settings.update({field: user[key] for key, field in USER_CORPUS_KEYS.items() if user.get(key) is not None})
    return settings


def calibrate(calibration: Mapping[str, Any], num_gpus: int) -> dict:
    """calibrate's settings: config `calibration` (the plan's subset), in fp mode sharded over the
    job's GPUs (same XᵀX). Its progress bars go to the job's log (a 3B calibration takes minutes)."""
    settings = dict(calibration)
    if settings["propagation"] == "fp":
        settings["num_devices"] = max(1, num_gpus)
    return settings


def calibrate_block(calibration: Mapping[str, Any], block: int) -> dict:
    return {**calibration, "block": block, "quiet": True}


def finetune_block(block_finetune: Mapping[str, Any], block: int) -> dict:
    """finetune-block's settings: config `calibration.block_finetune` (less `enabled`) is its `tuning`."""
    return {"block": block, "tuning": dict(block_finetune), "quiet": True}


def quantize_layer(quantizer: Mapping[str, Any]) -> dict:
    """quantize-layer's settings: the variant's quantizer settings (config `quantization` and the path)."""
    return {"quantizer": dict(quantizer)}


def stitch(num_codebooks: int, nbits: int, group_size: int) -> dict:
    return {"num_codebooks": num_codebooks, "nbits": nbits, "group_size": group_size}


def evaluate(evaluation: Mapping[str, Any], label: str, upstream: Mapping[str, Any], execution: Execution,
             with_perplexity: bool = True) -> dict:
    """evaluate's settings: config `evaluation`, the job's label and upstream record, and the logits
    budget of `execution` (how the job runs: it changes no metric). Without perplexity domains, no
    perplexity is measured. Its progress bars (perplexity batches, zero-shot requests) go to the job's log."""
    settings = {**evaluation, "label": label, "upstream": dict(upstream),
                "logits_budget_gib": execution.logits_budget_gib}
    if not with_perplexity:
        settings["perplexity"] = []
    return settings


def pvtune(section: Mapping[str, Any], execution: Execution) -> dict:
    """pvtune's settings: config `pvtune` as the plan passes it, its data keys at the top and the
    loop's under `training`, and how often `execution` saves the state. Its progress bar (steps done
    and left, with an estimate) goes to the job's log."""
    data = {key: section[key] for key in PVTUNE_DATA_KEYS if key in section}
    training = {key: value for key, value in section.items() if key not in PVTUNE_DATA_KEYS}
    return {**data, "training": training, "save_state_every": execution.save_state_every}


def speed(section: Mapping[str, Any], threads: int) -> dict:
    """speed's settings: config `speed` as the plan passes it (less `enabled`), every key the stage
    field of the same name, and the job's CPU threads (its `threads:`, config resources.speed.cpus:
    the cores Snakemake gave the job, which a CPU measurement uses and records)."""
    return {**section, "threads": threads}
