"""What each pipeline job cost, from the benchmark files Snakemake writes for it.

Every rule has a `benchmark:` file, `logs/benchmarks/<rule>/<the job's wildcards>.tsv` (the path of
its log under `logs/benchmarks/`; `logs/benchmarks/<rule>.tsv` for a rule without wildcards).
Snakemake writes it when the job ends: a header and one row per run of the job (more than one only
under `repeat()`), with the wall time `s` (seconds), the peak resident memory `max_rss`, the CPU
time `cpu_time` (seconds), the data read and written `io_in`/`io_out` (memory and data in MiB, which Snakemake
calls MB) and `mean_load` (CPU %), "NA" where psutil saw nothing (a job shorter than its sampling
interval). The file's modification time is when the job ended, so its start is that minus its
wall time.

These files are Snakemake's, not aqflow artifacts: they carry no checksum, and a missing value reads
as NaN (never as zero).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

import pandas as pd

BENCHMARK_ROOT = Path("logs/benchmarks")
# Snakemake's column -> ours (units in the name), and how repeated runs of one job combine
COLUMNS = {
    "s": ("wall_seconds", "mean"),
    "max_rss": ("max_rss_mib", "max"),
    "cpu_time": ("cpu_seconds", "mean"),
    "io_in": ("io_in_mib", "mean"),
    "io_out": ("io_out_mib", "mean"),
    "mean_load": ("mean_load_percent", "mean"),
}
JOB_COLUMNS = ["rule", "job", *(name for name, _ in COLUMNS.values()), "started_at", "ended_at", "path"]


def rule_and_job(path: str | os.PathLike, root: str | os.PathLike) -> tuple[str, str]:
    """logs/benchmarks/quantize_layer/tiny/2bpp/greedy/b2/model.layers.0.mlp.up_proj.tsv ->
    ("quantize_layer", "tiny/2bpp/greedy/b2/model.layers.0.mlp.up_proj"); logs/benchmarks/report.tsv
    -> ("report", ""). The rule is the first folder under `root`, the job the rest (no suffix)."""
    relative = Path(path).relative_to(root)
    if relative.suffix != ".tsv":
        raise ValueError(f"{path}: a benchmark file ends in .tsv")
    parts = relative.with_suffix("").parts
    return parts[0], "/".join(parts[1:])


def read_job(path: str | os.PathLike, root: str | os.PathLike = BENCHMARK_ROOT) -> dict:
    """One benchmark file -> one job's row (JOB_COLUMNS). An empty file, or a column Snakemake left
    out or wrote as NA, gives NaN; repeated runs are averaged (peak memory: the largest)."""
    path = Path(path)
    rule, job = rule_and_job(path, root)
    try:
        runs = pd.read_csv(path, sep="\t", na_values=["NA", "-"])
    except pd.errors.EmptyDataError:  # created by `snakemake --touch`: no run was measured
        runs = pd.DataFrame()
    row: dict = {"rule": rule, "job": job}
    for column, (name, combine) in COLUMNS.items():
        values = pd.to_numeric(runs[column], errors="coerce") if column in runs else pd.Series(dtype=float)
        row[name] = float(getattr(values, combine)()) if values.notna().any() else math.nan
    row["ended_at"] = path.stat().st_mtime
    row["started_at"] = row["ended_at"] - row["wall_seconds"]
    row["path"] = str(path)
    return row


def benchmark_files(root: str | os.PathLike = BENCHMARK_ROOT) -> list[Path]:
    """Every benchmark file under `root`, sorted."""
    return sorted(Path(root).rglob("*.tsv"))


def job_table(paths: Iterable[str | os.PathLike], root: str | os.PathLike = BENCHMARK_ROOT) -> pd.DataFrame:
    """One row per benchmark file (JOB_COLUMNS), in order of start (unmeasured jobs last)."""
    rows = [read_job(path, root) for path in paths]
    table = pd.DataFrame(rows, columns=JOB_COLUMNS)
    return table.sort_values(["started_at", "rule", "job"], na_position="last", kind="stable").reset_index(drop=True)


def rule_table(jobs: pd.DataFrame) -> pd.DataFrame:
    """Per rule, in order of its first job's start: jobs; measured (jobs with a wall time); the sum,
    median and largest job wall time; span_seconds, its first job's start to its last job's end
    (shorter than the sum when jobs ran in parallel); summed CPU time and IO; the largest peak RSS."""
    rows = []
    for rule, group in jobs.groupby("rule", sort=False):
        wall = group["wall_seconds"].dropna()
        measured = group.dropna(subset=["wall_seconds"])
        rows.append({
            "rule": rule,
            "jobs": len(group),
            "measured": len(wall),
            "wall_seconds_sum": float(wall.sum()) if len(wall) else math.nan,
            "wall_seconds_median": float(wall.median()) if len(wall) else math.nan,
            "wall_seconds_max": float(wall.max()) if len(wall) else math.nan,
            "span_seconds": float(measured["ended_at"].max() - measured["started_at"].min()) if len(wall) else math.nan,
            "cpu_seconds_sum": float(group["cpu_seconds"].sum(min_count=1)),
            "max_rss_mib": float(group["max_rss_mib"].max()),
            "io_in_mib_sum": float(group["io_in_mib"].sum(min_count=1)),
            "io_out_mib_sum": float(group["io_out_mib"].sum(min_count=1)),
        })
    return pd.DataFrame(rows)


def run_span_seconds(jobs: pd.DataFrame) -> float:
    """The first job's start to the last job's end (NaN without a measured job)."""
    measured = jobs.dropna(subset=["wall_seconds"])
    return float(measured["ended_at"].max() - measured["started_at"].min()) if len(measured) else math.nan
