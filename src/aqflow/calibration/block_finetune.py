"""Block fine-tuning (AQLM, section 3.4): after a block's linears are quantized, tune its continuous
parameters so that the quantized block reproduces the full-precision block's outputs.

With the codes fixed, the quantized block is a differentiable function of its codebooks
[M, K, 1, g], scales [out, 1, 1, 1] and every other parameter of the block (norms, biases). Over
the calibration inputs X of the block (the outputs of the quantized blocks before it) and the
targets Y = block_fp(X), Adam minimises the relative output error

    L = sum_windows ||block_q(X) - Y||² / sum_windows ||Y||²

in mini-batches of windows, one pass over the windows per epoch. L on all windows is measured
before tuning and after every epoch; the parameters of the best measurement are returned, so
fine-tuning never leaves a block worse than it found it on the data it optimises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.func import functional_call
from tqdm.auto import tqdm

from ..models.structure import find_linears
from .hessians import BlockInputs
from ..quant.representation import dequantize_weight


@dataclass(frozen=True)
class BlockFinetuneSettings:
    """epochs: passes over the calibration windows; lr: Adam learning rate (betas 0.9, 0.95, as AQLM);
    batch_size: windows per Adam step; seed: order of the windows."""

    epochs: int = 5
    lr: float = 1e-4
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.epochs < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"block fine-tuning needs epochs >= 0, batch_size >= 1, lr > 0; got {self}")


@dataclass
class QuantizedLinearParams:
    """One linear's AQLM parameters: codes [out, in/g, M] int64 in [0, K), codebooks [M, K, 1, g],
    scales [out, 1, 1, 1]."""

    codes: torch.Tensor
    codebooks: torch.Tensor
    scales: torch.Tensor


@dataclass
class BlockFinetuneResult:
    """Tuned parameters (float32, on the block's device) and the error before and after.

    linears:            linear name inside the block -> tuned codebooks and scales (codes unchanged)
    block_tensors:      name inside the block -> tuned norm / bias
    relative_mse_*:     L above on all windows; per_epoch has one entry per epoch
    """

    linears: dict[str, QuantizedLinearParams]
    block_tensors: dict[str, torch.Tensor]
    relative_mse_before: float
    relative_mse_after: float
    relative_mse_per_epoch: list[float] = field(default_factory=list)
    best_epoch: int = 0
    seconds: float = 0.0


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor inside a BlockInputs or nested tuples / lists / dicts."""
    if isinstance(value, BlockInputs):
        return BlockInputs(cast_floats(value.hidden_states, dtype), cast_floats(value.args, dtype),
                           cast_floats(value.kwargs, dtype), value.hidden_in_kwargs)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def _call(block: nn.Module, params: Mapping[str, torch.Tensor], call: BlockInputs, hidden: torch.Tensor) -> torch.Tensor:
    """The block on hidden [batch, T, hidden] with `params` in place of its own (functional call)."""
    if call.hidden_in_kwargs:
        out = functional_call(block, dict(params), call.args, {"hidden_states": hidden, **call.kwargs})
    else:
        out = functional_call(block, dict(params), (hidden, *call.args), call.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _parameters(linears: Mapping[str, QuantizedLinearParams], extra: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter the block is called with: dequantized weights from codes, codebooks, scales."""
    params = {f"{name}.weight": dequantize_weight(p.codes, p.codebooks, p.scales) for name, p in linears.items()}
    params.update(extra)
    return params


@torch.no_grad()
def block_output_relative_mse(block: nn.Module, params: Mapping[str, torch.Tensor], call: BlockInputs,
                              hidden_in: torch.Tensor, targets: torch.Tensor, batch_size: int) -> float:
    """L = sum ||block(hidden_in; params) - targets||² / sum ||targets||² over all windows.

    hidden_in, targets: [num_windows, T, hidden] float32.
    """
    error = norm = 0.0
    for start in range(0, hidden_in.shape[0], batch_size):
        target = targets[start:start + batch_size]
        out = _call(block, params, call, hidden_in[start:start + batch_size])
        error += float(((out - target).double() ** 2).sum())
        norm += float((target.double() ** 2).sum())
    return error / norm


def finetune_block(block: nn.Module, call: BlockInputs, hidden_in: torch.Tensor, targets: torch.Tensor,
                   quantized: Mapping[str, QuantizedLinearParams], settings: BlockFinetuneSettings,
                   progress: bool = True) -> BlockFinetuneResult:
    """Tune codebooks, scales, norms and biases of a quantized block to match `targets`.

    block:     the block (its linear weights are ignored: `quantized` replaces them); cast to float32
               in place, its parameters are otherwise untouched (the result holds the tuned ones).
    call:      how the model calls the block (see sequential.block_call_inputs)
    hidden_in: [num_windows, T, hidden], the block's inputs in the quantized model
    targets:   [num_windows, T, hidden], the full-precision block's outputs on hidden_in
    quantized: every linear of the block -> its codes, codebooks, scales
    """
    started = time.perf_counter()
    linear_names = set(find_linears(block))
    if set(quantized) != linear_names:
        raise KeyError(f"quantized parameters for {sorted(quantized)}, but the block's linears are {sorted(linear_names)}")
    device = next(block.parameters()).device
    block = block.float()
    call = cast_floats(call, torch.float32)
    hidden_in, targets = hidden_in.float(), targets.float()
    linears = {name: QuantizedLinearParams(p.codes.to(device),
                                           p.codebooks.detach().float().to(device).clone().requires_grad_(),
                                           p.scales.detach().float().to(device).clone().requires_grad_())
               for name, p in quantized.items()}
    weights = {f"{name}.weight" for name in linear_names}
    extra = {name: p.detach().float().clone().requires_grad_() for name, p in block.named_parameters()
             if name not in weights and p.is_floating_point()}
    trainable = [t for p in linears.values() for t in (p.codebooks, p.scales)] + list(extra.values())
    optimizer = torch.optim.Adam(trainable, lr=settings.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(settings.seed)

    def measure() -> float:
        return block_output_relative_mse(block, _parameters(linears, extra), call, hidden_in, targets,
                                         settings.batch_size)

    def snapshot() -> tuple[dict, dict]:
        return ({n: QuantizedLinearParams(p.codes, p.codebooks.detach().clone(), p.scales.detach().clone())
                 for n, p in linears.items()}, {n: t.detach().clone() for n, t in extra.items()})

    before = measure()
    best, best_epoch, best_state = before, 0, snapshot()
    per_epoch = []
    num_windows = hidden_in.shape[0]
    for epoch in tqdm(range(1, settings.epochs + 1), desc="block fine-tune", unit="epoch", disable=not progress):
        order = torch.randperm(num_windows, generator=generator)
        for start in range(0, num_windows, settings.batch_size):
            batch = order[start:start + settings.batch_size].to(hidden_in.device)
            target = targets[batch]
            out = _call(block, _parameters(linears, extra), call, hidden_in[batch])
            loss = ((out - target) ** 2).sum() / (target ** 2).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        per_epoch.append(measure())
        if per_epoch[-1] < best:
            best, best_epoch, best_state = per_epoch[-1], epoch, snapshot()
    tuned_linears, tuned_extra = best_state
    return BlockFinetuneResult(tuned_linears, tuned_extra, before, best, per_epoch, best_epoch,
                               time.perf_counter() - started)
