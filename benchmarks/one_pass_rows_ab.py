"""One-pass row reductions on and off in one process (issue 27): the Llama-3.2-3B-shaped model with random 2x8
codes (and, with --bf16-too, in bf16 first), decoded compile+graph with greedy_decode(one_pass_rows=False),
then True, --rounds times, default kernel configurations. Prints tokens/s and the step's profile per run and
writes JSON.

    PYTHONPATH=src python3 benchmarks/one_pass_rows_ab.py --out $OUT/one_pass_rows_ab.json [--bf16-too]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aqflow.inference.decode import fuse_projections, greedy_decode
from benchmarks.inference_gpu import build_llama, quantize_randomly, summarize_kernels


def decode_rates(model, flags, new_tokens: int) -> list[dict]:
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(7))
    runs = []
    for flag in flags:
        start = time.perf_counter()
        tokens, timings = greedy_decode(model, prompt, new_tokens, fuse=False, profile=True, one_pass_rows=flag)
        run = {"one_pass_rows": timings.one_pass_rows, "mode": timings.mode,
               "decode_tokens_per_second": timings.decode_tokens_per_second, "first_tokens": tokens[:8].tolist(),
               "profile": summarize_kernels(timings.step_kernels), "seconds": time.perf_counter() - start}
        print(f"one_pass_rows={flag}: {run['mode']} {run['decode_tokens_per_second']:.1f} tok/s, "
              f"{run['profile']['total']}, tokens {run['first_tokens']}", flush=True)
        runs.append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--bf16-too", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_llama("3b", device, torch.bfloat16)
    fuse_projections(model)
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    flags = (False, True) * args.rounds
    if args.bf16_too:
        result["bf16"] = decode_rates(model, flags, args.new_tokens)
    quantize_randomly(model, "ours")
    fuse_projections(model)
    result["2x8"] = decode_rates(model, flags, args.new_tokens)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
