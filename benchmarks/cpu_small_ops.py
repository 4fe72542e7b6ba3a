"""What the small operations of a CPU decode step cost per call at several thread counts: numba's
empty parallel region, the one-token attention (cpu_layers.rope_cache_attend) at two cache lengths,
RMSNorm (cpu_layers.rms_norm), torch's bf16 add and SiLU gate, and the register kernel's smallest 3B
product (o_proj), all at the Llama-3.2-3B shape.

    NUMBA_CACHE_DIR=/tmp/numba_cache PYTHONPATH=src python3 benchmarks/cpu_small_ops.py --threads 16 8 1 \\
        --out $OUT/small_ops.json

Why: on a 16-core host a decode step's operations other than the products and the head took ~12 ms of
~44 (benchmarks/results/cpu_planes_h200/), ~25 % of it, against ~10 % on 2 cores; these timings say
which of them the thread count makes dear (a parallel region's start and end on many cores). Each
figure is the median of --calls calls after a warm-up. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

from aqflow.inference import cpu_layers, register_kernel
from aqflow.io.artifacts import atomic_path


@njit(parallel=True, cache=True)
def empty_region(out):
    for i in prange(out.shape[0]):
        out[i] = i


def median_microseconds(call, calls: int) -> float:
    call()
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e6


def operations() -> dict:
    """name -> a no-argument call, at the 3B shape (24 query heads, 8 key/value heads of 128, hidden 3072,
    MLP 8192), bf16 values as the decode holds them."""
    generator = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, generator=generator).to(torch.bfloat16)  # noqa: E731
    bits = lambda tensor: tensor.view(torch.uint16).numpy()  # noqa: E731
    calls = {"numba empty parallel region": (lambda out=np.zeros(64): empty_region(out))}
    for length, position in ((64, 40), (1024, 600)):
        query, key, value = bf16(24, 128), bf16(8, 128), bf16(8, 128)
        cos, sin, keys, values, out = bf16(128), bf16(128), bf16(8, length, 128), bf16(8, length, 128), bf16(24, 128)
        valid = np.arange(length) <= position
        calls[f"rope + cache + attention, {position + 1} of {length} positions"] = (
            lambda q=bits(query), k=bits(key), v=bits(value), c=bits(cos), s=bits(sin), ks=bits(keys), vs=bits(values),
            valid=valid, p=position, o=bits(out): cpu_layers.rope_cache_attend(q, k, v, c, s, ks, vs, p, valid,
                                                                               np.float32(0.088), o))
    hidden, weight, normed = bf16(3072), bf16(3072), bf16(3072)
    calls["RMSNorm (numba, 3072)"] = lambda: cpu_layers.rms_norm(bits(hidden), bits(weight), np.float32(1e-5), bits(normed))
    residual = bf16(1, 1, 3072)
    calls["torch add (bf16, 3072)"] = lambda: residual + hidden.view(1, 1, -1)
    gate, up = bf16(1, 1, 8192), bf16(1, 1, 8192)
    calls["torch silu(gate) * up (bf16, 8192)"] = lambda: torch.nn.functional.silu(gate) * up
    if register_kernel.compiled_kernel() is not None:
        codes = torch.randint(0, 256, (3072, 384, 2), dtype=torch.uint8, generator=generator)
        operands = register_kernel.register_operands(register_kernel.column_tiles(codes),
                                                     torch.randn(2, 256, 8, generator=generator),
                                                     torch.rand(3072, generator=generator), None)
        x = bf16(1, 3072)
        calls["register product o_proj 3072x3072 (bf16 in)"] = lambda: register_kernel.product_with_operands(x, operands)
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[numba.config.NUMBA_NUM_THREADS, 1])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    calls = operations()
    rows = []
    for threads in args.threads:
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        for name, call in calls.items():
            rows.append({"threads": threads, "operation": name, "microseconds": median_microseconds(call, args.calls)})
    names = list(calls)
    print(f"{'operation (median us a call)':58s}" + "".join(f"{t:>8d}t" for t in args.threads))
    for name in names:
        print(f"{name:58s}" + "".join(f"{r['microseconds']:9.1f}" for t in args.threads for r in rows
                                      if r["threads"] == t and r["operation"] == name))
    if args.out is not None:
        record = {"cpu_count": os.cpu_count(), "numba_threading_layer": numba.threading_layer(), "rows": rows}
        with atomic_path(args.out, checksum=False) as tmp:
            tmp.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
