"""One row per evaluated run of the grid, with what the claims group and pair on.

Built on the report's summary row (`aqflow.reporting.summary_row`), plus the columns a grid needs:
the quantizer seed, the bit-rate geometry (group size, codebooks, codewords) and the model-level ρ
(median over the quantized layers).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Iterable

import pandas as pd

from ..reporting import pipeline_settings, summary_row


def geometry_name(group_size: int, num_codebooks: int, nbits: int) -> str:
    """8, 2, 8 -> "g8m2k256" (group size, codebooks, codewords per codebook)."""
    return f"g{group_size}m{num_codebooks}k{1 << nbits}"


def run_row(path: str | Path) -> dict:
    """One eval.json -> the summary row plus seed, geometry and rho (None where not quantized)."""
    row = summary_row(path)
    settings = pipeline_settings(json.loads(Path(path).read_text()))
    quantizer = settings.get("quantizer") or {}
    layers = settings.get("layers") or []
    rhos = [layer["rho"] for layer in layers if layer.get("rho") is not None]
    row["seed"] = quantizer.get("seed")
    row["geometry"] = (geometry_name(quantizer.get("group_size", 8), quantizer["num_codebooks"], quantizer["nbits"])
                       if "num_codebooks" in quantizer and "nbits" in quantizer else None)
    row["rho"] = statistics.median(rhos) if rhos else None
    # code bits per weight of the geometry (scales and codebooks aside): M * log2 K / g
    row["nominal_bits"] = (quantizer["num_codebooks"] * quantizer["nbits"] / quantizer.get("group_size", 8)
                           if row["geometry"] else None)
    return row


def runs_table(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Every run's row; quantized runs only have an init of greedy/oaem (fp baselines say "fp")."""
    return pd.DataFrame([run_row(path) for path in paths])


def missing_cells(runs: pd.DataFrame, expected: list[dict]) -> list[dict]:
    """The expected cells (dicts of model, bpp, init, beam, max_epochs, seed) with no run in `runs`."""
    keys = ("model", "bpp", "init", "beam", "max_epochs", "seed")
    have = {tuple(_comparable(row[k]) for k in keys) for _, row in runs.iterrows()} if len(runs) else set()
    return [cell for cell in expected if tuple(_comparable(cell.get(k)) for k in keys) not in have]


def _comparable(value):
    """8.0 (a float column: fp rows hold NaN) and 8 compare equal as keys."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
