"""The CPU register kernel's product per linear of the Llama-3.2-3B shape, with the codes streamed from
memory as a decode step reads them, by thread count, table dtype and prefetch distance.

    NUMBA_CACHE_DIR=/tmp/numba_cache PYTHONPATH=src python3 benchmarks/lut_stream.py --threads 1 8 16 \\
        --prefetch 0 8 --out $OUT/lut_stream.json

Why: `lut_threads.py` times one layer's product again and again, so on a host with a large L3 its
codes stay in cache; a decode step reads 28 blocks' codes (0.7 GB at 3B) once each. Here each
linear of the block (q/k/v and gate/up stacked as the decode fuses them) is held `--layers` times
with different random codes and a timing sweeps all copies in turn ("streamed"); the same product on
one copy again and again is timed beside it ("resident"). A thread's slice of a tile's code columns
is a short run of cache lines at 16 threads, so the kernel requests the lines of a column
`$AQFLOW_CPU_PREFETCH` columns ahead (`--prefetch` compares distances; 0 is none). Table kinds
(`--tables`): float16, float32 held in registers or, where the CPU has AVX-512 VBMI, as byte planes
(`$AQFLOW_CPU_PLANES`), and int16 (AVX-512 VBMI and VNNI). Prints a table (microseconds a product, GB/s
of codes, a token's 28 blocks) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numba
import numpy as np
import torch

from aqflow.inference import register_kernel
from aqflow.io.artifacts import atomic_path

# (name, [out_features of each stacked layer], in_features) of a Llama-3.2-3B block as the decode calls them
LINEARS_3B = [("q/k/v", [3072, 1024, 1024], 3072), ("o", [3072], 3072), ("gate/up", [8192, 8192], 3072),
              ("down", [3072], 8192)]
BLOCKS_3B = 28


def random_stack(outs: list[int], in_features: int, generator: torch.Generator) -> register_kernel.RegisterOperands:
    """Random 2x8 layers of one input stacked as one product (register_kernel.stacked_operands)."""
    layers, tiles = [], []
    for out_features in outs:
        codes = torch.randint(0, 256, (out_features, in_features // 8, 2), dtype=torch.uint8, generator=generator)
        tiles.append(register_kernel.column_tiles(codes))
        codebooks, scales = torch.randn(2, 256, 8, generator=generator), torch.rand(out_features, generator=generator)
        layers.append(register_kernel.register_operands(tiles[-1], codebooks, scales + 0.5, None))
    if len(layers) == 1:
        return layers[0]
    return register_kernel.stacked_operands(torch.cat(tiles), layers)


def sweep_seconds(x: np.ndarray, copies: list, threads: int, dtype: str, rounds: int) -> float:
    """The best over `rounds` of the mean seconds of one product, each round one product per copy."""
    for operands in copies:  # warm: scratch arrays, the compiled kernel
        register_kernel.register_matmul(x, operands, threads, dtype)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for operands in copies:
            register_kernel.register_matmul(x, operands, threads, dtype)
        best = min(best, (time.perf_counter() - started) / len(copies))
    return best


TABLE_KINDS = {"float16": ("float16", "1"), "float32-registers": ("float32", "0"), "float32-planes": ("float32", "1"),
               "int16": ("int16", "1")}


def use_kernel(columns: int, kind: str) -> str:
    """Builds (or loads) the kernel with this prefetch distance and the float32 tables' layout of `kind`
    for the products that follow; the table dtype register_matmul takes for it."""
    dtype, planes = TABLE_KINDS[kind]
    os.environ[register_kernel.PREFETCH_ENV] = str(columns)
    os.environ[register_kernel.PLANES_ENV] = planes
    register_kernel.compiled_kernel.cache_clear()
    kernels = register_kernel.compiled_kernel()
    if kernels is None:
        raise SystemExit("the AVX-512 register kernel is not available on this machine")
    if kind == "float32-planes" and kernels.float32_layout != "planes":
        raise SystemExit("float32-planes: this CPU has no AVX-512 VBMI")
    if kind == "int16" and kernels.int16 is None:
        raise SystemExit("int16: this CPU lacks AVX-512 VBMI or VNNI")
    return dtype


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, numba.config.NUMBA_NUM_THREADS])
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, register_kernel.DEFAULT_PREFETCH_COLUMNS])
    parser.add_argument("--tables", nargs="+", default=list(TABLE_KINDS), choices=list(TABLE_KINDS))
    parser.add_argument("--layers", type=int, default=BLOCKS_3B, help="copies of each linear streamed in turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    copies = {name: [random_stack(outs, inp, generator) for _ in range(args.layers)] for name, outs, inp in LINEARS_3B}
    code_bytes = {name: stack[0].codes.nbytes for name, stack in copies.items()}
    print(f"{args.layers} copies of each linear ({sum(code_bytes.values()) * args.layers / 2**30:.2f} GiB of codes) "
          f"in {time.perf_counter() - started:.0f} s", flush=True)
    inputs = {name: np.random.default_rng(0).standard_normal((1, inp), dtype=np.float32) for name, _, inp in LINEARS_3B}

    rows = []
    for prefetch in args.prefetch:
        for threads in args.threads:
            numba.set_num_threads(threads)
            for kind in args.tables:
                dtype = use_kernel(prefetch, kind)
                for residency in ("streamed", "resident"):
                    token = 0.0
                    for name, _, _ in LINEARS_3B:
                        stack = copies[name] if residency == "streamed" else copies[name][:1] * args.layers
                        seconds = sweep_seconds(inputs[name], stack, threads, dtype, args.rounds)
                        token += BLOCKS_3B * seconds
                        rows.append({"prefetch": prefetch, "threads": threads, "tables": kind, "codes": residency,
                                     "linear": name, "microseconds": seconds * 1e6,
                                     "code_gb_per_second": code_bytes[name] / seconds / 1e9})
                    rows.append({"prefetch": prefetch, "threads": threads, "tables": kind, "codes": residency,
                                 "linear": "token (28 blocks)", "milliseconds": token * 1e3})
                    print(f"prefetch {prefetch:2d} threads {threads:2d} {kind} {residency:8s}: "
                          + ", ".join(f"{r['linear']} {r['microseconds']:.0f} us ({r['code_gb_per_second']:.1f} GB/s)"
                                      for r in rows[-5:-1]) + f"; token {token * 1e3:.1f} ms", flush=True)

    print(f"\n{'prefetch':>8} {'threads':>7} {'tables':>17} {'codes':>9} {'token ms':>9}")
    for row in rows:
        if "milliseconds" in row:
            print(f"{row['prefetch']:8d} {row['threads']:7d} {row['tables']:>17} {row['codes']:>9} "
                  f"{row['milliseconds']:9.1f}")
    if args.out is not None:
        record = {"numba_threading_layer": numba.threading_layer(), "cpu_count": os.cpu_count(),
                  "layers": args.layers, "code_bytes_per_block": code_bytes, "rows": rows}
        with atomic_path(args.out, checksum=False) as tmp:  # no sidecar among the files a device call returns
            tmp.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
