"""Where the zero-shot evaluation's time goes on a GPU: host Python, model forward, or waiting.

    PYTHONPATH=src python3 benchmarks/eval_profile.py --tokenizer DIR --task-data-dir DIR \
        [--limit 500] [--batch-sizes 32 128] [--out $OUT/eval_profile.json]

The model is SmolLM2-135M's shape (30 blocks, hidden 576, MLP 1536, 9/3 heads, its tokenizer's
vocabulary) with random weights in float16 on the GPU: the answers are meaningless but every
request, padding and forward pass is the real evaluation's, so the cost is (no GGUF needs to
travel). For each batch size it runs the six tasks once through `run_zero_shot` (lm-eval's
requests, aqflow's batched scoring) under cProfile, and records: wall seconds, the seconds
inside the model's forward (CUDA-synchronised), inside lm-eval's request building, and the top
functions by own time. Prints a short table last and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch
from synthetic_models import random_llama


def smollm2_shaped_model(tokenizer_dir: Path, device: str):
    """A random LlamaForCausalLM of SmolLM2-135M's shape, float16 on `device` (float32 on a CPU),
    and its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    shape = dict(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                 tie_word_embeddings=True, rope_theta=100000.0)
    dtype = torch.float16 if device != "cpu" else torch.float32
    return random_llama(shape, tokenizer, device, dtype), tokenizer


class ForwardTimer:
    """Adds up the CUDA-synchronised seconds spent in a module's forward (hooks around it)."""

    def __init__(self, module: torch.nn.Module):
        self.seconds, self.calls, self._start = 0.0, 0, 0.0
        self._handles = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _before(self, *_):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def _after(self, *_):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def remove(self):
        for handle in self._handles:
            handle.remove()


def top_functions(profile: cProfile.Profile, count: int = 25) -> list[dict]:
    """The functions with the largest own time: [{function, calls, own_seconds, cumulative_seconds}]."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(filename).name}:{line}({name})", "calls": calls,
                     "own_seconds": own, "cumulative_seconds": cumulative})
    return sorted(rows, key=lambda row: -row["own_seconds"])[:count]


def cumulative_of(profile: cProfile.Profile, name_part: str) -> float:
    """The largest cumulative seconds of a function whose name contains `name_part`."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    values = [cumulative for (filename, line, name), (_, _, _, cumulative, _) in stats.stats.items()
              if name_part in f"{Path(filename).name}({name})"]
    return max(values, default=0.0)


def main(argv: list[str] | None = None) -> int:
    from aqflow.evaluation.zero_shot import run_zero_shot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with SmolLM2's tokenizer files")
    parser.add_argument("--task-data-dir", type=Path, required=True, help="the six tasks' JSONL files")
    parser.add_argument("--limit", type=int, default=None, help="examples per task (default: all)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eval_profile"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "eval_profile.json")
    args = parser.parse_args(argv)

    model, tokenizer = smollm2_shaped_model(args.tokenizer, args.device)
    tasks = ("arc_challenge", "arc_easy", "hellaswag", "lambada_openai", "piqa", "winogrande")
    files = {task: str(args.task_data_dir / f"{task}.jsonl") for task in tasks}
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "limit": args.limit, "runs": []}
    for batch_size in args.batch_sizes:
        timer = ForwardTimer(model)
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        run_zero_shot(model, tokenizer, files, args.work / f"b{batch_size}", limit=args.limit, batch_size=batch_size)
        profile.disable()
        wall = time.perf_counter() - started
        timer.remove()
        run = {"batch_size": batch_size, "wall_seconds": wall, "forward_seconds": timer.seconds,
               "forward_calls": timer.calls,
               "build_requests_seconds": cumulative_of(profile, "build_all_requests"),
               "loglikelihood_seconds": cumulative_of(profile, "_loglikelihood_tokens"),
               "task_loading_seconds": cumulative_of(profile, "_build_task"),
               "top_own_time": top_functions(profile)}
        result["runs"].append(run)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"batch {batch_size}: top functions by own time")
        for row in run["top_own_time"][:15]:
            print(f"  {row['own_seconds']:8.2f} s {row['calls']:>9} calls  {row['function']}")
    print(f"\n{result['device']}, limit {args.limit}")
    print(f"{'batch':>6}{'wall s':>9}{'forward s':>11}{'calls':>7}{'loglik s':>10}{'requests s':>12}{'tasks s':>9}")
    for run in result["runs"]:
        print(f"{run['batch_size']:>6}{run['wall_seconds']:>9.1f}{run['forward_seconds']:>11.1f}{run['forward_calls']:>7}"
              f"{run['loglikelihood_seconds']:>10.1f}{run['build_requests_seconds']:>12.1f}{run['task_loading_seconds']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
