"""Evaluation speed, main's source tree against this one, on one GPU, in one call.

    # before = another copy of the source tree (`git archive 423e9cc src`), after = this one
    PYTHONPATH=src python3 benchmarks/eval_speed.py run --before before/src --after src \\
        --model fp=resources/models/smollm2 --model oaem=results/smollm2/2bpp/oaem/b8/model \\
        --data-dir resources/data --task-data-dir $AQFLOW_CACHE/zero-shot --task-batch-size 32 128 \\
        --work /root/es --out $OUT/eval_speed.json
    python3 benchmarks/eval_speed.py merge $OUT/eval_speed.json --into benchmarks/results/throughput_h100.json

Each evaluation is `python -m aqflow evaluate` of one model folder from one source tree, as the DAG
runs it on a GPU, one at a time on an idle card; seconds are the whole process's wall time, with
eval.json's own split kept. "after" runs once per --task-batch-size; every run's metrics are kept
with their largest differences from "before".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PERPLEXITY_BATCH = int(os.environ.get("EVAL_SPEED_PERPLEXITY_BATCH", 32))  # profiles/gpu's evaluation.batch_size


def flat_metrics(metrics: dict) -> dict[str, float]:
    """eval.json metrics -> {"wikitext2-standin/perplexity": ..., "hellaswag/acc_norm": ..., "avg_acc": ...}."""
    flat = {}
    for name, value in metrics.items():
        if name == "tasks":
            for task, values in value.items():
                flat.update({f"{task}/{key}": float(v) for key, v in values.items()})
        elif isinstance(value, dict) and "perplexity" in value:
            flat[f"{name}/perplexity"] = float(value["perplexity"])
        elif isinstance(value, (int, float)):
            flat[name] = float(value)
    return flat


def run_evaluation(source: Path, model_dir: Path, args: argparse.Namespace, output: Path,
                   extra: list[str]) -> dict:
    """One `aqflow evaluate` process from `source`; its wall seconds, timings and metrics."""
    data_dir = args.data_dir
    argv = [sys.executable, "-m", "aqflow", "evaluate", "--model-dir", str(model_dir), "--output", str(output),
            "--domain", "wikitext2-standin", "joined", str(data_dir / "wikitext2-standin.parquet"),
            "--domain", "c4-standin", "sampled", str(data_dir / "c4-standin.parquet"),
            "--task-data-dir", str(args.task_data_dir), "--batch-size", str(PERPLEXITY_BATCH), "--quiet", *extra]
    if args.task_limit:
        argv += ["--task-limit", str(args.task_limit)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), *filter(None, [os.environ.get("SITE")])])}
    started = time.perf_counter()
    completed = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"evaluate from {source} failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    payload = json.loads(output.read_text())
    print(f"  {source} {' '.join(extra)}: {seconds:.1f} s  {completed.stdout.strip()}", flush=True)
    return {"seconds": seconds, "timings": payload["timings"], "metrics": flat_metrics(payload["metrics"]),
            "settings": {key: payload["settings"].get(key) for key in ("batch_size", "task_batch_size", "gpu_kernel",
                                                                        "dtype", "device_name")}}


def largest_differences(before: dict[str, float], after: dict[str, float]) -> dict:
    """Largest |after - before| over accuracies and over perplexities (relative), and which metric."""
    accuracy = [(abs(after[k] - before[k]), k) for k in before if "/acc" in k and "stderr" not in k]
    perplexity = [(abs(after[k] - before[k]) / before[k], k) for k in before
                  if k.endswith("perplexity") and "stderr" not in k]
    return {"max_abs_accuracy_difference": max(accuracy, default=(0.0, None)),
            "max_relative_perplexity_difference": max(perplexity, default=(0.0, None))}


def run(args: argparse.Namespace) -> None:
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"device": device, "perplexity_batch_size": PERPLEXITY_BATCH,
              "task_limit": args.task_limit, "models": {}}
    for spec in args.model:
        label, _, folder = spec.partition("=")
        print(f"{label}: {folder}", flush=True)
        entry = {"model_dir": folder,
                 "before": run_evaluation(args.before, Path(folder), args, args.work / f"{label}-before.json", [])}
        entry["after"] = {}
        for size in args.task_batch_size:
            entry["after"][str(size)] = run_evaluation(args.after, Path(folder), args,
                                                       args.work / f"{label}-after-{size}.json",
                                                       ["--task-batch-size", str(size)])
            entry["after"][str(size)]["differences_from_before"] = largest_differences(
                entry["before"]["metrics"], entry["after"][str(size)]["metrics"])
        result["models"][label] = entry
        args.out.write_text(json.dumps(result, indent=2))
    print(table(result))


def table(result: dict) -> str:
    lines = [f"card: {result['device']}",
             "| model | run | seconds | zero-shot s | perplexity s | avg_acc | max |Δacc| | max rel Δppl |",
             "|---|---|---|---|---|---|---|---|"]
    for label, entry in result["models"].items():
        runs = [("before", entry["before"])] + [(f"after, task batch {size}", run) for size, run in entry["after"].items()]
        for name, one in runs:
            diff = one.get("differences_from_before", {})
            acc = diff.get("max_abs_accuracy_difference", ("", ""))
            ppl = diff.get("max_relative_perplexity_difference", ("", ""))
            lines.append(f"| {label} | {name} | {one['seconds']:.1f} | {one['timings']['zero_shot_seconds']:.1f} | "
                         f"{one['timings']['perplexity_seconds']:.1f} | {one['metrics'].get('avg_acc', float('nan')):.4f} | "
                         f"{acc[0] if acc[0] == '' else f'{acc[0]:.4f} ({acc[1]})'} | "
                         f"{ppl[0] if ppl[0] == '' else f'{ppl[0]:.1e} ({ppl[1]})'} |")
    return "\n".join(lines)


def merge(args: argparse.Namespace) -> None:
    """Add eval_seconds_before/after per model of the eval run into the throughput summary JSON."""
    result = json.loads(args.result.read_text())
    summary = json.loads(args.into.read_text()) if args.into.exists() else {}
    evaluation = {}
    for label, entry in result["models"].items():
        size = args.task_batch_size or min(entry["after"], key=lambda key: entry["after"][key]["seconds"])
        after = entry["after"][str(size)]
        evaluation[label] = {"eval_seconds_before": entry["before"]["seconds"], "eval_seconds_after": after["seconds"],
                             "speedup": entry["before"]["seconds"] / after["seconds"], "task_batch_size_after": int(size),
                             **after["differences_from_before"]}
    summary["evaluation"] = {"device": result["device"], "task_limit": result["task_limit"],
                             "perplexity_batch_size": result["perplexity_batch_size"], "smollm2": evaluation}
    args.into.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["evaluation"], indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--before", type=Path, required=True, help="source tree (src/) of the baseline")
    run_parser.add_argument("--after", type=Path, required=True, help="source tree (src/) measured")
    run_parser.add_argument("--model", action="append", required=True, metavar="LABEL=DIR")
    run_parser.add_argument("--data-dir", type=Path, required=True, help="folder of the stand-in corpora (fetch-data)")
    run_parser.add_argument("--task-data-dir", type=Path, required=True)
    run_parser.add_argument("--task-batch-size", type=int, nargs="+", default=[32])
    run_parser.add_argument("--task-limit", type=int, default=None, help="quick checks only")
    run_parser.add_argument("--work", type=Path, required=True)
    run_parser.add_argument("--out", type=Path, required=True)
    merge_parser = commands.add_parser("merge")
    merge_parser.add_argument("result", type=Path)
    merge_parser.add_argument("--into", type=Path, required=True)
    merge_parser.add_argument("--task-batch-size", type=int, default=None, help="default: the fastest")
    args = parser.parse_args()
    run(args) if args.command == "run" else merge(args)


if __name__ == "__main__":
    main()
