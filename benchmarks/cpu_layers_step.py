"""One CPU decode step of the Llama-3.2-3B-shaped model with the layers' one-token attention and norms in
numba (`aqflow.inference.cpu_layers`, greedy_decode's default) against the modules' own forwards, in one
process, in turn.

    NUMBA_CACHE_DIR=/tmp/numba_cache PYTHONPATH=src:. python3 benchmarks/cpu_layers_step.py [--linears fast]

Why: whole decodes on a shared machine move by more than the difference (each variant in its own process
in `inference_cpu.py`), so this times single steps of one model, both ways alternately, `--rounds`
times `--steps` steps each after a warm-up, and prints the fastest and the median step of each way.
Both ways attend through `cpu_attention` (numba); only the modules' forwards differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--linears", default="fast", choices=("fast", "dense"))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()

    import numba

    from aqflow.inference.cpu_attention import cpu_attention_enabled
    from aqflow.inference.cpu_layers import cpu_layers_enabled
    from aqflow.inference.decode import fuse_projections, new_static_cache, step_logits
    from aqflow.inference.fast_linear import install_cpu_bf16_linears
    from benchmarks.inference_cpu import LLAMA_3B, random_llama

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    model = random_llama(LLAMA_3B, torch.bfloat16, args.linears)
    install_cpu_bf16_linears(model)
    fuse_projections(model)
    prompt = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    steps = {"stock": [], "cpu_layers": []}
    with torch.inference_mode(), cpu_attention_enabled(model):
        for _ in range(args.rounds):
            for way in steps:
                cache = new_static_cache(model, 8 + args.steps + 3)
                model(input_ids=prompt, position_ids=torch.arange(8)[None], past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
                token, position = prompt[:, -1:], 8
                with cpu_layers_enabled(model) if way == "cpu_layers" else torch.inference_mode():
                    for step in range(args.steps + 2):
                        started = time.perf_counter()
                        token = step_logits(model, cache, token, torch.tensor([[position]])).argmax(-1, keepdim=True)
                        if step >= 2:  # two warm-up steps a round
                            steps[way].append(time.perf_counter() - started)
                        position += 1
    print(f"{args.linears} linears, {args.threads} threads, {args.rounds} rounds of {args.steps} steps, load "
          f"{os.getloadavg()[0]:.2f}")
    for way, times in steps.items():
        print(f"  {way:10s} step min {min(times) * 1e3:7.2f} ms, median {statistics.median(times) * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
