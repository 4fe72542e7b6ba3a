"""The CPU lookup-table product per linear of the Llama-3.2-3B shape, by thread count.

    NUMBA_CACHE_DIR=/tmp/numba_cache PYTHONPATH=src python3 benchmarks/lut_threads.py --threads 1 2 4 8 14 \\
        --out $OUT/lut_threads.json

Why: on a 16-core host the 2x8 decode reads its tables at ~0.5e9 loads/s per thread, against
~1.6e9 on one core of the 2-core box, so the 16-core speed-up over dense stays ~1.1-1.3x. This
times one token's product (`cpu_kernels.lut_matmul_operands`, random 2x8 codes) of each linear
of a 3B block at each thread count, and a numba parallel region that does nothing (what waking
the pool costs). A token's lookups in the block linears = 28 x the per-block sum. Each product is
timed through the gathers (`gathers`) and, where it can run, through the AVX-512 register kernel
(`registers`: register_kernel.product_with_operands on the same codes laid out per column, its
operands made once as FastQuantizedLinear keeps them, the tables built in the call as the decode
does; until 2026-11-29 the operands' float32 copies were made in every call too, ~12 us on the
2-core box). Prints a table, writes JSON. (Commit 2771e50 also timed a
one-region "units" schedule here, which did not win.)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

from aqflow.inference import cpu_kernels, register_kernel
from aqflow.io.artifacts import atomic_path

# (name, out_features, in_features, linears of the name per block) of Llama-3.2-3B
LINEARS_3B = [("q/o", 3072, 3072, 2), ("k/v", 1024, 3072, 2), ("gate/up", 8192, 3072, 2), ("down", 3072, 8192, 1)]
BLOCKS_3B = 28


@njit(parallel=True, cache=True)
def _empty_region(values):
    """One parallel region with one trivial iteration per thread (the cost of waking the pool)."""
    for i in prange(values.shape[0]):
        values[i] += 1.0


def random_operands(out_features: int, in_features: int,
                    seed: int = 0) -> tuple[cpu_kernels.CpuOperands, register_kernel.RegisterOperands | None]:
    """A 2x8 layer (groups of 8) with random codes, codebooks and scales: tiled as the gathers read
    it, and as the register kernel's operands (codes per column)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out_features, in_features // 8, 2), dtype=torch.uint8, generator=generator)
    codebooks, scales = torch.randn(2, 256, 8, generator=generator), torch.rand(out_features, generator=generator) + 0.5
    operands = cpu_kernels.operands_from_tiled(cpu_kernels.tile_codes(codes, 8), codebooks, scales, None, 8)
    registers = (register_kernel.register_operands(register_kernel.column_tiles(codes), codebooks, scales, None)
                 if register_kernel.compiled_kernel() is not None else None)
    return operands, registers


def best_seconds(call, calls: int, rounds: int) -> float:
    """The best over `rounds` of the mean time of `calls` calls."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def cpu_description() -> dict:
    """The host's CPU as lscpu names it (model, cores, threads per core, caches)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"processor": platform.processor()}
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "L1d cache", "L2 cache",
            "L3 cache", "NUMA node(s)")
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines()) if key in keep}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, numba.config.NUMBA_NUM_THREADS])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    layers = {name: (*random_operands(out, inp), count) for name, out, inp, count in LINEARS_3B}
    kernels = ["gathers"] + (["registers"] if register_kernel.compiled_kernel() is not None else [])
    rows = []
    for threads in args.threads:
        numba.set_num_threads(threads)
        flags = np.zeros(threads, dtype=np.float64)
        _empty_region(flags)
        region = best_seconds(lambda: _empty_region(flags), 200, args.rounds)
        for kernel in kernels:
            block_seconds = 0.0
            for name, (operands, registers, count) in layers.items():
                x = np.random.default_rng(0).standard_normal((1, operands.in_features), dtype=np.float32)
                if kernel == "gathers":
                    call = lambda: cpu_kernels.lut_matmul_operands(x, operands)  # noqa: E731
                else:
                    xt = torch.from_numpy(x)
                    call = lambda: register_kernel.product_with_operands(xt, registers)  # noqa: E731
                call()  # compile or load the cache
                seconds = best_seconds(call, args.calls, args.rounds)
                block_seconds += count * seconds
                rows.append({"threads": threads, "kernel": kernel, "linear": name, "microseconds": seconds * 1e6,
                             "loads_per_second_per_thread": operands.codes.size / seconds / threads,
                             "empty_region_microseconds": region * 1e6})
            rows.append({"threads": threads, "kernel": kernel, "linear": "token (28 blocks)",
                         "milliseconds": BLOCKS_3B * block_seconds * 1e3, "empty_region_microseconds": region * 1e6})
    record = {"cpu": cpu_description(), "numba_threading_layer": numba.threading_layer(),
              "numba_num_threads": numba.config.NUMBA_NUM_THREADS, "rows": rows}
    print(f"CPU: {record['cpu']}, numba layer {record['numba_threading_layer']}")
    print(f"{'threads':>7} {'kernel':>9} {'linear':>18} {'us':>9} {'e9 loads/s/thread':>18} {'empty region us':>15}")
    for row in rows:
        if "milliseconds" in row:
            print(f"{row['threads']:7d} {row['kernel']:>9} {row['linear']:>18} {row['milliseconds']:8.1f}ms")
        else:
            print(f"{row['threads']:7d} {row['kernel']:>9} {row['linear']:>18} {row['microseconds']:9.1f} "
                  f"{row['loads_per_second_per_thread'] / 1e9:18.2f} {row['empty_region_microseconds']:15.1f}")
    if args.out is not None:
        with atomic_path(args.out, checksum=False) as tmp:  # no sidecar among the files a device call returns
            tmp.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
