"""The continuous half of an epoch: Adam on codebooks and scales with the codes fixed.

Loss: the relative output error tr(ΔW XᵀX ΔWᵀ) / tr(W XᵀX Wᵀ) with the full XᵀX. For fixed
codes it is a smooth function of codebooks and scales, so plain Adam steps improve both.
"""

from __future__ import annotations

import torch

from aqflow.quant.objective import output_error
from aqflow.quant.representation import dequantize_weight


def adam_update(
    weight: torch.Tensor,
    xtx: torch.Tensor,
    codes: torch.Tensor,
    codebooks: torch.Tensor,
    scales: torch.Tensor,
    steps: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> tuple[torch.Tensor, torch.Tensor]:
    """S Adam steps on (codebooks, scales) against the full objective.

    weight [out, in], xtx [in, in], codes [out, G, M], codebooks [M, K, g], scales [out]
    -> codebooks [M, K, g], scales [out]
    """
    reference_error = output_error(weight, xtx)
    codebooks = codebooks.clone().requires_grad_(True)
    scales = scales.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([codebooks, scales], lr=lr, betas=betas, foreach=True)
    with torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=False)
            loss = output_error(weight - dequantize_weight(codes, codebooks, scales), xtx) / reference_error
            loss.backward()
            optimizer.step()
    return codebooks.detach(), scales.detach()
