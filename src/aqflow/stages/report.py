"""`python -m aqflow report`: summary table (CSV + Parquet) and plots from eval.json files.

Where speed was measured (`aqflow speed`), the speed.json beside an eval.json adds its row's speed
and memory columns and a point to the speed figure."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aqflow.io import artifacts
from aqflow.experiments import job_benchmarks
from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import verify_inputs
from aqflow.experiments.reporting import plot_layers, plot_pareto, plot_pv_curves, plot_speed, summary_table
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "report"
INPUT_ERRORS = EXPECTED_ERRORS


@dataclass(frozen=True)
class ReportSettings:
    """The report has no knobs: what it shows follows from the eval.json files."""


@dataclass(frozen=True)
class ReportPaths:
    evals: tuple[Path, ...] = field(metadata=option("eval.json files", positional=True, nargs="+"))
    csv: Path = field(metadata=option("summary table .csv to write"))
    parquet: Path = field(metadata=option("summary table .parquet to write"))
    pareto: Path = field(metadata=option("perplexity against bits plot .png to write"))
    layers: Path = field(metadata=option("per-layer plot .png to write"))
    pv_curves: Path | None = field(default=None, metadata=option("PV-tuning curves .png to write"))
    pv_logs: tuple[Path, ...] = field(default=(), metadata=option("PV-tuning train_log.parquet files"))
    speeds: tuple[Path, ...] = field(default=(), metadata=option(
        "speed.json files (aqflow speed), each in the folder of one of the eval.json files: its row's speed columns"))
    speed_plot: Path | None = field(default=None, metadata=option(
        "perplexity against decode speed and weight memory .png to write"))
    stage_times: Path | None = field(default=None, metadata=option(
        "per-rule costs .csv to write, from the jobs' benchmark files"))
    benchmarks: tuple[Path, ...] = field(default=(), metadata=option(
        "Snakemake benchmark .tsv files of the jobs, under --benchmark-root (those missing are left out: "
        "a job run before benchmark files existed, or whose logs were cleaned)"))
    benchmark_root: Path = field(default=job_benchmarks.BENCHMARK_ROOT, metadata=option(
        "the folder whose first level names the rule"))


def run(settings: ReportSettings, paths: ReportPaths):
    """Every output of the report from the eval.json files; the summary table."""
    verify_inputs(*paths.evals, *paths.pv_logs, *paths.speeds)
    folders = {Path(path).parent for path in paths.evals}
    stray = [str(path) for path in paths.speeds if Path(path).parent not in folders]
    if stray:
        raise StageInputError(f"--speeds {stray}: no eval.json given in the same folder")
    table = summary_table(list(paths.evals), list(paths.speeds))
    artifacts.write_parquet(paths.parquet, table)
    with artifacts.atomic_path(paths.csv) as tmp:
        table.to_csv(tmp, index=False)
    with artifacts.atomic_path(paths.pareto) as tmp:
        plot_pareto(table, tmp)
    with artifacts.atomic_path(paths.layers) as tmp:
        plot_layers(list(paths.evals), tmp)
    if paths.pv_curves is not None:
        with artifacts.atomic_path(paths.pv_curves) as tmp:
            plot_pv_curves(list(paths.pv_logs), tmp)
    if paths.speed_plot is not None:
        with artifacts.atomic_path(paths.speed_plot) as tmp:
            plot_speed(table, tmp)
    if paths.stage_times is not None:
        jobs = job_benchmarks.job_table([path for path in paths.benchmarks if Path(path).is_file()], paths.benchmark_root)
        with artifacts.atomic_path(paths.stage_times) as tmp:
            job_benchmarks.rule_table(jobs).to_csv(tmp, index=False)
    return table


def summary(table) -> str:
    return table.to_string(index=False)


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
