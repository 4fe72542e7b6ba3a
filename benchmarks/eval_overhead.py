"""The fixed cost of one evaluation: everything `python -m aqflow evaluate` does besides the model's
forward passes, phase by phase, for two source trees (before / after) in one call.

    # before = another copy of the source tree (`git archive <commit> src | tar -x -C before`)
    PYTHONPATH=src python3 benchmarks/eval_overhead.py --before before/src --after src \\
        --model-dir $AQFLOW_CACHE/smollm2/hf-float16 --data-dir resources/data \\
        --task-data-dir $AQFLOW_CACHE/zero-shot [--device cuda] [--task-limit 5] [--repeats 3] \\
        --work /tmp/eval_overhead --out $OUT/eval_overhead.json

Each run is one `aqflow evaluate` process of the given tree, as the DAG runs it (six zero-shot
tasks, the WikiText-2 and C4 stand-in perplexities), but with few examples (--task-limit) and
short windows (--context, one window per domain) so that the forward passes are small; they are
timed anyway (CUDA-synchronised hooks around the model's forward) and taken out: the fixed cost is
the process's wall time less its forward seconds. The child process (this file's `child` mode)
times its imports, then runs `python -m aqflow evaluate` in itself (the tree's own `__main__`, so
its own way of exiting) and times every phase of the stage by wrapping the stage's and lm-eval's
functions (no profiler, so nothing is slowed down); phases are inclusive and nest as printed;
"process exit" is from the last atexit callback to the process's end (the interpreter's
teardown). The runs alternate before / after, --repeats times each, on one machine, and the table
shows medians. Offline: set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 (the runs set them too). The
runs' PYTHONPATH is the tree, then $SITE if set (the GPU box's staged packages, as for
eval_speed.py). AQFLOW_CACHE is where `after` keeps what evaluations share (the task data's Arrow
copies, the perplexity windows): "after" runs with it as an earlier evaluation left it (--warmup:
untimed runs first), "after_cold" with an empty one of its own each time, as the first evaluation
on a machine.

--host-only --task-limit 0: every example of the six tasks, with lm-eval's model calls and aqflow's
scoring replaced by constants, so what is timed is the tasks' host work (request building,
tokenization, batching, metrics): the part of a full evaluation that no faster forward removes.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (phase, module, attribute path) of the functions the child wraps in a timer; a tree that lacks one
# simply has no such phase. Nesting (for the table): stage main > evaluate phases > lm-eval phases.
STAGE_PHASES = (
    ("verify_inputs", "aqflow.stages.evaluate", "verify_inputs"),
    ("bits_per_parameter", "aqflow.stages.evaluate", "stored_bits_per_parameter"),
    ("tokenizer", "aqflow.stages.evaluate", "load_tokenizer"),
    ("perplexity_data", "aqflow.stages.evaluate", "perplexity_windows_for"),
    ("task_data_dir", "aqflow.stages.evaluate", "zero_shot_data_dir"),
    ("model_load", "aqflow.stages.evaluate", "load_model"),
    ("perplexity", "aqflow.stages.evaluate", "perplexity_metrics"),
    ("zero_shot", "aqflow.stages.evaluate", "run_tasks"),
    ("settings_record", "aqflow.stages.evaluate", "settings_record"),
    ("write_json", "aqflow.io.artifacts", "write_json"),
)
LM_EVAL_PHASES = (
    ("lm_eval_simple_evaluate", "lm_eval.evaluator", "simple_evaluate"),
    ("task_building", "lm_eval.tasks", "TaskManager.load"),
    ("requests_scoring_metrics", "lm_eval.evaluator", "evaluate"),
    ("request_building", "lm_eval.api.task", "ConfigurableTask.build_all_requests"),
    ("prefetch_tokenization", "aqflow.evaluation.batched_scoring", "BatchedScoringLM.prefetch_encodings"),
    ("loglikelihood", "lm_eval.models.huggingface", "HFLM.loglikelihood"),
    ("process_results", "lm_eval.api.task", "ConfigurableTask.process_results"),
    ("bootstrap_stderr", "lm_eval.api.metrics", "bootstrap_stderr"),
)
# imported one after another before the stage runs, each timed (the stage imports them lazily)
IMPORTS = (
    ("torch", ("torch",)),
    ("transformers", ("transformers", "transformers.modeling_utils", "transformers.models.auto.tokenization_auto",
                      "transformers.models.auto.modeling_auto")),
    ("datasets", ("datasets",)),
    ("lm_eval", ("lm_eval", "lm_eval.evaluator", "lm_eval.tasks", "lm_eval.models.huggingface")),
    ("aqflow", ("aqflow.stages.evaluate", "aqflow.evaluation.zero_shot", "aqflow.evaluation.batched_scoring")),
)


# --- the child: one timed evaluation ---------------------------------------------------------------

class PhaseClock:
    """Inclusive seconds and call counts per phase name."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, phase: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
                self.calls[phase] = self.calls.get(phase, 0) + 1
        return timed

    def install(self, phases) -> list[str]:
        """Wrap each (phase, module, "Class.attr" or "attr") that exists; the phases installed."""
        installed = []
        for phase, module_name, attribute in phases:
            try:
                owner = importlib.import_module(module_name)
            except ImportError:
                continue
            *classes, name = attribute.split(".")
            for class_name in classes:
                owner = getattr(owner, class_name, None)
            if owner is None or not hasattr(owner, name):
                continue
            setattr(owner, name, self.wrap(phase, getattr(owner, name)))
            installed.append(phase)
        return installed


class ForwardClock:
    """Seconds inside a model's forward, synchronised with the GPU on both sides."""

    def __init__(self):
        self.seconds, self.calls, self._started = 0.0, 0, 0.0

    def attach(self, model):
        import torch

        cuda = next(model.parameters()).is_cuda

        def before(*_):
            if cuda:
                torch.cuda.synchronize()
            self._started = time.perf_counter()

        def after(*_):
            if cuda:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - self._started
            self.calls += 1

        model.register_forward_pre_hook(before)
        model.register_forward_hook(after)
        return model


def without_model_work() -> None:
    """lm-eval's model calls return a placeholder and every batch's scores are constants: what is
    left of a zero-shot evaluation is its host work (requests, tokenization, batching, metrics)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    HFLM._model_call = lambda self, inputs, attn_mask=None, labels=None: torch.zeros(1, 1, 1)
    try:
        from aqflow.evaluation import batched_scoring
    except ImportError:
        return
    batched_scoring.score_batch = lambda logits, layout, dtype: (
        torch.full((layout.num_requests,), -1.0, dtype=torch.float64),
        torch.zeros(layout.num_requests, dtype=torch.bool))


def child(launched_at: float, phases_out: Path, stage_argv: list[str]) -> None:
    """Time imports, then run `python -m aqflow evaluate <stage_argv>` in this process exactly as
    that command does (its `__main__`, its way of exiting); the record is written by an atexit
    callback, the last thing before the process's own exit. HOST_ONLY=1 in the environment: the
    zero-shot model work is replaced (`without_model_work`)."""
    entered_at = time.time()
    record = {"process_start_seconds": entered_at - launched_at, "imports": {}}
    for name, modules in IMPORTS:
        started = time.perf_counter()
        for module in modules:
            importlib.import_module(module)
        record["imports"][name] = time.perf_counter() - started
    import torch

    if os.environ.get("HOST_ONLY") == "1":
        without_model_work()
    clock, forward = PhaseClock(), ForwardClock()
    installed = clock.install(STAGE_PHASES) + clock.install(LM_EVAL_PHASES)
    installed += clock.install((("stage_main", "aqflow.stages.evaluate", "main"),))
    stage = importlib.import_module("aqflow.stages.evaluate")
    load_model = stage.load_model  # already wrapped: attach the forward clock to what it returns
    stage.load_model = lambda *args, **kwargs: forward.attach(load_model(*args, **kwargs))

    def write_record():
        record.update(stage_main_seconds=clock.seconds.pop("stage_main", None), phases=clock.seconds,
                      calls=clock.calls, installed=installed, forward_seconds=forward.seconds,
                      forward_calls=forward.calls, exited_at=time.time(),
                      device=torch.cuda.get_device_name() if torch.cuda.is_available()
                      else platform.processor() or "cpu")
        phases_out.write_text(json.dumps(record, indent=1))

    atexit.register(write_record)
    sys.argv = ["aqflow", "evaluate", *stage_argv]
    runpy.run_module("aqflow", run_name="__main__", alter_sys=True)


# --- the parent: runs, medians, table --------------------------------------------------------------

def stage_argv(args: argparse.Namespace, output: Path) -> list[str]:
    data = args.data_dir
    argv = ["--model-dir", str(args.model_dir), "--output", str(output),
            "--domain", "wikitext2-standin", "joined", str(data / "wikitext2-standin.parquet"),
            "--domain", "c4-standin", "sampled", str(data / "c4-standin.parquet"),
            "--context", str(args.context), "--max-windows", "1", "--c4-windows", "1",
            "--task-data-dir", str(args.task_data_dir),
            "--batch-size", "1", "--task-batch-size", str(args.task_batch_size), "--quiet"]
    argv += ["--task-limit", str(args.task_limit)] if args.task_limit else []
    return argv + (["--device", args.device] if args.device else [])


def run_once(source: Path, args: argparse.Namespace, run_dir: Path, cold: bool = False) -> dict:
    """One child evaluation from `source`; its record with the process's wall and fixed seconds.
    cold: with an empty AQFLOW_CACHE of its own (the model and data are named explicitly, so the
    cache holds only what evaluations keep between them), as the first evaluation on a machine."""
    run_dir.mkdir(parents=True, exist_ok=True)
    phases_out = run_dir / "phases.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(source.resolve()), *filter(None, [os.environ.get("SITE")])])}
    if cold:
        env["AQFLOW_CACHE"] = str(run_dir / "empty-cache")
    if args.host_only:
        env["HOST_ONLY"] = "1"
    launched_at = time.time()
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, __file__, "child", str(launched_at), str(phases_out), "--",
                                *stage_argv(args, run_dir / "eval.json")], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"evaluation from {source} failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    record = json.loads(phases_out.read_text())
    record["wall_seconds"] = wall
    record["process_exit_seconds"] = launched_at + wall - record.pop("exited_at")
    record["fixed_seconds"] = wall - record["forward_seconds"]
    record["metrics"] = json.loads((run_dir / "eval.json").read_text())["metrics"]
    return record


def medians(runs: list[dict]) -> dict:
    """Median over runs of every number of a run record (nested dicts of phases included)."""
    def collect(key_path):
        values = []
        for run in runs:
            value = run
            for key in key_path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                values.append(value)
        return statistics.median(values) if values else None

    out = {}
    for key in ("process_start_seconds", "stage_main_seconds", "process_exit_seconds", "wall_seconds",
                "forward_seconds", "fixed_seconds"):
        out[key] = collect((key,))
    for group in ("imports", "phases"):
        names = sorted({name for run in runs for name in run.get(group, {})})
        out[group] = {name: collect((group, name)) for name in names}
    return out


def print_table(result: dict) -> None:
    labels = list(result["medians"])
    rows = [("process start (interpreter)", "process_start_seconds", None)]
    rows += [(f"import {name}", name, "imports") for name, _ in IMPORTS]
    rows += [("stage main", "stage_main_seconds", None)]
    depth = {"lm_eval_simple_evaluate": 2, "task_building": 3, "requests_scoring_metrics": 3,
             "request_building": 4, "prefetch_tokenization": 4, "loglikelihood": 4, "process_results": 4,
             "bootstrap_stderr": 4}
    for phase, _, _ in STAGE_PHASES + LM_EVAL_PHASES:
        indent = "  " * depth.get(phase, 1)
        rows.append((indent + phase, phase, "phases"))
    rows += [("process exit", "process_exit_seconds", None), ("wall", "wall_seconds", None),
             ("  of which forward", "forward_seconds", None), ("fixed (wall - forward)", "fixed_seconds", None)]
    print(f"\n{result['device']}, median of {result['repeats']} runs each, task limit {result['task_limit']}, "
          f"context {result['context']}")
    print(f"{'seconds':36s}" + "".join(f"{label:>12s}" for label in labels))
    for title, key, group in rows:
        values = [result["medians"][label].get(group, {}).get(key) if group else result["medians"][label][key]
                  for label in labels]
        print(f"{title:36s}" + "".join(f"{v:12.2f}" if v is not None else f"{'-':>12s}" for v in values))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        child(float(argv[1]), Path(argv[2]), argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old source tree (its src/)")
    parser.add_argument("--after", type=Path, required=True, help="the new source tree (its src/)")
    parser.add_argument("--model-dir", type=Path, required=True, help="a model folder (SmolLM2 fp16)")
    parser.add_argument("--data-dir", type=Path, required=True, help="folder with the two stand-in corpora")
    parser.add_argument("--task-data-dir", type=Path, required=True, help="the six tasks' JSONL files")
    parser.add_argument("--device", default=None, help="evaluate's --device (default: its own)")
    parser.add_argument("--task-limit", type=int, default=5, help="examples per task (0: all)")
    parser.add_argument("--task-batch-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="perplexity window length (one window per domain)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--host-only", action="store_true", help="replace the zero-shot model calls and scoring by "
                        "constants: the host work of the tasks (with --task-limit 0: of every example); the "
                        "metrics are then meaningless")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each tree first")
    parser.add_argument("--machine", default=None, help="how to name the machine in the JSON (default: the device)")
    parser.add_argument("--before-name", default=None, help="how to name the old tree in the JSON (e.g. its commit)")
    parser.add_argument("--after-name", default=None, help="how to name the new tree in the JSON")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eval_overhead"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "eval_overhead.json")
    args = parser.parse_args(argv)

    # (tree, empty cache of its own): "after" with the caches an earlier evaluation left, and without
    trees = {"before": (args.before, False), "after_cold": (args.after, True), "after": (args.after, False)}
    for index in range(args.warmup):
        for label, (source, cold) in trees.items():
            run_once(source, args, args.work / f"warmup{index}-{label}", cold)
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for index in range(args.repeats):
        for label, (source, cold) in trees.items():
            run = run_once(source, args, args.work / f"run{index}-{label}", cold)
            runs[label].append(run)
            print(f"{label} run {index}: wall {run['wall_seconds']:.2f} s, forward {run['forward_seconds']:.2f} s, "
                  f"fixed {run['fixed_seconds']:.2f} s", flush=True)
    first = runs["after"][0]
    result = {"device": first["device"], "machine": args.machine or first["device"],
              "python": platform.python_version(), "task_limit": args.task_limit, "context": args.context,
              "task_batch_size": args.task_batch_size, "repeats": args.repeats, "host_only": args.host_only,
              "sources": {"before": args.before_name or str(args.before), "after": args.after_name or str(args.after)},
              "medians": {label: medians(label_runs) for label, label_runs in runs.items()},
              "metrics_equal": all(run["metrics"] == runs["before"][0]["metrics"] for label_runs in runs.values()
                                   for run in label_runs),
              "runs": runs}
    fixed = {label: medians_of["fixed_seconds"] for label, medians_of in result["medians"].items()}
    result["fixed_seconds_saved"] = fixed["before"] - fixed["after"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"\nfixed cost saved: {result['fixed_seconds_saved']:.2f} s a run; metrics equal in every run: "
          f"{result['metrics_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
