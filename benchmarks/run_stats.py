"""What a Snakemake run cost, from the files every run leaves: per rule from the jobs' benchmark
files, and per card from an nvidia-smi sample log (what benchmarks/gpu_pipeline.sh `wait` writes).

    python -m benchmarks.run_stats stages logs/benchmarks [--json stage_times.json]
    python -m benchmarks.run_stats cards gpu_utilisation.csv logs/benchmarks [--rule quantize_layer] [--json out.json]

`stages`: per rule the jobs measured, the sum, median and largest wall time, the span (shorter than
the sum where jobs ran in parallel), CPU seconds and the largest peak RSS (a killed job wrote no file
and is not counted). `cards`: over the rule's span, per card the share of samples busy, the mean
utilization and the peak memory (both clocks are the node's).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from datetime import datetime
from pathlib import Path

from aqflow.experiments.job_benchmarks import benchmark_files, job_table, rule_table, run_span_seconds


def read_samples(path: Path) -> list[dict]:
    """Rows of the nvidia-smi CSV: {time: datetime, card: str, utilisation: float %, memory_mib: float}."""
    samples = []
    with path.open(newline="") as handle:
        for row in csv.reader(handle):
            if not row or row[0].strip().startswith("timestamp"):
                continue
            try:
                stamp = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
                samples.append({"time": stamp, "card": row[1].strip(), "utilisation": float(row[2]),
                                "memory_mib": float(row[3])})
            except (ValueError, IndexError):
                continue  # a line cut short when the sampler was killed
    return samples


def rule_window(root: Path, rule: str) -> tuple[datetime, datetime]:
    """First start and last end of the rule's measured jobs under the benchmark folder `root`."""
    jobs = job_table(benchmark_files(root), root)
    jobs = jobs[(jobs["rule"] == rule)].dropna(subset=["wall_seconds"])
    if jobs.empty:
        raise SystemExit(f"no measured {rule} job under {root}")
    return datetime.fromtimestamp(jobs["started_at"].min()), datetime.fromtimestamp(jobs["ended_at"].max())


def per_card(samples: list[dict], start: datetime, end: datetime) -> list[dict]:
    """One row per card for the samples in [start, end]."""
    cards: dict[str, list[dict]] = {}
    for sample in samples:
        if start <= sample["time"] <= end:
            cards.setdefault(sample["card"], []).append(sample)
    rows = []
    for card in sorted(cards, key=int):
        group = cards[card]
        rows.append({"card": card, "samples": len(group),
                     "busy_share": sum(s["utilisation"] > 0 for s in group) / len(group),
                     "mean_utilisation": sum(s["utilisation"] for s in group) / len(group),
                     "peak_memory_mib": max(s["memory_mib"] for s in group)})
    return rows


def stages(args, parser) -> int:
    """Per-rule costs of the run: a table, and JSON with --json."""
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


def cards(args, parser) -> int:
    """How busy each card was while the rule's jobs ran: a table, and JSON with --json."""
    start, end = rule_window(args.benchmarks, args.rule)
    samples = read_samples(args.samples)
    rows = per_card(samples, start, end)
    seconds = (end - start).total_seconds()
    print(f"{args.rule}: {start:%H:%M:%S} to {end:%H:%M:%S} ({seconds:.0f} s)")
    print(f"{'card':>4}{'samples':>9}{'busy %':>8}{'mean util %':>13}{'peak MiB':>10}")
    for row in rows:
        print(f"{row['card']:>4}{row['samples']:>9}{100 * row['busy_share']:>8.0f}"
              f"{row['mean_utilisation']:>13.1f}{row['peak_memory_mib']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps({"rule": args.rule, "start": start.isoformat(), "end": end.isoformat(),
                                         "seconds": seconds, "cards": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    by_rule = commands.add_parser("stages", help="per rule, from the jobs' benchmark files")
    by_rule.add_argument("root", type=Path, help="the benchmark folder (logs/benchmarks)")
    by_card = commands.add_parser("cards", help="per card, from an nvidia-smi sample log")
    by_card.add_argument("samples", type=Path)
    by_card.add_argument("benchmarks", type=Path, help="the jobs' benchmark folder (logs/benchmarks)")
    by_card.add_argument("--rule", default="quantize_layer")
    for command in (by_rule, by_card):
        command.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    return (stages if args.command == "stages" else cards)(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
