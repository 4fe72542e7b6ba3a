"""The CPU decode speed-up of the 2x8 model over dense bf16, from single steps of both models in one
process, in turn: the Llama-3.2-3B-shaped models of benchmarks/inference_cpu.py (2x8 through
FastQuantizedLinear and dense bf16, both with bf16 linears through numba's GEMV, q/k/v and gate/up
fused, the one-token attention and layers of greedy_decode's CPU path), `--rounds` rounds of `--steps`
steps of each, after two warm-up steps a round.

    NUMBA_CACHE_DIR=/tmp/numba_cache PYTHONPATH=src:. python3 benchmarks/cpu_ratio_steps.py --threads 16 \\
        --out $OUT/ratio_steps.json

Why: `inference_cpu.py` decodes each model in its own process, round after round, and on the GPU hosts'
16-core machines a model's speed drifts between rounds (dense bf16 11.4, 10.5, then 9.2 tok/s in three
rounds on one machine), so a best-against-best ratio partly compares two moments of the machine. Here
the two models alternate every `--steps` steps in one process, so both see the same machine; the
ratio of median steps is the companion figure. Prints min and median step of each and the ratios, and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def decode_steps(model, cache, prompt: torch.Tensor, count: int) -> list[float]:
    """Seconds of `count` greedy steps after the prompt (two more run first, untimed), through `cache`."""
    from aqflow.inference.decode import step_logits

    length = prompt.shape[1]
    model(input_ids=prompt, position_ids=torch.arange(length)[None], past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    token, seconds = prompt[:, -1:], []
    for step in range(count + 2):
        started = time.perf_counter()
        token = step_logits(model, cache, token, torch.tensor([[length + step]])).argmax(-1, keepdim=True)
        if step >= 2:
            seconds.append(time.perf_counter() - started)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import numba

    from aqflow.inference.decode import fuse_projections, new_static_cache, one_token_paths
    from aqflow.inference.fast_linear import install_cpu_bf16_linears
    from aqflow.io.artifacts import atomic_path
    from benchmarks.inference_cpu import LLAMA_3B, random_llama

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    models = {}
    for name, linears in (("dense bf16", "dense"), ("2x8", "fast")):
        models[name] = random_llama(LLAMA_3B, torch.bfloat16, linears)
        install_cpu_bf16_linears(models[name])
        fuse_projections(models[name])
    prompt = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    steps = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, model in models.items():
                with one_token_paths(model):
                    steps[name] += decode_steps(model, new_static_cache(model, 8 + args.steps + 3), prompt,
                                                args.steps)
    summary = {name: {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}
               for name, times in steps.items()}
    record = {"threads": args.threads, "rounds": args.rounds, "steps": args.steps, "cpu_count": os.cpu_count(),
              "load_average_at_end": os.getloadavg(), "summary": summary,
              "speedup_median": summary["dense bf16"]["median_ms"] / summary["2x8"]["median_ms"],
              "speedup_min": summary["dense bf16"]["min_ms"] / summary["2x8"]["min_ms"],
              "step_seconds": steps}
    print(f"{args.threads} threads, {args.rounds} rounds of {args.steps} steps a model, load "
          f"{os.getloadavg()[0]:.2f}")
    for name, row in summary.items():
        print(f"  {name:10s} step min {row['min_ms']:7.2f} ms, median {row['median_ms']:7.2f} ms")
    print(f"2x8 over dense bf16: {record['speedup_median']:.2f}x by median steps, {record['speedup_min']:.2f}x by fastest")
    if args.out is not None:
        with atomic_path(args.out, checksum=False) as tmp:
            tmp.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
