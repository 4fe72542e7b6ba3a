"""One row per evaluated run of the grid, with what the claims group and pair on.

Built on the report's summary row (`aqflow.experiments.reporting.summary_row`), plus the columns a grid needs:
the quantizer seed, the bit-rate geometry (group size, codebooks, codewords) and the model-level ρ:
the median over the quantized layers, the largest layer's, and the mean weighted by parameters.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Iterable

import pandas as pd

from aqflow.experiments.reporting import pipeline_settings, summary_row


# a variant folder that names its geometry ("g6m2k64-b8"): one of a rho sweep, not its bit rate's own
GEOMETRY_LABEL = re.compile(r"g\d+m\d+k\d+-")


def geometry_name(group_size: int, num_codebooks: int, nbits: int) -> str:
    """8, 2, 8 -> "g8m2k256" (group size, codebooks, codewords per codebook)."""
    return f"g{group_size}m{num_codebooks}k{1 << nbits}"


def parameter_weighted_rho(rhos: list[float]) -> float | None:
    """The layers' ρ = N / K^M averaged with each layer's parameter count as its weight (None for
    no layers). At one geometry a layer's parameters are g x N = g x K^M x ρ, so the weights are
    the ρ themselves: sum(ρ²) / sum(ρ)."""
    if not rhos:
        return None
    return sum(rho * rho for rho in rhos) / sum(rhos)


def run_row(path: str | Path) -> dict:
    """One eval.json -> the summary row plus seed, geometry and rho (None where not quantized)."""
    row = summary_row(path)
    settings = pipeline_settings(json.loads(Path(path).read_text()))
    quantizer = settings.get("quantizer") or {}
    layers = settings.get("layers") or []
    rhos = [layer["rho"] for layer in layers if layer.get("rho") is not None]
    row["seed"] = quantizer.get("seed")
    row["geometry"] = (geometry_name(quantizer["group_size"], quantizer["num_codebooks"], quantizer["nbits"])
                       if "num_codebooks" in quantizer and "nbits" in quantizer else None)
    row["rho"] = statistics.median(rhos) if rhos else None
    row["rho_largest"] = max(rhos) if rhos else None
    row["rho_weighted"] = parameter_weighted_rho(rhos)
    row["bit_rate_geometry"] = row["geometry"] is not None and not GEOMETRY_LABEL.match(Path(path).parent.name)
    # code bits per weight of the geometry (scales and codebooks aside): M * log2 K / g
    row["nominal_bits"] = (quantizer["num_codebooks"] * quantizer["nbits"] / quantizer["group_size"]
                           if row["geometry"] else None)
    return row


def at_bit_rate_geometry(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs at their bit rate's own geometry (config `bitrates`; variant folders that name no
    other geometry). Every claim, table row and plot compares these, except those about ρ, which
    compare the geometries of one bit rate; pooled with a ρ sweep's runs, a "2 bpp b8" cell would
    average three geometries. A frame without the column is taken whole."""
    if "bit_rate_geometry" not in runs:
        return runs
    return runs[runs["bit_rate_geometry"].fillna(False).astype(bool)]


def runs_table(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Every run's row; quantized runs only have an init of greedy/oaem (fp baselines say "fp")."""
    return pd.DataFrame([run_row(path) for path in paths])


def after_pv_where_tuned(runs: pd.DataFrame) -> pd.DataFrame:
    """`runs` with the after-PV numbers (every perplexity column but the pre_pv_ ones, and avg_acc)
    blanked for quantized runs that were never PV-tuned (eval_pre_pv.json): their numbers are
    their pre-PV ones (reporting.pv_columns), and in the paper's tables and claims a cell that did
    not reach PV-tuning must not stand in for one after it. fp baselines keep theirs."""
    if not len(runs) or "pv_tuned" not in runs:
        return runs
    untuned = runs["init"].notna() & (runs["init"] != "fp") & ~runs["pv_tuned"].fillna(False).astype(bool)
    after = [c for c in runs.columns if (c.endswith("_ppl") and not c.startswith("pre_pv_")) or c == "avg_acc"]
    runs = runs.copy()
    runs.loc[untuned, after] = None
    return runs


def missing_cells(expected: list[dict]) -> list[dict]:
    """The expected cells (dicts with an `eval_json` path) whose eval.json does not exist yet."""
    return [cell for cell in expected if not Path(cell["eval_json"]).is_file()]


def grid_evals(evals: Iterable[str | Path], expected: list[dict]) -> list[Path]:
    """The given eval.json files and every expected cell's that exists, each once, in order."""
    paths = [Path(path) for path in evals] + [Path(cell["eval_json"]) for cell in expected]
    return list(dict.fromkeys(path for path in paths if path.is_file()))
