"""Calibration: per-block XᵀX of every input site, from calibration token windows."""

from .hessians import (
    BlockInputs,
    BlockXtx,
    InputSite,
    accumulate_block_xtx,
    accumulate_xtx,
    array_sha256,
    block_forward,
    capture_block_inputs,
    collect_xtx_fp,
    discover_input_sites,
    group_linears_by_input,
    load_block_xtx,
    load_manifest,
    save_block_xtx,
)

__all__ = [
    "BlockInputs", "BlockXtx", "InputSite", "accumulate_block_xtx", "accumulate_xtx", "array_sha256",
    "block_forward", "capture_block_inputs", "collect_xtx_fp", "discover_input_sites", "group_linears_by_input", "load_block_xtx", "load_manifest", "save_block_xtx",
]
