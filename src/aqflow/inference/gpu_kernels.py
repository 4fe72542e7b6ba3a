"""Triton kernels for AQLM linears at decode time (a few tokens): the weights stay codes, codebooks and
scales; nothing dense is formed.

Two kernels compute y[t, o] = scales[o] * sum_j sum_m <codebooks[m, codes[o, j, m], :], x[t, j*g:(j+1)*g]>
(+ bias[o]); both tile the output rows and split the input groups over programs (split-K):

- `direct`: per (row, group) gather the M codewords of g values (the codebooks of a layer are a
  few KB: they stay in L1) and dot their sum with the g inputs, in fp32. Any geometry, any nbits.
- `lut`: first a table lut[j, m, k] = <codebooks[m, k, :], x[j*g:(j+1)*g]> for every input group j
  (M*K*g multiply-adds per group, shared by all rows), then per (row, group) M table look-ups and
  adds: no multiply per weight, as the paper's CPU decode. One token, K <= 256.

Split-K programs write fp32 partial sums; the last program of a row block (an atomic counter per
row block, reset by that program) adds them, applies scales and bias and writes the output, so one
launch does the whole product. Several matrices that share the input (q/k/v, gate/up) are packed
by rows (`pack_weights`) with per-row codebooks, and run as one launch. More tokens than
`MAX_KERNEL_TOKENS` go through a dequantized weight and cuBLAS (prefill).

The product is the custom op `aqflow::packed_matmul`, opaque to torch.compile and CUDA graphs.
Kernel configurations are chosen per shape from a table that `tune` fills by timing candidates,
else by a heuristic.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import triton
import triton.language as tl

from aqflow.inference.layout import QuantizedWeights

MAX_FUSED_MATRICES = 4
MAX_KERNEL_TOKENS = 8  # above: dequantize and use cuBLAS (prefill)
MAX_LUT_CODEWORDS = 256


# ---------------------------------------------------------------- packed weights

@dataclass(frozen=True)
class PackedWeights:
    """One or several AQLM linears of the same input (same groups, codebook count and size) as one
    kernel operand: codes [rows, G, M] (uint8 or int32, the matrices' rows one after another),
    codebooks [n, M, K, g], scales [rows], bias [rows] or None; out_sizes: the rows of each matrix."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    out_sizes: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def num_groups(self) -> int:
        return self.codes.shape[1]

    @property
    def num_codebooks(self) -> int:
        return self.codes.shape[2]

    @property
    def codebook_size(self) -> int:
        return self.codebooks.shape[2]

    @property
    def group_size(self) -> int:
        return self.codebooks.shape[3]

    @property
    def in_features(self) -> int:
        return self.num_groups * self.group_size

    def bounds(self) -> list[int]:
        """The first row of matrices 1..3 (rows where there is none): a row's matrix is how many it reaches."""
        starts = [sum(self.out_sizes[:i]) for i in range(1, len(self.out_sizes))]
        return starts + [self.rows] * (MAX_FUSED_MATRICES - 1 - len(starts))

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"codes": self.codes, "codebooks": self.codebooks, "scales": self.scales}
        if self.bias is not None:
            named["bias"] = self.bias
        return named

    def code_bytes(self) -> int:
        return self.codes.numel() * self.codes.element_size()


def _geometry(w: QuantizedWeights) -> tuple:
    return (w.codes.shape[1], w.codes.shape[2], w.codebooks.shape[1], w.codebooks.shape[2], w.codes.dtype,
            w.codebooks.dtype, w.codes.device)


def can_pack(weights: Sequence[QuantizedWeights]) -> bool:
    """True when the linears share groups, codebook count and size, dtypes and device (1..4 of them)."""
    return 1 <= len(weights) <= MAX_FUSED_MATRICES and len({_geometry(w) for w in weights}) == 1


def as_packed(w: QuantizedWeights) -> PackedWeights:
    """One linear as a kernel operand (views of its tensors, no copy)."""
    return PackedWeights(codes=w.codes, codebooks=w.codebooks.unsqueeze(0), scales=w.scales, bias=w.bias,
                         out_sizes=(w.out_features,))


def pack_weights(weights: Sequence[QuantizedWeights]) -> PackedWeights:
    """Several linears of one input as one operand (their codes, scales and biases concatenated by rows:
    a copy, so the fused module should hold this instead of the originals)."""
    if not can_pack(weights):
        raise ValueError("pack_weights: the linears must share groups, codebook count and size, dtypes and device "
                         f"(1..{MAX_FUSED_MATRICES} of them); got {[_geometry(w)[:4] for w in weights]}")
    if len(weights) == 1:
        return as_packed(weights[0])
    biases = None
    if any(w.bias is not None for w in weights):
        biases = torch.cat([w.bias if w.bias is not None else w.scales.new_zeros(w.out_features) for w in weights])
    return PackedWeights(codes=torch.cat([w.codes for w in weights]).contiguous(),
                         codebooks=torch.stack([w.codebooks for w in weights]).contiguous(),
                         scales=torch.cat([w.scales for w in weights]).contiguous(), bias=biases,
                         out_sizes=tuple(w.out_features for w in weights))


def packed_dense_weight(packed: PackedWeights) -> torch.Tensor:
    """The dense weight [rows, in] the packed codes stand for, in the codebooks' dtype (prefill path)."""
    n, m, k, g = packed.codebooks.shape
    matrix_of_row = torch.repeat_interleave(torch.arange(len(packed.out_sizes), device=packed.codes.device),
                                            torch.tensor(packed.out_sizes, device=packed.codes.device))
    offsets = (matrix_of_row[:, None, None] * m + torch.arange(m, device=packed.codes.device)) * k  # [rows, 1, M]
    flat = packed.codebooks.reshape(n * m * k, g)
    indices = (packed.codes.to(torch.int64) + offsets).reshape(-1, m)
    groups = torch.nn.functional.embedding_bag(indices, flat, mode="sum")  # [rows*G, g]
    return (groups.view(packed.rows, packed.num_groups, g) * packed.scales.view(-1, 1, 1)).reshape(packed.rows, -1)


# ---------------------------------------------------------------- kernels

@triton.jit
def _code_tile(codes_ptr, rows, group0, ROWS, G, M: tl.constexpr, MP: tl.constexpr,
               BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr):
    """codes of rows [BLOCK_O] x groups group0.. [BLOCK_G] -> [BLOCK_O, BLOCK_G, MP] int32 (0 where masked)."""
    row_offsets = rows.to(tl.int64) * (G * M)
    if M == MP:
        # one contiguous run of BLOCK_G*M codes per row: wide loads
        cols = tl.arange(0, BLOCK_G * MP)
        ptrs = codes_ptr + row_offsets[:, None] + group0 * M + cols[None, :]
        mask = (rows[:, None] < ROWS) & (group0 * M + cols[None, :] < G * M)
        codes = tl.load(ptrs, mask=mask, other=0)
        codes = tl.reshape(codes, (BLOCK_O, BLOCK_G, MP))
    else:
        groups = group0 + tl.arange(0, BLOCK_G)
        mm = tl.arange(0, MP)
        ptrs = codes_ptr + row_offsets[:, None, None] + groups[None, :, None] * M + mm[None, None, :]
        mask = (rows[:, None, None] < ROWS) & (groups[None, :, None] < G) & (mm[None, None, :] < M)
        codes = tl.load(ptrs, mask=mask, other=0)
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
            T, ROWS, stride_ot, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write this program's sums; with split-K, the last program of the row block adds the partials."""
    if SPLIT == 1:
        _write_rows(acc, rows, tokens, scales_ptr, bias_ptr, out_ptr, T, ROWS, stride_ot, HAS_BIAS)
    else:
        mask = (tokens[:, None] < T) & (rows[None, :] < ROWS)
        tl.store(partial_ptr + (pid_s * T + tokens[:, None]) * ROWS + rows[None, :], acc, mask=mask)
        tl.debug_barrier()  # every thread's partials stored before the release below
        arrived = tl.atomic_add(counter_ptr + pid_o, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT):
                total += tl.load(partial_ptr + (s * T + tokens[:, None]) * ROWS + rows[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg")
            _write_rows(total, rows, tokens, scales_ptr, bias_ptr, out_ptr, T, ROWS, stride_ot, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_o, 0)  # ready for the next launch


@triton.jit
def _direct_kernel(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                   T, ROWS, G, groups_per_split, bound1, bound2, bound3, stride_xt, stride_ot,
                   M: tl.constexpr, MP: tl.constexpr, K: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr,
                   TP: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr,
                   STEPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """x [T, G*GS]; codes [ROWS, G, M]; codebooks [n, M, K, GS] -> out [T, ROWS]. Grid (row blocks, SPLIT);
    a program takes groups_per_split = STEPS * BLOCK_G groups."""
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    tokens = tl.arange(0, TP)
    mm = tl.arange(0, MP)
    ii = tl.arange(0, GP)
    codeword_base = (_matrix_of_rows(rows, ROWS, bound1, bound2, bound3) * M)[:, None, None] + mm[None, None, :]
    codeword_base = codeword_base * K  # [BLOCK_O, 1, MP]: first codeword of each row's codebook m
    value_ok = (mm[None, None, :, None] < M) & (ii[None, None, None, :] < GS)
    acc = tl.zeros((TP, BLOCK_O), dtype=tl.float32)
    group_start = pid_s * groups_per_split
    group_end = tl.minimum(group_start + groups_per_split, G)
    for step in range(STEPS):
        group0 = group_start + step * BLOCK_G
        codes = _code_tile(codes_ptr, rows, group0, ROWS, G, M, MP, BLOCK_O, BLOCK_G)
        codeword = codeword_base + codes  # [BLOCK_O, BLOCK_G, MP]
        values = tl.load(cb_ptr + codeword[:, :, :, None] * GS + ii[None, None, None, :], mask=value_ok, other=0.0)
        weights = tl.sum(values.to(tl.float32), axis=2)  # [BLOCK_O, BLOCK_G, GP]
        groups = group0 + tl.arange(0, BLOCK_G)
        x_ptrs = x_ptr + tokens[:, None, None] * stride_xt + groups[None, :, None] * GS + ii[None, None, :]
        x_ok = (tokens[:, None, None] < T) & (groups[None, :, None] < group_end) & (ii[None, None, :] < GS)
        xs = tl.load(x_ptrs, mask=x_ok, other=0.0).to(tl.float32)  # [TP, BLOCK_G, GP]
        products = weights[None, :, :, :] * xs[:, None, :, :]  # [TP, BLOCK_O, BLOCK_G, GP]
        acc += tl.sum(tl.sum(products, axis=3), axis=2)
    _finish(acc, rows, tokens, pid_o, pid_s, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
            T, ROWS, stride_ot, SPLIT, HAS_BIAS)


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
                ROWS, G, groups_per_split, bound1, bound2, bound3,
                M: tl.constexpr, MP: tl.constexpr, K: tl.constexpr,
                BLOCK_O: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, STEPS: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """One token: out[rows] = scales * sum over groups and codebooks of lut[n(row), j, m, codes[row, j, m]]."""
    pid_o = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    tokens = tl.arange(0, 1)
    mm = tl.arange(0, MP)
    matrix = _matrix_of_rows(rows, ROWS, bound1, bound2, bound3)
    acc = tl.zeros((1, BLOCK_O), dtype=tl.float32)
    group_start = pid_s * groups_per_split
    group_end = tl.minimum(group_start + groups_per_split, G)
    for step in range(STEPS):
        group0 = group_start + step * BLOCK_G
        codes = _code_tile(codes_ptr, rows, group0, ROWS, G, M, MP, BLOCK_O, BLOCK_G)
        groups = group0 + tl.arange(0, BLOCK_G)
        entry = ((matrix[:, None, None] * G + groups[None, :, None]) * M + mm[None, None, :]) * K + codes
        ok = (groups[None, :, None] < group_end) & (mm[None, None, :] < M)
        values = tl.load(lut_ptr + entry, mask=ok, other=0.0)  # [BLOCK_O, BLOCK_G, MP] fp32
        acc += tl.sum(tl.sum(values, axis=2), axis=1)[None, :]
    _finish(acc, rows, tokens, pid_o, pid_s, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
            1, ROWS, 0, SPLIT, HAS_BIAS)


# ---------------------------------------------------------------- configurations

@dataclass(frozen=True)
class KernelConfig:
    """variant 'direct' or 'lut'; a program computes block_rows rows over 1/split of the input groups,
    block_groups groups per step; num_warps per program."""

    variant: str = "direct"
    block_rows: int = 16
    block_groups: int = 16
    split: int = 1
    num_warps: int = 4

    def label(self) -> str:
        return f"{self.variant}:o{self.block_rows}g{self.block_groups}s{self.split}w{self.num_warps}"

    def as_list(self) -> list[int]:
        return [VARIANTS.index(self.variant), self.block_rows, self.block_groups, self.split, self.num_warps]

    @staticmethod
    def from_list(values: Sequence[int]) -> "KernelConfig":
        variant, block_rows, block_groups, split, num_warps = values
        return KernelConfig(VARIANTS[variant], block_rows, block_groups, split, num_warps)


VARIANTS = ("direct", "lut")
_TUNED: dict[tuple, KernelConfig] = {}


def shape_key(packed: PackedWeights, tokens: int) -> tuple:
    """What a tuned configuration is keyed by: rows, groups, codebooks, codebook size, group size, fused
    matrices, tokens."""
    return (packed.rows, packed.num_groups, packed.num_codebooks, packed.codebook_size, packed.group_size,
            len(packed.out_sizes), tokens)


def set_config(packed: PackedWeights, tokens: int, config: KernelConfig) -> None:
    _TUNED[shape_key(packed, tokens)] = config


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
    return max(1, min(most, triton.cdiv(target, row_blocks)))


def default_config(packed: PackedWeights, tokens: int) -> KernelConfig:
    """The configuration used for a shape nobody tuned: direct, 16 x 16 tiles, ~8 programs per SM."""
    config = KernelConfig("direct", 16, 16, 1, 4)
    return replace(config, split=split_for(packed, config.block_rows, config.block_groups, 8))


def config_for(packed: PackedWeights, tokens: int) -> KernelConfig:
    return _TUNED.get(shape_key(packed, tokens)) or default_config(packed, tokens)


def candidate_configs(packed: PackedWeights, tokens: int) -> list[KernelConfig]:
    """The configurations `tune` times for a shape: tile shapes and warps of both variants, each at a few
    split-K depths (programs per multiprocessor)."""
    tiles = {"direct": [(16, 16, 4), (32, 8, 4), (8, 32, 4), (16, 32, 8), (32, 16, 8), (64, 8, 8)],
             "lut": [(64, 16, 4), (128, 8, 4), (32, 32, 4), (128, 16, 8), (256, 8, 8), (64, 32, 8)]}
    variants = ["direct"] + (["lut"] if lut_applies(packed, tokens) else [])
    seen, configs = set(), []
    for variant in variants:
        for block_rows, block_groups, warps in tiles[variant]:
            for per_sm in (2, 4, 8, 16):
                split = split_for(packed, block_rows, block_groups, per_sm)
                config = KernelConfig(variant, block_rows, block_groups, split, warps)
                if config not in seen:
                    seen.add(config)
                    configs.append(config)
    return configs


# ---------------------------------------------------------------- launching

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 16


def _counters(device: torch.device) -> torch.Tensor:
    """Per-device split-K arrival counters, zero between launches (each launch's last programs reset theirs)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def _launch(x: torch.Tensor, packed: PackedWeights, config: KernelConfig, out: torch.Tensor) -> torch.Tensor:
    """x [T, in] contiguous rows, T <= MAX_KERNEL_TOKENS -> out [T, rows] (written in full)."""
    tokens = x.shape[0]
    m, k, gs = packed.num_codebooks, packed.codebook_size, packed.group_size
    groups = packed.num_groups
    row_blocks = triton.cdiv(packed.rows, config.block_rows)
    if config.split > 1 and row_blocks > _COUNTER_SLOTS:
        raise ValueError(f"{packed.rows} rows in blocks of {config.block_rows}: more row blocks than counters")
    groups_per_split = triton.cdiv(triton.cdiv(groups, config.split), config.block_groups) * config.block_groups
    split = triton.cdiv(groups, groups_per_split)  # no program without groups
    partial = (torch.empty(split * tokens * packed.rows, dtype=torch.float32, device=x.device) if split > 1
               else out)
    counters = _counters(x.device) if split > 1 else out
    bias = packed.bias if packed.bias is not None else packed.scales
    b1, b2, b3 = packed.bounds()
    grid = (row_blocks, split)
    common = dict(M=m, MP=triton.next_power_of_2(m), K=k, BLOCK_O=config.block_rows,
                  BLOCK_G=config.block_groups, SPLIT=split, STEPS=groups_per_split // config.block_groups,
                  HAS_BIAS=packed.bias is not None,
                  num_warps=config.num_warps)
    if config.variant == "lut":
        if not lut_applies(packed, tokens):
            raise ValueError(f"lut variant: one token and <= {MAX_LUT_CODEWORDS} codewords, got {tokens} tokens, "
                             f"{k} codewords")
        n = packed.codebooks.shape[0]
        lut = torch.empty(n * groups * m * k, dtype=torch.float32, device=x.device)
        block_j = 4
        _lut_build_kernel[(triton.cdiv(groups, block_j), n)](
            x, packed.codebooks, lut, groups, M=m, K=k, MKP=triton.next_power_of_2(m * k), GS=gs,
            GP=triton.next_power_of_2(gs), BLOCK_J=block_j, num_warps=4)
        _lut_kernel[grid](lut, packed.codes, packed.scales, bias, out, partial, counters,
                          packed.rows, groups, groups_per_split, b1, b2, b3, **common)
    elif config.variant == "direct":
        _direct_kernel[grid](x, packed.codes, packed.codebooks, packed.scales, bias, out, partial, counters,
                             tokens, packed.rows, groups, groups_per_split, b1, b2, b3, x.stride(0), out.stride(0),
                             GS=gs, GP=triton.next_power_of_2(gs), TP=triton.next_power_of_2(tokens), **common)
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
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def packed_matmul(x: torch.Tensor, packed: PackedWeights, *, config: KernelConfig | None = None) -> torch.Tensor:
    """x [..., in] -> [..., sum(out_sizes)] (bias and scales applied), one kernel launch for a few tokens."""
    return _packed_matmul_op(x, packed.codes, packed.codebooks, packed.scales, packed.bias, list(packed.out_sizes),
                             config.as_list() if config is not None else [])


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

def time_config(x: torch.Tensor, packed: PackedWeights, config: KernelConfig, *, warmup_ms: int = 5,
                rep_ms: int = 25) -> float:
    """Median seconds of one launch (triton's do_bench, which flushes L2 before every launch)."""
    out = torch.empty(x.shape[0], packed.rows, dtype=x.dtype, device=x.device)
    return triton.testing.do_bench(lambda: _launch(x, packed, config, out), warmup=warmup_ms, rep=rep_ms,
                                   return_mode="median") / 1e3


def tune(packed: PackedWeights, tokens: int = 1, *, configs: Sequence[KernelConfig] | None = None,
         check: bool = True, rtol: float = 2e-2, log=None) -> list[tuple[KernelConfig, float | None, str]]:
    """Times each candidate configuration on random inputs (after checking it against the dense
    reference, when check) and records the fastest for this shape. Returns (config, seconds or None,
    note) for every candidate; a candidate that fails or is wrong is skipped, not fatal."""
    device = packed.codes.device
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, packed.in_features, device=device, dtype=packed.codebooks.dtype, generator=generator)
    reference = None
    if check:
        reference = (x.double() @ packed_dense_weight(packed).double().T
                     + (0 if packed.bias is None else packed.bias.double()))
    results = []
    for config in configs if configs is not None else candidate_configs(packed, tokens):
        try:
            if reference is not None:
                out = torch.full((tokens, packed.rows), float("nan"), dtype=x.dtype, device=device)
                _launch(x, packed, config, out)
                error = relative_error(out, reference)
                if not error <= rtol:
                    results.append((config, None, f"rel. error {error:.2e} > {rtol}"))
                    continue
            seconds = time_config(x, packed, config)
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
