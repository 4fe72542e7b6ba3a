"""The operand of the decode kernels: one or several AQLM linears of one input packed by rows
(`PackedWeights`), and a kernel configuration (`KernelConfig`), shared by the Triton kernels
(`gpu_kernels`) and the CUDA ones (`cuda_kernels`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from aqflow.inference.layout import QuantizedWeights

MAX_FUSED_MATRICES = 4

# The kernels' tiled code layout: tiles of TILE_ROWS rows x TILE_GROUPS input groups, each contiguous, and
# inside a tile the codes in the order the CUDA kernel's threads take them. Its thread (q, i) of a 256-row
# batch takes rows q, q + 32, ..., q + 224 (8 row slots) and groups 2i, 2i+1 of a 16-group chunk: their 8 x
# 4 code bytes lie together, two 16-byte loads, and a warp's load is 512 contiguous bytes where row-major
# codes gave it 32-byte pieces of 16 rows. Order within a tile: [q 32][i 8][slot 8][group % 2][codebook]
# (row = 32 slot + q, group = 2i + group % 2). H200 2-bit decode: tiles +7 % (3B) / +6 % (8B) over
# row-major codes (results/tiled_codes_h200/), the thread order in them +3 % more (8B, code_loads_h200/).
TILE_ROWS = 256
TILE_GROUPS = 16
_TILE_DIMS = 7  # [row tiles, group tiles, q, i, slot, group % 2, codebook]


def code_rows(codes: torch.Tensor) -> int:
    """Output rows of codes, row-major [rows, G, M] or tiled (tiled_codes)."""
    return codes.shape[0] * TILE_ROWS if codes.dim() == _TILE_DIMS else codes.shape[0]


@dataclass(frozen=True)
class PackedWeights:
    """One or several AQLM linears of the same input (same groups, codebook count and size) as one
    kernel operand: codes [rows, G, M] (uint8 or int32, the matrices' rows one after another) or the
    same codes in tiles, [rows / 256, G / 16, 32, 8, 8, 2, M] (`in_tiles`, `tiled_codes`),
    codebooks [n, M, K, g], scales [rows], bias [rows] or None; out_sizes: the rows of each matrix."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    out_sizes: tuple[int, ...]

    @property
    def tiled(self) -> bool:
        return self.codes.dim() == _TILE_DIMS

    @property
    def rows(self) -> int:
        return code_rows(self.codes)

    @property
    def num_groups(self) -> int:
        return self.codes.shape[1] * TILE_GROUPS if self.tiled else self.codes.shape[1]

    @property
    def num_codebooks(self) -> int:
        return self.codes.shape[-1]

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


def can_tile(packed: PackedWeights) -> bool:
    """Whether the codes can lie in tiles: every matrix's rows and the groups whole tiles (so that no tile
    straddles two matrices)."""
    return (not packed.tiled and packed.num_groups % TILE_GROUPS == 0
            and all(size % TILE_ROWS == 0 for size in packed.out_sizes))


def tiled_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [rows, G, M] -> [rows / 256, G / 16, 32, 8, 8, 2, M] (a contiguous copy): element
    [a, b, q, i, s, h, m] is codebook m of row 256a + 32s + q, group 16b + 2i + h."""
    rows, groups, m = codes.shape
    return (codes.view(rows // TILE_ROWS, 8, 32, groups // TILE_GROUPS, 8, 2, m)  # [a, s, q, b, i, h, m]
            .permute(0, 3, 2, 4, 1, 5, 6).contiguous())


def row_major_codes(packed: PackedWeights) -> torch.Tensor:
    """The codes as [rows, G, M] (a copy where they are tiled)."""
    if not packed.tiled:
        return packed.codes
    return packed.codes.permute(0, 4, 2, 1, 3, 5, 6).reshape(packed.rows, packed.num_groups, packed.num_codebooks)


def in_tiles(packed: PackedWeights) -> PackedWeights:
    """The operand with its codes in tiles where they can be (can_tile), else the operand itself. The kernels
    take either layout with the same results."""
    return replace(packed, codes=tiled_codes(packed.codes)) if can_tile(packed) else packed


def packed_dense_weight(packed: PackedWeights) -> torch.Tensor:
    """The dense weight [rows, in] the packed codes stand for, in the codebooks' dtype (prefill path)."""
    n, m, k, g = packed.codebooks.shape
    codes = row_major_codes(packed)
    matrix_of_row = torch.repeat_interleave(torch.arange(len(packed.out_sizes), device=codes.device),
                                            torch.tensor(packed.out_sizes, device=codes.device))
    offsets = (matrix_of_row[:, None, None] * m + torch.arange(m, device=codes.device)) * k  # [rows, 1, M]
    flat = packed.codebooks.reshape(n * m * k, g)
    indices = (codes.to(torch.int64) + offsets).reshape(-1, m)
    groups = torch.nn.functional.embedding_bag(indices, flat, mode="sum")  # [rows*G, g]
    return (groups.view(packed.rows, packed.num_groups, g) * packed.scales.view(-1, 1, 1)).reshape(packed.rows, -1)


@dataclass(frozen=True)
class KernelConfig:
    """variant 'direct', 'direct16' or 'lut' (Triton): a program computes block_rows rows over 1/split of
    the input groups, block_groups groups per step; num_warps per program. 'cuda_lut32' / 'cuda_lut16'
    (CUDA): a CTA of 8 warps takes block_rows rows and block_groups groups (split = the resulting depth).
    'cuda_cluster32' / 'cuda_cluster16' (CUDA, one token): the same, with the split-K done inside a
    cluster of `split` CTAs; block_rows 256 or 128."""

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


VARIANTS = ("direct", "lut", "direct16", "cuda_lut32", "cuda_lut16", "cuda_cluster32", "cuda_cluster16")
