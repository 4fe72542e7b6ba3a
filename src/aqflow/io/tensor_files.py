"""Reading tensors from the files stages exchange (safetensors and NPZ), with errors that name the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aqflow.io.artifacts import ArtifactError, decoding, verified


def load_tensor(path: str | Path, key: str | None = None, verify: bool = False) -> torch.Tensor:
    """One tensor from a .safetensors or .npz file. With key=None the file must hold exactly one tensor.
    verify=True: the file must match its recorded sha256 (pipeline artifacts); hand-made inputs
    of `quantize-layer --weight/--xtx` have no record."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if verify:
        verified(path)
    if path.suffix == ".npz":
        with decoding(path, "NPZ file"), np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
            name = _pick(path, names, key)
            return torch.from_numpy(np.array(archive[name]))
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with decoding(path, "safetensors file"), safe_open(str(path), framework="pt") as handle:
            name = _pick(path, list(handle.keys()), key)
            return handle.get_tensor(name)
    raise ArtifactError(f"{path}: unsupported tensor file type {path.suffix!r} (use .safetensors or .npz)")


def _pick(path: Path, names: list[str], key: str | None) -> str:
    if key is None:
        if len(names) != 1:
            raise ArtifactError(f"{path} holds {len(names)} tensors ({', '.join(sorted(names)[:8])}...): name one with a key")
        return names[0]
    if key not in names:
        raise ArtifactError(f"{path} has no tensor {key!r}; it has: {', '.join(sorted(names)[:20])}")
    return key
