"""AQLM linears on a CPU without a dense weight in RAM: numba kernels, multi-threaded.

`lut_matmul` is the decode path (a few tokens), the lookup-table product of "Extreme Compression
of Large Language Models via Additive Quantization" (Egiazarian, Panferov, Kuznedelev, Frantar,
Babenko, Alistarh): for every token t, input group j and codebook m a table of the K dot products
of x[t, j*g:(j+1)*g] with the codewords,

    table[t, j, m, k] = sum_d x[t, j*g + d] * codebooks[m, k, d]           (T*G*M*K*g multiply-adds)

then every output row sums one table entry per (group, codebook) - no multiply per weight:

    y[t, o] = scales[o] * sum_{j, m} table[t, j, m, codes[o, j, m]] + bias[o]   (T*out*G*M loads)

The second sum is the work: one indexed load per code, which LLVM turns into AVX-512/AVX2 gathers
when the reduction runs over a row's contiguous codes into one scalar (measured on this project's
2-core Xeon: ~1.6-1.9e9 table loads/s per core with the table in L2, the same as hand-written
AVX-512 gather intrinsics; an accumulator array per block of rows is not vectorised by LLVM, and
64-bit multiplies in the index cost a third). Threads split the output rows into blocks, each
thread writing only its own rows (aqlm's numba kernel splits the input groups instead and adds
into shared outputs, which races). A thread walks its rows through the table in slices of columns
small enough to stay in its core's L2 (`table_slice_bytes`): a down_proj of Llama-3.2-3B has a
2 MiB table per token.

`dequantized_matmul` is the prefill path (many tokens): rows of the weight are dequantized a chunk
at a time into a float32 buffer and multiplied by one dense matmul (torch's BLAS), so the dense
weight never exists whole. Both compute in float32 and return float32.

The kernels are compiled by numba on their first call per code dtype and cached on disk
(`cache=True`, in __pycache__ beside this file, or NUMBA_CACHE_DIR): the first call in a fresh
environment costs a few seconds (benchmarks/inference_cpu.py prints it), later processes load the
cache.
"""

from __future__ import annotations

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
# Rows of a thread's block: enough rows per block that the table slice loaded into L2 is reused,
# few enough that all threads get blocks (16 cores x 4 blocks at 4096 rows).
ROWS_PER_BLOCK = 64
# A thread's slice of the table (per token) that it sweeps its rows through before moving on:
# half of a 2 MiB L2, the rest for the codes streaming past. Measured on the 2-core box (L2 2 MiB):
# Llama-3.2-3B's down_proj (2 MiB table) 0.75 -> 1.0e9 loads/s per core; tables that fit are
# unaffected.
TABLE_SLICE_BYTES = 1 << 20
# The most table bytes built at once (all tokens): large codebooks (16-bit codes: 256 KiB of table
# per code column) are built and consumed in passes of this size instead of all at once.
TABLE_PASS_BYTES = 64 << 20
# Rows dequantized per chunk in dequantized_matmul, in dense float32 bytes: small next to the
# model, large enough that one BLAS call amortises its start.
DEQUANTIZED_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class CpuOperands:
    """A layer's tensors as the kernels read them (numpy views; codes are not copied).

    codes [out, G*M] uint8 or int32 (column j*M + m), codebooks_t [M, g, K] float32 (transposed so
    the table build runs along K), codebooks [M, K, g] float32, scales [out] float32,
    bias [out] float32 or None."""

    codes: np.ndarray
    codebooks_t: np.ndarray
    codebooks: np.ndarray
    scales: np.ndarray
    bias: np.ndarray | None
    nbits: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // self.codebooks.shape[0] * self.codebooks.shape[2]


def cpu_operands(weights: QuantizedWeights) -> CpuOperands:
    """The kernels' view of `weights` (on the CPU). Codes are shared, not copied; codebooks, scales
    and bias are float32 (copies only where they are stored in another dtype: a few KiB a layer)."""
    if weights.codes.device.type != "cpu":
        raise ValueError(f"cpu_operands: weights on {weights.codes.device}, expected the CPU")
    out_features, groups, codebooks = weights.codes.shape
    codes = weights.codes.reshape(out_features, groups * codebooks)
    if codes.dtype not in (torch.uint8, torch.int32):
        raise ValueError(f"codes dtype {codes.dtype}: expected uint8 or int32 (QuantizedWeights' containers)")
    codebook_f32 = weights.codebooks.detach().to(torch.float32).contiguous()
    return CpuOperands(
        codes=codes.contiguous().numpy(),
        codebooks_t=codebook_f32.permute(0, 2, 1).contiguous().numpy(),
        codebooks=codebook_f32.numpy(),
        scales=weights.scales.detach().to(torch.float32).contiguous().numpy(),
        bias=None if weights.bias is None else weights.bias.detach().to(torch.float32).contiguous().numpy(),
        nbits=weights.nbits)


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
def _table_row_sum(table, codes, row, column_start, column_stop, table_offset, nbits):
    """sum over code columns i in [column_start, column_stop) of table[((i - table_offset) << nbits) + codes[row, i]].

    Written as a scalar reduction over a slice of the row's codes from index 0 with unsigned
    shift-or indices: the form LLVM vectorises into gathers (a loop from column_start, a signed
    index (wraparound select) or a 64-bit multiply in the index measured 1.5-3.5x slower)."""
    total = np.float32(0.0)
    shift = np.uint64(nbits)
    row_codes = codes[row, column_start:column_stop]
    columns = table[(column_start - table_offset) << nbits:]
    for i in range(row_codes.shape[0]):
        total += columns[(np.uint64(i) << shift) | np.uint64(row_codes[i])]
    return total


@njit(fastmath=True, cache=True)
def _gather_block(tables, codes, nbits, column_start, column_stop, slice_columns, first, last, out,
                  scales, bias, has_bias, finish):
    """For rows o in [first, last): out[t, o] += the table entries their codes pick in code columns
    [column_start, column_stop), walked in slices of slice_columns (a slice of the table stays in
    L2 while the block's rows pass through it); with finish, then out[t, o] = out[t, o] *
    scales[o] (+ bias[o]).

    tables [T, (stop-start)*K] f32 (these columns' tables), codes [out, G*M], out [T, out] f32
    (accumulated into), scales [out] f32, bias [out] f32 (read only if has_bias)."""
    tokens = tables.shape[0]
    for slice_start in range(column_start, column_stop, slice_columns):
        slice_stop = min(column_stop, slice_start + slice_columns)
        for t in range(tokens):
            table = tables[t]
            for row in range(first, last):
                out[t, row] += _table_row_sum(table, codes, row, slice_start, slice_stop, column_start, nbits)
    if finish:
        for t in range(tokens):
            for row in range(first, last):
                value = out[t, row] * scales[row]
                if has_bias:
                    value += bias[row]
                out[t, row] = value


@njit(parallel=True, fastmath=True, cache=True)
def _lut_matmul_parallel(x, codebooks_t, codes, scales, bias, has_bias, nbits, pass_columns, slice_columns,
                         rows_per_block):
    """The lookup-table product on numba's threads: per table pass, the table units split among
    threads, then the output rows in blocks of rows_per_block (a thread writes only its own rows,
    so no two threads add into one output); scales and bias applied by the last pass. Two parallel
    regions per pass: each start wakes the thread pool.

    x [T, in] f32, codebooks_t [M, g, K] f32, codes [out, G*M], scales [out] f32, bias [out] f32
    (read only if has_bias) -> [T, out] f32."""
    tokens = x.shape[0]
    rows, total_columns = codes.shape
    tables = np.empty((tokens, pass_columns << nbits), dtype=np.float32)
    out = np.zeros((tokens, rows), dtype=np.float32)
    blocks = (rows + rows_per_block - 1) // rows_per_block
    for start in range(0, total_columns, pass_columns):
        stop = min(total_columns, start + pass_columns)
        units = tokens * (stop - start)
        unit_chunks = min(units, 4 * numba.get_num_threads())
        for chunk in prange(unit_chunks):
            _build_table_units(x, codebooks_t, start, stop, tables, chunk * units // unit_chunks,
                               (chunk + 1) * units // unit_chunks)
        for block in prange(blocks):
            _gather_block(tables, codes, nbits, start, stop, slice_columns, block * rows_per_block,
                          min(rows, (block + 1) * rows_per_block), out, scales, bias, has_bias, stop == total_columns)
    return out


@njit(fastmath=True, cache=True)
def _lut_matmul_serial(x, codebooks_t, codes, scales, bias, has_bias, nbits, pass_columns, slice_columns):
    """_lut_matmul_parallel on the calling thread alone (small products: waking the pool would
    cost more than the work). Same arguments and result, bitwise (the same per-row arithmetic)."""
    tokens = x.shape[0]
    rows, total_columns = codes.shape
    tables = np.empty((tokens, pass_columns << nbits), dtype=np.float32)
    out = np.zeros((tokens, rows), dtype=np.float32)
    for start in range(0, total_columns, pass_columns):
        stop = min(total_columns, start + pass_columns)
        _build_table_units(x, codebooks_t, start, stop, tables, 0, tokens * (stop - start))
        _gather_block(tables, codes, nbits, start, stop, slice_columns, 0, rows, out, scales, bias, has_bias,
                      stop == total_columns)
    return out


def table_plan(tokens: int, operands: CpuOperands, table_slice_bytes: int = TABLE_SLICE_BYTES,
               table_pass_bytes: int = TABLE_PASS_BYTES) -> tuple[int, int]:
    """(code columns per table pass, code columns per thread's L2 slice) for `tokens` tokens.

    A pass builds the table of that many columns for all tokens (at most table_pass_bytes, at
    least one column); a slice is what a thread sweeps its rows through (at most
    table_slice_bytes per token)."""
    column_bytes = 4 << operands.nbits  # K float32 entries
    total_columns = operands.codes.shape[1]
    pass_columns = max(1, min(total_columns, table_pass_bytes // (column_bytes * tokens)))
    slice_columns = max(1, min(pass_columns, table_slice_bytes // column_bytes))
    return pass_columns, slice_columns


def lut_matmul_operands(x: np.ndarray, operands: CpuOperands, rows_per_block: int = ROWS_PER_BLOCK,
                        table_slice_bytes: int = TABLE_SLICE_BYTES,
                        table_pass_bytes: int = TABLE_PASS_BYTES) -> np.ndarray:
    """`lut_matmul` on prepared operands: x [T, in] float32 (C-contiguous) -> [T, out] float32."""
    if x.ndim != 2 or x.shape[1] != operands.in_features:
        raise ValueError(f"x {x.shape}: expected [tokens, {operands.in_features}]")
    pass_columns, slice_columns = table_plan(x.shape[0], operands, table_slice_bytes, table_pass_bytes)
    has_bias = operands.bias is not None
    arguments = (x, operands.codebooks_t, operands.codes, operands.scales,
                 operands.bias if has_bias else operands.scales, has_bias, operands.nbits, pass_columns, slice_columns)
    if x.shape[0] * operands.codes.size < PARALLEL_MIN_LOADS or numba.get_num_threads() == 1:
        return _lut_matmul_serial(*arguments)
    return _lut_matmul_parallel(*arguments, rows_per_block)


def lut_matmul(x: torch.Tensor, w: QuantizedWeights, threads: int | None = None, *,
               operands: CpuOperands | None = None, rows_per_block: int = ROWS_PER_BLOCK,
               table_slice_bytes: int = TABLE_SLICE_BYTES) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through lookup tables (the decode path; T = 1..a few).

    Any geometry: M codebooks of nbits <= 16 over groups of g inputs. `threads`: numba threads
    (None: numba's current setting, all cores unless set). `operands`: `cpu_operands(w)` computed
    once by the caller (FastQuantizedLinear keeps it), else computed here."""
    operands = cpu_operands(w) if operands is None else operands
    x32 = np.ascontiguousarray(x.detach().to(torch.float32).numpy())
    with numba_threads(threads):
        out = lut_matmul_operands(x32, operands, rows_per_block, table_slice_bytes)
    return torch.from_numpy(out)


# --- dequantized product (prefill) ------------------------------------------------------------

@njit(parallel=True, fastmath=True, cache=True)
def _dequantize_rows(codes, codebooks, scales, first_row, dense):
    """dense[r, j*g:(j+1)*g] = scales[first_row + r] * sum_m codebooks[m, codes[first_row + r, j*M + m]]
    for r < dense.shape[0]. codes [out, G*M], codebooks [M, K, g] f32, dense [rows, G*g] f32."""
    num_codebooks, _, group_size = codebooks.shape
    rows = dense.shape[0]
    groups = codes.shape[1] // num_codebooks
    for r in prange(rows):
        row = first_row + r
        scale = scales[row]
        for j in range(groups):
            base = j * group_size
            first_code = codes[row, j * num_codebooks]
            for d in range(group_size):
                dense[r, base + d] = codebooks[0, first_code, d]
            for m in range(1, num_codebooks):
                code = codes[row, j * num_codebooks + m]
                for d in range(group_size):
                    dense[r, base + d] += codebooks[m, code, d]
            for d in range(group_size):
                dense[r, base + d] *= scale


def dequantized_rows_per_chunk(in_features: int, chunk_bytes: int = DEQUANTIZED_CHUNK_BYTES) -> int:
    """Rows of a dense float32 chunk of at most chunk_bytes (at least one row)."""
    return max(1, chunk_bytes // (4 * in_features))


def dequantized_matmul(x: torch.Tensor, w: QuantizedWeights, rows_per_chunk: int | None = None, *,
                       operands: CpuOperands | None = None, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through dense float32 chunks of rows_per_chunk weight rows
    (default: DEQUANTIZED_CHUNK_BYTES of them), one BLAS matmul per chunk: the prefill path, which
    never holds more of the dense weight than one chunk."""
    operands = cpu_operands(w) if operands is None else operands
    x32 = x.detach().to(torch.float32).contiguous()
    if x32.ndim != 2 or x32.shape[1] != operands.in_features:
        raise ValueError(f"x {tuple(x32.shape)}: expected [tokens, {operands.in_features}]")
    rows_per_chunk = rows_per_chunk or dequantized_rows_per_chunk(operands.in_features)
    out_features = operands.out_features
    out = torch.empty(x32.shape[0], out_features, dtype=torch.float32)
    chunk = np.empty((min(rows_per_chunk, out_features), operands.in_features), dtype=np.float32)
    bias = None if operands.bias is None else torch.from_numpy(operands.bias)
    with numba_threads(threads):
        for first in range(0, out_features, rows_per_chunk):
            rows = min(rows_per_chunk, out_features - first)
            dense = chunk[:rows]
            _dequantize_rows(operands.codes, operands.codebooks, operands.scales, first, dense)
            out[:, first:first + rows] = x32 @ torch.from_numpy(dense).T
    if bias is not None:
        out += bias
    return out
