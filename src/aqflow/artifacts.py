"""Atomic artifact writers: every file appears whole or not at all.

Each writer saves to a temporary file in the destination folder, flushes it to disk and renames
it over the target, so a crash or a killed cluster job never leaves a half-written artifact that a
later run would mistake for a finished one. Formats are safetensors, NPZ, Parquet and JSON: no pickles.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `target`; rename it onto `target` if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)  # mkstemp makes files private; artifacts are shared like any other output
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a fresh staging folder next to `target`; if the block succeeds it replaces `target`
    (replace=False: refuse an existing one), else it is removed. A crash never leaves a half folder."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not replace:
        raise FileExistsError(f"{target} exists")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; output folders are shared like any other output
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def write_json(target: str | os.PathLike, payload: Any) -> None:
    """Write `payload` as indented JSON, atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def save_safetensors(target: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Save a dict of torch tensors as safetensors, atomically (tensors are made contiguous)."""
    from safetensors.torch import save_file

    with atomic_path(target) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=dict(metadata or {}))


def save_npz(target: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Save named numpy arrays as an uncompressed NPZ, atomically."""
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)


def write_parquet(target: str | os.PathLike, frame) -> None:
    """Write a pandas DataFrame as Parquet (pyarrow), atomically."""
    with atomic_path(target) as tmp:
        frame.to_parquet(tmp, index=False)
