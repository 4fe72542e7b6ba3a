"""Triton kernels for AQLM linears at decode time (a few tokens): the weights stay codes, codebooks and
scales; nothing dense is formed.

Two kernels compute y[t, o] = scales[o] * sum_j sum_m <codebooks[m, codes[o, j, m], :], x[t, j*g:(j+1)*g]>
(+ bias[o]); both tile the output rows and split the input groups over programs (split-K):

- `direct`: per (row, group) gather the M codewords of g values (the codebooks of a layer are a
  few KB: they stay in L1) and dot each with the g inputs, in fp32. Any geometry, any nbits.
  `direct16` is the same with each codeword's g products summed in the codebooks' 16-bit type
  (paired multiply-adds, half the instructions; one token), then accumulated in fp32.
- `lut`: first a table lut[j, m, k] = <codebooks[m, k, :], x[j*g:(j+1)*g]> for every input group j
  (M*K*g multiply-adds per group, shared by all rows), then per (row, group) M table look-ups and
  adds: no multiply per weight, as the paper's CPU decode. One token, K <= 256.

Split-K programs write fp32 partial sums; the last program of a row block (an atomic counter per
row block, reset by that program) adds them, applies scales and bias and writes the output, so one
launch does the whole product. Several matrices that share the input (q/k/v, gate/up) are packed
by rows (`pack_weights`) with per-row codebooks, and run as one launch. More tokens than
`MAX_KERNEL_TOKENS` go through a dequantized weight and cuBLAS (prefill).

On CUDA, 2x8 linears (2 codebooks of 256 over groups of 8) have a third kernel, in CUDA C++
(`cuda_kernels`: the tables of a chunk of groups built in shared memory, a conflict-free look-up per
code): variants `cuda_lut32` and `cuda_lut16` (fp32 / fp16 table entries), built at first use; a build
failure leaves the Triton kernels in charge.

The product is the custom op `aqflow::packed_matmul`, opaque to torch.compile and CUDA graphs.
Kernel configurations are chosen per shape from a table that `tune` fills by timing candidates,
else by a heuristic.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from aqflow.inference import cuda_kernels
from aqflow.inference.layout import QuantizedWeights
from aqflow.inference.packed import (TILE_GROUPS, TILE_ROWS, VARIANTS, KernelConfig, PackedWeights, as_packed,
                                     code_rows, pack_weights, packed_dense_weight)

MAX_KERNEL_TOKENS = 8  # above: dequantize and use cuBLAS (prefill)
MAX_LUT_CODEWORDS = 256


# ---------------------------------------------------------------- kernels

_TILE_ROWS = tl.constexpr(TILE_ROWS)  # the tiled code layout (packed.in_tiles)
_TILE_GROUPS = tl.constexpr(TILE_GROUPS)


@triton.jit
def _code_columns(codes_ptr, rows, group0, ROWS, G, M: tl.constexpr, MP: tl.constexpr, BLOCK_G: tl.constexpr,
                  IN_RANGE: tl.constexpr, TILED: tl.constexpr):
    """codes of rows [BLOCK_O] for groups group0.. [BLOCK_G] -> [BLOCK_O, BLOCK_G*MP] int32, column
    j*MP + m holding codebook m of group group0 + j (0 where masked or m >= M). IN_RANGE: every row
    and group of every tile exists (no mask, so the loads can be wide). TILED: the codes lie in tiles
    of 256 rows x 16 groups ([ROWS/256, G/16, 32, 8, 8, 2, M], packed.tiled_codes), else [ROWS, G, M]."""
    cols = tl.arange(0, BLOCK_G * MP)
    if M == MP and not TILED:
        # one contiguous run of BLOCK_G*M codes per row
        ptrs = codes_ptr + rows.to(tl.int64)[:, None] * (G * M) + group0 * M + cols[None, :]
        if IN_RANGE:
            codes = tl.load(ptrs)
        else:
            codes = tl.load(ptrs, mask=(rows[:, None] < ROWS) & (group0 * M + cols[None, :] < G * M), other=0)
    else:
        groups = group0 + cols // MP
        books = cols % MP
        if TILED:
            in_rows, in_groups = rows % _TILE_ROWS, groups % _TILE_GROUPS
            row_part = (in_rows % 32) * (128 * M) + (in_rows // 32) * (2 * M)  # q, slot
            group_part = (in_groups // 2) * (16 * M) + (in_groups % 2) * M + books  # i, group % 2, codebook
            tiles = (rows.to(tl.int64) // _TILE_ROWS)[:, None] * (G // _TILE_GROUPS) + (groups // _TILE_GROUPS)[None, :]
            offsets = tiles * (_TILE_ROWS * _TILE_GROUPS * M) + row_part[:, None] + group_part[None, :]
        else:
            offsets = rows.to(tl.int64)[:, None] * (G * M) + (groups * M + books)[None, :]
        mask = (rows[:, None] < ROWS) & (groups[None, :] < G) & (books[None, :] < M)
        codes = tl.load(codes_ptr + offsets, mask=mask, other=0)
    return codes.to(tl.int32)


@triton.jit
def _matrix_of_rows(rows, ROWS, bound1, bound2, bound3):
    """Which packed matrix each row belongs to (rows past the end clamp to the last row's)."""
    r = tl.minimum(rows, ROWS - 1)
    return (r >= bound1).to(tl.int32) + (r >= bound2).to(tl.int32) + (r >= bound3).to(tl.int32)


@triton.jit
def _write_rows(acc, rows, tokens, scales_ptr, bias_ptr, out_ptr, T, ROWS, stride_ot, HAS_BIAS: tl.constexpr):
    """acc [TP, BLOCK_O] fp32 -> out[t, rows] = acc * scales[rows] (+ bias[rows]) in out's dtype."""
    row_ok = rows < ROWS
    scales = tl.load(scales_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    y = acc * scales[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0).to(tl.float32)[None, :]
    ptrs = out_ptr + tokens[:, None] * stride_ot + rows[None, :]
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=(tokens[:, None] < T) & row_ok[None, :])


@triton.jit
def _finish(acc, rows, tokens, pid_o, pid_s, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
            T, ROWS, stride_ot, SPLIT, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
    """Write this program's sums. With split-K (SPLIT programs per row block) the programs store
    partials [SPLIT, T, ROWS] (or, ATOMIC, add into a zeroed fp32 accumulator [T, ROWS], which suits
    deep splits: the last program then reads one row block, not SPLIT), and the last program of the
    row block to arrive finishes it and leaves counter and accumulator at zero for the next launch."""
    if not SPLIT_K:
        _write_rows(acc, rows, tokens, scales_ptr, bias_ptr, out_ptr, T, ROWS, stride_ot, HAS_BIAS)
    else:
        mask = (tokens[:, None] < T) & (rows[None, :] < ROWS)
        if ATOMIC:
            tl.atomic_add(partial_ptr + tokens[:, None] * ROWS + rows[None, :], acc, mask=mask, sem="relaxed")
        else:
            tl.store(partial_ptr + (pid_s * T + tokens[:, None]) * ROWS + rows[None, :], acc, mask=mask)
        tl.debug_barrier()  # every thread's partials written before the release below
        arrived = tl.atomic_add(counter_ptr + pid_o, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            if ATOMIC:
                sums = partial_ptr + tokens[:, None] * ROWS + rows[None, :]
                total = tl.load(sums, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(sums, tl.zeros_like(total), mask=mask)
            else:
                total = tl.zeros_like(acc)
                s = 0
                while s < SPLIT:
                    total += tl.load(partial_ptr + (s * T + tokens[:, None]) * ROWS + rows[None, :], mask=mask,
                                     other=0.0, cache_modifier=".cg")
                    s += 1
            _write_rows(total, rows, tokens, scales_ptr, bias_ptr, out_ptr, T, ROWS, stride_ot, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_o, 0)  # ready for the next launch


@triton.jit
def _direct_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                   T, ROWS, G, groups_per_split, SPLIT, bound1, bound2, bound3, stride_xt, stride_ot,
                   M: tl.constexpr, MP: tl.constexpr, K: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr,
                   TP: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr,
                   IN_RANGE: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, TILED: tl.constexpr,
                   HALF_MATH: tl.constexpr = False):
    """x [T, G*GS]; codes [ROWS, G, M] (or tiled: _code_columns); codebooks [n, M, K, GS] -> out [T, ROWS].
    Grid (row blocks, SPLIT); a program takes groups_per_split (a multiple of BLOCK_G) groups.

    A step's tile is [BLOCK_O rows, BLOCK_G*MP codes]: each code is a column of its own (codebook m
    of group j at column j*MP + m), whose codeword is dotted with group j's inputs; the sums stay per
    (row, column) until the end, so the loop has no reduction across threads."""
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    tokens = tl.arange(0, TP)
    cols = tl.arange(0, BLOCK_G * MP)
    col_group = cols // MP
    col_book = cols % MP
    ii = tl.arange(0, GP)
    matrix = _matrix_of_rows(rows, ROWS, bound1, bound2, bound3)
    book_base = (matrix[:, None] * M + col_book[None, :]) * K  # [BLOCK_O, BLOCK_G*MP]: codeword 0 of the column's codebook
    acc = tl.zeros((TP, BLOCK_O, BLOCK_G * MP), dtype=tl.float32)
    group_start = pid_s * groups_per_split
    group_end = tl.minimum(group_start + groups_per_split, G)
    group0 = group_start
    while group0 < group_start + groups_per_split:  # a while loop: runtime bounds run in the interpreter too
        codes = _code_columns(codes_ptr, rows, group0, ROWS, G, M, MP, BLOCK_G, IN_RANGE, TILED)
        cb_ptrs = cb_ptr + (book_base + codes)[:, :, None] * GS + ii[None, None, :]
        # a mask that varies along the g axis would split a codeword's load into single elements
        if GS == GP and M == MP:
            values = tl.load(cb_ptrs)  # masked codes read as 0: in range
        elif GS == GP:
            values = tl.load(cb_ptrs, mask=(col_book < M)[None, :, None], other=0.0)
        else:
            values = tl.load(cb_ptrs, mask=(col_book < M)[None, :, None] & (ii < GS)[None, None, :], other=0.0)
        groups = group0 + col_group
        x_ok = groups < group_end
        if GS != GP:
            x_ok = x_ok[:, None] & (ii < GS)[None, :]
        else:
            x_ok = x_ok[:, None]
        if TP == 1:
            # one token: [BLOCK_O, BLOCK_G*MP, GP] products, the inputs broadcast over the rows
            xs = tl.load(x_ptr + groups[:, None] * GS + ii[None, :], mask=x_ok, other=0.0)
            if HALF_MATH:
                # a codeword's g products summed in the codebooks' 16-bit type (paired multiply-adds), then fp32
                group_sums = tl.sum(values * xs.to(values.dtype)[None, :, :], axis=2, dtype=values.dtype)
                acc += group_sums.to(tl.float32)[None, :, :]
            else:
                acc += tl.sum(values.to(tl.float32) * xs.to(tl.float32)[None, :, :], axis=2)[None, :, :]
        else:
            x_ptrs = x_ptr + tokens[:, None, None] * stride_xt + groups[None, :, None] * GS + ii[None, None, :]
            xs = tl.load(x_ptrs, mask=(tokens[:, None, None] < T) & x_ok[None, :, :], other=0.0).to(tl.float32)
            products = values.to(tl.float32)[None, :, :, :] * xs[:, None, :, :]  # [TP, BLOCK_O, BLOCK_G*MP, GP]
            acc += tl.sum(products, axis=3)
        group0 += BLOCK_G
    _finish(tl.sum(acc, axis=2), rows, tokens, pid_o, pid_s, scales_ptr, bias_ptr, out_ptr, partial_ptr,
            counter_ptr, T, ROWS, stride_ot, SPLIT, SPLIT_K, HAS_BIAS, ATOMIC)


@triton.jit
def _lut_build_kernel(x_ptr, cb_ptr, lut_ptr, G, M: tl.constexpr, K: tl.constexpr, MKP: tl.constexpr,
                      GS: tl.constexpr, GP: tl.constexpr, BLOCK_J: tl.constexpr):
    """lut[n, j, m, k] = <codebooks[n, m, k, :], x[j*GS:(j+1)*GS]> (fp32) for groups of one program.
    Grid (cdiv(G, BLOCK_J), n)."""
    pid_j = tl.program_id(0)
    matrix = tl.program_id(1)
    codewords = tl.arange(0, MKP)
    ii = tl.arange(0, GP)
    cb_ok = (codewords[:, None] < M * K) & (ii[None, :] < GS)
    cb = tl.load(cb_ptr + (matrix * (M * K) + codewords[:, None]) * GS + ii[None, :], mask=cb_ok, other=0.0)
    cb = cb.to(tl.float32)  # [MKP, GP]
    for jj in range(BLOCK_J):
        j = pid_j * BLOCK_J + jj
        xs = tl.load(x_ptr + j * GS + ii, mask=(ii < GS) & (j < G), other=0.0).to(tl.float32)
        table = tl.sum(cb * xs[None, :], axis=1)  # [MKP]
        tl.store(lut_ptr + (matrix * G + j).to(tl.int64) * (M * K) + codewords, table,
                 mask=(codewords < M * K) & (j < G))


@triton.jit
def _lut_kernel(lut_ptr, codes_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                ROWS, G, groups_per_split, SPLIT, bound1, bound2, bound3,
                M: tl.constexpr, MP: tl.constexpr, K: tl.constexpr,
                BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr,
                IN_RANGE: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, TILED: tl.constexpr):
    """One token: out[rows] = scales * sum over groups and codebooks of lut[n(row), j, m, codes[row, j, m]]."""
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    tokens = tl.arange(0, 1)
    cols = tl.arange(0, BLOCK_G * MP)
    col_group = cols // MP
    col_book = cols % MP
    matrix = _matrix_of_rows(rows, ROWS, bound1, bound2, bound3)
    # entry of code 0 for each (row, column) at group 0: the loop only adds the step's offset and the codes
    entry0 = matrix[:, None] * (G * M * K) + ((col_group * M + col_book) * K)[None, :]
    acc = tl.zeros((BLOCK_O, BLOCK_G * MP), dtype=tl.float32)
    group_start = pid_s * groups_per_split
    group_end = tl.minimum(group_start + groups_per_split, G)
    group0 = group_start
    while group0 < group_start + groups_per_split:
        codes = _code_columns(codes_ptr, rows, group0, ROWS, G, M, MP, BLOCK_G, IN_RANGE, TILED)
        groups = group0 + col_group
        entry = entry0 + group0 * (M * K) + codes
        if IN_RANGE and M == MP:
            acc += tl.load(lut_ptr + entry)  # [BLOCK_O, BLOCK_G*MP]
        else:
            ok = (groups[None, :] < group_end) & (col_book[None, :] < M)
            acc += tl.load(lut_ptr + entry, mask=ok, other=0.0)
        group0 += BLOCK_G
    acc = tl.sum(acc, axis=1)[None, :]
    _finish(acc, rows, tokens, pid_o, pid_s, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
            1, ROWS, 0, SPLIT, SPLIT_K, HAS_BIAS, ATOMIC)


# ---------------------------------------------------------------- configurations

_TUNED: dict[tuple, KernelConfig] = {}


def shape_key(packed: PackedWeights, tokens: int) -> tuple:
    """What a tuned configuration is keyed by: rows, groups, codebooks, codebook size, group size, fused
    matrices, tokens."""
    return (packed.rows, packed.num_groups, packed.num_codebooks, packed.codebook_size, packed.group_size,
            len(packed.out_sizes), tokens)


def set_config(packed: PackedWeights, tokens: int, config: KernelConfig) -> None:
    _TUNED[shape_key(packed, tokens)] = config


def set_tuned(key: tuple, config: KernelConfig) -> None:
    """Record `config` for the shape `key` (a shape_key), e.g. one chosen by timing whole decode steps."""
    _TUNED[key] = config


def tuned_configs() -> dict[tuple, KernelConfig]:
    return dict(_TUNED)


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def lut_applies(packed: PackedWeights, tokens: int) -> bool:
    return tokens == 1 and packed.codebook_size <= MAX_LUT_CODEWORDS


def split_for(packed: PackedWeights, block_rows: int, block_groups: int, programs_per_sm: int) -> int:
    """Splits of the input groups so that about programs_per_sm programs per multiprocessor run, each
    with at least two steps of block_groups groups."""
    row_blocks = triton.cdiv(packed.rows, block_rows)
    target = programs_per_sm * _multiprocessors(packed.codes.device)
    most = max(1, triton.cdiv(packed.num_groups, 2 * block_groups))
    wanted = max(1, min(most, triton.cdiv(target, row_blocks)))
    steps, ragged = divmod(packed.num_groups, block_groups)
    if ragged:
        return wanted
    # the nearest split that divides the steps: no partial tile, so no masks in the inner loop
    divisors = [d for d in range(1, min(steps, most) + 1) if steps % d == 0]
    return min(divisors, key=lambda d: (abs(math.log(d / wanted)), -d))


def cuda_kernel_usable(packed: PackedWeights, tokens: int) -> bool:
    """The CUDA kernel takes this shape and its extension is (or can be) built: the first call builds it."""
    if not (cuda_kernels.enabled() and cuda_kernels.applies(packed, tokens)):
        return False
    try:
        cuda_kernels.load_extension()
    except RuntimeError:
        return False
    return True


def default_config(packed: PackedWeights, tokens: int) -> KernelConfig:
    """The configuration used for a shape nobody tuned: the CUDA kernel's heuristic where it applies, else
    Triton's direct kernel, 16 x 16 tiles, ~8 programs per SM."""
    if cuda_kernel_usable(packed, tokens):
        return cuda_kernels.default_config(packed, tokens, _multiprocessors(packed.codes.device))
    config = KernelConfig("direct", 16, 16, 1, 4)
    return replace(config, split=split_for(packed, config.block_rows, config.block_groups, 8))


def config_for(packed: PackedWeights, tokens: int) -> KernelConfig:
    return _TUNED.get(shape_key(packed, tokens)) or default_config(packed, tokens)


def candidate_configs(packed: PackedWeights, tokens: int, *, triton_tiles: dict | None = None,
                      programs_per_sm: Sequence[int] = (4, 8, 16)) -> list[KernelConfig]:
    """The configurations `tune` times for a shape: the CUDA kernel's first (when its extension is loaded
    and the shape is 2x8), then tile shapes and warps of each Triton variant, each at a few split-K depths
    (programs per multiprocessor). triton_tiles: {variant: [(block_rows, block_groups, warps), ...]}
    replaces the Triton search space and programs_per_sm its split depths (a short list keeps tuning fast:
    each Triton tile shape is a JIT compile)."""
    cuda_configs = []
    if cuda_kernels.ready() and cuda_kernels.applies(packed, tokens):
        cuda_configs = cuda_kernels.candidate_configs(packed, tokens, _multiprocessors(packed.codes.device))
    direct_tiles = [(16, 16, 4), (32, 8, 4), (64, 4, 4), (32, 16, 8), (64, 8, 8), (128, 4, 8)]
    # lut: 16 code columns per row and step (lanes along rows, so a warp's look-ups share one table)
    # lut: the table of the program's groups is read once per program from L2, so tall row blocks
    tiles = {"direct": direct_tiles, "direct16": direct_tiles,
             "lut": [(128, 8, 4), (256, 8, 8), (512, 8, 16), (256, 8, 4), (512, 8, 8), (1024, 8, 16)]}
    if triton_tiles is not None:
        tiles = triton_tiles
    variants = [v for v in ["direct"] + (["direct16", "lut"] if lut_applies(packed, tokens) else []) if v in tiles]
    seen, configs = set(cuda_configs), list(cuda_configs)
    for variant in variants:
        for block_rows, block_groups, warps in tiles[variant]:
            for per_sm in programs_per_sm:
                split = split_for(packed, block_rows, block_groups, per_sm)
                config = KernelConfig(variant, block_rows, block_groups, split, warps)
                if config not in seen:
                    seen.add(config)
                    configs.append(config)
    return configs


# ---------------------------------------------------------------- launching

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 16
_ACCUMULATORS: dict[torch.device, torch.Tensor] = {}
ATOMIC_SPLIT = 8  # from this split-K depth on, programs add into one accumulator instead of storing partials


def _counters(device: torch.device) -> torch.Tensor:
    """Per-device split-K arrival counters, zero between launches (each launch's last programs reset theirs)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def _accumulator(device: torch.device, size: int) -> torch.Tensor:
    """A per-device zeroed fp32 accumulator of at least size elements (the atomic split-K's; the last
    program of each row block zeroes what it read)."""
    accumulator = _ACCUMULATORS.get(device)
    if accumulator is None or accumulator.numel() < size:
        accumulator = torch.zeros(max(size, 1 << 20), dtype=torch.float32, device=device)
        _ACCUMULATORS[device] = accumulator
    return accumulator


def _launch(x: torch.Tensor, packed: PackedWeights, config: KernelConfig, out: torch.Tensor) -> torch.Tensor:
    """x [T, in] contiguous rows, T <= MAX_KERNEL_TOKENS -> out [T, rows] (written in full)."""
    tokens = x.shape[0]
    if config.variant in cuda_kernels.VARIANT_ENTRY_BITS:
        return cuda_kernels.launch(x, packed, config, out, _accumulator(x.device, tokens * packed.rows),
                                   _counters(x.device))
    m, k, gs = packed.num_codebooks, packed.codebook_size, packed.group_size
    groups = packed.num_groups
    row_blocks = triton.cdiv(packed.rows, config.block_rows)
    if config.split > 1 and row_blocks > _COUNTER_SLOTS:
        raise ValueError(f"{packed.rows} rows in blocks of {config.block_rows}: more row blocks than counters")
    groups_per_split = triton.cdiv(triton.cdiv(groups, config.split), config.block_groups) * config.block_groups
    split = triton.cdiv(groups, groups_per_split)  # no program without groups
    atomic = split >= ATOMIC_SPLIT
    if atomic:
        partial = _accumulator(x.device, tokens * packed.rows)
    elif split > 1:
        partial = torch.empty(split * tokens * packed.rows, dtype=torch.float32, device=x.device)
    else:
        partial = out
    counters = _counters(x.device) if split > 1 else out
    bias = packed.bias if packed.bias is not None else packed.scales
    b1, b2, b3 = packed.bounds()
    grid = (row_blocks, split)
    common = dict(M=m, MP=triton.next_power_of_2(m), K=k, BLOCK_O=config.block_rows,
                  BLOCK_G=config.block_groups, SPLIT_K=split > 1, ATOMIC=atomic,
                  IN_RANGE=packed.rows % config.block_rows == 0 and groups == split * groups_per_split,
                  HAS_BIAS=packed.bias is not None, TILED=packed.tiled,
                  num_warps=config.num_warps)
    if config.variant == "lut":
        if not lut_applies(packed, tokens):
            raise ValueError(f"lut variant: one token and <= {MAX_LUT_CODEWORDS} codewords, got {tokens} tokens, "
                             f"{k} codewords")
        n = packed.codebooks.shape[0]
        lut = torch.empty(n * groups * m * k, dtype=torch.float32, device=x.device)
        block_j = 16 if groups >= 1024 else 8  # each program reads the whole codebook once: not too many
        _lut_build_kernel[(triton.cdiv(groups, block_j), n)](
            x, packed.codebooks, lut, groups, M=m, K=k, MKP=triton.next_power_of_2(m * k), GS=gs,
            GP=triton.next_power_of_2(gs), BLOCK_J=block_j, num_warps=4)
        _lut_kernel[grid](lut, packed.codes, packed.scales, bias, out, partial, counters,
                          packed.rows, groups, groups_per_split, split, b1, b2, b3, **common)
    elif config.variant in ("direct", "direct16"):
        _direct_kernel[grid](x, packed.codes, packed.codebooks, packed.scales, bias, out, partial, counters,
                             tokens, packed.rows, groups, groups_per_split, split, b1, b2, b3, x.stride(0),
                             out.stride(0),
                             GS=gs, GP=triton.next_power_of_2(gs), TP=triton.next_power_of_2(tokens),
                             HALF_MATH=config.variant == "direct16" and tokens == 1, **common)
    else:
        raise ValueError(f"unknown kernel variant {config.variant!r}; known: {VARIANTS}")
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _matmul(x: torch.Tensor, packed: PackedWeights, config: KernelConfig | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., rows] through the kernels (or the dense weight for many tokens)."""
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weights take {packed.in_features}")
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    tokens = flat.shape[0]
    kernels_run_here = x.is_cuda or _interpreting()
    if tokens > MAX_KERNEL_TOKENS or tokens == 0 or not kernels_run_here:
        bias = None if packed.bias is None else packed.bias.to(x.dtype)
        result = torch.nn.functional.linear(flat, packed_dense_weight(packed).to(x.dtype), bias)
        if out is not None:
            out.copy_(result)
            result = out
        return result.reshape(*leading, packed.rows)
    flat = flat.contiguous()
    if out is None:
        out = torch.empty(tokens, packed.rows, dtype=x.dtype, device=x.device)
    _launch(flat, packed, config or config_for(packed, tokens), out)
    return out.reshape(*leading, packed.rows)


@torch.library.custom_op("aqflow::packed_matmul", mutates_args=())
def _packed_matmul_op(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None, out_sizes: list[int], config: list[int]) -> torch.Tensor:
    packed = PackedWeights(codes, codebooks, scales, bias, tuple(out_sizes))
    return _matmul(x, packed, KernelConfig.from_list(config) if config else None)


@_packed_matmul_op.register_fake
def _packed_matmul_shape(x, codes, codebooks, scales, bias, out_sizes, config):
    return x.new_empty((*x.shape[:-1], code_rows(codes)))


def packed_matmul(x: torch.Tensor, packed: PackedWeights, *, config: KernelConfig | None = None) -> torch.Tensor:
    """x [..., in] -> [..., sum(out_sizes)] (bias and scales applied), one kernel launch for a few tokens."""
    return _packed_matmul_op(x, packed.codes, packed.codebooks, packed.scales, packed.bias, list(packed.out_sizes),
                             config.as_list() if config is not None else [])


@torch.library.custom_op("aqflow::packed_open_sums", mutates_args=("sums",))
def _packed_open_sums_op(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None, out_sizes: list[int], config: list[int], sums: torch.Tensor) -> None:
    packed = PackedWeights(codes, codebooks, scales, bias, tuple(out_sizes))
    cuda_kernels.launch_open(x.contiguous(), packed, KernelConfig.from_list(config), sums)


@_packed_open_sums_op.register_fake
def _packed_open_sums_shape(x, codes, codebooks, scales, bias, out_sizes, config, sums):
    return None


def open_packed_sums(x: torch.Tensor, packed: PackedWeights, config: list[int], sums: torch.Tensor) -> torch.Tensor:
    """The split-K CUDA kernel (`config`: a KernelConfig.as_list() of cuda_lut32 or cuda_lut16) adding the
    unscaled sums of x [..., in] (sums.shape[0] tokens) into sums [T, rows] fp32, which must be zero
    (`open_sums` zeroes them once a decode step). Returns sums, for a reader that finishes them itself
    (sums * scales (+ bias), cast: open_packed_matmul, or the attention kernels)."""
    _packed_open_sums_op(x.reshape(-1, x.shape[-1]), packed.codes, packed.codebooks, packed.scales, packed.bias,
                         list(packed.out_sizes), list(config), sums)
    return sums


def open_packed_matmul(x: torch.Tensor, packed: PackedWeights, config: list[int], sums: torch.Tensor) -> torch.Tensor:
    """packed_matmul through the split-K CUDA kernel with open sums (open_packed_sums): x [..., in] ->
    [..., rows]; the scales, the bias and the cast are torch operations that torch.compile folds into
    whatever reads the output next."""
    y = open_packed_sums(x, packed, config, sums) * packed.scales
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype).view(*x.shape[:-1], packed.rows)


def quantized_matmul(x: torch.Tensor, w: QuantizedWeights, *, config: KernelConfig | None = None) -> torch.Tensor:
    """x [T, in] (or [..., in]) -> [T, out] = x @ dense(w).T (+ bias): CUDA, few tokens (the decode path)."""
    return packed_matmul(x, as_packed(w), config=config)


def fused_quantized_matmul(x: torch.Tensor, ws: Sequence[QuantizedWeights], *,
                           config: KernelConfig | None = None) -> torch.Tensor:
    """x [T, in] -> [T, sum(out)]: several linears of the same input in one launch. Packs (copies) the
    weights on every call: a module that calls this repeatedly should hold `pack_weights(ws)` and call
    `packed_matmul`."""
    return packed_matmul(x, pack_weights(ws), config=config)


# ---------------------------------------------------------------- tuning

def median_seconds(fn, *, warmup_ms: int = 5, rep_ms: int = 25) -> float:
    """Median seconds of fn() on the GPU (triton's do_bench: L2 flushed before every call, so weights
    come from memory as in decoding), or by the wall clock on a CPU (the interpreter's dry runs)."""
    if torch.cuda.is_available() and not _interpreting():
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def time_config(x: torch.Tensor, packed: PackedWeights, config: KernelConfig) -> float:
    """Median seconds of one launch of this configuration."""
    out = torch.empty(x.shape[0], packed.rows, dtype=x.dtype, device=x.device)
    return median_seconds(lambda: _launch(x, packed, config, out))


def code_copies(packed: PackedWeights, copies: int) -> list[PackedWeights]:
    """packed and copies - 1 others with their own code tensors (codebooks, scales shared): as many weight
    sets as layers, so that a graph of launches reads codes from memory, not from L2."""
    return [packed] + [replace(packed, codes=packed.codes.clone()) for _ in range(copies - 1)]


def graph_replay_seconds(launch_all: Callable[[], None], launches: int, device: torch.device,
                         replays: int = 10) -> float:
    """Seconds per launch of a CUDA graph recording launch_all() (which makes `launches` launches), replayed
    `replays` times: launch_all runs once on a side stream first (warm-up off the capture: attributes,
    workspaces, JIT)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        launch_all()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_all()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / (replays * launches)


def graph_seconds(x: torch.Tensor, packs: Sequence[PackedWeights], config: KernelConfig, replays: int = 10,
                  open_sums: bool = False) -> float:
    """Seconds per launch of a CUDA graph of one launch per weight set, back to back: the way a decode
    step replays them (no host launch, no L2 flush between launches, the next weights not in L2).
    open_sums: the split-K kernel (cuda_lut32/16) launched as a decode step with open sums runs it, without
    its finishing pass (the sums, never zeroed here, only grow: the time does not depend on them)."""
    open_launch = open_sums and config.variant in cuda_kernels.SPLIT_K_VARIANTS
    outs = [torch.zeros(x.shape[0], p.rows, dtype=torch.float32, device=x.device) if open_launch
            else torch.empty(x.shape[0], p.rows, dtype=x.dtype, device=x.device) for p in packs]

    def launch_all() -> None:
        for p, out in zip(packs, outs):
            if open_launch:
                cuda_kernels.launch_open(x, p, config, out)
            else:
                _launch(x, p, config, out)

    return graph_replay_seconds(launch_all, len(packs), x.device, replays)


def graph_copies(weight_bytes: int, device: torch.device) -> int:
    """How many weight sets of weight_bytes a graph timing needs so that together they are twice the
    device's L2 (2..28, 28 being a 3B model's layers)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, min(28, math.ceil(2 * l2_bytes / max(weight_bytes, 1))))


def tune(packed: PackedWeights, tokens: int = 1, *, configs: Sequence[KernelConfig] | None = None,
         check: bool = True, rtol: float = 2e-2, log=None,
         deadline: float | None = None, timing: str = "launch",
         open_sums: bool = False) -> list[tuple[KernelConfig, float | None, str]]:
    """Times each candidate configuration on random inputs (after checking it against the dense
    reference, when check) and records the fastest for this shape. Returns (config, seconds or None,
    note) for every candidate; a candidate that fails or is wrong is skipped, not fatal; past deadline
    (a time.perf_counter() value) the remaining candidates are skipped. timing: 'launch' (do_bench of
    one launch, L2 flushed) or 'graph' (graph_seconds over enough code copies to pass the L2: what a
    decode step sees; CUDA only); with open_sums (graph timing) the split-K candidates are timed as a decode
    step with open sums runs them (`graph_seconds`)."""
    if timing not in ("launch", "graph"):
        raise ValueError(f"timing must be 'launch' or 'graph', got {timing!r}")
    device = packed.codes.device
    packs = None
    if timing == "graph":
        if device.type != "cuda":
            raise ValueError("graph timing needs the weights on a CUDA device")
        packs = code_copies(packed, graph_copies(packed.code_bytes(), device))
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, packed.in_features, device=device, dtype=packed.codebooks.dtype, generator=generator)
    reference = None
    if check:
        reference = (x.double() @ packed_dense_weight(packed).double().T
                     + (0 if packed.bias is None else packed.bias.double()))
    results = []
    for config in configs if configs is not None else candidate_configs(packed, tokens):
        if deadline is not None and time.perf_counter() > deadline:
            results.append((config, None, "skipped: tuning time used up"))
            continue
        try:
            if reference is not None:
                out = torch.full((tokens, packed.rows), float("nan"), dtype=x.dtype, device=device)
                _launch(x, packed, config, out)
                error = relative_error(out, reference)
                if not error <= rtol:
                    results.append((config, None, f"rel. error {error:.2e} > {rtol}"))
                    continue
            seconds = (time_config(x, packed, config) if packs is None
                       else graph_seconds(x, packs, config, open_sums=open_sums))
            results.append((config, seconds, ""))
        except Exception as failure:  # noqa: BLE001 - one bad candidate must not stop tuning
            results.append((config, None, f"{type(failure).__name__}: {str(failure)[:200]}"))
        if log is not None:
            config_, seconds, note = results[-1]
            log(f"  {config_.label():28s} {'%.2f us' % (seconds * 1e6) if seconds else note}")
    timed = [(c, s) for c, s, _ in results if s is not None]
    if timed:
        set_config(packed, tokens, min(timed, key=lambda cs: cs[1])[0])
    return results


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in float64 (inf when value has NaNs)."""
    value, reference = value.double(), reference.double()
    if not torch.isfinite(value).all():
        return math.inf
    return ((value - reference).norm() / reference.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- a module

class KernelQuantizedLinear(torch.nn.Module):
    """A minimal AQLM linear that runs these kernels (the 2-bit tensors are its buffers); `quantized_weights()`
    lets `decode.fuse_projections` pack it with its siblings. Models the pipeline writes use the
    inference package's FastQuantizedLinear, which dispatches by device; this one serves benchmarks and tests."""

    open_sums = None  # an open_sums.OpenSumsSite inside open_sums_enabled: one token computed with open sums

    def __init__(self, w: QuantizedWeights):
        super().__init__()
        self.in_features, self.out_features, self.nbits = w.in_features, w.out_features, w.nbits
        self.register_buffer("codes", w.codes)
        self.register_buffer("codebooks", w.codebooks)
        self.register_buffer("scales", w.scales)
        self.register_buffer("bias", w.bias)

    def quantized_weights(self) -> QuantizedWeights:
        return QuantizedWeights(self.codes, self.codebooks, self.scales, self.bias, self.nbits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.open_sums is not None:
            return self.open_sums(x)
        return quantized_matmul(x, self.quantized_weights())
