"""Reading single tensors from a Hugging Face model folder (one file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from aqflow.artifacts import decoding, read_json, verified


def weight_file(model_dir: str | Path, key: str) -> Path:
    """The safetensors file of `model_dir` that holds tensor `key`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index)["weight_map"]
        if key not in weight_map:
            raise KeyError(f"{model_dir}: no tensor {key!r} in {index.name}")
        return model_dir / weight_map[key]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
    return single


def load_model_tensor(model_dir: str | Path, key: str) -> torch.Tensor:
    """Tensor `key` (e.g. `model.layers.0.self_attn.q_proj.weight`) of a model folder."""
    path = verified(weight_file(model_dir, key), required=False)  # a hand-made model folder has no record
    with decoding(path, "safetensors file"), safe_open(str(path), framework="pt") as handle:
        if key not in handle.keys():
            raise KeyError(f"{path}: no tensor {key!r}")
        return handle.get_tensor(key)
