"""A real one-node Slurm cluster on this machine, for the tests: Debian's slurm-wlm and munge,
installed with apt-get when missing, daemons started in a private temporary folder, stopped after.

Everything it starts is private: its own munge key and socket, free TCP ports, state and logs in
the temporary folder. slurm.conf and gres.conf go to /etc/slurm/ (and are removed afterwards): the
Slurm executor plugin's job step drops SLURM_CONF from the environment of the `srun` it runs inside
each job, so that srun finds the configuration only at Slurm's default path. An existing
/etc/slurm/slurm.conf that this module did not write is never touched (the test fails instead). There is
no accounting database (slurmdbd needs MySQL): finished jobs are recorded by jobcomp/filetxt, which
`sacct --completion` reads, and the controller keeps finished jobs in memory for MinJobAge seconds,
so `squeue --states=all` and `scontrol show job` still show them.

The node declares two GPUs as generic resources backed by /dev/null and /dev/zero: Slurm schedules
and records GPU requests (`--gpus`, TresPerJob, CUDA_VISIBLE_DEVICES) exactly as on a GPU node, but
no CUDA runs behind them; jobs compute on the CPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from apt_packages import ensure_debian_packages

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
GPUS = 2
CONF_DIR = Path("/etc/slurm")
MARKER = "# written by aqflow's tests/slurm_node.py; removed when its test cluster stops"


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt-get unless present; skip only where that is impossible."""
    ensure_debian_packages(PACKAGES, lambda: all(shutil.which(name) or Path("/usr/sbin", name).exists()
                                                 for name in DAEMONS))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


class SlurmNode:
    """Start with `start()`, stop with `stop()`; `env` is os.environ with SLURM_CONF set."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="aqflow-slurm-"))
        self.root.chmod(0o755)  # munged wants its socket folder reachable by everyone
        self.host = socket.gethostname().split(".")[0]
        self.conf = CONF_DIR / "slurm.conf"
        self.gres = CONF_DIR / "gres.conf"
        self.wrote_conf = False
        self.jobcomp = self.root / "jobcomp.txt"
        self.socket = self.root / "munge" / "munge.socket"
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for name in ("SLURM_JOB_ID", "SLURM_JOBID"):  # not a job of some outer Slurm
            self.env.pop(name, None)

    # --- set-up ------------------------------------------------------------------------------------

    def write_config(self) -> None:
        for path in (self.conf, self.gres):
            if path.exists() and MARKER not in path.read_text(errors="replace"):
                raise RuntimeError(f"{path} exists and was not written by this test: a real Slurm is configured "
                                   "on this machine, and the test will not replace its configuration")
        CONF_DIR.mkdir(parents=True, exist_ok=True)
        self.wrote_conf = True
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir()
        cpus = os.cpu_count() or 1
        memory = int(_memory_mb() * 0.8)
        r = self.root
        self.conf.write_text("\n".join([
            MARKER,
            f"# state and logs: {r}",
            "ClusterName=aqflowtest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "ReturnToService=2",
            "MinJobAge=900",  # finished jobs stay visible to squeue/scontrol for 15 minutes
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp}",
            "GresTypes=gpu",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} Gres=gpu:{GPUS} State=UNKNOWN",
            "PartitionName=aqflow Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        # count-only GPUs are dropped by slurmd; each needs a device file (no CUDA behind them)
        self.gres.write_text(
            f"{MARKER}\nNodeName={self.host} Name=gpu File=/dev/null\nNodeName={self.host} Name=gpu File=/dev/zero\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "w")
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True)
        log.close()

    def _wait(self, what: str, ready, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}:\n"
                                       f"{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def start(self) -> "SlurmNode":
        self.write_config()
        m = self.root / "munge"
        self._spawn("munged", ["munged", "--foreground", f"--socket={self.socket}", f"--key-file={m}/munge.key",
                               f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/seed"])
        self._wait("the munge socket", self.socket.exists)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._spawn("slurmd", ["slurmd", "-D"])
        self._wait("an idle node", lambda: self.run("sinfo", "--noheader", "--format=%T", check=False).stdout.strip()
                   == "idle")
        return self

    # --- use -----------------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
        return result

    def jobs(self) -> dict[str, dict[str, str]]:
        """Every job the controller remembers, by job id: scontrol's fields (JobState, Comment, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner").stdout
        jobs = {}
        for line in out.splitlines():
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            if "JobId" in fields:
                jobs[fields["JobId"]] = fields
        return jobs

    def completions(self) -> dict[str, dict[str, str]]:
        """Slurm's job completion records (`sacct --completion`), by job id."""
        out = self.run("sacct", "--completion", "--parsable2", "--noheader",
                       "--format=JobIDRaw,JobName,State,ExitCode,NodeList").stdout
        records = {}
        for line in out.splitlines():
            job, name, state, exit_code, nodes = line.split("|")
            records[job] = {"name": name, "state": state, "exit_code": exit_code, "nodes": nodes}
        return records

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log", "munged.out", "slurmctld.out", "slurmd.out"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    # --- tear-down -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel what is left of this cluster's jobs, stop the daemons this object started."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", str(os.getuid()), check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run(
                    "squeue", "--noheader", "--format=%i", check=False).stdout.strip():
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self.wrote_conf:
            for path in (self.conf, self.gres):
                if path.exists() and MARKER in path.read_text(errors="replace"):
                    path.unlink()
        shutil.rmtree(self.root, ignore_errors=True)
