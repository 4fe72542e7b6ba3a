"""Per-rule costs of a Snakemake run, from the benchmark file every rule writes per job.

    python benchmarks/stage_times.py logs/benchmarks [--json stage_times.json]

Reads every `<rule>/....tsv` under the folder (see aqflow.experiments.job_benchmarks): for each rule, jobs (and
how many were measured), the sum, median and largest job wall time, its span (first job start to
last job end: shorter than the sum when jobs ran in parallel), summed CPU seconds and the largest
peak RSS; then the first job start to the last job end of all of them. A job that was killed wrote
no benchmark file and is not counted.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from aqflow.experiments.job_benchmarks import benchmark_files, job_table, rule_table, run_span_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the benchmark folder (logs/benchmarks)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    files = benchmark_files(args.root)
    if not files:
        parser.error(f"no benchmark .tsv files under {args.root}")
    jobs = job_table(files, args.root)
    rules = rule_table(jobs)
    total = run_span_seconds(jobs)

    def fmt(value: float) -> str:
        return "-" if math.isnan(value) else f"{value:.0f}"

    print(f"{'rule':<20}{'jobs':>6}{'span s':>10}{'sum s':>10}{'median s':>10}{'max s':>8}{'max RSS MiB':>13}")
    for row in rules.itertuples():
        print(f"{row.rule:<20}{row.jobs:>6}{fmt(row.span_seconds):>10}{fmt(row.wall_seconds_sum):>10}"
              f"{fmt(row.wall_seconds_median):>10}{fmt(row.wall_seconds_max):>8}{fmt(row.max_rss_mib):>13}")
    print("no measured job" if math.isnan(total) else f"first job start to last job end: {total:.0f} s")
    if args.json:
        records = [{key: (None if isinstance(value, float) and math.isnan(value) else value)
                    for key, value in row.items()} for row in rules.to_dict("records")]
        payload = {"rules": records, "first_start_to_last_end_seconds": None if math.isnan(total) else total}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
