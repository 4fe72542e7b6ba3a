"""What a headline run cost, rule by rule, from what the run left: Snakemake's job benchmarks, the
GPU/disk samples taken while it ran (`sample`), the outputs' sizes and PV-tuning's log.

    python -m benchmarks.headline_results sample --out samples.csv --disk /root/stage --stop-file F [--interval 1]
    python -m benchmarks.headline_results --work DIR --shape llama3b --card "NVIDIA H100 80GB HBM3" \
        --started-at UNIX_SECONDS --targets T1 T2 T3 [--samples CSV] [--hf-home DIR] [--pv DIR] \
        [--plan-seconds S] [--merge PRE_PV.json] [--out headline.json]
    python -m benchmarks.headline_results --synthetic-pv AFTER_DIR --merge PRE_PV.json --shape llama8b \
        --card "NVIDIA H200" --out headline.json

Writes the JSON of benchmarks/results/headline_<shape>_<card>.json and prints a table:

* `stages`: per rule, `jobs`; `wall_seconds` (first job start to last job end), the sum and median
  of job wall times; `gpu_peak_gib` (the largest sum over the rule's processes in one sample, or,
  where nvidia-smi listed no processes, the card's largest total while a job of the rule ran: an
  upper bound; `gpu_peak_source` says which); `host_peak_rss_gib` (Snakemake's benchmark: the job
  and its children, not a warm worker); `disk_written_bytes` (the rule's outputs, files hard-linked
  to the hub cache counted as 0) and Snakemake's `io_out_mib`.
* `pre_pv_total_seconds`: from `--started-at` (Snakemake started on an empty results/) to the last
  of `--targets` written.
* `pv_step_seconds`: the median training step of the PV-tuning run under `--pv` (the first and those
  holding a held-out evaluation left out); `paper_pv_hours_projected`: the paper budget's steps and
  held-out evaluations at the measured times. A projection, labelled so; everything else is measured.
* `disk_bytes`: results/, resources/ and the hub cache (hard links once), and the file system's peak
  rise during the run.

--pv names the PV-tuning run's folder, of the same run as the pre-PV targets or of a later one
(headline_gpu.sh pv, no --targets; --merge then adds its measurement to the pre-PV record).

`sample` writes, until --stop-file exists, rows `unix_seconds,kind,pid,rule,value` of kind `process`
(MiB a GPU process holds, with the rule it serves), `card` (MiB used on card `pid`) and `disk` (bytes
used on the file system of --disk). A process's rule comes from its or its parents' command line:
Snakemake runs a rule's script as `.snakemake/scripts/tmp<id>.<script>.py`, whose preamble names the
rule; warm workers serve layer jobs only. Where nvidia-smi lists no processes (some container
runtimes hide them), the `card` rows remain and the collection falls back to them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from aqflow.experiments.job_benchmarks import benchmark_files, job_table, rule_table, run_span_seconds

GIB = 2**30

RULES = ("fetch_model", "fetch_data", "calibrate", "calibrate_block", "finetune_block", "quantize_layer", "stitch",
         "evaluate_quantized", "evaluate_fp", "evaluate_pvtuned", "pvtune", "report", "domain_distances",
         "paper_tables")
SCRIPT = re.compile(r"\.snakemake/scripts/tmp[^/\s]*\.([A-Za-z_]+)\.py")


def rule_of_command(cmdline: list[str], script_text: str | None = None) -> str | None:
    """The rule a process serves, from its command line (and its rule script's text, which names
    the rule in its preamble); None for a process that is no rule's."""
    joined = " ".join(cmdline)
    if "aqflow.jobs.warm_workers" in joined:
        return "quantize_layer"
    match = SCRIPT.search(joined)
    if not match:
        return None
    script = match.group(1)
    if script_text:
        named = [rule for rule in RULES if re.search(rf"\b{rule}\b", script_text)]
        # the script's own name is a rule's name too (calibrate.py): prefer the longer, more specific name
        specific = [rule for rule in named if rule != script]
        if script == "evaluate" and specific:
            return max(specific, key=len)
        if script in named:
            return script
    return script


def rule_of_pid(pid: int, cache: dict) -> str | None:
    """The rule of process `pid` or of its nearest ancestor that has one (cached per pid)."""
    if pid in cache:
        return cache[pid]
    import psutil

    rule = None
    try:
        process = psutil.Process(pid)
        for candidate in [process, *process.parents()][:8]:
            cmdline = candidate.cmdline()
            match = SCRIPT.search(" ".join(cmdline))
            text = None
            if match:
                script = Path(candidate.cwd()) / match.group(0)
                text = script.read_text(errors="replace") if script.is_file() else None
            rule = rule_of_command(cmdline, text)
            if rule:
                break
    except (psutil.Error, OSError):
        pass
    cache[pid] = rule
    return rule


def query(fields: str, what: str) -> list[list[str]]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]


def sample(writer, disk: Path, cache: dict, card: str | None = None) -> None:
    """One row per GPU process and per card (only card `card`, nvidia-smi's index, when given: two
    runs on two cards of one machine each sample their own), and one for the disk."""
    now = f"{time.time():.1f}"
    cards = query("index,memory.used,pci.bus_id", "gpu")
    bus = {bus_id for index, _, bus_id in cards if card is None or index == card}
    for pid, used, bus_id in query("pid,used_memory,gpu_bus_id", "compute-apps"):
        if pid.isdigit() and used.isdigit() and bus_id in bus:
            writer.writerow([now, "process", pid, rule_of_pid(int(pid), cache) or "", used])
    for index, used, _ in cards:
        if used.isdigit() and (card is None or index == card):
            writer.writerow([now, "card", index, "", used])
    writer.writerow([now, "disk", "", "", shutil.disk_usage(disk).used])


# (pattern on a path relative to the work folder) -> the rule that writes it, first match wins
OUTPUT_RULES = (
    (re.compile(r"^resources/models/"), "fetch_model"),
    (re.compile(r"^resources/data/"), "fetch_data"),
    (re.compile(r"^results/[^/]+/calib/"), "calibrate"),
    (re.compile(r"^results/[^/]+/fp/"), "evaluate_fp"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/calib/"), "calibrate_block"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/tuned/"), "finetune_block"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/layers/"), "quantize_layer"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/model/"), "stitch"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/pv/"), "pvtune"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/eval_pre_pv\.json"), "evaluate_quantized"),
    (re.compile(r"^results/[^/]+/\d+bpp/[^/]+/[^/]+/eval\.json"), "evaluate_pvtuned"),
    (re.compile(r"^results/report/"), "report"),
)


def rule_of_output(relative: str) -> str | None:
    """The rule whose output a file is (its path relative to the work folder), or None."""
    for pattern, rule in OUTPUT_RULES:
        if pattern.search(relative):
            return rule
    return None


def files_under(folder: Path):
    """(path, (device, inode), size) of every file under `folder` (symlinks not followed)."""
    if folder.is_dir():
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                stat = path.stat()
                yield path, (stat.st_dev, stat.st_ino), stat.st_size


def tree_inodes(folder: Path) -> set[tuple[int, int]]:
    return {key for _, key, _ in files_under(folder)}


def du_bytes(folders: list[Path], seen: set | None = None) -> int:
    """Bytes of the files under `folders`, each inode once (hard links, and inodes in `seen`, skipped)."""
    seen = set() if seen is None else seen
    total = 0
    for folder in folders:
        for _, key, size in files_under(folder):
            if key not in seen:
                seen.add(key)
                total += size
    return total


def output_bytes_per_rule(work: Path, linked: set[tuple[int, int]]) -> dict[str, int]:
    """Bytes each rule's outputs hold under results/ and resources/ (files whose inode is in
    `linked`, the hub cache's, count 0: fetch_model hard-links the cached weights)."""
    totals: dict[str, int] = {}
    for top in ("results", "resources"):
        for path, key, size in files_under(work / top):
            rule = rule_of_output(path.relative_to(work).as_posix())
            if rule is not None:
                totals[rule] = totals.get(rule, 0) + (0 if key in linked else size)
    return totals


def read_samples(path: Path | None) -> pd.DataFrame:
    if path is None or not path.is_file():
        return pd.DataFrame(columns=["unix_seconds", "kind", "pid", "rule", "value"])
    frame = pd.read_csv(path, dtype={"rule": str}, keep_default_na=False)
    frame["unix_seconds"] = pd.to_numeric(frame["unix_seconds"], errors="coerce")
    frame["value"] = pd.to_numeric(frame["value"], errors="coerce")
    return frame


def gpu_peaks(samples: pd.DataFrame, jobs: pd.DataFrame) -> dict[str, tuple[float, str]]:
    """Per rule: (peak GiB on the cards, how it was measured)."""
    peaks: dict[str, tuple[float, str]] = {}
    processes = samples[(samples["kind"] == "process") & (samples["rule"] != "")]
    if len(processes):
        summed = processes.groupby(["unix_seconds", "rule"])["value"].sum().reset_index()
        for rule, group in summed.groupby("rule"):
            peaks[rule] = (float(group["value"].max()) * 2**20 / GIB, "per-process (nvidia-smi compute-apps)")
    cards = samples[samples["kind"] == "card"].groupby("unix_seconds")["value"].sum()
    if len(cards):
        for rule, group in jobs.dropna(subset=["wall_seconds"]).groupby("rule"):
            if rule in peaks:
                continue
            inside = pd.Series(False, index=cards.index)
            for start, end in zip(group["started_at"], group["ended_at"]):
                inside |= (cards.index >= start) & (cards.index <= end)
            if inside.any():
                peaks[rule] = (float(cards[inside].max()) * 2**20 / GIB,
                               "card total while a job of the rule ran (upper bound)")
    return peaks


def disk_peak_rise(samples: pd.DataFrame) -> float | None:
    disk = samples[samples["kind"] == "disk"].sort_values("unix_seconds")["value"]
    return float(disk.max() - disk.iloc[0]) if len(disk) else None


def pv_measurement(pv_dir: Path | None, settings: dict) -> dict:
    """Step time of a short PV-tuning run (its pv/ folder) and the paper budget projected from it."""
    if pv_dir is None or not (pv_dir / "train_log.parquet").is_file():
        return {}
    log = pd.read_parquet(pv_dir / "train_log.parquet").sort_values("seconds").reset_index(drop=True)
    steps, evaluations = [], []
    previous = None  # (split, seconds) of the row before
    for row in log.itertuples():
        if previous is not None:
            interval = row.seconds - previous[1]
            if row.split == "train" and previous[0] == "train":
                steps.append(interval)
            elif row.split != "train":
                evaluations.append(interval)
        previous = (row.split, row.seconds)
    metrics = json.loads((pv_dir / "pvtune.json").read_text()) if (pv_dir / "pvtune.json").is_file() else {}
    timed = steps[1:] if len(steps) > 2 else steps  # the first step pays one-time costs
    step = float(pd.Series(timed).median()) if timed else math.nan
    heldout_rows = int((log["split"] != "train").sum())
    timings = metrics.get("timings") or {}
    if heldout_rows and timings.get("heldout_eval_seconds") is not None:  # the stage times every evaluation
        evaluation = timings["heldout_eval_seconds"] / heldout_rows
    else:
        evaluation = float(pd.Series(evaluations).median()) if evaluations else math.nan
    # a run with fewer held-out windows than the paper's (the synthetic 8B student) is scaled to them:
    # an evaluation's time grows with its windows
    paper_windows = settings.get("heldout_samples")
    heldout_windows = (metrics.get("data") or {}).get("heldout_samples") or paper_windows
    if paper_windows and heldout_windows:
        evaluation *= paper_windows / heldout_windows
    samples, epochs, batch = settings["num_samples"], settings["epochs"], settings["batch_size"]
    paper_steps = math.ceil(samples * epochs / batch)
    paper_evaluations = paper_steps // settings["eval_every_steps"] + 1
    hours = (paper_steps * step + paper_evaluations * (0 if math.isnan(evaluation) else evaluation)) / 3600
    return {
        "pv_step_seconds": step,
        "pv": {"steps_timed": len(timed), "step_seconds": timed, "heldout_evaluation_seconds": evaluation,
               "heldout_windows_timed": heldout_windows,
               "timings": metrics.get("timings"), "peak_memory_allocated_gib": metrics.get("peak_memory_allocated_gib"),
               "micro_batch_size": (metrics.get("settings") or {}).get("micro_batch_size")},
        "paper_pv_hours_projected": hours,
        "paper_pv_projection": {"steps": paper_steps, "heldout_evaluations": paper_evaluations,
                                "from": f"{samples} samples x {epochs} epochs / batch {batch} at the measured step "
                                        f"time, plus a held-out evaluation every {settings['eval_every_steps']} steps"},
    }


def collect(work: Path, shape: str, card: str, started_at: float, targets: list[str], samples_path: Path | None,
            hf_home: Path | None, pv_dir: Path | None, plan_seconds: float | None, pv_settings: dict) -> dict:
    jobs = job_table(benchmark_files(work / "logs" / "benchmarks"), work / "logs" / "benchmarks")
    rules = rule_table(jobs)
    samples = read_samples(samples_path)
    peaks = gpu_peaks(samples, jobs)
    linked = tree_inodes(hf_home / "hub") if hf_home else set()
    written = output_bytes_per_rule(work, linked)
    stages = {}
    for row in rules.to_dict("records"):
        peak = peaks.get(row["rule"])
        stages[row["rule"]] = {
            "jobs": row["jobs"], "wall_seconds": row["span_seconds"], "job_wall_seconds_sum": row["wall_seconds_sum"],
            "job_wall_seconds_median": row["wall_seconds_median"],
            "gpu_peak_gib": peak[0] if peak else None, "gpu_peak_source": peak[1] if peak else None,
            "host_peak_rss_gib": row["max_rss_mib"] / 1024, "disk_written_bytes": written.get(row["rule"]),
            "io_out_mib": row["io_out_mib_sum"],
        }
    done = [work / target for target in targets if (work / target).is_file()]
    hub_bytes = du_bytes([hf_home / "hub"]) if hf_home else None
    record = {
        "card": card, "shape": shape, "targets": targets, "targets_done": len(done),
        "stages": stages,
        "pre_pv_total_seconds": (max(path.stat().st_mtime for path in done) - started_at) if done and len(done) == len(targets) else None,
        "first_job_to_last_job_seconds": run_span_seconds(jobs),
        "dag_plan_seconds": plan_seconds,
        "disk_bytes": {"results": du_bytes([work / "results"]), "resources_new": du_bytes([work / "resources"], set(linked)),
                       "hub_cache": hub_bytes, "peak_rise_during_run": disk_peak_rise(samples)},
        "pv_step_seconds": None, "paper_pv_hours_projected": None,
    }
    if pv_dir is not None and (pv_dir / "pvtune.json").is_file():  # from the start to the PV-tuning run's end
        record["pv_run_seconds"] = (pv_dir / "pvtune.json").stat().st_mtime - started_at
    record.update(pv_measurement(pv_dir, pv_settings))
    if hf_home and (hf_home / "kit.json").is_file():
        record["kit"] = json.loads((hf_home / "kit.json").read_text())
    return json.loads(json.dumps(record, default=float).replace("NaN", "null"))


PV_KEYS = ("pv_step_seconds", "pv", "paper_pv_hours_projected", "paper_pv_projection", "pv_run_seconds")


def merge_pv(pre_pv: dict, pv_run: dict) -> dict:
    """The pre-PV run's record with the PV-tuning run's measurement added: its PV keys, the pvtune
    rule's stage and the disk after it (`disk_bytes_after_pv`)."""
    merged = {**pre_pv, **{key: pv_run.get(key) for key in PV_KEYS}}
    merged["stages"] = {**pre_pv["stages"], **{rule: stage for rule, stage in pv_run["stages"].items() if rule == "pvtune"}}
    merged["disk_bytes_after_pv"] = pv_run["disk_bytes"]
    return merged


def merge_synthetic_pv(pre_pv: dict, pv_dir: Path, settings: dict, card: str) -> dict:
    """The pre-PV record with the PV step of `benchmarks/throughput.py pv` at the same shape (its
    `after/` folder): the pvtune stage on a random student of the shape, outside Snakemake, where the
    card's time did not allow the pipeline's own PV-tuning after the pre-PV run."""
    measured = pv_measurement(pv_dir, settings)
    if not measured:
        raise SystemExit(f"{pv_dir}: no train_log.parquet of a PV-tuning run")
    return {**pre_pv, **measured, "pv_source": (
        f"benchmarks/throughput.py pv --shape {pre_pv['shape']} on {card}: the pvtune stage at the paper's "
        "settings on a random 2x8-bit student of the shape (not the pre-PV run's model; the step time does "
        "not depend on the weights' values)")}


def table(record: dict) -> str:
    """The README table "What a run costs" for one record."""
    def number(value, digits=0):
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = [f"card: {record['card']}; shape: {record['shape']}",
             "| rule | jobs | wall s (first start to last end) | GPU peak GiB | host peak RSS GiB | disk written GB |",
             "|---|---|---|---|---|---|"]
    for rule, stage in record["stages"].items():
        written = stage["disk_written_bytes"]
        lines.append(f"| {rule} | {stage['jobs']} | {number(stage['wall_seconds'])} | {number(stage['gpu_peak_gib'], 1)} | "
                     f"{number(stage['host_peak_rss_gib'], 1)} | {number(None if written is None else written / 1e9, 2)} |")
    disk = record["disk_bytes"]
    lines += [f"pre-PV total (empty results/ to the last pre-PV eval.json): {number(record['pre_pv_total_seconds'])} s",
              f"first job to last job: {number(record['first_job_to_last_job_seconds'])} s; "
              f"snakemake -n on the finished run: {number(record['dag_plan_seconds'], 1)} s",
              f"disk: results {number(disk['results'] / 1e9, 1)} GB, resources (new) {number(disk['resources_new'] / 1e9, 1)} GB, "
              f"hub cache {number(None if disk['hub_cache'] is None else disk['hub_cache'] / 1e9, 1)} GB, peak rise "
              f"{number(None if disk['peak_rise_during_run'] is None else disk['peak_rise_during_run'] / 1e9, 1)} GB",
              f"PV step: {number(record['pv_step_seconds'], 2)} s (run {number(record.get('pv_run_seconds'))} s); "
             f"paper budget (projection): "
              f"{number(record['paper_pv_hours_projected'], 1)} h"]
    return "\n".join(lines)


def sample_main(argv: list[str]) -> int:
    """`sample`: the sampler, until --stop-file exists."""
    parser = argparse.ArgumentParser(prog="headline_results sample", description="Sample GPU processes, cards and disk into a CSV.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--disk", type=Path, required=True, help="a folder on the file system the run writes to")
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--card", default=None, help="sample this card only (nvidia-smi's index; with "
                        "CUDA_DEVICE_ORDER=PCI_BUS_ID it is CUDA's too)")
    args = parser.parse_args(argv)
    cache: dict = {}
    with open(args.out, "a", newline="") as handle:
        writer = csv.writer(handle)
        if handle.tell() == 0:
            writer.writerow(["unix_seconds", "kind", "pid", "rule", "value"])
        while not args.stop_file.exists():
            sample(writer, args.disk, cache, args.card)
            handle.flush()
            time.sleep(args.interval)
        sample(writer, args.disk, cache, args.card)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sample"]:
        return sample_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="the folder Snakemake ran in (not with --synthetic-pv)")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--card", required=True)
    parser.add_argument("--started-at", type=float, help="unix seconds Snakemake was started at")
    parser.add_argument("--targets", nargs="*", default=[], help="the run's pre-PV targets (none: a PV-tuning run only)")
    parser.add_argument("--samples", type=Path)
    parser.add_argument("--hf-home", type=Path)
    parser.add_argument("--pv", type=Path, help="a PV-tuning run's pv/ folder")
    parser.add_argument("--plan-seconds", type=float)
    parser.add_argument("--config", type=Path, default=Path("config.yaml"), help="where the paper's pvtune settings are")
    parser.add_argument("--merge", type=Path, help="a pre-PV record to add this PV-tuning run's measurement to")
    parser.add_argument("--synthetic-pv", type=Path, help="benchmarks/throughput.py's after/ folder: its PV "
                        "step added to the --merge record")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import yaml

    pv_settings = yaml.safe_load(args.config.read_text())["pvtune"]
    if args.synthetic_pv is not None:
        if args.merge is None or not args.merge.is_file():
            parser.error("--synthetic-pv needs --merge PRE_PV.json")
        record = merge_synthetic_pv(json.loads(args.merge.read_text()), args.synthetic_pv, pv_settings, args.card)
    elif args.work is None or args.started_at is None:
        parser.error("--work and --started-at are needed (or --synthetic-pv)")
    else:
        record = collect(args.work, args.shape, args.card, args.started_at, args.targets, args.samples, args.hf_home,
                         args.pv, args.plan_seconds, pv_settings)
        if args.merge is not None and args.merge.is_file():
            record = merge_pv(json.loads(args.merge.read_text()), record)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
