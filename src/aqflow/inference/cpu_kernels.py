"""AQLM linears on a CPU without a dense weight in RAM: numba kernels, multi-threaded.

`lut_matmul` is the decode path (a few tokens), the lookup-table product of "Extreme Compression
of Large Language Models via Additive Quantization" (Egiazarian, Panferov, Kuznedelev, Frantar,
Babenko, Alistarh): for every token t, input group j and codebook m a table of the K dot products
of x[t, j*g:(j+1)*g] with the codewords,

    table[t, j, m, k] = sum_d x[t, j*g + d] * codebooks[m, k, d]           (T*G*M*K*g multiply-adds)

then every output row sums one table entry per (group, codebook) - no multiply per weight:

    y[t, o] = scales[o] * sum_{j, m} table[t, j, m, codes[o, j, m]] + bias[o]   (T*out*G*M loads)

The second sum is the work: one indexed load per code, which LLVM turns into AVX-512/AVX2 gathers
when it is written as a reduction over contiguous codes into one scalar, with unsigned shift-or
indices (an accumulator array is not vectorised; a signed index or a 64-bit multiply in it cost a
third). What limits it is where the table is: measured on this project's 2-core Xeon (2.1 GHz,
hand-written AVX-512 gathers in C), ~2.2e9 loads/s per core from a 64 KiB table, 1.3e9 from
512 KiB, 0.6e9 from 2 MiB (Llama-3.2-3B's down_proj has a 2 MiB table per token). So the kernels
read the codes in a tiled layout (`tile_codes`): tiles of TILE_ROWS output rows, each cut into
slices of code columns whose table (per token) is L1-sized; a thread walks its block of tiles
slice by slice, every row of the block through the same L1-resident slice of the table, the codes
of a (tile, slice) contiguous. In C that layout reads 3.0-3.6e9 codes/s per core against 1.5-2.2e9
for the row-major codes (the same slicing, but every row's slice a separate stream).

Threads split the output into blocks of tiles, each thread writing only its own rows (aqlm's numba
kernel splits the input groups instead and adds into shared outputs, which races with more than
one thread); small products run on the calling thread (waking the pool costs more).

`dequantized_matmul` is the prefill path (many tokens): tiles of rows are dequantized a chunk at a
time into a float32 buffer and multiplied by one dense matmul (torch's BLAS), so the dense weight
never exists whole. Both compute in float32 and return float32.

The kernels are compiled by numba on their first call per code dtype and cached on disk
(`cache=True`, in __pycache__ beside this file, or NUMBA_CACHE_DIR): the first call in a fresh
environment costs ~10-20 s of compilation (benchmarks/inference_cpu.py prints it), later
processes load the cache (~1 s).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numba
import numpy as np
import torch
from numba import njit, prange

from aqflow.inference.layout import QuantizedWeights

# Table loads (tokens x codes) below which a product runs on the calling thread: waking numba's
# pool for two parallel regions costs microseconds on idle cores and a scheduler slice on busy
# ones, more than ~40 us of loads.
PARALLEL_MIN_LOADS = 1 << 16
# Output rows per tile of the codes (or the largest divisor of out_features below it).
TILE_ROWS = 64
# The table slice (per token) a block of rows is walked through: L1-sized (48 KiB L1d on the
# 2-core box; 32 KiB: 32 code columns of 256 codewords).
TABLE_SLICE_BYTES = 32 << 10
# The most table bytes built at once (all tokens): large codebooks (16-bit codes: 256 KiB of table
# per code column) are built and consumed in passes of this size instead of all at once.
TABLE_PASS_BYTES = 64 << 20
# Rows dequantized per chunk in dequantized_matmul, in dense float32 bytes: small next to the
# model, large enough that one BLAS call amortises its start.
DEQUANTIZED_CHUNK_BYTES = 16 << 20


def tile_geometry(out_features: int, code_columns: int, nbits: int, tile_rows: int = TILE_ROWS,
                  table_slice_bytes: int = TABLE_SLICE_BYTES) -> tuple[int, int]:
    """(rows per tile, code columns per slice): the largest divisor of out_features up to
    tile_rows, and of code_columns (G*M) whose table slice (K float32 per column) fits
    table_slice_bytes (at least 1)."""
    rows = math.gcd(out_features, tile_rows)
    target = max(1, table_slice_bytes // (4 << nbits))
    columns = max(d for d in range(1, min(target, code_columns) + 1) if code_columns % d == 0)
    return rows, columns


def tile_codes(codes: torch.Tensor, nbits: int, tile_rows: int = TILE_ROWS,
               table_slice_bytes: int = TABLE_SLICE_BYTES) -> torch.Tensor:
    """codes [out, G, M] -> tiled [out/R, G*M/C, R, C] (a contiguous copy; same dtype and bytes):
    tiled[a, b, r, c] = codes[a*R + r, column b*C + c] with column = j*M + m (tile_geometry)."""
    out_features, groups, num_codebooks = codes.shape
    rows, columns = tile_geometry(out_features, groups * num_codebooks, nbits, tile_rows, table_slice_bytes)
    flat = codes.reshape(out_features // rows, rows, groups * num_codebooks // columns, columns)
    return flat.permute(0, 2, 1, 3).contiguous()


def untile_codes(tiled: torch.Tensor, num_codebooks: int) -> torch.Tensor:
    """Inverse of tile_codes: tiled [out/R, G*M/C, R, C] -> codes [out, G, M] (a copy)."""
    tiles, slices, rows, columns = tiled.shape
    return tiled.permute(0, 2, 1, 3).reshape(tiles * rows, slices * columns // num_codebooks, num_codebooks).contiguous()


@dataclass(frozen=True)
class CpuOperands:
    """A layer's tensors as the kernels read them (numpy arrays sharing the torch tensors' memory).

    codes [out/R, G*M/C, R, C] uint8 or int32 (tile_codes), codebooks_t [M, g, K] float32
    (transposed so the table build runs along K), codebooks [M, K, g] float32, scales [out]
    float32, bias [out] float32 or None."""

    codes: np.ndarray
    codebooks_t: np.ndarray
    codebooks: np.ndarray
    scales: np.ndarray
    bias: np.ndarray | None
    nbits: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * self.codes.shape[2]

    @property
    def code_columns(self) -> int:
        return self.codes.shape[1] * self.codes.shape[3]

    @property
    def in_features(self) -> int:
        return self.code_columns // self.codebooks.shape[0] * self.codebooks.shape[2]


def operands_from_tiled(tiled: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None, nbits: int) -> CpuOperands:
    """The kernels' view of already tiled codes (tile_codes) and their codebooks [M, K, g], scales
    [out] and bias [out]: codes shared, not copied; codebooks, scales and bias as float32 (copies
    only where they are stored in another dtype: a few KiB a layer)."""
    if tiled.device.type != "cpu":
        raise ValueError(f"cpu kernels: codes on {tiled.device}, expected the CPU")
    if tiled.dtype not in (torch.uint8, torch.int32):
        raise ValueError(f"codes dtype {tiled.dtype}: expected uint8 or int32 (QuantizedWeights' containers)")
    codebook_f32 = codebooks.detach().to(torch.float32).contiguous()
    return CpuOperands(
        codes=tiled.contiguous().numpy(),
        codebooks_t=codebook_f32.permute(0, 2, 1).contiguous().numpy(),
        codebooks=codebook_f32.numpy(),
        scales=scales.detach().to(torch.float32).contiguous().numpy(),
        bias=None if bias is None else bias.detach().to(torch.float32).contiguous().numpy(),
        nbits=nbits)


def cpu_operands(weights: QuantizedWeights) -> CpuOperands:
    """The kernels' view of `weights` (on the CPU), with its codes tiled (a copy of the codes:
    FastQuantizedLinear keeps tiled codes instead, so that it holds one copy)."""
    if weights.codes.device.type != "cpu":
        raise ValueError(f"cpu_operands: weights on {weights.codes.device}, expected the CPU")
    return operands_from_tiled(tile_codes(weights.codes, weights.nbits), weights.codebooks, weights.scales,
                               weights.bias, weights.nbits)


@contextmanager
def numba_threads(threads: int | None) -> Iterator[None]:
    """Run numba's parallel loops on `threads` threads (None: as set), restored after."""
    if threads is None:
        yield
        return
    if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads={threads}: numba was started with {numba.config.NUMBA_NUM_THREADS} "
                         "(NUMBA_NUM_THREADS caps it)")
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(before)


# --- lookup-table product ---------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _build_table_units(x, codebooks_t, column_start, column_stop, tables, first_unit, last_unit):
    """tables[t, (i - column_start)*K + k] = x[t, group(i)] . codebooks[m(i), k] for the units
    (t, i) numbered t*(stop-start) + (i - start) in [first_unit, last_unit), code columns
    i in [column_start, column_stop) (column i = j*M + m).

    x [T, in] f32, codebooks_t [M, g, K] f32, tables [T, >= (stop-start)*K] f32 (overwritten)."""
    num_codebooks, group_size, codewords = codebooks_t.shape
    columns = column_stop - column_start
    for unit in range(first_unit, last_unit):
        t = unit // columns
        local = unit - t * columns
        column = column_start + local
        group = column // num_codebooks
        codebook = column - group * num_codebooks
        row = tables[t, local * codewords:(local + 1) * codewords]
        row[:] = 0
        for d in range(group_size):
            xd = x[t, group * group_size + d]
            for k in range(codewords):
                row[k] += xd * codebooks_t[codebook, d, k]


@njit(fastmath=True, cache=True)
def _table_row_sum(table, row_codes, nbits):
    """sum over i of table[(i << nbits) | row_codes[i]]: a table slice [C*K] and one row's codes [C].

    Written as a scalar reduction from index 0 with unsigned shift-or indices: the form LLVM
    vectorises into gathers."""
    total = np.float32(0.0)
    shift = np.uint64(nbits)
    for i in range(row_codes.shape[0]):
        total += table[(np.uint64(i) << shift) | np.uint64(row_codes[i])]
    return total


@njit(fastmath=True, cache=True)
def _gather_tiles(tables, tiled, nbits, first_slice, last_slice, pass_slice, first_tile, last_tile, out,
                  scales, bias, has_bias, finish):
    """For the rows of tiles [first_tile, last_tile): out[t, row] += the table entries their codes
    pick in slices [first_slice, last_slice), slice by slice (the block's rows all pass through
    one slice of the table while it is in L1); with finish, then out[t, row] = out[t, row] *
    scales[row] (+ bias[row]).

    tables [T, >= (last_slice - pass_slice)*C*K] f32 (the pass's tables, from slice pass_slice on),
    tiled [out/R, G*M/C, R, C], out [T, out] f32 (accumulated into), scales [out] f32, bias [out]
    f32 (read only if has_bias)."""
    tokens = tables.shape[0]
    rows, columns = tiled.shape[2], tiled.shape[3]
    slice_entries = columns << nbits
    for s in range(first_slice, last_slice):
        offset = (s - pass_slice) * slice_entries
        for t in range(tokens):
            table = tables[t, offset:offset + slice_entries]
            for tile in range(first_tile, last_tile):
                for r in range(rows):
                    out[t, tile * rows + r] += _table_row_sum(table, tiled[tile, s, r], nbits)
    if finish:
        for t in range(tokens):
            for row in range(first_tile * rows, last_tile * rows):
                value = out[t, row] * scales[row]
                if has_bias:
                    value += bias[row]
                out[t, row] = value


@njit(parallel=True, fastmath=True, cache=True)
def _lut_matmul_parallel(x, codebooks_t, tiled, scales, bias, has_bias, nbits, pass_slices, blocks, build_chunks):
    """The lookup-table product on numba's threads. Per table pass (pass_slices slices of code
    columns): the table built in build_chunks chunks of units, then the output in `blocks` blocks
    of whole tiles (a thread writes only its own rows: no two threads add into one output); scales
    and bias applied by the last pass. Two parallel regions per pass: each start wakes the pool.

    x [T, in] f32, codebooks_t [M, g, K] f32, tiled [out/R, G*M/C, R, C], scales [out] f32, bias
    [out] f32 (read only if has_bias) -> [T, out] f32."""
    tokens = x.shape[0]
    tiles, slices, rows, columns = tiled.shape
    tables = np.empty((tokens, (pass_slices * columns) << nbits), dtype=np.float32)
    out = np.zeros((tokens, tiles * rows), dtype=np.float32)
    for first in range(0, slices, pass_slices):
        last = min(slices, first + pass_slices)
        units = tokens * (last - first) * columns
        chunks = min(units, build_chunks)
        for chunk in prange(chunks):
            _build_table_units(x, codebooks_t, first * columns, last * columns, tables,
                               chunk * units // chunks, (chunk + 1) * units // chunks)
        for block in prange(blocks):
            _gather_tiles(tables, tiled, nbits, first, last, first, block * tiles // blocks,
                          (block + 1) * tiles // blocks, out, scales, bias, has_bias, last == slices)
    return out


@njit(fastmath=True, cache=True)
def _lut_matmul_serial(x, codebooks_t, tiled, scales, bias, has_bias, nbits, pass_slices):
    """_lut_matmul_parallel on the calling thread alone (small products). Same arguments and
    result, bitwise (the same arithmetic per row)."""
    tokens = x.shape[0]
    tiles, slices, rows, columns = tiled.shape
    tables = np.empty((tokens, (pass_slices * columns) << nbits), dtype=np.float32)
    out = np.zeros((tokens, tiles * rows), dtype=np.float32)
    for first in range(0, slices, pass_slices):
        last = min(slices, first + pass_slices)
        _build_table_units(x, codebooks_t, first * columns, last * columns, tables, 0, tokens * (last - first) * columns)
        _gather_tiles(tables, tiled, nbits, first, last, first, 0, tiles, out, scales, bias, has_bias, last == slices)
    return out


def pass_slices(tokens: int, operands: CpuOperands, table_pass_bytes: int = TABLE_PASS_BYTES) -> int:
    """Slices of code columns whose tables (all tokens) one pass builds: at most table_pass_bytes,
    at least one slice."""
    slice_bytes = (4 << operands.nbits) * operands.codes.shape[3] * tokens
    return max(1, min(operands.codes.shape[1], table_pass_bytes // slice_bytes))


def lut_matmul_operands(x: np.ndarray, operands: CpuOperands, table_pass_bytes: int = TABLE_PASS_BYTES) -> np.ndarray:
    """`lut_matmul` on prepared operands: x [T, in] float32 (C-contiguous) -> [T, out] float32."""
    if x.ndim != 2 or x.shape[1] != operands.in_features:
        raise ValueError(f"x {x.shape}: expected [tokens, {operands.in_features}]")
    has_bias = operands.bias is not None
    arguments = (x, operands.codebooks_t, operands.codes, operands.scales,
                 operands.bias if has_bias else operands.scales, has_bias, operands.nbits,
                 pass_slices(x.shape[0], operands, table_pass_bytes))
    threads = numba.get_num_threads()
    if x.shape[0] * operands.codes.size < PARALLEL_MIN_LOADS or threads == 1:
        return _lut_matmul_serial(*arguments)
    # one block of tiles per thread: the fewer blocks, the fewer times the table is read into L1
    return _lut_matmul_parallel(*arguments, min(threads, operands.codes.shape[0]), 4 * threads)


def lut_product(x: torch.Tensor, operands: CpuOperands, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through lookup tables, on prepared operands."""
    x32 = np.ascontiguousarray(x.detach().to(torch.float32).numpy())
    with numba_threads(threads):
        return torch.from_numpy(lut_matmul_operands(x32, operands))


def lut_matmul(x: torch.Tensor, w: QuantizedWeights, threads: int | None = None, *,
               operands: CpuOperands | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through lookup tables (the decode path; T = 1..a few).

    Any geometry: M codebooks of nbits <= 16 over groups of g inputs. `threads`: numba threads
    (None: numba's current setting, all cores unless set). `operands`: the kernels' view of w
    held by the caller (FastQuantizedLinear keeps its codes tiled), else made here (a tiled copy
    of the codes per call)."""
    return lut_product(x, cpu_operands(w) if operands is None else operands, threads)


# --- dequantized product (prefill) ------------------------------------------------------------

@njit(parallel=True, fastmath=True, cache=True)
def _dequantize_tiles(tiled, codebooks, scales, first_tile, dense):
    """The dense rows of tiles first_tile.. (dense.shape[0] / R of them):
    dense[r, j*g:(j+1)*g] = scales[row] * sum_m codebooks[m, code of (row, j, m)], row = first_tile*R + r.

    tiled [out/R, G*M/C, R, C], codebooks [M, K, g] f32, scales [out] f32, dense [rows, G*g] f32."""
    num_codebooks, _, group_size = codebooks.shape
    slices, rows, columns = tiled.shape[1], tiled.shape[2], tiled.shape[3]
    for local in prange(dense.shape[0]):
        tile = first_tile + local // rows
        r = local - (local // rows) * rows
        target = dense[local]
        target[:] = 0
        for s in range(slices):
            codes = tiled[tile, s, r]
            for c in range(columns):
                column = s * columns + c
                group = column // num_codebooks
                codeword = codebooks[column - group * num_codebooks, codes[c]]
                base = group * group_size
                for d in range(group_size):
                    target[base + d] += codeword[d]
        scale = scales[tile * rows + r]
        for i in range(target.shape[0]):
            target[i] *= scale


def dequantized_tiles_per_chunk(operands: CpuOperands, chunk_bytes: int = DEQUANTIZED_CHUNK_BYTES) -> int:
    """Tiles of rows in a dense float32 chunk of at most chunk_bytes (at least one tile)."""
    return max(1, chunk_bytes // (4 * operands.in_features * operands.codes.shape[2]))


def dequantized_product(x: torch.Tensor, operands: CpuOperands, rows_per_chunk: int | None = None,
                        threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through dense chunks of rows, on prepared operands."""
    x32 = x.detach().to(torch.float32).contiguous()
    if x32.ndim != 2 or x32.shape[1] != operands.in_features:
        raise ValueError(f"x {tuple(x32.shape)}: expected [tokens, {operands.in_features}]")
    tiles, _, tile_rows, _ = operands.codes.shape
    per_chunk = (max(1, rows_per_chunk // tile_rows) if rows_per_chunk else dequantized_tiles_per_chunk(operands))
    out = torch.empty(x32.shape[0], operands.out_features, dtype=torch.float32)
    chunk = np.empty((min(per_chunk, tiles) * tile_rows, operands.in_features), dtype=np.float32)
    with numba_threads(threads):
        for first in range(0, tiles, per_chunk):
            count = min(per_chunk, tiles - first)
            dense = chunk[:count * tile_rows]
            _dequantize_tiles(operands.codes, operands.codebooks, operands.scales, first, dense)
            out[:, first * tile_rows:(first + count) * tile_rows] = x32 @ torch.from_numpy(dense).T
    if operands.bias is not None:
        out += torch.from_numpy(operands.bias)
    return out


def dequantized_matmul(x: torch.Tensor, w: QuantizedWeights, rows_per_chunk: int | None = None, *,
                       operands: CpuOperands | None = None, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through dense float32 chunks of about rows_per_chunk weight
    rows (whole tiles; default: DEQUANTIZED_CHUNK_BYTES of them), one BLAS matmul per chunk: the
    prefill path, which never holds more of the dense weight than one chunk."""
    return dequantized_product(x, cpu_operands(w) if operands is None else operands, rows_per_chunk, threads)
