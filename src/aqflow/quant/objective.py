"""The layer objective: output error under the calibration second moment XᵀX.

For inputs X [tokens, in] the output error of a weight error ΔW [out, in] is
    ||X ΔWᵀ||_F^2 = tr(ΔW XᵀX ΔWᵀ) = sum_{o} ΔW[o] XᵀX ΔW[o]ᵀ,
so XᵀX (called `xtx`, [in, in]) is all the calibration data the quantizer needs. Rows are
independent; groups of one row are coupled through the off-diagonal blocks of XᵀX.
"""

from __future__ import annotations

import torch


def output_error(weight_error: torch.Tensor, xtx: torch.Tensor) -> torch.Tensor:
    """tr(ΔW XᵀX ΔWᵀ). weight_error [out, in], xtx [in, in] -> scalar."""
    return ((weight_error @ xtx) * weight_error).sum()


def relative_output_mse(weight: torch.Tensor, weight_hat: torch.Tensor, xtx: torch.Tensor) -> torch.Tensor:
    """tr(ΔW XᵀX ΔWᵀ) / tr(W XᵀX Wᵀ): 0 is perfect, 1 is as bad as a zero weight."""
    return output_error(weight - weight_hat, xtx) / output_error(weight, xtx)


def diagonal_blocks(xtx: torch.Tensor, group_size: int) -> torch.Tensor:
    """The g x g diagonal blocks of XᵀX. xtx [in, in] -> [in/g, g, g]."""
    num_groups = xtx.shape[0] // group_size
    blocks = xtx.reshape(num_groups, group_size, num_groups, group_size)
    index = torch.arange(num_groups, device=xtx.device)
    return blocks[index, :, index, :]


def damped_diagonal_blocks(xtx: torch.Tensor, group_size: int, damping_ratio: float) -> torch.Tensor:
    """H_i = (XᵀX)_ii + λI with λ = damping_ratio * mean(diag XᵀX) (paper, eq. 3). -> [in/g, g, g]"""
    damping = damping_ratio * torch.diagonal(xtx).mean()
    eye = torch.eye(group_size, dtype=xtx.dtype, device=xtx.device)
    return diagonal_blocks(xtx, group_size) + damping * eye
