"""Where a CPU decode step's wall time goes by Python line, sampled rather than hooked: `run` decodes the
Llama-3.2-3B-shaped model of benchmarks/inference_cpu.py (2x8 or dense bf16, bf16 linears through numba's
GEMV, greedy_decode's defaults) while py-spy samples it from outside; `summarize` reads py-spy's raw
stacks and prints each line's share of the samples inside the decode steps, by its own time (a call into
numba or C is charged to the Python line that makes it) and inclusive.

    py-spy record -r 200 --nonblocking --format raw -o stacks.txt -- \\
        python3 benchmarks/cpu_decode_sampled.py run --linears fast --threads 16 --new-tokens 64
    python3 benchmarks/cpu_decode_sampled.py summarize stacks.txt --out summary.json

Why: forward hooks (inference_cpu_profile.py) cost microseconds a module call and so inflate exactly
the small operations whose cost is in question; a sampler outside the process charges nothing to them.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

STEP_FRAME = "run_step"  # decode._greedy_decode's per-token step: the samples counted


def run(args) -> None:
    import numba
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from inference_cpu import LLAMA_3B, random_llama

    from aqflow.inference.decode import greedy_decode
    from aqflow.inference.fast_linear import install_cpu_bf16_linears

    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    model = random_llama(LLAMA_3B, torch.bfloat16, args.linears)
    install_cpu_bf16_linears(model)
    prompt = torch.randint(0, LLAMA_3B["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    greedy_decode(model, prompt, 4)  # compile, caches, the table choice
    started = time.perf_counter()
    _, timings = greedy_decode(model, prompt, args.new_tokens)
    print(f"{args.linears}: {timings.decode_tokens_per_second:.2f} tokens/s over {timings.timed_steps} steps "
          f"({time.perf_counter() - started:.1f} s)", flush=True)


def frame_name(frame: str) -> str:
    """'function (path/to/file.py:123)' -> 'function file.py:123'."""
    match = re.match(r"(.*) \((.*):(\d+)\)$", frame)
    return f"{match.group(1)} {Path(match.group(2)).name}:{match.group(3)}" if match else frame


def summarize(args) -> None:
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in Path(args.stacks).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not any(STEP_FRAME in frame for frame in frames):
            continue
        total += int(count)
        own[frame_name(frames[-1])] += int(count)
        for name in {frame_name(frame) for frame in frames}:
            inclusive[name] += int(count)
    if total == 0:
        raise SystemExit(f"{args.stacks}: no samples inside {STEP_FRAME}")
    rows = {"samples": total, "own": [[name, count / total] for name, count in own.most_common(args.top)],
            "inclusive": [[name, count / total] for name, count in inclusive.most_common(args.top)]}
    for kind in ("own", "inclusive"):
        print(f"--- {kind} share of {total} samples in decode steps")
        for name, share in rows[kind]:
            print(f"{100 * share:5.1f}%  {name}")
    if args.out is not None:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    decode = commands.add_parser("run", help="decode the 3B-shaped model (run under py-spy)")
    decode.add_argument("--linears", choices=("fast", "dense"), default="fast")
    decode.add_argument("--threads", type=int, default=2)
    decode.add_argument("--new-tokens", type=int, default=64)
    table = commands.add_parser("summarize", help="shares of py-spy's raw stacks inside the decode steps")
    table.add_argument("stacks")
    table.add_argument("--top", type=int, default=40)
    table.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run(args) if args.command == "run" else summarize(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
