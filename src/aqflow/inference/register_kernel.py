"""The CPU decode product of 8-bit-code AQLM layers through compiled table kernels (C, called from numba).

`cpu_kernels.lut_matmul` sums one table entry per code through numba's gathers from an L1-resident
table slice. Here a C kernel sums them, the one cpu_dispatch chose for this CPU, on codes laid out
per code column (`kernel_tiles`):

    avx512 (csrc/lut_cpu.c): a column's 256-entry table held in 16 AVX-512 registers, a 16-lane
           permute looking up 16 rows, loaded once for 512 rows; codes as column tiles (`column_tiles`:
           [tiles][columns][64], a tile's 64 rows of one column contiguous);
    avx2, neon (csrc/lut_cpu_l1.c): tables in L1, built 16 columns at a time, one scalar load per code
           (a table is twice the register file of AVX2 or NEON; on Zen 4 twice the codes/s of gathers);
           codes block-major (`block_tiles`: the column tiles of 16 columns for every tile, then of the
           next 16), so that a block is one sequential read.

The threads split a layer's code columns: each builds the tables of its slice and sums them over
every row, then the slices are added. Several layers of one input (q/k/v, gate/up) can be one
product (`stacked_operands`): each thread takes its slice of every layer in turn, so the call and its
two parallel regions are paid once.

Table kinds. float32 for float32 activations, on every kernel: the outputs equal the gather kernels'
up to float32 rounding (the order of the additions, the rounding of the table entries). On avx512,
where the CPU has AVX-512 VBMI they are held as four byte planes (`float32_layout` "planes": a 64-lane
byte permute pair looks up 64 rows of a plane, a third of the shuffles per code; the same sums, bit for
bit), else as float32 registers ("registers"; AQFLOW_CPU_PLANES=0 keeps those); avx2 and neon hold
them in L1 ("l1"). For bfloat16/float16 activations, whose outputs are rounded to 16 bits, avx512 also
has float16 tables (8 registers, half the permutes; each entry rounded by at most 2^-11 of itself) and,
with AVX-512 VBMI and VNNI, int16 ones (a step per block of 8 columns, its largest entry / 32767; each
entry within half a step; two byte planes); whichever kind times fastest on the first product
(`tables_for_16bit`, AQFLOW_CPU_TABLES). avx2 and neon have float32 tables alone: a scalar load
costs the same whatever the entry's width. On the 16 cores of the GPU host's Xeon a Llama-3.2-3B
decode is 1.97-2.68x dense bf16's with the int16 kind (benchmarks/results/README.md, "Byte-plane
tables on the CPU").

`compiled_kernel()` is None, and FastQuantizedLinear keeps the numba kernels, where cpu_dispatch
chose numba (no compiled kernel runs or builds here, or AQFLOW_CPU_KERNEL=numba).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import njit, prange

from aqflow.inference import cpu_dispatch
from aqflow.inference.cpu_dispatch import L1_BLOCK_COLUMNS
from aqflow.inference.cpu_kernels import PARALLEL_MIN_LOADS

ROWS = 64  # rows per tile: four 16-lane lookups per code column
# Code columns per thread at the least (a 64-row tile's column is 64 codes): a thread's slice of
# fewer would cost more in its partial sums (one float per row) than in table lookups.
MIN_BLOCK_COLUMNS = 32
PLANES_CPU_FLAG = "avx512vbmi"  # byte permutes: float32 tables as byte planes
PLANES_ENV = "AQFLOW_CPU_PLANES"  # 0: float32 tables as float32 registers even where byte planes run
INT16_CPU_FLAGS = ("avx512vbmi", "avx512_vnni", "avx512vl")  # byte permutes, 16-bit multiply-adds


@dataclass(frozen=True)
class Kernels:
    """The compiled products of kernel `name` (cpu_dispatch.KERNELS; ctypes functions of its C
    source), with the arguments (x, codebooks, M, g, codes, tiles, columns, first_column, last_column,
    tables, out): `float32` tables (exact to float32 rounding; held as `float32_layout` "planes" or
    "registers" on avx512, "l1" on avx2 and neon), and for 16-bit activations on avx512 `float16` ones
    and, where the CPU has AVX-512 VBMI and VNNI, `int16` ones (each block of 8 columns scaled by its
    largest entry: an entry off by at most 2^-16 of that); None where the kernel has none."""

    name: str
    float32: object
    float32_layout: str
    float16: object = None
    int16: object = None
    code_layout: str = "columns"  # how the kernel reads codes: "columns" (column_tiles) or "blocks" (block_tiles)

    def kinds(self) -> tuple[str, ...]:
        """The table kinds 16-bit activations may take here."""
        return tuple(kind for kind in ("float16", "float32", "int16") if getattr(self, kind) is not None)


def planes_wanted(flags: set[str]) -> bool:
    """Whether float32 tables are held as byte planes: the CPU has AVX-512 VBMI and $AQFLOW_CPU_PLANES
    is not 0 (1, the default, where it runs; an error naming the variable otherwise)."""
    value = os.environ.get(PLANES_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PLANES_ENV}={value!r}: expected 1 (byte planes where the CPU has AVX-512 VBMI) or 0")
    return value == "1" and PLANES_CPU_FLAG in flags


def _bound(function):
    """A kernel function of the C sources with its argument types set (they share one signature)."""
    if function is not None:
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                             ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                             ctypes.c_void_p]
        function.restype = None
    return function


def bind_kernels(name: str, library: ctypes.CDLL) -> Kernels:
    """Kernel `name`'s products from its loaded library (avx512: by the CPU's AVX-512 extensions)."""
    if name != "avx512":
        return Kernels(name, _bound(library.aqflow_l1_product), "l1", code_layout="blocks")
    flags = cpu_dispatch.cpu_flags()
    planes = planes_wanted(flags)
    float32 = library.aqflow_register_product_planes if planes else library.aqflow_register_product
    int16 = library.aqflow_register_product_int16 if all(flag in flags for flag in INT16_CPU_FLAGS) else None
    return Kernels(name, _bound(float32), "planes" if planes else "registers",
                   _bound(library.aqflow_register_product_f16), _bound(int16))


@functools.cache
def compiled_kernel() -> Kernels | None:
    """The compiled products of the kernel cpu_dispatch chose for this process, or None where it chose
    numba (cache_clear() after changing AQFLOW_CPU_KERNEL, AQFLOW_CPU_PLANES or AQFLOW_CPU_PREFETCH)."""
    name, library = cpu_dispatch.chosen_kernel()
    return None if library is None else bind_kernels(name, library)


def kernel_name() -> str:
    """The CPU kernel 8-bit-code layers take in this process: avx512, avx2, neon or numba."""
    kernels = compiled_kernel()
    return "numba" if kernels is None else kernels.name


def applies(nbits: int, out_features: int) -> bool:
    """Whether a layer takes a compiled kernel on this machine: 8-bit codes, whole tiles of rows."""
    return nbits == 8 and out_features % ROWS == 0 and compiled_kernel() is not None


def kernel_layout() -> str:
    """How the compiled kernel in use reads codes: "columns" (avx512) or "blocks" (avx2, neon)."""
    kernels = compiled_kernel()
    if kernels is None:
        raise RuntimeError("no compiled CPU kernel in this process (cpu_dispatch chose numba)")
    return kernels.code_layout


def column_tiles(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, G, M] uint8 -> [out/64, G*M, 64] (a contiguous copy): tiles[a, c, r] =
    codes[a*64 + r, column c] with c = j*M + m."""
    out_features, groups, num_codebooks = codes.shape
    return codes.reshape(out_features // ROWS, ROWS, groups * num_codebooks).permute(0, 2, 1).contiguous()


def rows_from_column_tiles(tiles: torch.Tensor, num_codebooks: int) -> torch.Tensor:
    """Inverse of column_tiles: [out/64, G*M, 64] -> codes [out, G, M] (a copy)."""
    count, columns, rows = tiles.shape
    return tiles.permute(0, 2, 1).reshape(count * rows, columns // num_codebooks, num_codebooks).contiguous()


def layout_blocks(columns: int, block_columns: int = L1_BLOCK_COLUMNS) -> list[tuple[int, int]]:
    """(first, last) of each block of the block-major layout: block_columns columns, the last fewer."""
    return [(start, min(start + block_columns, columns)) for start in range(0, columns, block_columns)]


def block_tiles(codes: torch.Tensor, block_columns: int = L1_BLOCK_COLUMNS) -> torch.Tensor:
    """codes [out, G, M] uint8 -> the same bytes block-major, held as [out/64, G*M, 64] (the shape of
    column_tiles, so that a stack of layers is a torch.cat along tiles; the order within is not
    column_tiles'): for each block of block_columns columns (the last narrower), for every tile, the
    block's columns' 64 rows each, i.e. column_tiles(codes)[:, first:last] flattened, block after block."""
    tiles = column_tiles(codes)
    blocks = [tiles[:, first:last].reshape(-1) for first, last in layout_blocks(tiles.shape[1], block_columns)]
    return torch.cat(blocks).view(tiles.shape)


def rows_from_block_tiles(held: torch.Tensor, num_codebooks: int, block_columns: int = L1_BLOCK_COLUMNS) -> torch.Tensor:
    """Inverse of block_tiles: block-major [out/64, G*M, 64] -> codes [out, G, M] (a copy)."""
    count, columns, rows = held.shape
    flat = held.reshape(-1)
    tiles = torch.empty_like(held)
    for first, last in layout_blocks(columns, block_columns):
        size = count * (last - first) * rows
        tiles[:, first:last] = flat[first * count * rows:first * count * rows + size].view(count, last - first, rows)
    return rows_from_column_tiles(tiles, num_codebooks)


LAYOUTS = {"columns": (column_tiles, rows_from_column_tiles), "blocks": (block_tiles, rows_from_block_tiles)}


def kernel_tiles(codes: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """codes [out, G, M] uint8 laid out as `layout` ("columns" or "blocks"; None: the kernel in use's)."""
    return LAYOUTS[layout or kernel_layout()][0](codes)


def rows_from_kernel_tiles(held: torch.Tensor, num_codebooks: int, layout: str) -> torch.Tensor:
    """Inverse of kernel_tiles: codes held as `layout` -> [out, G, M] (a copy)."""
    return LAYOUTS[layout][1](held, num_codebooks)


@dataclass(frozen=True)
class RegisterOperands:
    """One layer, or several layers of the same input stacked by rows (q/k/v, gate/up: one product
    for all), as the kernel reads them: codes [tiles, G*M, 64] uint8 (kernel_tiles as `layout`, the
    layers' tiles one after another), codebooks [layers, M, g, 256] float32 (codeword index last),
    scales [out] and bias [out] float32 (zeros where a layer has none), layer_tiles [layers + 1] int64
    (layer i holds tiles layer_tiles[i]:layer_tiles[i + 1], so rows 64 times those)."""

    codes: np.ndarray
    codebooks: np.ndarray
    scales: np.ndarray
    bias: np.ndarray
    layer_tiles: np.ndarray
    layout: str = "columns"

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * ROWS


def register_operands(tiles: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None, layout: str = "columns") -> RegisterOperands:
    """The kernel's view of a layer whose codes are held as `layout` (kernel_tiles: [out/64, G*M, 64])
    with codebooks [M, 256, g], scales [out] and bias [out] (or None): the codes shared, the rest as
    float32 copies."""
    out_features = tiles.shape[0] * ROWS
    as_float = lambda tensor: np.ascontiguousarray(tensor.detach().to(torch.float32).reshape(-1).numpy())  # noqa: E731
    return RegisterOperands(
        codes=tiles.numpy(),
        codebooks=np.ascontiguousarray(codebooks.detach().to(torch.float32).transpose(1, 2).numpy())[None],
        scales=as_float(scales),
        bias=np.zeros(out_features, dtype=np.float32) if bias is None else as_float(bias),
        layer_tiles=np.array([0, tiles.shape[0]], dtype=np.int64), layout=layout)


def stacked_operands(tiles: torch.Tensor, layers: list[RegisterOperands]) -> RegisterOperands:
    """Several layers of the same input as one product: `tiles` [sum of their tiles, G*M, 64] uint8
    holds their codes one after another, each layer's laid out on its own (the caller keeps it; the
    operands view it), `layers` their own operands (one layer each, same code columns, codebook shape
    and layout)."""
    first = layers[0]
    if any(layer.codes.shape[1:] != first.codes.shape[1:] or layer.codebooks.shape != first.codebooks.shape
           or len(layer.layer_tiles) != 2 or layer.layout != first.layout for layer in layers):
        raise ValueError("stacked_operands: the layers must be single layers with the same code columns, codebooks "
                         "and layout")
    counts = [layer.codes.shape[0] for layer in layers]
    if tiles.shape[0] != sum(counts) or tuple(tiles.shape[1:]) != first.codes.shape[1:]:
        raise ValueError(f"stacked_operands: tiles {tuple(tiles.shape)} do not hold the layers' {sum(counts)} tiles")
    return RegisterOperands(
        codes=tiles.numpy(),
        codebooks=np.concatenate([layer.codebooks for layer in layers]),
        scales=np.concatenate([layer.scales for layer in layers]),
        bias=np.concatenate([layer.bias for layer in layers]),
        layer_tiles=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), layout=first.layout)


def column_blocks(columns: int, threads: int) -> int:
    """How many slices of the code columns a product is split into: one a thread, each at least
    MIN_BLOCK_COLUMNS columns (fewer would make the partial sums cost more than the slice)."""
    return max(1, min(threads, columns // MIN_BLOCK_COLUMNS))


@njit(parallel=True, cache=True)
def _product_parallel(kernel, x, codebooks, codes, layer_tiles, scales, bias, tables, partial, out):
    """out[t] = (the table sums of token t) * scales + bias: each of `blocks` = partial.shape[0]
    threads builds, layer by layer, the tables of a slice of the code columns into tables[block] and
    sums them over the layer's rows into partial[block, t] (the kernel); then the slices are added in
    block order, a chunk of rows a thread. Two parallel regions whatever the number of layers.

    x [T, in] f32, codebooks [layers, M, g, 256] f32, codes [tiles, C, 64] u8, layer_tiles [layers + 1],
    scales and bias [out] f32, tables [blocks, >= C/blocks + 1, 256] f32 or f16 bits as u16 (the
    kernel's; scratch), partial [blocks, T, out] f32, out [T, out] f32."""
    columns = codes.shape[1]
    num_codebooks, group = codebooks.shape[1], codebooks.shape[2]
    blocks = partial.shape[0]
    for t in range(x.shape[0]):
        for block in prange(blocks):
            first = block * columns // blocks
            last = (block + 1) * columns // blocks
            for layer in range(layer_tiles.shape[0] - 1):
                start, stop = layer_tiles[layer], layer_tiles[layer + 1]
                kernel(x[t].ctypes.data, codebooks[layer].ctypes.data, num_codebooks, group, codes[start].ctypes.data,
                       stop - start, columns, first, last, tables[block].ctypes.data,
                       partial[block, t, start * ROWS:].ctypes.data)
    rows = out.shape[1]
    for chunk in prange(blocks):
        start = chunk * rows // blocks
        stop = (chunk + 1) * rows // blocks
        for t in range(out.shape[0]):
            for r in range(start, stop):
                total = partial[0, t, r]
                for block in range(1, blocks):
                    total += partial[block, t, r]
                out[t, r] = total * scales[r] + bias[r]


# Scratch arrays by (thread, shape): a decode step calls the same few layer shapes again and again,
# and fresh arrays of a few MiB cost page faults on every call.
_scratch: dict[tuple, np.ndarray] = {}


def scratch(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An array of `shape` kept for this thread's next calls of the same shape and dtype (its
    contents are whatever the last call left)."""
    key = (threading.get_ident(), shape, np.dtype(dtype).str)
    array = _scratch.get(key)
    if array is None:
        array = _scratch[key] = np.empty(shape, dtype=dtype)
    return array


def register_matmul(x: np.ndarray, operands: RegisterOperands, threads: int | None = None,
                    table_dtype: str = "float32") -> np.ndarray:
    """x [T, in] float32 -> [T, out] float32 = x W^T (times scales, plus bias) through the register
    kernel. threads: slices of the code columns summed at once (None: numba's thread count, or the
    calling thread alone for a product too small to wake the pool, as cpu_kernels decides).
    table_dtype: "float32" (exact to float32 rounding), or for outputs that will be rounded to 16 bits
    anyway "float16" (each table entry rounded to float16) or "int16" (Kernels.int16)."""
    kernels = compiled_kernel()
    if kernels is None:
        raise RuntimeError("no compiled CPU kernel in this process (cpu_dispatch chose numba: "
                           "register_kernel.applies is False)")
    if operands.layout != kernels.code_layout:  # codes laid out for another kernel would be read as garbage
        raise RuntimeError(f"codes laid out as {operands.layout!r}, the {kernels.name} kernel in use reads "
                           f"{kernels.code_layout!r}: lay them out again (kernel_tiles) after changing the kernel")
    kernel = getattr(kernels, table_dtype)
    if kernel is None:
        raise RuntimeError(f"the {kernels.name} kernel has no {table_dtype} tables (it has {', '.join(kernels.kinds())})")
    tokens, columns = x.shape[0], operands.codes.shape[1]
    if threads is None:
        threads = 1 if tokens * operands.codes.size < PARALLEL_MIN_LOADS else numba.get_num_threads()
    out = np.empty((tokens, operands.out_features), dtype=np.float32)
    blocks = column_blocks(columns, threads)
    # a column's table: 256 float32 entries, float16 ones, or int16 ones and a share of its block's scale
    tables = scratch((blocks, -(-columns // blocks), 256), np.uint16 if table_dtype == "float16" else np.float32)
    if blocks == 1:  # one slice: the kernel writes the output itself, on the calling thread
        _, num_codebooks, group, _ = operands.codebooks.shape
        for t in range(tokens):
            for layer, (start, stop) in enumerate(zip(operands.layer_tiles[:-1], operands.layer_tiles[1:])):
                kernel(x[t].ctypes.data, operands.codebooks[layer].ctypes.data, num_codebooks, group,
                       operands.codes[start].ctypes.data, stop - start, columns, 0, columns, tables.ctypes.data,
                       out[t, start * ROWS:].ctypes.data)
        out *= operands.scales
        out += operands.bias
    else:
        _product_parallel(kernel, x, operands.codebooks, operands.codes, operands.layer_tiles, operands.scales,
                          operands.bias, tables, scratch((blocks, tokens, operands.out_features)), out)
    return out


def table_dtype_for(activations: torch.dtype) -> str:
    """The tables' dtype activations of this dtype may take: float16 for 16-bit activations (the
    entries' rounding, <= 2^-11 relative, is below that of the 16-bit outputs), float32 otherwise."""
    return "float16" if activations in (torch.bfloat16, torch.float16) else "float32"


TABLES_ENV = "AQFLOW_CPU_TABLES"  # for 16-bit activations: auto (default), float16, float32 or int16
TABLE_TIMING_ROUNDS = 7  # calls of each table kind, in turn, when choosing by time
# (kernel name, thread count) -> the table dtype timed fastest in this process
_fastest_tables: dict[tuple[str, int], str] = {}


def tables_for_16bit(x: np.ndarray, operands: RegisterOperands, threads: int | None) -> str:
    """The tables for a product whose activations are 16-bit, where every kind here is accurate enough
    (Kernels.kinds: float16, float32 and, with AVX-512 VBMI and VNNI, int16): $AQFLOW_CPU_TABLES if it
    names one, else ('auto') whichever was fastest on the first such product at this thread count (each
    kind warmed once, then the best of TABLE_TIMING_ROUNDS calls, the kinds in turn). Why measure: float16
    tables halve the permutes and won on a 2-core EPYC (2.24x against 1.67-1.81x dense bf16's speed),
    while on a 16-core Xeon float32 ones once decoded faster (17.4 against 16.1 tokens/s) and on another
    float16 ones took ~30 % less time (benchmarks/lut_stream.py). A kernel of one kind (avx2, neon)
    takes it untimed."""
    kernels = compiled_kernel()
    kinds = kernels.kinds()
    wanted = os.environ.get(TABLES_ENV, "auto")
    if wanted != "auto":
        if wanted not in kinds:
            raise ValueError(f"{TABLES_ENV}={wanted!r}: expected auto or one of {', '.join(kinds)} "
                             f"(the {kernels.name} kernel's)")
        return wanted
    key = (kernels.name, threads if threads is not None else numba.get_num_threads())
    if key not in _fastest_tables and len(kinds) == 1:
        _fastest_tables[key] = kinds[0]
    if key not in _fastest_tables:  # every product asks; the kinds are timed once per kernel and thread count
        for dtype in kinds:
            register_matmul(x, operands, threads, dtype)  # warm: scratch, caches
        seconds = {dtype: float("inf") for dtype in kinds}
        # the kinds in turn, each one's best kept: on a 16-core host whose load moves, three calls of one
        # kind then three of the other once chose float32 tables, whose products took ~40 % longer there
        for _ in range(TABLE_TIMING_ROUNDS):
            for dtype in kinds:
                start = time.perf_counter()
                register_matmul(x, operands, threads, dtype)
                seconds[dtype] = min(seconds[dtype], time.perf_counter() - start)
        _fastest_tables[key] = min(seconds, key=seconds.get)
    return _fastest_tables[key]


def chosen_tables() -> dict[int, str]:
    """The table dtype tables_for_16bit settled on in this process for the current kernel, by thread
    count (empty before the first 16-bit product, or where AQFLOW_CPU_TABLES names one)."""
    name = kernel_name()
    return {threads: dtype for (kernel, threads), dtype in _fastest_tables.items() if kernel == name}


def product_with_operands(x: torch.Tensor, operands: RegisterOperands, threads: int | None = None) -> torch.Tensor:
    """x [T, in] in any float dtype -> [T, out] float32 through the compiled kernel, with float32 tables
    for float32 activations and tables_for_16bit's for 16-bit ones (table_dtype_for says which may
    take float16). threads: as register_matmul."""
    flat = np.ascontiguousarray(x.detach().to(torch.float32).numpy())
    dtype = table_dtype_for(x.dtype)
    if dtype == "float16":
        dtype = tables_for_16bit(flat, operands, threads)
    return torch.from_numpy(register_matmul(flat, operands, threads, dtype))


def register_product(x: torch.Tensor, tiles: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through the compiled kernel in use, for a layer held in its layout
    (kernel_tiles: [out/64, G*M, 64]) with codebooks [M, 256, g], scales [out] and bias [out] or None
    (product_with_operands; FastQuantizedLinear keeps the operands between calls instead)."""
    return product_with_operands(x, register_operands(tiles, codebooks, scales, bias, kernel_layout()), threads)
