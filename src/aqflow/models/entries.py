"""Model entries of config.yaml's `models:` section, and what fetch_model is told about them.

An entry names where a model comes from, exactly one of:
    preset: NAME        a named preset (models/presets.py; `tiny` is a seeded random Llama)
    hub_id: ORG/NAME    any hub model, optional `revision:` (branch, tag or commit; default main)
    path: DIR           a local Hugging Face model folder (config.json, safetensors, tokenizer)
and optionally `dtype:` (float16, bfloat16, float32), the dtype the model is stored in and every
stage computes in on a GPU; without it, the model's own (config.json's dtype/torch_dtype).

Pure Python (no torch), so the Snakefile can parse and check entries while it builds the DAG.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .folder import CONFIG_FILE, read_config
from .hub import cached_config
from .presets import PRESETS
from .support import config_problems

SOURCE_KEYS = ("preset", "hub_id", "path")
TINY_PRESET = "tiny"


@dataclass(frozen=True)
class ModelEntry:
    """One `models:` entry. hub_repo is the hub id of hub presets and hub_id entries, else None."""

    name: str
    preset: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    path: str | None = None
    dtype: str | None = None
    tiny_layers: int = 2
    tiny_hidden: int = 64

    @property
    def hub_repo(self) -> str | None:
        if self.hub_id:
            return self.hub_id
        preset = PRESETS.get(self.preset or "")
        return preset.hub_id if preset is not None else None

    @property
    def kind(self) -> str:
        """"tiny", "gguf" (a preset from package registries), "hub" or "path"."""
        if self.path:
            return "path"
        if self.hub_repo:
            return "hub"
        return TINY_PRESET if self.preset == TINY_PRESET else "gguf"


def parse_model_entry(name: str, entry: Mapping) -> ModelEntry:
    """The ModelEntry of config `models.<name>`; a ValueError names the model and the bad key."""
    given = [key for key in SOURCE_KEYS if entry.get(key)]
    if len(given) != 1:
        raise ValueError(f"models.{name}: give exactly one of {', '.join(SOURCE_KEYS)} (got {given or 'none'})")
    preset = entry.get("preset")
    if preset is not None and preset != TINY_PRESET and preset not in PRESETS:
        raise ValueError(f"models.{name}: unknown preset {preset!r}; known presets: {sorted([*PRESETS, TINY_PRESET])}")
    parsed = ModelEntry(name=name, preset=preset, hub_id=entry.get("hub_id"), revision=entry.get("revision"),
                        path=entry.get("path"), dtype=entry.get("dtype"),
                        tiny_layers=entry.get("tiny_layers", 2), tiny_hidden=entry.get("tiny_hidden", 64))
    if parsed.revision and parsed.kind != "hub":
        raise ValueError(f"models.{name}: `revision` applies to hub models only (hub_id or a hub preset)")
    if parsed.hub_id is not None and parsed.hub_id.count("/") != 1:
        raise ValueError(f"models.{name}: hub_id {parsed.hub_id!r} must look like ORG/NAME")
    return parsed


def entry_problems(entry: ModelEntry, group_size: int, base_dir: str | os.PathLike = ".") -> list[str]:
    """What config.json already says against quantizing this model, without torch or a network:
    a `path` folder that is missing or unsupported, or an unsupported hub model whose config the hub
    cache holds. Models not yet downloaded are checked by fetch_model instead."""
    if entry.kind == "path":
        folder = Path(base_dir) / entry.path
        if not (folder / CONFIG_FILE).is_file():
            return [f"path {folder} is not a Hugging Face model folder (no config.json)"]
        return config_problems(read_config(folder), group_size)
    if entry.kind == "hub":
        config = cached_config(entry.hub_repo, entry.revision)
        return config_problems(config, group_size) if config is not None else []
    return []


def fetch_model_request(entry: ModelEntry, group_size: int) -> dict:
    """What `aqflow fetch-model` is asked for this entry: the values of its settings (source,
    revision, dtype, tiny sizes, group size) and, for a local folder, its `path`. Keys left out take
    the stage's defaults."""
    if entry.kind == "path":
        request: dict = {"path": str(Path(entry.path).resolve())}
    elif entry.hub_id:
        request = {"hub_id": entry.hub_id}
    else:
        request = {"preset": entry.preset}
    if entry.revision:
        request["revision"] = entry.revision
    if entry.dtype:
        request["dtype"] = entry.dtype
    if entry.kind == TINY_PRESET:
        request.update(tiny_layers=entry.tiny_layers, tiny_hidden=entry.tiny_hidden)
    return request | {"group_size": group_size}
