"""The input widths of a model's decoder-block linears, known before any job runs, and the first
layer a quantization group size does not divide.

A code covers `group_size` consecutive input weights, so every quantized linear's in_features must
be a multiple of the group size of every geometry it is quantized with (a variant such as
`g6m2k64-b8` brings its own). The widths come, best first, from the model folder fetch-model wrote
(its safetensors headers: every linear, exactly), else from config.json (a local folder, a hub
model in the hub cache, or the `tiny` preset's own) for the Llama layout the supported families
share (q/k/v/gate/up read hidden_size, o_proj heads x head_dim, down_proj intermediate_size), else
they are unknown until the model is fetched (fetch-model checks the configured group size).

Pure Python (json only): the Snakefile calls it while it builds the DAG.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from .entries import TINY_PRESET, ModelEntry
from .folder import BLOCK_NUMBER, CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, read_config
from .hub import cached_config

# model types whose decoder blocks are laid out as Llama's (attention q/k/v/o, MLP gate/up/down)
LLAMA_LAYOUT = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3", "olmo", "olmo2",
                "granite", "phi3", "smollm3", "cohere", "stablelm", "internlm2", "deepseek"}
# the tiny preset's shape besides its entry's hidden size and block count (fetch-model's build)
TINY_HEADS, TINY_KV_HEADS = 4, 2
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _header(path: Path) -> dict:
    """The JSON header of a safetensors file ({} if unreadable: the stage that reads it says why)."""
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            return json.loads(handle.read(size)) if 0 < size <= (1 << 30) else {}
    except (OSError, ValueError):
        return {}


def folder_widths(model_dir: str | os.PathLike) -> list[tuple[str, int]] | None:
    """[(module name, in_features)] of every 2-D weight inside a decoder block of a fetched model
    folder, in block order then name order; None without weights."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            files = sorted({model_dir / shard for shard in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError):
            return None
    elif (model_dir / WEIGHTS_FILE).is_file():
        files = [model_dir / WEIGHTS_FILE]
    else:
        return None
    widths = []
    for path in files:
        for name, entry in _header(path).items():
            if not name.endswith(".weight") or not isinstance(entry, Mapping) or len(entry.get("shape", [])) != 2:
                continue
            module = name[: -len(".weight")]
            match = BLOCK_NUMBER.match(module)
            if match and "embed" not in module and "lm_head" not in module:
                widths.append((int(match.group(1)), module, int(entry["shape"][1])))
    return [(module, width) for _, module, width in sorted(widths)] or None


def config_widths(config: Mapping) -> list[tuple[str, int]] | None:
    """The same from config.json, for the Llama layout (block 0 stands for every block); None for
    another layout or missing sizes."""
    config = config.get("text_config", config) if isinstance(config.get("text_config"), Mapping) else config
    if config.get("model_type") not in LLAMA_LAYOUT:
        return None
    hidden, intermediate, heads = (config.get(key) for key in ("hidden_size", "intermediate_size", "num_attention_heads"))
    if not all(isinstance(value, int) and value > 0 for value in (hidden, intermediate, heads)):
        return None
    head_dim = config.get("head_dim") or hidden // heads
    inputs = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim,
              "gate_proj": hidden, "up_proj": hidden, "down_proj": intermediate}
    return ([(f"model.layers.0.self_attn.{name}", inputs[name]) for name in _ATTENTION]
            + [(f"model.layers.0.mlp.{name}", inputs[name]) for name in _MLP])


def tiny_config(entry: ModelEntry) -> dict:
    """The config.json fetch-model writes for the `tiny` preset (the sizes that matter here)."""
    hidden = entry.tiny_hidden
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": TINY_HEADS, "num_key_value_heads": TINY_KV_HEADS,
            "num_hidden_layers": entry.tiny_layers}


def linear_widths(entry: ModelEntry, model_dir: str | os.PathLike) -> tuple[list[tuple[str, int]], str] | None:
    """The widths of a model's block linears and where they were read, or None while unknown."""
    found = folder_widths(model_dir)
    if found:
        return found, f"{model_dir}'s weights"
    if entry.kind == "path" and (Path(entry.path) / CONFIG_FILE).is_file():
        config, where = read_config(entry.path), f"{entry.path}/{CONFIG_FILE}"
    elif entry.kind == "hub":
        config, where = cached_config(entry.hub_repo, entry.revision), f"{entry.hub_repo}'s {CONFIG_FILE}"
    elif entry.kind == TINY_PRESET:
        config, where = tiny_config(entry), "the tiny preset"
    else:
        return None
    widths = config_widths(config) if config else None
    return (widths, where) if widths else None


def first_undivided(widths: list[tuple[str, int]], group_size: int) -> tuple[str, int] | None:
    """The first (module, in_features) whose width `group_size` does not divide, or None."""
    return next(((module, width) for module, width in widths if width % group_size), None)
