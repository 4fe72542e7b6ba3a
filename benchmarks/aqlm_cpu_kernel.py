"""aqlm's CPU kernel for 2x8-bit codes against a dense matmul of the same layer, one thread.

    .venv/bin/python benchmarks/aqlm_cpu_kernel.py --json benchmarks/results/aqlm_cpu_kernel.json

Why `evaluate` runs AQLM layers as dense linears on a CPU (`evaluation.cpu_kernel: dense`): the
numba kernel aqlm picks for 8-bit codebooks on a CPU must run on one thread (it races with more)
and rebuilds a lookup table every call. SmolLM2-135M's layer shapes, 512 tokens (the demo's
evaluation context), random codes (speed does not depend on their values); median of 5 calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ["NUMBA_NUM_THREADS"] = "1"  # as evaluate sets it: numba reads it on import

import torch  # noqa: E402
import transformers.quantizers  # noqa: E402,F401  (must precede aqlm's transformers integration)
from aqlm import QuantizedLinear  # noqa: E402

from aqflow.evaluation.dense_aqlm import dense_weight  # noqa: E402

SHAPES = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (576, 192), "gate_proj/up_proj": (576, 1536),
          "down_proj": (1536, 576)}


def median_seconds(call, repeats: int = 5) -> float:
    call()  # warm-up (numba compiles on the first call)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name, (in_features, out_features) in SHAPES.items():
        layer = QuantizedLinear(in_features, out_features, in_group_size=8, out_group_size=1, num_codebooks=2,
                                nbits_per_codebook=8, bias=False, dtype=torch.float32)
        layer.codes.data = torch.randint(-128, 128, layer.codes.shape, dtype=torch.int8)
        layer.codebooks.data.normal_()
        layer.scales.data.uniform_(0.5, 1.5)
        weight = dense_weight(layer)  # before the kernel's first call transposes the codes
        x = torch.randn(1, args.tokens, in_features)
        with torch.no_grad():
            aqlm_s = median_seconds(lambda: layer(x))
            dense_s = median_seconds(lambda: torch.nn.functional.linear(x, weight))
            error = float((layer(x) - torch.nn.functional.linear(x, weight)).abs().max())
        rows.append({"layer": name, "in": in_features, "out": out_features, "aqlm_seconds": aqlm_s,
                     "dense_seconds": dense_s, "ratio": aqlm_s / dense_s, "max_abs_difference": error})
    record = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": 1,
              "tokens": args.tokens, "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)
    print(f"{'layer':18s} {'in x out':>11s} {'aqlm s':>8s} {'dense s':>8s} {'ratio':>6s} {'max |diff|':>10s}")
    for row in rows:
        print(f"{row['layer']:18s} {row['in']:>5d}x{row['out']:<5d} {row['aqlm_seconds']:8.4f} {row['dense_seconds']:8.4f} "
              f"{row['ratio']:6.1f} {row['max_abs_difference']:10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
