"""Per-block input statistics XᵀX ("Hessians") of every linear layer of a decoder-only model.

The quantizer minimises the output error of each linear layer W [out, in],

    ||X Wᵀ - X Ŵᵀ||² = tr(ΔW XᵀX ΔWᵀ),   ΔW = W - Ŵ,  X [tokens, in],

so XᵀX [in, in] is all it needs to know about the calibration data. Linears that read the same
input tensor (q/k/v of an attention block, gate/up of a gated MLP) have the same X, hence the same
XᵀX: they form one *input site* and their statistics are computed and stored once.

Everything here is generic over decoder-only `transformers` models: the repeated blocks and
their linears are found by walking the module tree (`aqflow.models.structure`), and input sites
by running a short probe through the model and comparing the tensors each linear receives, not
by tables of layer names.

Propagation modes:
* fp: every block sees the inputs the full-precision model gives it; one forward pass of the
  whole model per batch feeds all blocks at once (`collect_xtx_fp`).
* sequential: block i sees the outputs of the already-quantized blocks < i (`sequential.py`,
  one block per step). Its building blocks are here: `capture_block_inputs` (a block's inputs),
  `block_forward` (one block on given inputs) and `accumulate_block_xtx` (XᵀX of one block on
  given inputs).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from aqflow.io.artifacts import decoding, save_npz, verified, write_parquet
from ..models.structure import find_decoder_blocks, find_linears
from .site_xtx import MANIFEST_FILE, array_sha256, manifest_rows, read_site_xtx

SITE_SEPARATOR = "+"
PROBE_TOKENS = 16  # sharing of inputs is structural: a short probe detects it as well as a long one


@dataclass(frozen=True)
class InputSite:
    """Linears of one block that read the same input tensor, and so share one XᵀX.

    site_id:     the linear names joined by "+", e.g. "self_attn.q_proj+self_attn.k_proj+self_attn.v_proj"
    linears:     module names relative to the block, in module order
    in_features: size of the shared input, so XᵀX is [in_features, in_features]
    """

    site_id: str
    linears: tuple[str, ...]
    in_features: int


@dataclass
class BlockXtx:
    """XᵀX of every input site of one block.

    xtx:    site_id -> [in_features, in_features] float64, the sum over calibration tokens of x xᵀ
    tokens: site_id -> number of tokens (rows of X) summed into xtx
    """

    block: int
    sites: list[InputSite]
    xtx: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def site_of(self, linear: str) -> InputSite:
        """The site whose XᵀX applies to `linear` (a module name relative to the block)."""
        for site in self.sites:
            if linear in site.linears:
                return site
        raise KeyError(f"linear {linear!r} is in no input site of block {self.block}; "
                       f"sites: {[s.site_id for s in self.sites]}")


class _StopForward(Exception):
    """Raised by a hook after the last block of interest, so the rest of the model is skipped."""


# --- input sites ---------------------------------------------------------------------------------

def group_linears_by_input(inputs: Mapping[str, torch.Tensor]) -> list[tuple[str, ...]]:
    """Group linear names whose captured inputs are the same tensor.

    inputs: linear name -> the input it received, [..., in_features], in module order.
    Two linears share a site when their inputs are the same object or equal element-wise; equal
    inputs give equal XᵀX, so merging them is exact however the model produced the tensors.
    Returns the groups, each in module order, ordered by their first member.
    """
    groups: list[list[str]] = []
    representatives: list[torch.Tensor] = []
    for name, x in inputs.items():
        for group, rep in zip(groups, representatives):
            if x is rep or (x.shape == rep.shape and x.dtype == rep.dtype and torch.equal(x, rep)):
                group.append(name)
                break
        else:
            groups.append([name])
            representatives.append(x)
    return [tuple(g) for g in groups]


def _first_input(args: tuple, kwargs: dict, what: str) -> torch.Tensor:
    if args:
        return args[0]
    for key in ("input", "hidden_states"):
        if key in kwargs:
            return kwargs[key]
    raise ValueError(f"cannot find the input tensor of {what}: no positional args, kwargs {sorted(kwargs)}")


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def discover_input_sites(model: nn.Module, probe_ids: torch.Tensor,
                         block_indices: Sequence[int] | None = None) -> dict[int, list[InputSite]]:
    """Find the input sites of each selected block by running `probe_ids` [batch, T] once.

    Linears never called during the probe are left out with a warning (they would get no XᵀX);
    a linear called more than once per forward (weight sharing inside a block) is an error here.
    """
    _, blocks = find_decoder_blocks(model)
    selected = _check_block_indices(block_indices, len(blocks))
    captured: dict[int, dict[str, list[torch.Tensor]]] = {i: {} for i in selected}
    handles = []
    for i in selected:
        for name, linear in find_linears(blocks[i]).items():
            captured[i][name] = []

            def hook(module, args, kwargs, _store=captured[i][name], _name=name):
                _store.append(_first_input(args, kwargs, _name))

            handles.append(linear.register_forward_pre_hook(hook, with_kwargs=True))
    handles.append(blocks[selected[-1]].register_forward_hook(_raise_stop))
    try:
        _run_model(model, probe_ids.to(_model_device(model)))
    finally:
        for handle in handles:
            handle.remove()

    sites: dict[int, list[InputSite]] = {}
    for i in selected:
        called = {}
        for name, calls in captured[i].items():
            if len(calls) > 1:
                raise NotImplementedError(f"block {i}: linear {name!r} ran {len(calls)} times in one forward; "
                                          "shared weights inside a block are not supported")
            if calls:
                called[name] = calls[0]
        skipped = sorted(set(captured[i]) - set(called))
        if skipped:
            warnings.warn(f"block {i}: linears {skipped} were not called on the probe and get no XᵀX")
        sites[i] = [
            InputSite(SITE_SEPARATOR.join(group), group, int(called[group[0]].shape[-1]))
            for group in group_linears_by_input(called)
        ]
    return sites


def _check_block_indices(block_indices: Sequence[int] | None, num_blocks: int) -> list[int]:
    if block_indices is None:
        return list(range(num_blocks))
    selected = sorted(set(int(i) for i in block_indices))
    bad = [i for i in selected if not 0 <= i < num_blocks]
    if bad or not selected:
        raise ValueError(f"block indices {list(block_indices)} must be non-empty and within [0, {num_blocks})")
    return selected


def _raise_stop(module, args, output):
    raise _StopForward


def _run_model(model: nn.Module, input_ids: torch.Tensor) -> None:
    # use_cache=False: a KV cache would only cost memory here.
    try:
        model(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass


# --- accumulation ------------------------------------------------------------------------------

def accumulate_xtx(xtx: torch.Tensor, x: torch.Tensor) -> int:
    """Add XᵀX of one batch into `xtx` in place; return the number of tokens added.

    xtx: [in, in] float64 accumulator; x: [..., in] any float dtype (flattened to [tokens, in]).
    float64 because the sum runs over up to millions of tokens and the quantizer later inverts
    or factorises it: float32 partial sums would lose the small eigenvalues that matter.
    """
    flat = x.reshape(-1, x.shape[-1]).to(dtype=torch.float64, device=xtx.device)
    xtx.addmm_(flat.T, flat)
    return flat.shape[0]


def _site_hooks(pairs: Sequence[tuple[nn.Module, BlockXtx]]) -> list:
    """Register one pre-hook per site, on its first linear, accumulating into the site's stats.

    pairs: (block module, its BlockXtx). Only the first linear of a site is hooked: the others
    read the same tensor, so hooking them too would count every token several times.
    """
    handles = []
    for block, block_stats in pairs:
        linears = find_linears(block)
        for site in block_stats.sites:

            def hook(module, args, kwargs, _stats=block_stats, _site=site.site_id):
                _stats.tokens[_site] += accumulate_xtx(_stats.xtx[_site], _first_input(args, kwargs, _site))

            handles.append(linears[site.linears[0]].register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _empty_stats(sites: dict[int, list[InputSite]], device: torch.device) -> dict[int, BlockXtx]:
    return {
        i: BlockXtx(
            block=i,
            sites=block_sites,
            xtx={s.site_id: torch.zeros(s.in_features, s.in_features, dtype=torch.float64, device=device)
                 for s in block_sites},
            tokens={s.site_id: 0 for s in block_sites},
        )
        for i, block_sites in sites.items()
    }


@torch.no_grad()
def collect_xtx_fp(model: nn.Module, windows: torch.Tensor, block_indices: Sequence[int] | None = None,
                   batch_size: int = 8, xtx_device: str | torch.device | None = None,
                   progress: bool = True) -> dict[int, BlockXtx]:
    """XᵀX of every input site of the selected blocks, in `fp` propagation mode.

    windows: [num_windows, T] int64 calibration token windows (no padding: every token counts).
    One forward pass of the full-precision model per batch of `batch_size` windows feeds all
    selected blocks; the pass stops after the last selected block (the head is never run).
    Accumulators live on `xtx_device` (default: the model's device) and take
    sum over sites of in_features² · 8 bytes.
    Returns block index -> BlockXtx, with tokens = num_windows · T for every site.
    """
    if windows.dim() != 2:
        raise ValueError(f"windows must be [num_windows, T], got shape {tuple(windows.shape)}")
    model.eval()
    device = _model_device(model)
    _, blocks = find_decoder_blocks(model)
    selected = _check_block_indices(block_indices, len(blocks))
    sites = discover_input_sites(model, windows[:1, :PROBE_TOKENS], selected)
    stats = _empty_stats(sites, torch.device(xtx_device) if xtx_device is not None else device)
    handles = _site_hooks([(blocks[i], block_stats) for i, block_stats in stats.items()])
    handles.append(blocks[selected[-1]].register_forward_hook(_raise_stop))
    try:
        for start in tqdm(range(0, windows.shape[0], batch_size), desc="XᵀX (fp)", unit="batch",
                          disable=not progress):
            _run_model(model, windows[start:start + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()
    return stats


# --- block by block (building blocks of the sequential mode) -----------------------------------

@dataclass
class BlockInputs:
    """What a block is called with: hidden_states [batch, T, hidden] and the other arguments
    (attention mask, rotary position embeddings, ...) exactly as the model passed them."""

    hidden_states: torch.Tensor
    args: tuple
    kwargs: dict
    hidden_in_kwargs: bool = False


@torch.no_grad()
def capture_block_inputs(model: nn.Module, input_ids: torch.Tensor, block_index: int = 0) -> BlockInputs:
    """Run the model up to block `block_index` and return that block's inputs (nothing after it runs)."""
    _, blocks = find_decoder_blocks(model)
    _check_block_indices([block_index], len(blocks))
    seen: dict[str, BlockInputs] = {}

    def hook(module, args, kwargs):
        in_kwargs = not args
        hidden = kwargs["hidden_states"] if in_kwargs else args[0]
        rest_kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        seen["inputs"] = BlockInputs(hidden, tuple(args[1:]), rest_kwargs, in_kwargs)
        raise _StopForward

    handle = blocks[block_index].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _run_model(model, input_ids.to(_model_device(model)))
    finally:
        handle.remove()
    if "inputs" not in seen:
        raise RuntimeError(f"block {block_index} was never called by {type(model).__name__}.forward")
    return seen["inputs"]


@torch.no_grad()
def block_forward(block: nn.Module, inputs: BlockInputs, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
    """Run one block on `hidden_states` [batch, T, hidden] (default: inputs.hidden_states) with the
    other arguments of `inputs`; return its output hidden states [batch, T, hidden]."""
    hidden = inputs.hidden_states if hidden_states is None else hidden_states
    if inputs.hidden_in_kwargs:
        out = block(*inputs.args, hidden_states=hidden, **inputs.kwargs)
    else:
        out = block(hidden, *inputs.args, **inputs.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def accumulate_block_xtx(block: nn.Module, stats: BlockXtx, inputs: BlockInputs,
                         hidden_states: torch.Tensor | None = None) -> torch.Tensor:
    """Run one block on given inputs, adding its sites' XᵀX into `stats`; return the block output.

    This is the step of the sequential mode: feed it the outputs of the already-quantized blocks.
    """
    handles = _site_hooks([(block, stats)])
    try:
        return block_forward(block, inputs, hidden_states)
    finally:
        for handle in handles:
            handle.remove()


# --- artifacts ---------------------------------------------------------------------------------

def block_file_name(block: int) -> str:
    return f"block{block}.npz"


# XᵀX is accumulated in float64 but stored in float32: the quantizer computes in float32 and casts
# it first thing (quant.quantize.quantize_layer), so it sees the same numbers, and the files are
# half as large (Llama-3.2-3B at 128 x 4096 tokens: 10.7 GB instead of 21.4; Llama-3.1-8B: 32.8
# instead of 65.6, more than a 64 GB disk).
STORED_XTX_DTYPE = torch.float32


def save_block_xtx(out_dir: str | os.PathLike, stats: Mapping[int, BlockXtx], source_data_id: str,
                   write_manifest: bool = True) -> pd.DataFrame:
    """Write `block{i}.npz` per block and `manifest.parquet`; return the manifest.

    NPZ keys per site s: "xtx/{s}" [in, in] float32 (STORED_XTX_DTYPE, rounded from the float64
    sums), "linears/{s}" [n] str, "tokens/{s}" [] int64. The manifest has one row per (block,
    site): block, site, linears, in_features, shape, dtype, tokens, sha256 (of the XᵀX bytes), file,
    source_data_id (what calibration data produced it). write_manifest=False: the block files only
    (a caller writing blocks in several calls writes the concatenated manifest itself).
    """
    out_dir = Path(out_dir)
    rows = []
    for i in sorted(stats):
        block_stats = stats[i]
        arrays: dict[str, np.ndarray] = {}
        for site in block_stats.sites:
            xtx = block_stats.xtx[site.site_id].detach().to(STORED_XTX_DTYPE).cpu().numpy()
            arrays[f"xtx/{site.site_id}"] = xtx
            arrays[f"linears/{site.site_id}"] = np.array(site.linears, dtype=str)
            arrays[f"tokens/{site.site_id}"] = np.array(block_stats.tokens[site.site_id], dtype=np.int64)
            rows.append({
                "block": i, "site": site.site_id, "linears": list(site.linears), "in_features": site.in_features,
                "shape": list(xtx.shape), "dtype": str(xtx.dtype), "tokens": block_stats.tokens[site.site_id],
                "sha256": array_sha256(xtx), "file": block_file_name(i), "source_data_id": source_data_id,
            })
        save_npz(out_dir / block_file_name(i), arrays)
    manifest = pd.DataFrame(rows)
    if write_manifest:
        write_parquet(out_dir / MANIFEST_FILE, manifest)
    return manifest


def load_block_xtx(path: str | os.PathLike, block: int | None = None) -> BlockXtx:
    """Read a `block{i}.npz` written by `save_block_xtx` (no pickles are allowed in it)."""
    path = Path(path)
    if block is None:
        stem = path.stem
        if not stem.startswith("block") or not stem[5:].isdigit():
            raise ValueError(f"cannot infer the block index from {path.name}; pass block=")
        block = int(stem[5:])
    with decoding(verified(path), "NPZ file"), np.load(path, allow_pickle=False) as data:
        site_ids = [key[len("xtx/"):] for key in data.files if key.startswith("xtx/")]
        out = BlockXtx(block=block, sites=[])
        for site_id in site_ids:
            xtx = data[f"xtx/{site_id}"]
            out.sites.append(InputSite(site_id, tuple(str(s) for s in data[f"linears/{site_id}"]), xtx.shape[0]))
            out.xtx[site_id] = torch.from_numpy(xtx)
            out.tokens[site_id] = int(data[f"tokens/{site_id}"])
    return out


def load_manifest(out_dir: str | os.PathLike, verify: bool = False) -> pd.DataFrame:
    """The manifest written by `save_block_xtx` (checked against its recorded file checksum); with
    verify=True every block file's checksum and every site's array are checked too (the array as
    a layer job checks it: `site_xtx.read_site_xtx`)."""
    out_dir = Path(out_dir)
    rows = manifest_rows(out_dir)
    if verify:
        for file in sorted({row["file"] for row in rows}):
            verified(out_dir / file)
        for row in rows:
            read_site_xtx(out_dir, row)
    return pd.DataFrame(rows)
