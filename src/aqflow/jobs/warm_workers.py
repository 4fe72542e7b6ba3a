"""Warm workers: a job's stage call run by a process that already has torch imported and the card
set up, instead of by the job's own fresh process.

A layer job's own work is short (~1.5 s of quantization for a SmolLM2 linear on an H100), and a
fresh process spends ~3 s more before and around it: importing CUDA-enabled torch (~1.9 s) and
the card's first use (~1.3 s: Triton kernels loaded, cuBLAS set up, CUDA graphs captured), as
measured by benchmarks/layer_job_overhead.py (in the git history); under Snakemake such a job took 4.6 s in its own
process and 0.7 s in a warm worker. With `execution.warm_workers` in the config, a
rule script (which imports no torch) hands its call to a worker instead:

- the job takes a free *slot* of its card: an exclusive lock on `<pool>/<host>.<card>.slot<k>.lock`,
  the lowest k free, held until the job ends, so a slot serves one job at a time;
- it connects to the slot's worker (a Unix socket in Linux's abstract namespace, named from the
  slot's lock file, so nothing is left on disk); the slot's first job starts the worker, a
  detached `python -m aqflow.jobs.warm_workers serve` with the job's environment (its
  CUDA_VISIBLE_DEVICES included) and working folder;
- the worker runs the call exactly as the job would in its own process
  (`stage_jobs.execute_logged`: the rule's log, stale temporaries removed, the same outputs),
  frees the card's cached memory, answers with the exit code, and waits for the slot's next
  job; after `idle_seconds` without one it exits.

Each job is still one Snakemake job with its own log and its artifacts on disk; only the process
that computes them lives longer. If no worker can be started, the job runs in its own process as
before. A worker that dies during a job fails that job (its outputs are written by rename, so
none is half-written). A worker serves only its own user's jobs (the peer's uid, as an abstract
socket has no file permissions), and runs the code it was started with; its address names that
code (`code_fingerprint`), so a job after an edit of aqflow is served by a new worker. Linux only (abstract sockets, flock, SO_PEERCRED);
elsewhere jobs run in process.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import gc
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any, Mapping

START_TIMEOUT_SECONDS = 300.0  # torch's import on a busy node can take a minute
# Set inside a job of Slurm, PBS/Torque and LSF: the job is its own allocation there
BATCH_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per card the driver sees
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/aqflow


def supported() -> bool:
    """Whether this platform has what the workers need (Linux's abstract Unix sockets)."""
    return sys.platform.startswith("linux")


def card_key(environ: Mapping[str, str] | None = None) -> str:
    """Which card(s) a job's worker must be on: its CUDA_VISIBLE_DEVICES as `gpu_pool` set it, or
    'default' (one card, or none)."""
    environ = os.environ if environ is None else environ
    cards = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return cards.replace(",", "-") if cards else "default"


def take_slot(pool_dir: Path, card: str) -> tuple[Path, IO]:
    """The lowest free slot of `card`: (its lock file, the open handle holding the lock). The lock
    is released when the handle is closed or the process ends."""
    pool_dir.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    slot = 0
    while True:
        path = pool_dir / f"{host}.{card}.slot{slot}.lock"
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return path, handle
        except BlockingIOError:
            handle.close()
            slot += 1


def wanted(setting: bool | str, environ: Mapping[str, str] | None = None,
           nvidia_gpus: Path = NVIDIA_GPUS) -> bool:
    """Whether a layer job hands its call to a warm worker under `execution.warm_workers`: true or
    false as given; "auto" where the job's machine shows it an NVIDIA card (`nvidia_gpus` lists one
    and CUDA_VISIBLE_DEVICES does not hide them all) and the job is not itself a batch scheduler's
    job. On a card a fresh job pays seconds of start-up for ~1-2 s of work; on a CPU the
    quantization dwarfs it; a cluster job is its own allocation, where a worker would only linger."""
    if setting != "auto":
        return bool(setting)
    environ = os.environ if environ is None else environ
    if any(name in environ for name in BATCH_JOB_VARIABLES):
        return False
    if environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return nvidia_gpus.is_dir() and any(nvidia_gpus.iterdir())


@functools.cache
def code_fingerprint(package: Path = PACKAGE_DIR) -> str:
    """What identifies the code a worker runs: the Python executable and every module of aqflow
    (path, size, modification time). Stat calls only: ~1 ms for the package."""
    entries = [sys.executable] + [f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns}"
                                  for path in sorted(package.rglob("*.py")) for stat in [path.stat()]]
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def worker_address(slot_lock: Path, code: str | None = None) -> str:
    """The abstract socket name of a slot's worker: unique per lock file (host, card, slot, pool)
    and per code (`code_fingerprint()` by default), so a job after an edit of aqflow starts a worker
    of the new code instead of being served by the old one (which exits after its idle time)."""
    code = code_fingerprint() if code is None else code
    digest = hashlib.sha256(f"{slot_lock.resolve()}\n{code}".encode()).hexdigest()[:32]
    return f"\0aqflow-warm-worker-{digest}"


def connect(address: str) -> socket.socket | None:
    """A connection to the worker listening at `address`, or None if none is."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        client.close()
        return None
    return client


def start_worker(address: str, idle_seconds: float, log_path: Path) -> subprocess.Popen:
    """A detached worker for `address` (its own session, so it outlives the job that starts it),
    with this process's environment and working folder; its own output goes to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "aqflow.jobs.warm_workers", "serve", "--address", address.encode().hex(),
             "--idle-seconds", str(idle_seconds)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_worker(address: str, worker: subprocess.Popen, timeout: float = START_TIMEOUT_SECONDS
                    ) -> socket.socket | None:
    """A connection to the worker just started, once it listens; None if it exited first or does
    not listen within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client = connect(address)
        if client is not None:
            return client
        if worker.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def send_message(stream: IO, message: Mapping[str, Any]) -> None:
    """One message: a JSON line (paths and other non-JSON values as strings)."""
    stream.write(json.dumps(message, default=str) + "\n")
    stream.flush()


def receive_message(stream: IO) -> dict | None:
    """The next JSON-line message, or None if the other side closed the connection first."""
    line = stream.readline()
    return json.loads(line) if line.endswith("\n") else None


def greeted(client: socket.socket | None) -> tuple[socket.socket, IO] | None:
    """The connection and its stream once the worker says it is ready for a job (it does on
    accepting), or None if there is no worker or it hangs up first (it was exiting or dying)."""
    if client is None:
        return None
    stream = client.makefile("rw")
    try:
        if receive_message(stream) is not None:
            return client, stream
    except OSError:
        pass
    stream.close()
    client.close()
    return None


def run_in_worker(request: Mapping[str, Any], pool_dir: Path, idle_seconds: float) -> tuple[int, str] | None:
    """Run a stage call (`request`: stage, settings, paths, log, outputs, cwd) in the warm worker of a
    free slot of this job's card, starting the worker if the slot has none (or its worker is going
    away). Returns the call's (exit code, failure message), or None when no worker could be started
    (run it in process)."""
    slot_lock, held = take_slot(pool_dir, card_key())
    try:
        address = worker_address(slot_lock)
        session = greeted(connect(address))
        if session is None:
            worker = start_worker(address, idle_seconds, slot_lock.with_suffix(".log"))
            session = greeted(wait_for_worker(address, worker))
            if session is None:
                return None
        client, stream = session
        try:  # the request is sent only to a worker that said it is ready: from here on, it may be running
            send_message(stream, request)
            reply = receive_message(stream)
        except OSError:
            reply = None
        finally:
            stream.close()
            client.close()
        if reply is None:
            return 1, (f"aqflow {request['stage']}: the warm worker running this job died (its log: "
                       f"{slot_lock.with_suffix('.log')}; the job's log: {request['log']})")
        return int(reply["code"]), str(reply["message"])
    finally:
        held.close()


def serve_one(stream: IO, served: int) -> bool:
    """Run one request from a connected job (this worker's job number served + 1) and answer it;
    False if the job hung up first."""
    from aqflow.jobs.stage_jobs import execute_logged

    request = receive_message(stream)
    if request is None:
        return False
    try:
        os.chdir(request["cwd"])  # the job's relative paths are its working folder's
        code, message = execute_logged(request["stage"], request["settings"], request["paths"], request["log"],
                                       request["outputs"], note=f"(run by warm worker {os.getpid()}, its job {served + 1})")
    except SystemExit as exit_:  # what would have ended the job's own process ends only this job
        code = exit_.code if isinstance(exit_.code, int) else 1
        message = f"aqflow {request['stage']} exited: {exit_.code} (log: {request['log']})"
    except Exception as error:  # a bug: its traceback goes to the job's log (once the stage runs) and the worker's
        traceback.print_exc()
        code, message = 1, f"aqflow {request['stage']} raised {type(error).__name__}: {error} (log: {request['log']})"
    finally:
        release_memory()
    try:
        send_message(stream, {"code": code, "message": message})
    except OSError:  # the job was killed meanwhile
        pass
    return True


def release_memory() -> None:
    """What one job leaves behind is not kept for the next: its CUDA graphs and the card memory
    torch's allocator caches (other jobs and stages on the card need it)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        from aqflow.quant.quantize import release_cuda_graphs

        release_cuda_graphs()
        torch.cuda.empty_cache()


def serve(address: str, idle_seconds: float) -> int:
    """Listen at `address` and run the slot's jobs one after another; exit after `idle_seconds`
    without a job, or at once if another worker holds the address."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(address)
    except OSError:  # a worker for this slot is already listening
        return 0
    server.listen(1)
    server.settimeout(idle_seconds)
    import torch  # noqa: F401  (what the worker is for: imported once, before the first job)

    served = 0
    while True:
        try:
            connection, _ = server.accept()
        except TimeoutError:
            print(f"warm worker {os.getpid()}: {served} jobs, idle for {idle_seconds:g} s: exiting", flush=True)
            return 0
        connection.settimeout(None)
        if peer_uid(connection) != os.getuid():  # an abstract socket has no file permissions
            connection.close()
            continue
        with connection, connection.makefile("rw") as stream:
            try:
                send_message(stream, {"ready": os.getpid()})
            except OSError:  # the job went away while waiting
                continue
            served += serve_one(stream, served)


def peer_uid(connection: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket connection (SO_PEERCRED)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aqflow.jobs.warm_workers", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run one slot's worker (started by a job)")
    serve_parser.add_argument("--address", required=True, help="the abstract socket name, hex-encoded")
    serve_parser.add_argument("--idle-seconds", type=float, required=True)
    args = parser.parse_args(argv)
    return serve(bytes.fromhex(args.address).decode(), args.idle_seconds)


if __name__ == "__main__":
    raise SystemExit(main())
