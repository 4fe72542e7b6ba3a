"""Calibration: per-block XᵀX of every input site, from calibration token windows.

Names are imported on first use (PEP 562), so that a layer job's reader (`site_xtx`) loads
without the collection code (pandas, torch.nn).
"""

from importlib import import_module

_EXPORTS = {name: "hessians" for name in (
    "BlockInputs", "BlockXtx", "InputSite", "accumulate_block_xtx", "accumulate_xtx", "block_forward",
    "capture_block_inputs", "collect_xtx_fp", "discover_input_sites", "group_linears_by_input", "load_block_xtx",
    "load_manifest", "save_block_xtx")} | {"array_sha256": "site_xtx", "read_site_xtx": "site_xtx"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
