"""Checks on a layer's inputs before any work starts, with errors that name the problem."""

from __future__ import annotations

import torch

from aqflow.quant.representation import MAX_NBITS


class QuantizationInputError(ValueError):
    """A weight, XᵀX or setting that the quantizer cannot work with."""


def check_finite(name: str, tensor: torch.Tensor) -> None:
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        kinds = [k for k, present in (("NaN", torch.isnan(tensor).any()), ("Inf", torch.isinf(tensor).any())) if bool(present)]
        raise QuantizationInputError(
            f"{name} contains {' and '.join(kinds)} ({int(bad.sum())} of {tensor.numel()} entries, first at index {first})"
        )


def validate_layer_inputs(weight: torch.Tensor, xtx: torch.Tensor, settings) -> None:
    """Raise QuantizationInputError naming the first problem with (weight, xtx, settings)."""
    if weight.dim() != 2:
        raise QuantizationInputError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if xtx.dim() != 2 or xtx.shape[0] != xtx.shape[1]:
        raise QuantizationInputError(f"XᵀX must be a square matrix, got shape {tuple(xtx.shape)}")
    if xtx.shape[0] != in_features:
        raise QuantizationInputError(
            f"XᵀX is {xtx.shape[0]}x{xtx.shape[1]} but the weight has in_features={in_features}: "
            f"XᵀX must be {in_features}x{in_features}"
        )
    g = settings.group_size
    if g < 1 or in_features % g != 0:
        raise QuantizationInputError(f"in_features={in_features} is not divisible by group_size g={g}")
    if not 1 <= settings.nbits <= MAX_NBITS:
        raise QuantizationInputError(f"nbits={settings.nbits} is out of range: must be 1..{MAX_NBITS}")
    if settings.num_codebooks < 1:
        raise QuantizationInputError(f"num_codebooks={settings.num_codebooks} must be at least 1")
    if settings.beam_size < 1:
        raise QuantizationInputError(f"beam_size={settings.beam_size} must be at least 1")
    num_groups = out_features * in_features // g
    if (1 << settings.nbits) > num_groups:
        raise QuantizationInputError(
            f"nbits={settings.nbits} gives K={1 << settings.nbits} codewords per codebook but the layer has only "
            f"{num_groups} weight groups: most codewords could never be used"
        )
    from aqflow.quant.init import INITIALISERS

    if settings.init not in INITIALISERS:
        raise QuantizationInputError(f"init={settings.init!r} is unknown: choose one of {sorted(INITIALISERS)}")
    for name in ("max_epochs", "steps_per_epoch", "oaem_rounds", "oaem_steps"):
        if getattr(settings, name) < 0:
            raise QuantizationInputError(f"{name}={getattr(settings, name)} must be >= 0")
    check_finite("weight", weight)
    check_finite("XᵀX", xtx)
