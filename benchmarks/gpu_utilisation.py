"""How busy each card of a node was while a rule's jobs ran, from an nvidia-smi sample log.

    python -m benchmarks.gpu_utilisation gpu_utilisation.csv logs/benchmarks [--rule quantize_layer] [--json out.json] \
        [--plot out.png]

The CSV is what benchmarks/gpu_pipeline.sh samples twice a second while Snakemake runs
(`nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,nounits`).
The window is the rule's span in the jobs' benchmark files (first job start to last job end, as
aqflow.experiments.job_benchmarks reads them). For each card: samples in the window, the share of samples
with the card busy (utilization > 0), mean utilization and peak memory. Both clocks are the node's.
"""

from __future__ import annotations

import argparse
import csv
import json
from datetime import datetime
from pathlib import Path

from aqflow.experiments.job_benchmarks import benchmark_files, job_table


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


def rolling_mean(values: list[float], width: int) -> list[float]:
    """values [n] -> their mean over the last `width` samples at each index [n] (fewer at the start)."""
    means, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - width] if index >= width else 0.0)
        means.append(total / min(index + 1, width))
    return means


def plot_cards(samples: list[dict], start: datetime, end: datetime, rule: str, path: Path,
               smooth_seconds: float = 10.0) -> None:
    """One line per card: utilisation over the whole log (a rolling mean of `smooth_seconds`), the
    rule's span shaded; x in seconds from the first sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(sample["time"] for sample in samples)
    cards: dict[str, list[dict]] = {}
    for sample in samples:
        cards.setdefault(sample["card"], []).append(sample)
    width = max(1, round(smooth_seconds / 0.5))  # samples come twice a second
    figure, axis = plt.subplots(figsize=(9, 3.6))
    axis.axvspan((start - origin).total_seconds(), (end - origin).total_seconds(), color="0.9",
                 label=f"{rule} jobs running")
    for card in sorted(cards, key=int):
        group = cards[card]
        axis.plot([(sample["time"] - origin).total_seconds() for sample in group],
                  rolling_mean([sample["utilisation"] for sample in group], width), lw=1, label=f"card {card}")
    axis.set_xlabel("seconds since the first sample")
    axis.set_ylabel(f"utilisation %, {smooth_seconds:g} s mean")
    axis.set_ylim(0, 100)
    axis.legend(loc="upper right", fontsize=8, ncol=len(cards) + 1)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", type=Path)
    parser.add_argument("benchmarks", type=Path, help="the jobs' benchmark folder (logs/benchmarks)")
    parser.add_argument("--rule", default="quantize_layer")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="a PNG of every card's utilisation over time")
    args = parser.parse_args(argv)
    start, end = rule_window(args.benchmarks, args.rule)
    samples = read_samples(args.samples)
    rows = per_card(samples, start, end)
    if args.plot:
        plot_cards(samples, start, end, args.rule, args.plot)
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


if __name__ == "__main__":
    raise SystemExit(main())
