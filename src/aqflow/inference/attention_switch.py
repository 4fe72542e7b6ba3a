"""Switching a transformers model from SDPA to one of aqflow's attention implementations for a block.

`attention_switched(model, implementation, forward)`: within the block the model's configs that are on
SDPA (the model's own and every distinct sub-config: the attention layers read their own) name
`implementation` instead, registered first with transformers as `forward` (an attention function of
transformers' AttentionInterface signature) with SDPA's mask. Yields the implementation if it
switched, None where no config was on SDPA; SDPA is restored after.

`forwards_replaced(model, maker_for)`: within the block every module for which `maker_for(module)` gives a
maker runs `maker(module, its forward)` as its forward (cpu_layers, cuda_layers); yields how many; the
forwards come back after.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def sdpa_configs(model: torch.nn.Module) -> list:
    """The distinct configs of the model and its submodules that use SDPA."""
    seen, configs = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            if getattr(config, "_attn_implementation", None) == "sdpa":
                configs.append(config)
    return configs


def register(implementation: str, forward: Callable) -> None:
    """Registers `forward` with transformers under `implementation`, with SDPA's mask; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(implementation, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(implementation, sdpa_mask)


@contextlib.contextmanager
def attention_switched(model: torch.nn.Module, implementation: str, forward: Callable) -> Iterator[str | None]:
    configs = sdpa_configs(model)
    if not configs:
        yield None
        return
    register(implementation, forward)
    for config in configs:
        config._attn_implementation = implementation
    try:
        yield implementation
    finally:
        for config in configs:
            config._attn_implementation = "sdpa"


@contextlib.contextmanager
def forwards_replaced(model: torch.nn.Module,
                      maker_for: Callable[[torch.nn.Module], Callable | None]) -> Iterator[int]:
    """Within the block each module of `model` for which maker_for(module) returns a maker (not None) has
    the forward maker(module, its forward); yields how many modules; each gets its own forward back after
    (one set on the instance before stays)."""
    switched = []
    for module in model.modules():
        make = maker_for(module)
        if make is None:
            continue
        switched.append((module, module.__dict__.get("forward")))  # a forward set on the instance before ours
        module.forward = make(module, module.forward)
    try:
        yield len(switched)
    finally:
        for module, previous in switched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
