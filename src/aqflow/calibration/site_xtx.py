"""The XᵀX of one linear from a calibration folder, reading and verifying only what it needs.

A layer job needs one array of one block file. It checks the manifest (small) against its
recorded checksum, finds the layer's input site there, decodes that one array and compares its
sha256, dtype and shape with the manifest's: the bytes it computes on are verified, without
hashing the whole block file (all sites of a block: ~0.8 GB at Llama-3B shapes) in every job.
Any mismatch or undecodable file is reported as the whole file's checksum error where the file
disagrees with its record (the same message as a whole-file check). Light on purpose: numpy and
pyarrow only (no pandas, no torch.nn), since every layer job imports it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from aqflow.io.artifacts import ArtifactError, decoding, redo_hint, verified

MANIFEST_FILE = "manifest.parquet"


def array_sha256(array: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (dtype and shape are recorded beside it)."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def manifest_rows(calibration_dir: str | os.PathLike) -> list[dict]:
    """The rows of a calibration folder's manifest (checked against its recorded checksum)."""
    import pyarrow.parquet

    path = verified(Path(calibration_dir) / MANIFEST_FILE)
    # ParquetFile, not read_table: the latter goes through pyarrow.dataset, which imports pandas (~0.3 s)
    with decoding(path, "Parquet file"), pyarrow.parquet.ParquetFile(path) as manifest:
        return manifest.read().to_pylist()


def site_row(calibration_dir: str | os.PathLike, block: int, linear: str) -> dict | None:
    """The manifest row of the input site of `linear` (name inside the block) of block `block`, or None."""
    for row in manifest_rows(calibration_dir):
        if row["block"] == block and linear in row["linears"]:
            return row
    return None


def read_site_xtx(calibration_dir: str | os.PathLike, row: dict) -> np.ndarray:
    """XᵀX [in, in] of the site of manifest row `row`, its sha256, dtype and shape checked
    against the row; ArtifactError naming the block file otherwise."""
    path = Path(calibration_dir) / row["file"]
    key = f"xtx/{row['site']}"
    try:
        with decoding(path, "NPZ file"), np.load(path, allow_pickle=False) as archive:
            array = archive[key]
    except (ArtifactError, KeyError, ValueError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        verified(path)  # a file that changed since it was written: the whole-file error names it
        raise
    found = (array_sha256(array), str(array.dtype), list(array.shape))
    expected = (row["sha256"], row["dtype"], list(row["shape"]))
    if found != expected:
        verified(path)
        raise ArtifactError(f"{path}: corrupt: XᵀX of site {row['site']!r} has sha256 {found[0][:16]}... "
                            f"{found[1]} {found[2]}, the manifest says {expected[0][:16]}... {expected[1]} "
                            f"{expected[2]}; " + redo_hint(Path(calibration_dir)))
    return array
