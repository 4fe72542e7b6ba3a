"""Nothing stale, nothing corrupt passes unseen (issue 23), as a property of random fault sequences.

Each sequence starts from a finished tiny run and takes a few random steps: a setting changed, a
random job SIGKILLed (its process tree) at a random time while a run that changed a setting is
under way, one byte of a random artifact flipped (its mtime put back or not), a random artifact
truncated or deleted. Each step is followed by a plain `snakemake` and a named-target run. After
each run either every evaluation equals what a clean run with the current settings gives (the
settings recorded and the metrics: eval.json, eval_pre_pv.json, pvtune.json and the fp baseline)
and every artifact matches its checksum record, or the run failed naming a file; then its advice
is followed literally (delete what it names) and the run repeated, which must then succeed. A run
that says "Nothing to be done" over a stale or corrupt artifact fails the first condition.

Clean results are computed once per settings combination, from the base run's upstream (fetch,
calibration, layers, stitch: no setting of the sequences touches them) with every settings-
dependent result and its Snakemake record removed. Seeded: AQFLOW_PROPERTY_SEED (default 0),
AQFLOW_PROPERTY_SEQUENCES x AQFLOW_PROPERTY_STEPS (default 2 x 3) and AQFLOW_PROPERTY_BASE (a
finished run of the config to start from) for a longer soak.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from aqflow.io import artifacts

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "workflow" / "config.property.yaml"
VARIANT = "results/tiny/2bpp/greedy/b2e1"
TARGET = f"{VARIANT}/eval.json"
# the settings a sequence changes, each between two values (the first is the config's)
SETTINGS = {("pvtune", "lr"): (1.0e-4, 3.0e-4), ("evaluation", "max_windows"): (2, 3)}
# what a change of those settings makes again (removed, with their records, for a clean run)
SETTINGS_DEPENDENT = (f"{VARIANT}/pv", f"{VARIANT}/eval_pre_pv.json", f"{VARIANT}/eval.json", "results/tiny/fp",
                      "results/report")
SCRIPTS = {"evaluate_quantized": "evaluate", "evaluate_pvtuned": "evaluate", "evaluate_fp": "evaluate"}
ACTIONS = ("change", "kill", "flip", "truncate", "delete")
SEED = int(os.environ.get("AQFLOW_PROPERTY_SEED", "0"))
SEQUENCES = int(os.environ.get("AQFLOW_PROPERTY_SEQUENCES", "2"))
STEPS = int(os.environ.get("AQFLOW_PROPERTY_STEPS", "3"))
ADVICE = re.compile(r"delete (?:the folder )?(\S+?)(?: \(or the folder \S+\))? and rerun|remove it \(or delete the folder")


def config_file(folder: Path, choice: dict) -> Path:
    """The property config with `choice` ({(section, key): value}) applied, written to `folder`."""
    config = yaml.safe_load(CONFIG.read_text())
    for (section, key), value in choice.items():
        config[section][key] = value
    name = "-".join(f"{key}={value}" for (_, key), value in sorted(choice.items()))
    path = folder / f"config.{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake_command(workdir: Path, config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(config),
            "--directory", str(workdir), "--cores", "2", *args]


def _env() -> dict:
    return dict(os.environ, AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))


def snakemake(workdir: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(snakemake_command(workdir, config, *args), capture_output=True, text=True, env=_env(),
                          timeout=1800)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _untimed(value):
    """`value` without its wall times (keys `timings`, `*seconds`), which no two runs share."""
    if isinstance(value, dict):
        return {key: _untimed(item) for key, item in value.items() if key != "timings" and "seconds" not in key}
    if isinstance(value, list):
        return [_untimed(item) for item in value]
    return value


def evaluations(workdir: Path) -> dict:
    """What must equal a clean run's: the settings each evaluation and the PV-tuning recorded and
    their numbers (not timings, devices or paths)."""
    final, pre_pv = _read(workdir / TARGET), _read(workdir / VARIANT / "eval_pre_pv.json")
    final, pre_pv = _untimed(final), _untimed(pre_pv)
    pvtune = _read(workdir / VARIANT / "pv" / "pvtune.json")
    return {"eval": {"metrics": final["metrics"], "upstream": final["settings"]["upstream"],
                     "pre_pv": final["pre_pv"]["metrics"]},
            "eval_pre_pv": {"metrics": pre_pv["metrics"], "upstream": pre_pv["settings"]["upstream"]},
            "pvtune": {key: pvtune[key] for key in ("settings", "steps", "best_step", "best_heldout_kl",
                                                    "initial_heldout_kl", "codes_changed_fraction")},
            "fp": _read(workdir / "results/tiny/fp/eval.json")["metrics"]}


def every_record_matches(workdir: Path) -> None:
    """Every file with a checksum record under results/ and resources/ matches it."""
    for root in ("results", "resources"):
        for sidecar in (workdir / root).rglob("*" + artifacts.SIDECAR_SUFFIX):
            data = sidecar.with_name(sidecar.name[: -len(artifacts.SIDECAR_SUFFIX)])
            if data.exists():
                artifacts.verified(data)
        for sums in (workdir / root).rglob(artifacts.SUMS_FILE):
            artifacts.verified_tree(sums.parent, required=True)
    artifacts._VERIFIED.clear()


def remove_with_records(workdir: Path, relatives: tuple[str, ...]) -> None:
    """Remove these results and Snakemake's records of them (its metadata file names are the
    base64 of each output's path), as if they had never been made."""
    for relative in relatives:
        path = workdir / relative
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        for sidecar in path.parent.glob(path.name + "*" + artifacts.SIDECAR_SUFFIX):
            sidecar.unlink()
    for record in (workdir / ".snakemake" / "metadata").iterdir():
        if record.is_file() and base64.urlsafe_b64decode(record.name).decode(errors="replace").startswith(relatives):
            record.unlink()
    shutil.rmtree(workdir / ".snakemake" / "aqflow", ignore_errors=True)


class CleanRuns:
    """Clean results per settings combination, computed on first use."""

    def __init__(self, base: Path, folder: Path):
        self.base, self.folder, self.results = base, folder, {}

    def __call__(self, choice: dict) -> dict:
        key = tuple(sorted(choice.items()))
        if key not in self.results:
            workdir = self.folder / f"clean-{len(self.results)}"
            shutil.copytree(self.base, workdir, symlinks=True)
            remove_with_records(workdir, SETTINGS_DEPENDENT)
            result = snakemake(workdir, config_file(self.folder, choice))
            assert result.returncode == 0, result.stderr[-3000:]
            self.results[key] = evaluations(workdir)
        return self.results[key]


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, command line, working directory)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(entry.name)] = (int(stat.rpartition(")")[2].split()[1]), cmdline, os.readlink(entry / "cwd"))
            except (OSError, ValueError, IndexError):
                continue
    return found


def kill_job_tree(workdir: Path, run: subprocess.Popen, rule: str, delay: float) -> bool:
    """Once a job of `rule` runs in `workdir`, wait `delay` s and SIGKILL it with every process it
    started (Snakemake's jobs share its process group, so the group itself is not killed: the run
    goes on and sees the job die). False if the run ended first."""
    script = f".{SCRIPTS.get(rule, rule)}.py"
    while run.poll() is None:
        processes = _processes()
        job = next((pid for pid, (_, cmdline, cwd) in processes.items()
                    if ".snakemake/scripts/" in cmdline and script in cmdline and Path(cwd) == workdir), None)
        if job is not None:
            time.sleep(delay)
            tree, grew = {job}, True
            while grew:
                children = {pid for pid, (parent, _, _) in _processes().items() if parent in tree} - tree
                tree, grew = tree | children, bool(children)
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return True
        time.sleep(0.05)
    return False


def planned_rules(workdir: Path, config: Path, *args: str) -> list[str]:
    result = snakemake(workdir, config, *args, "-n", "--quiet", "rules")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return sorted({match.group(1) for line in result.stdout.splitlines()
                   if (match := re.match(r"^(\w+)\s+\d+$", line.strip())) and match.group(1) not in ("total", "all")})


def artifacts_of(workdir: Path) -> list[Path]:
    """The finished artifacts a fault may hit: results' files and folder outputs (no records, no
    hidden files)."""
    files = [path for path in (workdir / "results").rglob("*") if path.is_file()
             and not path.name.endswith(artifacts.SIDECAR_SUFFIX) and path.name != artifacts.SUMS_FILE
             and not any(part.startswith(".") for part in path.relative_to(workdir).parts)]
    folders = [path for path in (workdir / "results").rglob(artifacts.SUMS_FILE)]
    return sorted(files) + sorted(path.parent for path in folders)


def _flip(path: Path, rng: random.Random) -> str:
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    if rng.random() < 0.5:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        return "mtime kept"
    return "mtime moved"


class Sequence:
    """One random sequence on its own copy of the base run."""

    def __init__(self, base: Path, workdir: Path, rng: random.Random, clean: CleanRuns, log: list):
        shutil.copytree(base, workdir, symlinks=True)
        self.workdir, self.rng, self.clean, self.log = workdir, rng, clean, log
        self.choice = {key: values[0] for key, values in SETTINGS.items()}

    @property
    def config(self) -> Path:
        return config_file(self.workdir.parent, self.choice)

    def change(self) -> str:
        key = self.rng.choice(sorted(SETTINGS))
        values = SETTINGS[key]
        self.choice[key] = values[1] if self.choice[key] == values[0] else values[0]
        return f"{key[0]}.{key[1]} = {self.choice[key]}"

    def act(self, action: str) -> str:
        if action == "change":
            return self.change()
        if action == "kill":
            changed = self.change()  # work to kill in
            args = [TARGET] if self.rng.random() < 0.5 else []
            rules = planned_rules(self.workdir, self.config, *args)
            rule = self.rng.choice(rules)
            run = subprocess.Popen(snakemake_command(self.workdir, self.config, *args), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=_env(), start_new_session=True)
            killed = kill_job_tree(self.workdir, run, rule, self.rng.uniform(0.0, 2.0))
            run.wait(timeout=1800)
            return f"{changed}, {'killed' if killed else 'missed'} {rule} in a {'named' if args else 'plain'} run"
        path = self.rng.choice(artifacts_of(self.workdir))
        relative = path.relative_to(self.workdir)
        if action == "delete":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            return f"deleted {relative}"
        if path.is_dir():  # a fault in a folder hits one of its files
            path = self.rng.choice(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
            relative = path.relative_to(self.workdir)
        if action == "flip":
            return f"flipped a byte of {relative} ({_flip(path, self.rng)})"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return f"truncated {relative}"

    def run_checked(self, *args: str) -> int:
        """A run; if it fails it must name a file and give advice, which is followed (once) and the
        run repeated. Then the evaluations equal a clean run's and every record matches. Returns the
        number of pieces of advice followed."""
        result, followed = snakemake(self.workdir, self.config, *args), 0
        if result.returncode != 0:
            output = result.stdout + result.stderr
            advice = ADVICE.search(output)
            assert advice and re.search(r"aqflow: (results|resources)/\S+: ", output), output[-3000:]
            named = advice.group(1) or re.search(r"aqflow: (\S+): unlisted", output).group(1)
            target = self.workdir / named
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            self.log.append(f"    advice followed: {advice.group(0)}")
            followed += 1
            result = snakemake(self.workdir, self.config, *args)
            assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        output = result.stdout + result.stderr
        done = re.findall(r"(\d+) of \d+ steps \(100%\) done", output)
        self.log.append(f"    {'named' if args else 'plain'} run: "
                        + ("nothing to be done" if "Nothing to be done" in output else f"{done[-1] if done else '?'} jobs"))
        every_record_matches(self.workdir)
        assert evaluations(self.workdir) == self.clean(self.choice), (self.log, result.stderr[-2000:])
        return followed


@pytest.mark.slow
def test_random_faults_never_leave_a_stale_or_corrupt_result_served(tmp_path):
    started, cpu_before = time.monotonic(), _children_cpu_seconds()
    base = tmp_path / "base"
    if os.environ.get("AQFLOW_PROPERTY_BASE"):  # a finished run of CONFIG made before (a longer soak)
        shutil.copytree(os.environ["AQFLOW_PROPERTY_BASE"], base, symlinks=True)
    else:
        result = snakemake(base, CONFIG)
        assert result.returncode == 0, result.stderr[-3000:]
    clean = CleanRuns(base, tmp_path)
    assert evaluations(base) == clean({key: values[0] for key, values in SETTINGS.items()})
    rng, log, followed, runs = random.Random(SEED), [], 0, 0
    # every kind of fault at least once, the rest drawn at random, in a random order
    total = SEQUENCES * STEPS
    actions = list(ACTIONS) + rng.choices(ACTIONS, k=total - len(ACTIONS)) if total >= len(ACTIONS) \
        else rng.sample(ACTIONS, total)
    rng.shuffle(actions)
    for number in range(SEQUENCES):
        sequence = Sequence(base, tmp_path / f"sequence-{number}", rng, clean, log)
        for step in range(STEPS):
            log.append(f"sequence {number}, step {step}: {sequence.act(actions[number * STEPS + step])}")
            followed += sequence.run_checked()  # plain
            followed += sequence.run_checked(TARGET)  # named target
            runs += 2
    print("\n".join(log))
    print(f"property: {SEQUENCES} sequences, {total} steps, {runs} checked runs, {followed} pieces of advice "
          f"followed, {len(clean.results)} clean settings combinations; {time.monotonic() - started:.0f} s, "
          f"{_children_cpu_seconds() - cpu_before:.0f} CPU s of Snakemake and its jobs (seed {SEED})")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
