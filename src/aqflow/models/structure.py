"""The module tree of a decoder-only model: its repeated blocks and their linears.

Found by walking the tree, not by tables of layer names, so any `transformers` causal LM whose
blocks are built of nn.Linear works: the blocks are the nn.ModuleList of identical children that
holds most of the parameters, the linears every nn.Linear inside one block.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def _contains_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def find_decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the list of repeated transformer blocks of a model.

    Candidates are nn.ModuleLists whose children all have the same class and contain nn.Linear
    layers; the one holding the most parameters is the decoder stack (this passes over, e.g.,
    the smaller list of a vision tower or the expert list inside one MoE block).
    Returns (qualified name, the ModuleList), e.g. ("model.layers", ...).
    """
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1 or not _contains_linear(module[0]):
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise ValueError(f"no list of repeated blocks with linear layers found in {type(model).__name__}")
    return best[1], best[2]


def find_linears(block: nn.Module) -> dict[str, nn.Linear]:
    """All nn.Linear modules of a block, by name relative to the block, in module order."""
    linears = {name: m for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise ValueError(f"block {type(block).__name__} has no nn.Linear modules")
    return linears


def meta_model(model_dir: str | os.PathLike) -> nn.Module:
    """The module tree of a model folder's causal LM, on the meta device: no weight is allocated or read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
