"""Table sums with the table held in AVX-512 registers, against gathers from an L1-resident table:
is an in-register lookup (T-MAC's idea, here for 8-bit codes) the 2x per core that the CPU decode
target needs (issue 27)? One token, one thread, 2x8 layers of the Llama-3.2-3B shape.

    python benchmarks/lut_registers.py --out benchmarks/results/lut_registers_2core.json

Builds benchmarks/lut_registers/lut_registers.c and aqflow's own kernel (src/aqflow/inference/csrc/
lut_cpu.c) with the system C compiler (-O3 -march=native) into a temporary folder and calls them
through ctypes. For each layer shape: random codes and a
random token, the tables built once (float32, and rounded to float16), then the best of --repeats
calls of each kernel:
  - gathers (f32): the layout and loop of aqflow's numba kernels (tiles of 64 rows, slices of 32
    code columns whose table is L1-resident), written with AVX-512 gathers;
  - registers (f32): aqflow's register_kernel (since this benchmark, the CPU decode path): codes
    laid out per code column, the column's 256-entry table in 16 registers, 16 rows per permute,
    each table loaded once for a group of 8 tiles (512 rows); exact (the same float32 entries);
  - registers per tile (f32): the same with the table loaded again for every tile of 64 rows (the
    shipped kernel's first form);
  - registers (f16): the table rounded to float16 in 8 registers, 32 rows per permute; not exact;
  - aqflow's numba kernel (`lut_product`, one thread), tables built in the call: the reference.
Prints a table (codes per nanosecond) and the largest relative error of each kernel's output
against float64 sums of the float32 table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).parent / "lut_registers" / "lut_registers.c"
SHIPPED = Path(__file__).parents[1] / "src" / "aqflow" / "inference" / "csrc" / "lut_cpu.c"
ROWS, SLICE_COLUMNS, K = 64, 32, 256
# Llama-3.2-3B's block linears (out, in) at 2x8 (groups of 8, two codebooks: in / 4 code columns)
SHAPES = {"q/o": (3072, 3072), "k/v": (1024, 3072), "gate/up": (8192, 3072), "down": (3072, 8192)}


def build(folder: Path) -> ctypes.CDLL:
    library = folder / "lut_registers.so"
    subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", str(SOURCE), str(SHIPPED), "-o", str(library)],
                   check=True)
    lib = ctypes.CDLL(str(library))
    for name in ("sum_f16_registers", "sum_f32_gathers", "sum_f32_registers_per_tile"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.aqflow_register_sums.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_long, ctypes.c_void_p]
    return lib


def column_major_tiles(codes: np.ndarray) -> np.ndarray:
    """codes [out, C] uint8 -> [out/64, C, 64]: per tile, each code column's 64 rows contiguous."""
    out, columns = codes.shape
    return np.ascontiguousarray(codes.reshape(out // ROWS, ROWS, columns).transpose(0, 2, 1))


def slice_tiles(codes: np.ndarray) -> np.ndarray:
    """codes [out, C] uint8 -> [out/64, C/32, 64, 32]: the numba kernels' tiled layout."""
    out, columns = codes.shape
    return np.ascontiguousarray(codes.reshape(out // ROWS, ROWS, columns // SLICE_COLUMNS, SLICE_COLUMNS)
                                .transpose(0, 2, 1, 3))


def best_seconds(call, repeats: int) -> float:
    call()  # warm: caches, page faults, numba's compilation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure(lib: ctypes.CDLL, name: str, out_features: int, in_features: int, repeats: int,
            rng: np.random.Generator) -> dict:
    from aqflow.inference.cpu_kernels import lut_product, operands_from_tiled, tile_codes

    columns = in_features // 4
    codes = rng.integers(0, K, size=(out_features, columns), dtype=np.uint8)
    tables32 = rng.standard_normal((columns, K)).astype(np.float32)
    tables16 = tables32.astype(np.float16)
    exact = tables32.astype(np.float64)[np.arange(columns)[None, :], codes].sum(axis=1)
    tiles = out_features // ROWS
    by_column, by_slice = column_major_tiles(codes), slice_tiles(codes)
    outputs = {kind: np.empty(out_features, dtype=np.float32) for kind in ("gathers", "f32", "f32 tile", "f16")}

    def call(function, table, layout, kind):
        return lambda: function(table.ctypes.data, layout.ctypes.data, tiles, columns, outputs[kind].ctypes.data)

    def shipped():
        lib.aqflow_register_sums(tables32.ctypes.data, by_column.ctypes.data, tiles, columns, 0, columns,
                                 outputs["f32"].ctypes.data)

    seconds = {
        "gathers (f32)": best_seconds(call(lib.sum_f32_gathers, tables32, by_slice, "gathers"), repeats),
        "registers (f32)": best_seconds(shipped, repeats),
        "registers per tile (f32)": best_seconds(call(lib.sum_f32_registers_per_tile, tables32, by_column, "f32 tile"),
                                                 repeats),
        "registers (f16)": best_seconds(call(lib.sum_f16_registers, tables16.view(np.uint16), by_column, "f16"), repeats),
    }
    # aqflow's kernel on a real 2x8 layer of this shape (tables built in the call)
    quantized = torch.from_numpy(codes.reshape(out_features, columns // 2, 2).copy())
    codebooks = torch.randn(2, K, 8)
    operands = operands_from_tiled(tile_codes(quantized, 8), codebooks, torch.ones(out_features), None, 8)
    x = torch.randn(1, in_features)
    seconds["aqflow numba, with tables"] = best_seconds(lambda: lut_product(x, operands, threads=1), repeats)
    loads = out_features * columns
    scale = np.abs(exact).max()
    errors = {kind: float(np.abs(outputs[key].astype(np.float64) - exact).max() / scale)
              for kind, key in (("gathers (f32)", "gathers"), ("registers (f32)", "f32"),
                                ("registers per tile (f32)", "f32 tile"), ("registers (f16)", "f16"))}
    return {"layer": name, "out": out_features, "in": in_features, "code_columns": columns,
            "seconds": seconds, "codes_per_ns": {k: loads / s / 1e9 for k, s in seconds.items()},
            "max_relative_error": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        lib = build(Path(folder))
        rows = [measure(lib, name, *shape, args.repeats, rng) for name, shape in SHAPES.items()]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    kinds = list(rows[0]["seconds"])
    print(f"{cpu}, one thread; codes per ns (best of {args.repeats}); max relative error vs float64")
    print(f"{'layer':8s} " + " ".join(f"{k:>26s}" for k in kinds))
    for row in rows:
        print(f"{row['layer']:8s} " + " ".join(f"{row['codes_per_ns'][k]:26.2f}" for k in kinds))
    print(f"{'error':8s} " + " ".join(f"{max(r['max_relative_error'].get(k, 0) for r in rows):26.1e}" for k in kinds))
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu, "threads": 1, "repeats": args.repeats, "layers": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
