"""Zero-shot accuracy through lm-eval, on local copies of the task data.

The six task configs in `tasks/*.yaml` reproduce lm-eval's standard arc_easy, arc_challenge,
hellaswag, piqa, winogrande and lambada_openai (same prompts, choices, targets and metrics; the
hellaswag and winogrande preprocessing functions are imported from the installed lm-eval), except
that the data is read with `dataset_path: json` from the JSONL files of
`aqflow.data.zero_shot`. The templates are filled with the data paths at run time and written
into a work folder, which a TaskManager then indexes without lm-eval's built-in tasks (so the
standard task names are free and nothing touches a hub). The model is the already-loaded one,
wrapped in lm-eval's HFLM, whose requests are scored a batch at a time by default, with each
prompt template compiled once and the request strings tokenized in one batch
(`aqflow.evaluation.batched_scoring`: same requests, batches and numbers, less host work).

Three fixed costs of an evaluation go too, without changing a request or a number (measured by
`benchmarks/eval_overhead.py`, in the git history): the Arrow copies `datasets` makes of the JSONL (and of hellaswag's
preprocessed split) can live in a folder kept between evaluations (`datasets_cache_dir`); each task
is built without the few-shot sampler lm-eval fills with a list of every document (a zero-shot
prompt never draws from it); and lambada's bootstrapped stderr is computed in this process, with
lm-eval's own serial code (same seeds and draws), not in a pool of one process per CPU core
forked from this one for its single chunk of draws.
"""

from __future__ import annotations

import contextlib
import json
import os
import string
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from ..data.zero_shot import ZERO_SHOT_TASKS
from .logits_budget import DEFAULT_LOGITS_BUDGET_BYTES

TASK_TEMPLATES_DIR = Path(__file__).with_name("tasks")
DEFAULT_BOOTSTRAP_ITERS = 1000  # only lambada's perplexity stderr is bootstrapped; 1000 draws suffice
SCORING = ("batched", "lm-eval")  # batched: BatchedScoringLM; lm-eval: its HFLM as shipped

# The accuracy each task is usually quoted with in quantization papers' tables: length-normalised
# for ARC-Challenge and HellaSwag, plain for the rest. avg_acc uses plain acc everywhere, so it
# depends on no such choice; avg_headline follows this table.
HEADLINE_METRIC = {
    "arc_easy": "acc",
    "arc_challenge": "acc_norm",
    "hellaswag": "acc_norm",
    "piqa": "acc",
    "winogrande": "acc",
    "lambada_openai": "acc",
}


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """The task list, deduplicated in order; raises ValueError naming any unknown task."""
    unknown = [task for task in tasks if task not in ZERO_SHOT_TASKS]
    if unknown:
        raise ValueError(f"unknown zero-shot tasks {unknown}; known: {list(ZERO_SHOT_TASKS)}")
    return list(dict.fromkeys(tasks))


def write_task_configs(data_files: Mapping[str, str | os.PathLike], config_dir: str | os.PathLike,
                       datasets_cache_dir: str | os.PathLike) -> Path:
    """Fill each task template with its local data file and write `<config_dir>/<task>.yaml`.

    data_files: {task: JSONL path}. datasets_cache_dir: where `datasets` keeps its Arrow copy of
    the JSONL (inside the run's work folder, not the user's shared HF cache).
    Returns config_dir, ready for `TaskManager(include_path=config_dir, include_defaults=False)`.
    """
    config_dir = Path(config_dir)
    config_dir.mkdir(parents=True, exist_ok=True)
    for task, data_file in data_files.items():
        template = string.Template((TASK_TEMPLATES_DIR / f"{task}.yaml").read_text())
        # JSON strings are valid YAML double-quoted scalars: any path survives quoting.
        text = template.substitute(data_file=json.dumps(str(Path(data_file).resolve())),
                                   cache_dir=json.dumps(str(Path(datasets_cache_dir).resolve())))
        (config_dir / f"{task}.yaml").write_text(text)
    return config_dir


def task_metrics(results: Mapping[str, Mapping]) -> dict[str, dict[str, float]]:
    """lm-eval's `results["results"]` -> {task: {metric: value}}, dropping the ",none" filter
    suffix and the alias (e.g. {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": ...})."""
    out = {}
    for task, entries in results.items():
        out[task] = {key.split(",")[0]: float(value) for key, value in entries.items()
                     if "," in key and isinstance(value, (int, float))}
    return out


def average_accuracy(metrics: Mapping[str, Mapping[str, float]]) -> dict:
    """avg_acc (mean plain `acc` over the tasks) and avg_headline (mean of HEADLINE_METRIC)."""
    if not metrics:
        return {"avg_acc": None, "avg_headline": None, "headline_metrics": {}}
    headline = {task: HEADLINE_METRIC[task] for task in metrics}
    return {
        "avg_acc": sum(m["acc"] for m in metrics.values()) / len(metrics),
        "avg_headline": sum(metrics[t][name] for t, name in headline.items()) / len(metrics),
        "headline_metrics": headline,
    }


@contextlib.contextmanager
def zero_shot_tasks_only() -> Iterator[None]:
    """Inside: lm-eval builds each task without a few-shot sampler. Its `ConfigurableTask.__init__`
    otherwise copies every document of the split (hellaswag's after its preprocessing) into the
    sampler's list; a zero-shot prompt never reads it (`fewshot_context` samples only when
    num_fewshot > 0), so the requests are the same. Not for few-shot runs."""
    from lm_eval.api.task import ConfigurableTask

    shipped = ConfigurableTask.fewshot_docs
    ConfigurableTask.fewshot_docs = lambda self: None  # __init__ makes no sampler for None
    try:
        yield
    finally:
        ConfigurableTask.fewshot_docs = shipped


@contextlib.contextmanager
def bootstrap_in_process() -> Iterator[None]:
    """Inside: lm-eval's `bootstrap_stderr` takes its serial path (env DISABLE_MULTIPROC): the same
    chunks with the same seeds and draws, so the same stderr, without a pool of cpu_count() worker
    processes forked from this one (with the model loaded) for what is one chunk at 1000 draws."""
    previous = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = previous


def run_zero_shot(model, tokenizer, data_files: Mapping[str, str | os.PathLike], work_dir: str | os.PathLike,
                  limit: int | None = None, batch_size: int = 1, max_length: int | None = None,
                  bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS, seed: int = 0,
                  scoring: str = "batched", datasets_cache_dir: str | os.PathLike | None = None,
                  logits_budget_bytes: int | None = DEFAULT_LOGITS_BUDGET_BYTES) -> dict[str, dict[str, float]]:
    """Evaluate `model` zero-shot on the tasks of `data_files` ({task: JSONL}); return task metrics.

    limit: at most this many examples per task (the first ones, lm-eval's `limit`), None for all.
    max_length: the longest sequence lm-eval feeds the model (its left-truncation length).
    scoring: "batched" (BatchedScoringLM) or "lm-eval" (HFLM's own per-request scoring).
    datasets_cache_dir: where `datasets` keeps its Arrow copies of the JSONL files (keyed by path
    and modification time, so a folder shared between evaluations is reused, not mixed up);
    default `<work_dir>/datasets-cache`. The task configs go under `work_dir`.
    logits_budget_bytes: "batched" scoring cuts a batch whose logits would hold more (None: never).
    """
    check_tasks(list(data_files))
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")
    # Local JSON only: make sure `datasets` never looks for a hub copy.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    work_dir = Path(work_dir)
    datasets_cache_dir = Path(datasets_cache_dir) if datasets_cache_dir is not None else work_dir / "datasets-cache"
    config_dir = write_task_configs(data_files, work_dir / "tasks", datasets_cache_dir)
    manager = TaskManager(include_path=str(config_dir), include_defaults=False)
    from .batched_scoring import BatchedScoringLM, cached_templates

    lm_class = BatchedScoringLM if scoring == "batched" else HFLM
    lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    fast_host = contextlib.ExitStack()
    if scoring == "batched":  # "lm-eval" stays lm-eval as shipped, the reference of the tests
        lm.logits_budget_bytes = logits_budget_bytes
        for context in (cached_templates(), zero_shot_tasks_only(), bootstrap_in_process()):
            fast_host.enter_context(context)
    with fast_host:
        output = lm_eval.simple_evaluate(
            model=lm, tasks=list(data_files), num_fewshot=0, limit=limit, task_manager=manager,
            bootstrap_iters=bootstrap_iters, log_samples=False, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed,
        )
    return task_metrics(output["results"])
