"""Per-rule wall times of a Snakemake run, read from Snakemake's own log.

    python benchmarks/stage_times.py .snakemake/log/<run>.snakemake.log [...] --json stage_times.json

A job starts at the "[timestamp]" line above its "rule <name>:" header and ends at the
"[timestamp]" above "Finished jobid: <id>". Several logs (a run resumed across calls) are read in
order; a job that was started but never finished (killed) is counted as unfinished.
For each rule: jobs finished, wall span (first start to last finish), the sum and median of the
job durations (the span is shorter than the sum when jobs ran in parallel).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?(?:checkpoint|rule) (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)")


def parse_jobs(text: str, run: int = 0) -> list[dict]:
    """One dict per job of one log: rule, jobid, start/end datetimes (end None if unfinished)."""
    jobs: dict[tuple[int, int], dict] = {}
    stamp = pending_rule = None
    for line in text.splitlines():
        if match := STAMP.match(line):
            stamp = datetime.strptime(match.group(1), "%a %b %d %H:%M:%S %Y")
        elif match := RULE.match(line):
            pending_rule = (match.group(1), stamp)
        elif (match := JOBID.match(line)) and pending_rule is not None:
            rule, started = pending_rule
            jobs[(run, int(match.group(1)))] = {"rule": rule, "jobid": int(match.group(1)), "start": started, "end": None}
            pending_rule = None
        elif match := FINISHED.match(line):
            job = jobs.get((run, int(match.group(1))))
            if job is not None:
                job["end"] = stamp
    return list(jobs.values())


def summarise(jobs: list[dict]) -> list[dict]:
    """Per rule, in order of first start: jobs, unfinished, span_seconds, sum/median job seconds."""
    rules: dict[str, list[dict]] = {}
    for job in sorted(jobs, key=lambda j: j["start"]):
        rules.setdefault(job["rule"], []).append(job)
    rows = []
    for rule, group in rules.items():
        done = [j for j in group if j["end"] is not None]
        seconds = [(j["end"] - j["start"]).total_seconds() for j in done]
        span = (max(j["end"] for j in done) - min(j["start"] for j in done)).total_seconds() if done else None
        rows.append({"rule": rule, "jobs": len(done), "unfinished": len(group) - len(done), "span_seconds": span,
                     "sum_job_seconds": sum(seconds), "median_job_seconds": statistics.median(seconds) if seconds else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    jobs = [job for run, path in enumerate(args.logs) for job in parse_jobs(path.read_text(), run)]
    rows = summarise(jobs)
    starts = [j["start"] for j in jobs]
    ends = [j["end"] for j in jobs if j["end"] is not None]
    total = (max(ends) - min(starts)).total_seconds() if ends else None
    print(f"{'rule':<20}{'jobs':>6}{'killed':>8}{'span s':>10}{'sum s':>10}{'median s':>10}")
    for row in rows:
        fmt = lambda v: f"{v:.0f}" if v is not None else "-"  # noqa: E731
        print(f"{row['rule']:<20}{row['jobs']:>6}{row['unfinished']:>8}{fmt(row['span_seconds']):>10}"
              f"{fmt(row['sum_job_seconds']):>10}{fmt(row['median_job_seconds']):>10}")
    print(f"first job start to last job end: {total:.0f} s" if total is not None else "no finished job")
    if args.json:
        args.json.write_text(json.dumps({"rules": rows, "first_start_to_last_end_seconds": total}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
