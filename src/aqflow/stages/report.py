"""`python -m aqflow report`: summary table (CSV + Parquet) and plots from eval.json files, and
what each rule's jobs cost from their Snakemake benchmark files."""

from __future__ import annotations

import argparse
from pathlib import Path

from aqflow import artifacts, job_benchmarks
from aqflow.reporting import plot_layers, plot_pareto, plot_pv_curves, summary_table
from aqflow.artifacts import verify_inputs
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aqflow report", description=__doc__)
    parser.add_argument("evals", nargs="+", type=Path, help="eval.json files")
    parser.add_argument("--csv", required=True, type=Path)
    parser.add_argument("--parquet", required=True, type=Path)
    parser.add_argument("--pareto", required=True, type=Path)
    parser.add_argument("--layers", required=True, type=Path)
    parser.add_argument("--pv-curves", type=Path, default=None, help="PV-tuning curves .png to write")
    parser.add_argument("--pv-logs", nargs="*", type=Path, default=[], help="PV-tuning train_log.parquet files")
    parser.add_argument("--stage-times", type=Path, default=None,
                        help="per-rule costs .csv to write, from the --benchmarks files")
    parser.add_argument("--benchmarks", nargs="*", type=Path, default=[],
                        help="Snakemake benchmark .tsv files of the jobs, under --benchmark-root")
    parser.add_argument("--benchmark-root", type=Path, default=job_benchmarks.BENCHMARK_ROOT,
                        help="the folder whose first level names the rule (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        verify_inputs(*args.evals, *args.pv_logs)
        table = write_report(args)
    except (*EXPECTED_ERRORS, KeyError, ValueError) as error:
        return report_error("report", error)
    print(table.to_string(index=False))
    return 0


def write_report(args: argparse.Namespace):
    """Every output of the report from the eval.json files; the summary table."""
    table = summary_table(args.evals)
    artifacts.write_parquet(args.parquet, table)
    with artifacts.atomic_path(args.csv) as tmp:
        table.to_csv(tmp, index=False)
    with artifacts.atomic_path(args.pareto) as tmp:
        plot_pareto(table, tmp)
    with artifacts.atomic_path(args.layers) as tmp:
        plot_layers(args.evals, tmp)
    if args.pv_curves is not None:
        with artifacts.atomic_path(args.pv_curves) as tmp:
            plot_pv_curves(args.pv_logs, tmp)
    if args.stage_times is not None:
        jobs = job_benchmarks.job_table(args.benchmarks, args.benchmark_root)
        with artifacts.atomic_path(args.stage_times) as tmp:
            job_benchmarks.rule_table(jobs).to_csv(tmp, index=False)
    return table
