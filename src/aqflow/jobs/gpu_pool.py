"""Spread the jobs of one node over all of its GPUs: each job pinned to the least-busy card(s).

Snakemake counts a `gpu` resource but never says which card a job should use, so without help
every job of a multi-GPU node lands on card 0. Before a GPU job's stage imports torch, its rule
script calls `pin_job_gpus(n)`: under a file lock shared by the node's jobs, it reads which
processes hold which cards, forgets processes that have exited, takes the n cards held by the
fewest live jobs, records itself on them and sets CUDA_VISIBLE_DEVICES to them. Several jobs
may share a card (layer jobs are short and mostly CPU start-up); a job holds its cards until its
process exits, so nothing has to release them.

The cards to choose from are the job's visible ones: CUDA_VISIBLE_DEVICES if set (a cluster
executor's allocation, or a user's restriction), else every card `nvidia-smi` lists (asked once
per boot of the host, then read from the pool folder). With one card or none nothing changes.
The state lives in AQFLOW_GPU_POOL_DIR, by default `.snakemake/aqflow-gpu-pool` of the working
directory, one file per host.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

POOL_DIR_ENV = "AQFLOW_GPU_POOL_DIR"
DEFAULT_POOL_DIR = Path(".snakemake") / "aqflow-gpu-pool"


def pool_folder(pool_dir: str | os.PathLike | None = None) -> Path:
    """The pool's folder: `pool_dir`, else AQFLOW_GPU_POOL_DIR, else the default."""
    return Path(pool_dir or os.environ.get(POOL_DIR_ENV) or DEFAULT_POOL_DIR)


def replace_json(path: Path, value) -> None:
    """Write `value` as JSON to `path` through a temporary file of this process and a rename, so a
    job reading it never sees half a file."""
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(value))
    staging.replace(path)


def visible_gpus(environ: Mapping[str, str] | None = None, pool_dir: str | os.PathLike | None = None) -> list[str]:
    """Ids of the cards this process may use: CUDA_VISIBLE_DEVICES's entries if it is set, else
    the indices `nvidia-smi` lists (none if it is missing or fails), listed once per boot of the
    host and kept in the pool folder (`listed_gpus`)."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [card.strip() for card in environ["CUDA_VISIBLE_DEVICES"].split(",") if card.strip()]
    return listed_gpus(pool_dir)


def boot_id() -> str:
    """This boot of the host ('' where the kernel does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def listed_gpus(pool_dir: str | os.PathLike | None = None) -> list[str]:
    """The card indices `nvidia-smi` lists. Every GPU job of a node asks (a one-card box too), and
    nvidia-smi costs a job up to seconds of CPU, so a non-empty listing is kept in
    `<pool>/<host>.cards.json` with the boot it was made in and reused until the next boot."""
    record = pool_folder(pool_dir) / f"{socket.gethostname()}.cards.json"
    boot = boot_id()
    try:
        kept = json.loads(record.read_text())
        if boot and kept["boot_id"] == boot and kept["cards"]:
            return [str(card) for card in kept["cards"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cards = nvidia_smi_gpus()
    if boot and cards:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            replace_json(record, {"boot_id": boot, "cards": cards})
        except OSError:  # a read-only working folder: list again next time
            pass
    return cards


def nvidia_smi_gpus() -> list[str]:
    """The card indices `nvidia-smi` lists ([] if it is missing or fails)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def least_loaded(holders: Mapping[str, Sequence[int]], cards: Sequence[str], count: int) -> list[str]:
    """The `count` cards with the fewest holders (ties: the earlier card), in `cards` order."""
    if not 1 <= count <= len(cards):
        raise ValueError(f"cannot choose {count} of the cards {list(cards)}")
    ranked = sorted(range(len(cards)), key=lambda i: (len(holders.get(cards[i], ())), i))
    return [cards[i] for i in sorted(ranked[:count])]


def pin_job_gpus(count: int, pool_dir: str | os.PathLike | None = None, pid: int | None = None) -> list[str]:
    """Choose `count` of the visible cards for this job (see the module docstring), record `pid`
    (default: this process) on them and point CUDA_VISIBLE_DEVICES at them. Returns the chosen
    ids; [] (and no change) for count < 1 or when no card is visible. A job asking for more cards
    than are visible gets all of them."""
    if count < 1:  # a CPU job: no need to list the cards
        return []
    pool_dir = pool_folder(pool_dir)
    cards = visible_gpus(pool_dir=pool_dir)
    if not cards:
        return []
    count = min(count, len(cards))
    if len(cards) == 1:
        return cards
    # only a job with a card to choose needs these (CPU jobs run in environments without them)
    import psutil
    from filelock import FileLock

    host = socket.gethostname()
    state_path = pool_dir / f"{host}.json"
    pid = os.getpid() if pid is None else pid
    pool_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(pool_dir / f"{host}.lock"):
        holders: dict[str, list[int]] = json.loads(state_path.read_text()) if state_path.is_file() else {}
        holders = {card: [p for p in pids if psutil.pid_exists(p)] for card, pids in holders.items()}
        chosen = least_loaded(holders, cards, count)
        for card in chosen:
            holders.setdefault(card, []).append(pid)
        replace_json(state_path, holders)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
    return chosen
