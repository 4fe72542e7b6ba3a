"""Sample, while a Snakemake run goes on, each GPU process's memory with the rule it serves, the
card's total and the disk's use, into one CSV (benchmarks/headline_results.py reads it).

    python -m benchmarks.headline_gpu_memory --out samples.csv --disk /root/stage --stop-file F [--interval 1]

Rows: `unix_seconds,kind,pid,rule,value` with kind `process` (value: MiB the process holds on a
card, `nvidia-smi --query-compute-apps`), `card` (MiB used on card `pid`, `--query-gpu`) and
`disk` (bytes used on the file system of --disk). A process's rule comes from its command line or
its parents': Snakemake runs a rule's script as `.snakemake/scripts/tmp<id>.<script>.py`, whose
preamble names the rule (the three evaluation rules share evaluate.py); warm workers
(`aqflow.jobs.warm_workers`) serve layer jobs only. Where nvidia-smi lists no processes (some
container runtimes hide other processes' ids), the `card` rows remain and headline_results.py
falls back to them. Stops when --stop-file exists.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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


if __name__ == "__main__":
    raise SystemExit(main())
