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

The tables are built in the same numba call, split among the threads (for g = 8 at ~28e9
multiply-adds/s per core, as fast as a BLAS call on one core, and parallel: a torch.mm of this
shape runs on one thread). Threads then split the output into blocks of tiles, each thread
writing only its own rows (aqlm's numba kernel splits the input groups instead and adds into
shared outputs, which races with more than one thread); small products run on the calling thread
(waking the pool costs more).

`dequantized_matmul` is the prefill path (many tokens): tiles of rows are dequantized a chunk at a
time into a float32 buffer and multiplied by one dense matmul (torch's BLAS), so the dense weight
never exists whole. Both compute in float32 and return float32.

The kernels are compiled by numba on their first call per code dtype and cached on disk
(`cache=True`, in __pycache__ beside this file, or NUMBA_CACHE_DIR): the first call in a fresh
environment costs ~10-20 s of compilation (benchmarks/inference_cpu.py prints it), later
processes load the cache (~1 s).
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

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
    (transposed: the table build runs along K), codebooks [M, K, g] float32, scales [out] float32,
    bias [out] float32 or None."""

    codes: np.ndarray
    codebooks_t: np.ndarray
    codebooks: np.ndarray
    scales: np.ndarray
    bias: np.ndarray | None
    nbits: int

    @functools.cached_property
    def bias_or_scales(self) -> np.ndarray:
        """What the kernels take for bias (an array of the right type; read only where there is a bias)."""
        return self.scales if self.bias is None else self.bias

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * self.codes.shape[2]

    @property
    def code_columns(self) -> int:
        return self.codes.shape[1] * self.codes.shape[3]

    @property
    def num_codebooks(self) -> int:
        return self.codebooks.shape[0]

    @property
    def group_size(self) -> int:
        return self.codebooks.shape[2]

    @property
    def in_features(self) -> int:
        return self.code_columns // self.num_codebooks * self.group_size


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
def _build_units(x, codebooks_t, first_column, last_column, tables, first_unit, last_unit):
    """tables[t, (i - first_column)*K + k] = x[t, group(i)] . codebooks[m(i), k] for the units
    (t, i) numbered t*(last-first) + (i - first) in [first_unit, last_unit), code columns
    i in [first_column, last_column) (column i = j*M + m).

    x [T, in] f32, codebooks_t [M, g, K] f32, tables [T, >= (last-first)*K] f32 (overwritten).
    For g = 8 the group's inputs and codebook rows are held in scalars and each entry is stored
    once (LLVM vectorises it along K: ~28e9 multiply-adds/s per core, like a BLAS call, 4x the
    general loop, whose stores into `tables` may alias the codebooks as far as LLVM knows)."""
    num_codebooks, group_size, codewords = codebooks_t.shape
    columns = last_column - first_column
    for unit in range(first_unit, last_unit):
        t = unit // columns
        local = unit - t * columns
        column = first_column + local
        group = column // num_codebooks
        m = column - group * num_codebooks
        row = tables[t, local * codewords:(local + 1) * codewords]
        base = group * group_size
        if group_size == 8:
            x0, x1, x2, x3 = x[t, base], x[t, base + 1], x[t, base + 2], x[t, base + 3]
            x4, x5, x6, x7 = x[t, base + 4], x[t, base + 5], x[t, base + 6], x[t, base + 7]
            c0, c1, c2, c3 = codebooks_t[m, 0], codebooks_t[m, 1], codebooks_t[m, 2], codebooks_t[m, 3]
            c4, c5, c6, c7 = codebooks_t[m, 4], codebooks_t[m, 5], codebooks_t[m, 6], codebooks_t[m, 7]
            for k in range(codewords):
                row[k] = ((x0 * c0[k] + x1 * c1[k]) + (x2 * c2[k] + x3 * c3[k])) + \
                         ((x4 * c4[k] + x5 * c5[k]) + (x6 * c6[k] + x7 * c7[k]))
        else:
            row[:] = 0
            for d in range(group_size):
                xd = x[t, base + d]
                for k in range(codewords):
                    row[k] += xd * codebooks_t[m, d, k]


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
def _table_row_sum_32x8(table, row_codes):
    """_table_row_sum for slices of 32 code columns of 8-bit codes (every 2x8 and 1x8 layer: a
    32 KiB slice). The constant trip count lets LLVM unroll the loop into four 8-lane gathers with
    no loop or remainder code around them: ~1.2x the general loop on the 3B layers (the gathers
    still take 64-bit indices: 32-bit index arithmetic, signed or not, compiled the same)."""
    total = np.float32(0.0)
    for i in range(32):
        total += table[(i << 8) | np.int64(row_codes[i])]
    return total


@njit(fastmath=True, cache=True)
def _gather_tiles(tables, tiled, nbits, first_slice, last_slice, first_tile, last_tile, out, scales, bias, has_bias,
                  finish):
    """For the rows of tiles [first_tile, last_tile): out[t, row] += the table entries their codes
    pick in slices [first_slice, last_slice), slice by slice (the block's rows all pass through
    one slice of the table while it is in L1); with finish, then out[t, row] = out[t, row] *
    scales[row] (+ bias[row]).

    tables [T, >= (last_slice - first_slice)*C*K] f32 (the pass's tables, from slice first_slice
    on), tiled [out/R, G*M/C, R, C], out [T, out] f32 (accumulated into), scales [out] f32, bias
    [out] f32 (read only if has_bias)."""
    tokens = tables.shape[0]
    rows, columns = tiled.shape[2], tiled.shape[3]
    slice_entries = columns << nbits
    for s in range(first_slice, last_slice):
        offset = (s - first_slice) * slice_entries
        for t in range(tokens):
            table = tables[t, offset:offset + slice_entries]
            for tile in range(first_tile, last_tile):
                if columns == 32 and nbits == 8:
                    for r in range(rows):
                        out[t, tile * rows + r] += _table_row_sum_32x8(table, tiled[tile, s, r])
                else:
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
def _lut_pass_parallel(x, codebooks_t, tiled, nbits, first_slice, last_slice, tables, out, scales, bias, has_bias,
                       blocks, build_chunks):
    """One table pass on numba's threads: the tables of slices [first_slice, last_slice) built in
    build_chunks chunks, then gathered in `blocks` blocks of whole tiles (a thread writes only its
    own rows: no two threads add into one output); scales and bias applied by the last pass. Two
    parallel regions: each start wakes the thread pool.

    x [T, in] f32, codebooks_t [M, g, K] f32, tiled [out/R, G*M/C, R, C], tables [T, >= pass
    columns * K] f32 (scratch), out [T, out] f32, scales [out] f32, bias [out] f32 (read only if
    has_bias)."""
    tiles, slices, _, columns = tiled.shape
    first_column, last_column = first_slice * columns, last_slice * columns
    units = x.shape[0] * (last_column - first_column)
    chunks = min(units, build_chunks)
    for chunk in prange(chunks):
        _build_units(x, codebooks_t, first_column, last_column, tables, chunk * units // chunks,
                     (chunk + 1) * units // chunks)
    for block in prange(blocks):
        _gather_tiles(tables, tiled, nbits, first_slice, last_slice, block * tiles // blocks,
                      (block + 1) * tiles // blocks, out, scales, bias, has_bias, last_slice == slices)


@njit(fastmath=True, cache=True)
def _lut_pass_serial(x, codebooks_t, tiled, nbits, first_slice, last_slice, tables, out, scales, bias, has_bias):
    """_lut_pass_parallel on the calling thread alone (small products): the same arithmetic."""
    tiles, slices, _, columns = tiled.shape
    first_column, last_column = first_slice * columns, last_slice * columns
    _build_units(x, codebooks_t, first_column, last_column, tables, 0, x.shape[0] * (last_column - first_column))
    _gather_tiles(tables, tiled, nbits, first_slice, last_slice, 0, tiles, out, scales, bias, has_bias,
                  last_slice == slices)


def pass_slices(tokens: int, operands: CpuOperands, table_pass_bytes: int = TABLE_PASS_BYTES) -> int:
    """Slices of code columns whose tables (all tokens) one pass builds: at most table_pass_bytes,
    at least one slice."""
    slice_bytes = (4 << operands.nbits) * operands.codes.shape[3] * tokens
    return max(1, min(operands.codes.shape[1], table_pass_bytes // slice_bytes))


@njit(fastmath=True, cache=True)
def _lut_one_pass_serial(x, codebooks_t, tiled, nbits, scales, bias, has_bias):
    """The whole product in one pass on the calling thread; tables and output allocated here (one
    call from Python per product: what a decode step makes ~200 times per token)."""
    tiles, slices, rows, columns = tiled.shape
    tables = np.empty((x.shape[0], (slices * columns) << nbits), dtype=np.float32)
    out = np.zeros((x.shape[0], tiles * rows), dtype=np.float32)
    _lut_pass_serial(x, codebooks_t, tiled, nbits, 0, slices, tables, out, scales, bias, has_bias)
    return out


@njit(fastmath=True, cache=True)
def _lut_one_pass_parallel(x, codebooks_t, tiled, nbits, scales, bias, has_bias, blocks, build_chunks):
    """_lut_one_pass_serial on numba's threads (_lut_pass_parallel)."""
    tiles, slices, rows, columns = tiled.shape
    tables = np.empty((x.shape[0], (slices * columns) << nbits), dtype=np.float32)
    out = np.zeros((x.shape[0], tiles * rows), dtype=np.float32)
    _lut_pass_parallel(x, codebooks_t, tiled, nbits, 0, slices, tables, out, scales, bias, has_bias, blocks,
                       build_chunks)
    return out


def lut_matmul_operands(x: np.ndarray | torch.Tensor, operands: CpuOperands,
                        table_pass_bytes: int = TABLE_PASS_BYTES) -> np.ndarray:
    """`lut_matmul` on prepared operands: x [T, in] float32 -> [T, out] float32. Tables are built
    and consumed in passes of at most table_pass_bytes (one pass unless codebooks are large)."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        x = (x.detach() if x.requires_grad else x).numpy()
    elif x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != operands.in_features:
        raise ValueError(f"x {tuple(x.shape)}: expected [tokens, {operands.in_features}]")
    tokens = x.shape[0]
    tiles, slices, _, columns = operands.codes.shape
    per_pass = pass_slices(tokens, operands, table_pass_bytes)
    serial = tokens * operands.codes.size < PARALLEL_MIN_LOADS
    threads = 1 if serial else numba.get_num_threads()
    common = (x, operands.codebooks_t, operands.codes, operands.nbits)
    bias = (operands.scales, operands.bias_or_scales, operands.bias is not None)
    if per_pass >= slices:
        if threads == 1:
            return _lut_one_pass_serial(*common, *bias)
        # one block of tiles per thread: the fewer blocks, the fewer times a table slice is loaded
        return _lut_one_pass_parallel(*common, *bias, min(threads, tiles), 4 * threads)
    tables = np.empty((tokens, (per_pass * columns) << operands.nbits), dtype=np.float32)
    out = np.zeros((tokens, operands.out_features), dtype=np.float32)
    for first in range(0, slices, per_pass):
        arguments = (*common, first, min(slices, first + per_pass), tables, out, *bias)
        if threads == 1:
            _lut_pass_serial(*arguments)
        else:
            _lut_pass_parallel(*arguments, min(threads, tiles), 4 * threads)
    return out


def lut_product(x: torch.Tensor, operands: CpuOperands, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through lookup tables, on prepared operands (the path a decode
    step takes ~200 times per token for SmolLM2: one numba call, ~10 us of Python around it)."""
    if threads is not None:
        with numba_threads(threads):
            return lut_product(x, operands)
    return torch.from_numpy(lut_matmul_operands(x, operands))


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

    tiled [out/R, G*M/C, R, C], codebooks [M, K, g] f32, scales [out] f32, dense [rows, G*g] f32.
    A row's codes are walked in column order (j, m) with counters (no divisions per code)."""
    num_codebooks, codewords, group_size = codebooks.shape
    slices, rows, columns = tiled.shape[1], tiled.shape[2], tiled.shape[3]
    flat = codebooks.reshape(-1)
    for local in prange(dense.shape[0]):
        tile = first_tile + local // rows
        r = local % rows
        target = dense[local]
        scale = scales[tile * rows + r]
        group = 0
        codebook = 0
        for s in range(slices):
            for c in range(columns):
                source = (codebook * codewords + tiled[tile, s, r, c]) * group_size
                base = group * group_size
                if codebook == 0:
                    for d in range(group_size):
                        target[base + d] = flat[source + d]
                else:
                    for d in range(group_size):
                        target[base + d] += flat[source + d]
                codebook += 1
                if codebook == num_codebooks:
                    for d in range(group_size):
                        target[base + d] *= scale
                    codebook = 0
                    group += 1


@njit(parallel=True, fastmath=True, cache=True)
def _dequantize_tiles_g8(tiled, codebooks, scales, first_tile, dense):
    """_dequantize_tiles for groups of 8 (the 2x8 and 3x8 geometries): a group's 8 sums kept in
    scalars and stored once, which LLVM can keep in registers (stores into `dense` may alias the
    codebooks as far as it knows, so an array accumulator is reloaded per code): ~4x faster."""
    num_codebooks, codewords, _ = codebooks.shape
    slices, rows, columns = tiled.shape[1], tiled.shape[2], tiled.shape[3]
    flat = codebooks.reshape(-1)
    for local in prange(dense.shape[0]):
        tile = first_tile + local // rows
        r = local % rows
        target = dense[local]
        scale = scales[tile * rows + r]
        group = 0
        codebook = 0
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = np.float32(0.0)
        for s in range(slices):
            for c in range(columns):
                source = (codebook * codewords + tiled[tile, s, r, c]) * 8
                v0 += flat[source]
                v1 += flat[source + 1]
                v2 += flat[source + 2]
                v3 += flat[source + 3]
                v4 += flat[source + 4]
                v5 += flat[source + 5]
                v6 += flat[source + 6]
                v7 += flat[source + 7]
                codebook += 1
                if codebook == num_codebooks:
                    base = group * 8
                    target[base] = v0 * scale
                    target[base + 1] = v1 * scale
                    target[base + 2] = v2 * scale
                    target[base + 3] = v3 * scale
                    target[base + 4] = v4 * scale
                    target[base + 5] = v5 * scale
                    target[base + 6] = v6 * scale
                    target[base + 7] = v7 * scale
                    v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = np.float32(0.0)
                    codebook = 0
                    group += 1


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
    dequantize = _dequantize_tiles_g8 if operands.group_size == 8 else _dequantize_tiles
    with numba_threads(threads):
        for first in range(0, tiles, per_chunk):
            count = min(per_chunk, tiles - first)
            dense = chunk[:count * tile_rows]
            dequantize(operands.codes, operands.codebooks, operands.scales, first, dense)
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


# --- dense bfloat16 product (the tied lm_head, and any bf16 linear at decode) ----------------------

# Rows of the weight per parallel chunk of bf16_matmul: enough that a chunk's start is amortised,
# few enough that the threads' shares stay even (128,256 rows of the 3B head: ~500 chunks).
BF16_ROWS_PER_CHUNK = 256


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are `bits` (a uint32): a bit cast, no conversion."""
    def codegen(context, builder, signature, arguments):
        return builder.bitcast(arguments[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float32(typingctx, value):
    """The bits of a float32 as a uint32: a bit cast, no conversion."""
    def codegen(context, builder, signature, arguments):
        return builder.bitcast(arguments[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(fastmath=True, cache=True)
def _bf16_widen(bits):
    """The float32 value of a bfloat16 given as its uint16 bits (bf16 is float32's top half)."""
    return _float32_from_bits(np.uint32(bits) << np.uint32(16))


@njit(parallel=True, fastmath=True, cache=True)
def _bf16_matmul(x, weight_bits, rows_per_chunk, out):
    """out[t, o] = sum_i x[t, i] * float32(weight[o, i]) for a bfloat16 weight read as its bits.

    x [T, in] f32, weight_bits [out, in] uint16 (the bf16 weight's bytes), out [T, out] f32.
    Four rows at a time, widened as they are read (one stream of loads that the prefetcher keeps
    ahead of; widening a row into a scratch first, then dotting it, stalled on DRAM in one phase
    and computed in the other: half the speed), four independent sums sharing each load of x.
    The weight is read from RAM once, as bf16: torch's bf16 GEMV on the 2-core box reads ~14 GB/s
    (compute-bound) where its fp32 one reads ~27, and an fp32 copy would double the memory."""
    rows, width = weight_bits.shape
    tokens = x.shape[0]
    chunks = (rows + rows_per_chunk - 1) // rows_per_chunk
    for chunk in prange(chunks):
        last = min(rows, (chunk + 1) * rows_per_chunk)
        o = chunk * rows_per_chunk
        while o + 4 <= last:
            w0, w1, w2, w3 = weight_bits[o], weight_bits[o + 1], weight_bits[o + 2], weight_bits[o + 3]
            for t in range(tokens):
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for i in range(width):
                    xi = x[t, i]
                    a0 += xi * _bf16_widen(w0[i])
                    a1 += xi * _bf16_widen(w1[i])
                    a2 += xi * _bf16_widen(w2[i])
                    a3 += xi * _bf16_widen(w3[i])
                out[t, o], out[t, o + 1], out[t, o + 2], out[t, o + 3] = a0, a1, a2, a3
            o += 4
        while o < last:  # the chunk's last rows, one at a time
            w0 = weight_bits[o]
            for t in range(tokens):
                total = np.float32(0.0)
                for i in range(width):
                    total += x[t, i] * _bf16_widen(w0[i])
                out[t, o] = total
            o += 1


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                rows_per_chunk: int = BF16_ROWS_PER_CHUNK) -> torch.Tensor:
    """x [T, in] (any float dtype) @ weight [out, in] bfloat16 ^T (+ bias [out]) -> [T, out] float32,
    computed in float32 from the bf16 weight read in place (no copy of it), on numba's threads."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"bf16_matmul: weight {weight.dtype} {tuple(weight.shape)} on {weight.device}, "
                         "expected a 2-d bfloat16 CPU tensor")
    x32 = x.detach().to(torch.float32).contiguous()
    if x32.dim() != 2 or x32.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x32.shape)}: expected [tokens, {weight.shape[1]}]")
    bits = weight.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
    out = np.empty((x32.shape[0], weight.shape[0]), dtype=np.float32)
    _bf16_matmul(x32.numpy(), bits, rows_per_chunk, out)
    result = torch.from_numpy(out)
    if bias is not None:
        result += bias.detach().to(torch.float32)
    return result
