"""The `sequential` propagation mode: block i is calibrated on the outputs of the quantized blocks < i.

AQLM's recipe. Block 0 sees what the full-precision model gives it (its XᵀX equals the `fp`
mode's). For i >= 1 the pipeline runs one step per block, which needs only block i-1:

    hidden_i = quantized block i-1 (hidden_{i-1})       [num_windows, T, hidden]
    XᵀX of block i's sites = full-precision block i run on hidden_i

so no job re-runs blocks 0..i-2: each step stores hidden_i for the next one. The quantized block is
the full-precision block with every linear's weight replaced by the weight its AQLM codes
represent (and, after block fine-tuning, its tuned norms and biases).

Block-call arguments other than the hidden states (attention mask, rotary embeddings, ...) do not
depend on the hidden states; they are captured per block from a one-window pass (`block_call_inputs`)
and broadcast over the batch, so models whose blocks take different arguments (sliding-window
layers) get their own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from .hessians import (
    BlockInputs,
    BlockXtx,
    PROBE_TOKENS,
    _empty_stats,
    accumulate_block_xtx,
    block_forward,
    capture_block_inputs,
    discover_input_sites,
)
from aqflow.io.artifacts import ArtifactError
from ..models.structure import find_decoder_blocks, find_linears
from ..quant.representation import dequantize_weight, unpack_codes

HIDDEN_KEY = "hidden_states"
BLOCK_TENSORS_FILE = "block.safetensors"  # block fine-tuning's tuned norms and biases, by full name
WINDOWS_FILE = "windows.safetensors"  # the calibration token ids, in the shared calibration folder


# --- quantized blocks --------------------------------------------------------------------------

def load_quantized_weight(path: str | os.PathLike) -> torch.Tensor:
    """The weight [out, in] float32 that a layer artifact (codes, codebooks, scales) represents."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such layer artifact")
    tensors = load_file(str(path))
    missing = {"codes", "codebooks", "scales"} - set(tensors)
    if missing:
        raise ArtifactError(f"{path}: layer artifact lacks {sorted(missing)}")
    nbits = tensors["codebooks"].shape[1].bit_length() - 1
    codes = unpack_codes(tensors["codes"], nbits)  # [out, in/g, M] int64
    return dequantize_weight(codes, tensors["codebooks"].float(), tensors["scales"].float())


def block_layer_files(layers_dir: str | os.PathLike, block_prefix: str, block: nn.Module) -> dict[str, Path]:
    """linear name inside the block -> `<layers_dir>/<block_prefix>.<linear>.safetensors`.

    block_prefix: the block's full module name, e.g. "model.layers.3".
    """
    return {name: Path(layers_dir) / f"{block_prefix}.{name}.safetensors" for name in find_linears(block)}


@torch.no_grad()
def install_quantized_block(block: nn.Module, layer_files: Mapping[str, str | os.PathLike],
                            block_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Turn a full-precision block into its quantized version, in place.

    layer_files:   linear name inside the block -> its layer artifact; every linear must have one.
    block_tensors: optional tuned non-quantized parameters (norms, biases) by name inside the block.
    """
    linears = find_linears(block)
    missing = sorted(set(linears) - set(layer_files))
    if missing:
        raise ArtifactError(f"no layer artifacts for linears {missing} of the block")
    for name, path in layer_files.items():
        weight = load_quantized_weight(path)
        linear = linears[name]
        if tuple(weight.shape) != tuple(linear.weight.shape):
            raise ArtifactError(f"{path}: represents a weight {tuple(weight.shape)}, the linear {name!r} "
                             f"is {tuple(linear.weight.shape)}")
        linear.weight.copy_(weight.to(linear.weight.dtype))
    params = dict(block.named_parameters())
    for name, tensor in (block_tensors or {}).items():
        if name not in params or params[name].shape != tensor.shape:
            raise ArtifactError(f"block tensor {name!r} {tuple(tensor.shape)} matches no parameter of the block")
        params[name].copy_(tensor.to(params[name].dtype))


# --- block inputs ------------------------------------------------------------------------------

def block_call_inputs(model: nn.Module, windows: torch.Tensor, block_index: int) -> BlockInputs:
    """How the model calls block `block_index` (mask, rotary embeddings, ...), from the first window.

    windows: [num_windows, T] int64. The hidden states of the returned BlockInputs are those of the
    full-precision model for window 0 and are not used for propagation; the other arguments have a
    batch dimension of 1 and broadcast over any batch of windows of the same length.
    """
    return capture_block_inputs(model, windows[:1], block_index)


@torch.no_grad()
def embedded_inputs(model: nn.Module, windows: torch.Tensor, batch_size: int = 8,
                    progress: bool = True) -> torch.Tensor:
    """The inputs of block 0 for every window: [num_windows, T, hidden] on the model's device."""
    parts = [capture_block_inputs(model, windows[start:start + batch_size], 0).hidden_states
             for start in tqdm(range(0, windows.shape[0], batch_size), desc="embed", unit="batch",
                               disable=not progress)]
    return torch.cat(parts)


# --- one step ----------------------------------------------------------------------------------

@torch.no_grad()
def propagate_and_collect(previous_block: nn.Module, previous_call: BlockInputs, hidden_in: torch.Tensor,
                          block: nn.Module, call: BlockInputs, stats: BlockXtx, batch_size: int = 8,
                          progress: bool = True) -> torch.Tensor:
    """One sequential step: run the (quantized) previous block on its inputs, and accumulate the XᵀX
    of `block` (full precision) on what comes out.

    hidden_in: [num_windows, T, hidden], the inputs of the previous block.
    Returns the inputs of `block`: [num_windows, T, hidden], in hidden_in's dtype and device.
    """
    hidden_out = torch.empty_like(hidden_in)
    for start in tqdm(range(0, hidden_in.shape[0], batch_size), desc=f"block {stats.block}", unit="batch",
                      disable=not progress):
        stop = start + batch_size
        out = block_forward(previous_block, previous_call, hidden_in[start:stop])
        hidden_out[start:stop] = out
        accumulate_block_xtx(block, stats, call, out)
    return hidden_out


def sequential_block_xtx(model: nn.Module, windows: torch.Tensor, block_index: int, hidden_in: torch.Tensor,
                         previous_layer_files: Mapping[str, str | os.PathLike],
                         previous_block_tensors: Mapping[str, torch.Tensor] | None = None,
                         batch_size: int = 8, progress: bool = True) -> tuple[BlockXtx, torch.Tensor]:
    """XᵀX of block `block_index` >= 1 in sequential mode, and that block's inputs.

    model:        the full-precision model; block `block_index - 1` is replaced by its quantized
                  version in place (the model is not usable as full precision afterwards).
    windows:      [num_windows, T] int64 calibration windows.
    hidden_in:    [num_windows, T, hidden], the inputs of block `block_index - 1` in the quantized model.
    previous_layer_files / previous_block_tensors: see `install_quantized_block`.
    Returns (BlockXtx of block `block_index`, its inputs [num_windows, T, hidden]).
    """
    _, blocks = find_decoder_blocks(model)
    if not 1 <= block_index < len(blocks):
        raise ValueError(f"sequential step needs 1 <= block < {len(blocks)}, got {block_index}")
    if hidden_in.shape[:2] != windows.shape:
        raise ValueError(f"hidden states {tuple(hidden_in.shape)} do not match windows {tuple(windows.shape)}")
    sites = discover_input_sites(model, windows[:1, :PROBE_TOKENS], [block_index])
    previous_call = block_call_inputs(model, windows, block_index - 1)
    call = block_call_inputs(model, windows, block_index)
    stats = _empty_stats(sites, hidden_in.device)[block_index]
    install_quantized_block(blocks[block_index - 1], previous_layer_files, previous_block_tensors)
    hidden_out = propagate_and_collect(blocks[block_index - 1], previous_call, hidden_in, blocks[block_index], call,
                                       stats, batch_size, progress)
    return stats, hidden_out


# --- hidden-state artifacts --------------------------------------------------------------------

def save_hidden_states(path: str | os.PathLike, hidden: torch.Tensor, block: int) -> None:
    """Write a block's inputs [num_windows, T, hidden] as safetensors, atomically."""
    from aqflow.io.artifacts import save_safetensors

    save_safetensors(path, {HIDDEN_KEY: hidden.cpu()}, {"block": str(block), "what": "inputs of the block"})


def load_hidden_states(path: str | os.PathLike, windows: torch.Tensor | None = None) -> torch.Tensor:
    """Read what `save_hidden_states` wrote; with `windows` [num_windows, T], check the shapes agree."""
    from aqflow.io.tensor_files import load_tensor

    hidden = load_tensor(path, HIDDEN_KEY)
    if windows is not None and hidden.shape[:2] != windows.shape:
        raise ArtifactError(f"{path}: hidden states {tuple(hidden.shape)} were not made from these "
                         f"{tuple(windows.shape)} windows")
    return hidden


def save_windows(path: str | os.PathLike, windows: torch.Tensor) -> None:
    """The calibration token ids [num_windows, T] int64, so sequential steps use the same windows."""
    from aqflow.io.artifacts import save_safetensors

    save_safetensors(path, {"input_ids": windows.to(torch.int64)})


def load_windows(path: str | os.PathLike) -> torch.Tensor:
    from aqflow.io.tensor_files import load_tensor

    return load_tensor(path, "input_ids")


def load_block_tensors(path: str | os.PathLike | None, block_prefix: str) -> dict[str, torch.Tensor]:
    """Tuned non-quantized block parameters from a fine-tune `block.safetensors` (full module names),
    keyed by name inside the block. None -> {}."""
    if path is None:
        return {}
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    prefix = block_prefix + "."
    foreign = [key for key in tensors if not key.startswith(prefix)]
    if foreign:
        raise ArtifactError(f"{path}: tensors {foreign[:3]} are not parameters of {block_prefix}")
    return {key[len(prefix):]: value for key, value in tensors.items()}


def block_prefix_of(model: nn.Module, block_index: int) -> str:
    name, _ = find_decoder_blocks(model)
    return f"{name}.{block_index}"


__all__ = [
    "BLOCK_TENSORS_FILE", "WINDOWS_FILE", "block_call_inputs", "block_layer_files", "block_prefix_of", "embedded_inputs",
    "install_quantized_block", "load_block_tensors", "load_hidden_states", "load_quantized_weight",
    "load_windows", "propagate_and_collect", "save_hidden_states", "save_windows", "sequential_block_xtx",
]
