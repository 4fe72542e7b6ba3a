"""Experiment tables: mean ± sd over seeds per grid cell, with the paper's numbers beside ours."""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

GROUP = ("model", "bpp", "geometry", "init", "beam", "max_epochs")
PAPER_KEYS = ("bpp", "init", "beam", "max_epochs")  # what our cells and the paper's rows share


def seed_statistics(frame: pd.DataFrame, metrics: Sequence[str], group: Sequence[str] = GROUP) -> pd.DataFrame:
    """Per group of runs that differ only by seed: `<metric>_mean`, `<metric>_sd` (sample sd; NaN
    for one seed) and `seeds`. Groups are sorted; metrics absent from `frame` are skipped."""
    present = [metric for metric in metrics if metric in frame]
    grouped = frame.groupby(list(group), dropna=False)
    stats = grouped[present].agg(["mean", "std"])
    stats.columns = [f"{metric}_{'sd' if stat == 'std' else stat}" for metric, stat in stats.columns]
    stats["seeds"] = grouped["seed"].nunique() if "seed" in frame else grouped.size()
    return stats.reset_index()


def mean_sd_text(mean: float, sd: float, digits: int = 2) -> str:
    """12.345, 0.5 -> "12.35 ± 0.50"; one seed (sd NaN) -> "12.35"; no runs -> "missing"."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "missing"
    if sd is None or (isinstance(sd, float) and math.isnan(sd)):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def with_paper(ours: pd.DataFrame, paper: pd.DataFrame, metrics: Sequence[str],
               on: Sequence[str] = PAPER_KEYS) -> pd.DataFrame:
    """Our per-cell statistics with the paper's value of each metric beside it (`paper_<metric>`),
    matched on `on` (not on the model: the paper's are larger models)."""
    paper_columns = {metric: f"paper_{metric}" for metric in metrics if metric in paper}
    reference = paper[list(on) + list(paper_columns)].rename(columns=paper_columns)
    reference = reference.drop_duplicates(subset=list(on))
    return ours.merge(reference, on=list(on), how="left")


def markdown_table(frame: pd.DataFrame, metrics: Sequence[str], labels: dict[str, str] | None = None,
                   keys: Sequence[str] = GROUP, digits: int = 2) -> str:
    """A Markdown table: the key columns, "mean ± sd" per metric, seeds, and paper columns if present."""
    labels = labels or {}
    header = [*keys]
    for metric in metrics:
        header.append(labels.get(metric, metric))
        if f"paper_{metric}" in frame:
            header.append(f"paper {labels.get(metric, metric)}")
    header.append("seeds")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in frame.iterrows():
        cells = [_plain(row[key]) for key in keys]
        for metric in metrics:
            cells.append(mean_sd_text(row.get(f"{metric}_mean"), row.get(f"{metric}_sd"), digits))
            if f"paper_{metric}" in frame:
                cells.append(_plain(row[f"paper_{metric}"]))
        cells.append(_plain(row.get("seeds")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plain(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def frame_markdown(frame: pd.DataFrame, digits: int = 3) -> str:
    """Any frame as a Markdown table (numbers to `digits` significant figures, NaN as blank)."""
    header = [str(column) for column in frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in frame.iterrows():
        cells = [_plain(value) if not isinstance(value, float) or value.is_integer() or value != value
                 else f"{value:.{digits}g}" for value in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
