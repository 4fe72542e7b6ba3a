"""The CPU decode product of 8-bit-code AQLM layers with each table held in AVX-512 registers.

`cpu_kernels.lut_matmul` sums one table entry per code through gathers from an L1-resident table
slice. Here the codes are laid out per code column (`column_tiles`: a tile's 64 rows of one column
contiguous), so a 16-lane permute looks up 16 rows in the same 256-entry table held in 16
registers (csrc/lut_cpu.c). The entries are the same float32 numbers, so the outputs equal the
gather kernels' up to the order of the additions. On the 2-core EPYC box this is 1.4-1.7x aqflow's
numba kernel over a Llama-3.2-3B block (benchmarks/results/README.md, "The table in registers").

The C file is compiled on first use with the system C compiler (`$CC`, else `cc`) into
`$AQFLOW_KERNEL_CACHE` (default `~/.cache/aqflow/kernels`), once per source and flags, and called
through ctypes from a numba parallel loop (numba's thread pool, as the other CPU kernels).
`compiled_kernel()` is None, and FastQuantizedLinear keeps the numba kernels, where the CPU lacks
AVX-512 (F and BW), no compiler works, or AQFLOW_REGISTER_KERNEL=0.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

from aqflow.inference.cpu_kernels import PARALLEL_MIN_LOADS

SOURCE = Path(__file__).parent / "csrc" / "lut_cpu.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-shared", "-fPIC")
ROWS = 64  # rows per tile: the kernel's four 16-lane accumulators
NEEDED_CPU_FLAGS = ("avx512f", "avx512bw")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_cache_dir() -> Path:
    env = os.environ.get("AQFLOW_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aqflow" / "kernels"


def build_library(compiler: str, cache_dir: Path) -> Path:
    """The compiled kernel's path in cache_dir, compiling it (to a temporary file, then renamed)
    unless a build of the same source and flags is there. Raises CalledProcessError/OSError."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    library = cache_dir / f"lut_cpu-{digest}.so"
    if library.is_file():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lut_cpu-", suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


@functools.cache
def compiled_kernel():
    """The C function aqflow_register_sums(tables, codes, tiles, columns, out), or None where it
    cannot run here (the reason is given once as a warning, except when switched off)."""
    if os.environ.get("AQFLOW_REGISTER_KERNEL", "1") == "0":
        return None
    missing = [flag for flag in NEEDED_CPU_FLAGS if flag not in cpu_flags()]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        return None  # the numba kernels are the path on such CPUs: nothing to warn about
    compiler = shutil.which(os.environ.get("CC", "cc"))
    try:
        if compiler is None:
            raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
        function = ctypes.CDLL(str(build_library(compiler, kernel_cache_dir()))).aqflow_register_sums
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        warnings.warn(f"aqflow: the AVX-512 table kernel is not available ({detail}); using the numba kernels",
                      stacklevel=2)
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    function.restype = None
    return function


def applies(nbits: int, out_features: int) -> bool:
    """Whether a layer takes this kernel on this machine: 8-bit codes, whole tiles of rows."""
    return nbits == 8 and out_features % ROWS == 0 and compiled_kernel() is not None


def column_tiles(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, G, M] uint8 -> [out/64, G*M, 64] (a contiguous copy): tiles[a, c, r] =
    codes[a*64 + r, column c] with c = j*M + m."""
    out_features, groups, num_codebooks = codes.shape
    return codes.reshape(out_features // ROWS, ROWS, groups * num_codebooks).permute(0, 2, 1).contiguous()


def rows_from_column_tiles(tiles: torch.Tensor, num_codebooks: int) -> torch.Tensor:
    """Inverse of column_tiles: [out/64, G*M, 64] -> codes [out, G, M] (a copy)."""
    count, columns, rows = tiles.shape
    return tiles.permute(0, 2, 1).reshape(count * rows, columns // num_codebooks, num_codebooks).contiguous()


def code_tables(x: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """x [T, in] float32, codebooks [M, K, g] float32 -> tables [T, G*M, K] float32 with
    tables[t, j*M + m, k] = sum_d x[t, j*g + d] * codebooks[m, k, d]."""
    tokens = x.shape[0]
    num_codebooks, codewords, group = codebooks.shape
    groups = x.shape[1] // group
    tables = torch.einsum("tjd,mkd->tjmk", x.reshape(tokens, groups, group), codebooks)
    return tables.reshape(tokens, groups * num_codebooks, codewords).contiguous()


@njit(parallel=True, cache=True)
def _sums_parallel(kernel, tables, tiles, out, blocks):
    """out[t, :] = the table sums of token t, the tiles split into `blocks` blocks on numba's threads.

    tables [T, C, 256] f32, tiles [out/64, C, 64] u8, out [T, out] f32."""
    count, columns = tiles.shape[0], tiles.shape[1]
    for t in range(tables.shape[0]):
        for block in prange(blocks):
            first = block * count // blocks
            last = (block + 1) * count // blocks
            if last > first:
                kernel(tables[t].ctypes.data, tiles[first:].ctypes.data, last - first, columns,
                       out[t, first * 64:].ctypes.data)


def register_product(x: torch.Tensor, tiles: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None, threads: int | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out] float32 through the register kernel: tables from x and the codebooks
    [M, K, g], summed per row from the column tiles [out/64, G*M, 64] (column_tiles), times scales
    [out], plus bias [out]. threads: blocks of tiles run at once (None: numba's thread count, or the
    calling thread alone for a product too small to wake the pool, as cpu_kernels decides)."""
    kernel = compiled_kernel()
    if kernel is None:
        raise RuntimeError("the AVX-512 table kernel is not available here (register_kernel.applies is False)")
    flat = x.detach().to(torch.float32).contiguous()
    if threads is None:
        threads = 1 if flat.shape[0] * tiles.numel() < PARALLEL_MIN_LOADS else numba.get_num_threads()
    tables = code_tables(flat, codebooks.detach().to(torch.float32)).numpy()
    codes = tiles.numpy()
    out = np.empty((flat.shape[0], codes.shape[0] * ROWS), dtype=np.float32)
    _sums_parallel(kernel, tables, codes, out, max(1, min(threads, codes.shape[0])))
    result = torch.from_numpy(out)
    result.mul_(scales.to(torch.float32))
    if bias is not None:
        result.add_(bias.to(torch.float32))
    return result
