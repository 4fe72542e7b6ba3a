"""Codeword sums of many groups in one memory-bound Triton kernel (the Adam phase's and the beam
search's `group_reconstruction`, without autograd).

On a 3072x8192 layer (3.1M groups, M=2) an Adam step spent 1.2 ms in embedding_bag's sum mode
and 1.9 ms in two index_selects, against ~1 ms for its TF32 product; the sums read 16 bytes of
codes and write 32 bytes per group, ~0.15 GB in all. One program sums BLOCK groups' M codewords.
"""

from __future__ import annotations

import os

import torch

from aqflow.quant.beam_kernels import triton
from aqflow.quant.representation import group_reconstruction

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _codeword_sums_kernel(codes_ptr, codebooks_ptr, out_ptr, num_groups, M: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = rows < num_groups
        gi = tl.arange(0, G)
        total = tl.zeros([BLOCK, G], tl.float32)
        for m in tl.static_range(M):  # codebook order, as group_reconstruction sums
            code = tl.load(codes_ptr + rows * M + m, mask=valid, other=0)
            total += tl.load(codebooks_ptr + (m * K + code)[:, None] * G + gi[None, :], mask=valid[:, None], other=0.0)
        tl.store(out_ptr + rows[:, None] * G + gi[None, :], total, mask=valid[:, None])


def codeword_sums_supported(codes: torch.Tensor, codebooks: torch.Tensor) -> bool:
    """float32 codebooks with a power-of-two group size, no autograd, on CUDA (by default; on the
    CPU the kernel runs only when asked for, under TRITON_INTERPRET=1)."""
    group_size = codebooks.shape[-1]
    return (
        triton is not None and codes.device.type == "cuda" and codebooks.dtype == torch.float32
        and not codebooks.requires_grad and group_size & (group_size - 1) == 0
    )


def codeword_sums(codes: torch.Tensor, codebooks: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """Unscaled sum of codewords per group, as `group_reconstruction`; the Triton kernel where supported.

    codes [..., M] int64, codebooks [M, K, g] -> [..., g]
    """
    if not (fused if fused is not None else codeword_sums_supported(codes, codebooks)):
        return group_reconstruction(codes, codebooks)
    if codes.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the codeword-sum kernel cannot run on {codes.device} (CUDA, or TRITON_INTERPRET=1)")
    num_codebooks, num_codewords, group_size = codebooks.shape
    flat_codes = codes.reshape(-1, num_codebooks).contiguous()
    out = torch.empty(flat_codes.shape[0], group_size, dtype=codebooks.dtype, device=codebooks.device)
    block = 256
    _codeword_sums_kernel[(triton.cdiv(flat_codes.shape[0], block),)](
        flat_codes, codebooks.contiguous(), out, flat_codes.shape[0], M=num_codebooks, K=num_codewords, G=group_size, BLOCK=block
    )
    return out.view(*codes.shape[:-1], group_size)
