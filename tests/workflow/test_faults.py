"""Fault injection on the tiny DAG (CPU): what a killed job, a killed Snakemake, a corrupted or
truncated artifact, a full disk and a read-only folder do, and that none of them loses a finished
artifact or lets a wrong one through silently. The README's "what survives what" table is these
tests' observed outcomes.

The DAG tests (marked slow: they run Snakemake several times) use tests/workflow/config.faults.yaml:
one uninterrupted reference run, then one run that is killed again and again (a calibrate job, a
layer job, stitch, pvtune after a saved state, then Snakemake with all its jobs) at random points,
and finished by a plain rerun; its outputs must equal the reference's, with no temporaries left.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from aqflow.io import artifacts
from aqflow.io.artifacts import ArtifactError
from aqflow.io.integrity import stat_signature
from aqflow.jobs.currency import digest_cache_path
from aqflow.quant.quantize import QuantizerSettings
from aqflow.stagekit.stage_cli import run_stage_module
from aqflow.stages import calibrate, evaluate, pvtune, quantize_layer, report, stitch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "workflow" / "config.faults.yaml"
TINY_CONFIG = REPO / "tests" / "workflow" / "config.tiny.yaml"
VARIANT = "results/tiny/2bpp/greedy/b2e2"
TARGET = f"{VARIANT}/eval.json"
SEED = int(os.environ.get("AQFLOW_FAULT_SEED", "0"))


def snakemake_command(workdir: Path, *args: str, config: Path = CONFIG) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(config),
            "--directory", str(workdir), *args]


def _env() -> dict:
    return dict(os.environ, AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))


def run_snakemake(workdir: Path, *args: str, config: Path = CONFIG) -> subprocess.CompletedProcess:
    return subprocess.run(snakemake_command(workdir, *args, config=config), capture_output=True, text=True,
                          env=_env(), timeout=1800)


# --- impossible targets fail when the DAG is built ------------------------------------------------

@pytest.mark.parametrize("target, named", [
    (f"{VARIANT[:-4]}b0/eval.json", "wildcard variant='b0'"),
    (f"{VARIANT[:-4]}b2e0/eval.json", "wildcard variant='b2e0'"),
    ("results/tiny/3bpp/greedy/b2e2/eval.json", "wildcard bpp='3' is not one of config bitrates: allowed ['2']"),
    ("results/huge/2bpp/greedy/b2e2/eval.json", "wildcard model='huge' is not one of config models: allowed ['tiny']"),
    ("results/huge/fp/eval.json", "wildcard model='huge'"),
    ("results/tiny/2bpp/kmeans/b2e2/eval.json", "wildcard init='kmeans' is not one of the known inits: allowed ['greedy', 'oaem', 'oaem-patient']"),
    (f"{VARIANT[:-4]}b0/layers/model.layers.0.mlp.up_proj.safetensors", "wildcard variant='b0'"),
    # 2 bits per weight as its folder says, but 6 does not divide the tiny model's 64 inputs
    ("results/tiny/2bpp/greedy/g6m2k64-b2/eval.json", "model 'tiny', variant 'g6m2k64-b2': geometry g6m2k64 "
     "(group size 6) does not divide the 64 inputs of model.layers.0.self_attn.q_proj"),
])
def test_an_impossible_target_fails_the_dry_run_naming_the_wildcard(tmp_path, target, named):
    result = run_snakemake(tmp_path, "-n", target, config=TINY_CONFIG)
    assert result.returncode != 0 and named in result.stdout + result.stderr, result.stderr[-2000:]


def test_the_preset_error_lists_tiny():
    from aqflow.models.presets import get_preset

    with pytest.raises(KeyError, match="'tiny'"):
        get_preset("no-such-model")


# --- processes ------------------------------------------------------------------------------------

def _processes() -> dict[int, tuple[str, str]]:
    """pid -> (command line, working directory) of every process we may inspect."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(entry.name)] = (cmdline, os.readlink(entry / "cwd"))
            except OSError:
                continue
    return found


def job_process(workdir: Path, script: str) -> int | None:
    """The pid of the process running rule script `script` (e.g. "quantize_layer") in `workdir`."""
    for pid, (cmdline, cwd) in _processes().items():
        if ".snakemake/scripts/" in cmdline and f".{script}.py" in cmdline and Path(cwd) == workdir:
            return pid
    return None


def start_snakemake(workdir: Path, *args: str, config: Path = CONFIG) -> subprocess.Popen:
    """Snakemake in its own process group (so that the whole run, jobs included, can be killed)."""
    log = open(workdir / f"snakemake.{time.time_ns()}.out", "w")
    return subprocess.Popen(snakemake_command(workdir, "--cores", "2", *args, config=config), stdout=log,
                            stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def planned_jobs(workdir: Path, *args: str, config: Path = CONFIG) -> dict[str, int]:
    """rule -> job count of a dry run (`snakemake -n ARGS`: a named target, or none for a plain run)."""
    result = run_snakemake(workdir, *args, "-n", "--quiet", "rules", config=config)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return {match.group(1): int(match.group(2)) for line in result.stdout.splitlines()
            if (match := re.match(r"^(\w+)\s+(\d+)$", line.strip())) and match.group(1) not in ("total", "all")}


def dry_run_output(workdir: Path, *args: str, config: Path = CONFIG) -> tuple[int, str]:
    result = run_snakemake(workdir, "-n", *args, config=config)
    return result.returncode, result.stdout + result.stderr


def copied(reference: Path, tmp_path: Path) -> Path:
    workdir = tmp_path / "run"
    subprocess.run(["cp", "-a", str(reference), str(workdir)], check=True)
    return workdir


def kill_job(workdir: Path, run: subprocess.Popen, script: str, delay: float, ready=lambda: True) -> bool:
    """Once the job of `script` runs (and `ready()`), wait `delay` s, then SIGKILL it. A job that
    ends within the delay (layer jobs take about a second) is let go and the next one of `script`
    is tried with half the delay. Returns whether a job was killed (False: the run ended first)."""
    while run.poll() is None:
        pid = job_process(workdir, script)
        if pid is not None and ready():
            time.sleep(delay)
            # a job that ended is a zombie until Snakemake reaps it, and a SIGKILL to a zombie
            # "succeeds" without failing anything: only a live job counts as killed
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    return True
                except ProcessLookupError:  # it ended and was reaped just now
                    pass
            delay /= 2
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (its /proc state is not Z, zombie, or X, dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # the state follows the parenthesised name


def _read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _tensors(path: Path) -> dict:
    """Every tensor's dtype, shape and bytes, and the metadata, of a safetensors file (not the file's
    bytes: safetensors writes the metadata keys in no fixed order)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: (str(tensor.dtype), tuple(tensor.shape), tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                   for name in handle.keys() for tensor in [handle.get_tensor(name)]}
        return {"tensors": tensors, "metadata": handle.metadata()}


def _outputs(workdir: Path) -> dict:
    """What must not depend on faults: every layer's and both checkpoints' tensors, the
    PV-tuning curve and the evaluation metrics."""
    variant = workdir / VARIANT
    digests = {path.name: _tensors(path) for path in sorted((variant / "layers").glob("*.safetensors"))}
    for folder in ("model", "pv/model"):
        digests[folder] = _tensors(variant / folder / "model.safetensors")
    log = pd.read_parquet(variant / "pv" / "train_log.parquet")
    curve = log[["step", "split", "kl", "perplexity"]].fillna(-1.0).to_dict("records")  # NaN != NaN
    metrics = json.loads((variant / "eval.json").read_text())["metrics"]
    return {"files": digests, "curve": curve, "metrics": metrics}


def _every_artifact_checks(workdir: Path) -> None:
    """Every file with a checksum record under results/ and resources/ matches it; no temporaries."""
    for root in ("results", "resources"):
        assert artifacts.stale_temporaries(workdir / root) == []
        for sidecar in (workdir / root).rglob("*.sha256"):
            artifacts.verified(sidecar.with_name(sidecar.name[: -len(".sha256")]))
        for sums in (workdir / root).rglob(artifacts.SUMS_FILE):
            artifacts.verified_tree(sums.parent, required=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    result = run_snakemake(workdir, "--cores", "2", TARGET)
    assert result.returncode == 0, result.stderr[-4000:]
    return workdir


@pytest.mark.slow
def test_kills_at_random_points_lose_nothing_and_the_rerun_equals_an_uninterrupted_run(reference, tmp_path):
    rng = random.Random(SEED)
    workdir = tmp_path
    pv_log = workdir / "logs/pvtune/tiny/2bpp/greedy/b2e2.log"
    state_dir = workdir / VARIANT / "pv" / "state"

    def state_saved() -> bool:  # one folder per saved step and process
        return any(state_dir.glob("step-*/rank-0/state.json"))

    pv_logs = []
    observed = {}
    faults = [
        ("calibrate", lambda: True, rng.uniform(0.0, 3.0)),
        ("quantize_layer", lambda: True, rng.uniform(0.0, 2.0)),
        ("stitch", lambda: True, rng.uniform(0.0, 2.0)),
        ("pvtune", state_saved, rng.uniform(0.0, 0.5)),  # after it saved a state
    ]
    for script, ready, delay in faults:
        run = start_snakemake(workdir, TARGET)
        killed = kill_job(workdir, run, script, delay, ready)
        code = run.wait(timeout=1800)
        pv_logs.append(_read_log(pv_log))
        observed[script] = (killed, code)
        assert killed and code != 0, (script, killed, code)
        if script == "pvtune":
            assert state_saved()  # the saved state outlives the killed job (Snakemake removed its outputs)
            assert not (workdir / VARIANT / "pv" / "model").exists()
    # Snakemake itself and every job of it, at a random point of a run that has work left
    run = start_snakemake(workdir, TARGET)
    time.sleep(rng.uniform(2.0, 8.0))
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    pv_logs.append(_read_log(pv_log))
    # what an operator does next: unlock (the killed Snakemake left its lock) and rerun
    assert run_snakemake(workdir, "--unlock", TARGET).returncode == 0
    final = run_snakemake(workdir, "--cores", "2", "--rerun-incomplete", TARGET)
    assert final.returncode == 0, final.stderr[-4000:]
    pv_logs.append(_read_log(pv_log))
    assert any("resuming PV-tuning after step" in text for text in pv_logs), pv_logs
    assert not (workdir / VARIANT / "pv" / "state").exists()  # removed once PV-tuning finished
    _every_artifact_checks(workdir)
    assert _outputs(workdir) == _outputs(reference)


def _flip_byte(path: Path, offset: int, keep_mtime: bool) -> None:
    """Flip one byte at `offset` (negative: from the end), the size kept and, with keep_mtime, the mtime."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def edited_config(tmp_path: Path, section: str, key: str, value) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config[section][key] = value
    path = tmp_path / f"config.{section}.{key}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# --- what is current: a named target, a plain run and a dry run agree (issue 23) ------------------

@pytest.mark.slow
def test_a_job_killed_after_a_settings_change_is_rerun_by_every_invocation(reference, tmp_path):
    """A finished run, a PV-tuning setting changed, the PV-tuning job killed: Snakemake removed its
    outputs and recorded its metadata (the new setting included) as if it had finished, so by its own
    rules the old eval.json was up to date for the named target ("Nothing to be done"). Every
    invocation plans PV-tuning again, and the rerun records the new setting."""
    workdir = copied(reference, tmp_path)
    changed = edited_config(tmp_path, "pvtune", "lr", 2.0e-4)
    run = start_snakemake(workdir, TARGET, config=changed)
    assert kill_job(workdir, run, "pvtune", 0.0) and run.wait(timeout=1800) != 0
    assert not (workdir / VARIANT / "pv" / "pvtune.json").exists() and (workdir / TARGET).exists()
    for target in ([TARGET], []):  # named, plain
        assert {"pvtune": 1, "evaluate_pvtuned": 1}.items() <= planned_jobs(workdir, *target, config=changed).items()
    result = run_snakemake(workdir, "--cores", "2", TARGET, config=changed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((workdir / VARIANT / "pv" / "pvtune.json").read_text())["settings"]["lr"] == 2.0e-4
    assert (workdir / TARGET).stat().st_mtime > (workdir / VARIANT / "pv" / "pvtune.json").stat().st_mtime
    assert planned_jobs(workdir, TARGET, config=changed) == {}


@pytest.mark.slow
@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_flipped_byte_in_a_finished_layer_fails_every_invocation_and_keeps_the_checkpoint(reference, tmp_path,
                                                                                            keep_mtime):
    """Whether or not the mtime was put back: the named target, a plain run and their dry runs stop
    while the DAG is built, naming the layer (Snakemake took a failing input function for a missing
    producer of the existing checkpoint, so a plain run used to pass); deleting the layer as advised
    reruns it and what follows."""
    workdir = copied(reference, tmp_path)
    layer = next((workdir / VARIANT / "layers").glob("*q_proj.safetensors"))
    _flip_byte(layer, -3, keep_mtime)  # inside the codes: same size, a valid file, one code changed
    checkpoint_before = artifacts.file_sha256(workdir / VARIANT / "model" / "model.safetensors")
    named = f"{VARIANT}/layers/{layer.name}: corrupt"
    for args in (["-n", TARGET], ["-n"], ["--cores", "2", TARGET], ["--cores", "2"]):
        result = run_snakemake(workdir, *args)
        output = result.stdout + result.stderr
        assert result.returncode != 0 and named in output, (args, output[-3000:])
        assert f"redo it: delete {VARIANT}/layers/{layer.name} and rerun" in output
    assert artifacts.file_sha256(workdir / VARIANT / "model" / "model.safetensors") == checkpoint_before
    # stitch itself refuses it too (run here as its job runs it)
    code = run_stage_module(stitch, stitch.StitchSettings(num_codebooks=2, nbits=6), stitch.StitchPaths(
        model_dir=workdir / "resources/models/tiny", layers_dir=(workdir / VARIANT / "layers",), output_dir=tmp_path / "out"))
    assert code == 2 and not (tmp_path / "out").exists()
    layer.unlink()  # the advice, literally
    after = {"quantize_layer": 1, "stitch": 1, "evaluate_quantized": 1, "pvtune": 1, "evaluate_pvtuned": 1}
    assert planned_jobs(workdir, TARGET) == after
    assert after.items() <= planned_jobs(workdir).items()


@pytest.mark.slow
def test_a_truncated_calibration_file_fails_every_invocation_and_deleting_it_recalibrates(reference, tmp_path):
    """Half an XᵀX file: refused while the DAG is built by every invocation, naming it (a rerun of the
    target used to say "Nothing to be done"); deleting it as advised recalibrates (the folder used to
    stay, and the layer jobs failed on the missing file) and the run ends equal to the reference."""
    workdir = copied(reference, tmp_path)
    xtx = workdir / CALIB / "block0.npz"
    xtx.write_bytes(xtx.read_bytes()[: xtx.stat().st_size // 2])
    for args in ([TARGET], []):
        code, output = dry_run_output(workdir, *args)
        assert code != 0 and f"aqflow: {CALIB}/block0.npz: corrupt: sha256" in output, output[-3000:]
        assert f"redo it: delete {CALIB}/block0.npz (or the folder {CALIB}) and rerun" in output
    xtx.unlink()
    assert planned_jobs(workdir, TARGET) == {"calibrate": 1, "stitch": 1, "evaluate_quantized": 1, "pvtune": 1,
                                             "evaluate_pvtuned": 1}  # and the layers, once calibrate has run
    result = run_snakemake(workdir, "--cores", "2", TARGET)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "block0.npz is missing from the folder" in result.stderr
    _every_artifact_checks(workdir)
    assert _outputs(workdir) == _outputs(reference)


@pytest.mark.slow
def test_a_change_the_dag_check_cannot_see_is_refused_by_the_stage_as_one_line(reference, tmp_path):
    """The DAG check trusts a file whose stat did not move since it hashed it. Bytes changed under an
    unchanged stat (a failing disk; here the digest cache made to vouch for them) pass it; the layer
    job reading them verifies them and fails with one line, in Snakemake's output and the rule's log."""
    workdir = copied(reference, tmp_path)
    assert run_snakemake(workdir, "-n", TARGET).returncode == 0  # the cache now holds every input's digest
    xtx = workdir / CALIB / "block0.npz"
    recorded = artifacts._parse_sums(xtx.parent / artifacts.SUMS_FILE)["block0.npz"]
    _corrupt(xtx, "flip")
    cache_file = digest_cache_path(workdir)
    cache = json.loads(cache_file.read_text())
    key = f"{CALIB}/block0.npz"
    cache[key] = list(stat_signature(xtx)) + [recorded]
    cache_file.write_text(json.dumps(cache))
    layer = f"{VARIANT}/layers/{NPZ_READER}.safetensors"  # the job that reads the flipped byte
    result = run_snakemake(workdir, "--cores", "1", "--force", layer)
    message = f"aqflow quantize-layer: error: {xtx.relative_to(workdir)}: corrupt: sha256"
    assert result.returncode != 0 and f"failed with exit code 2: {message}" in result.stdout + result.stderr
    log = _read_log(workdir / f"logs/quantize_layer/tiny/2bpp/greedy/b2e2/{NPZ_READER}.log")
    assert message in log and "Traceback" not in log


# --- corrupt and truncated artifacts, one of each kind, caught by the stage that reads them -----

def _corrupt(path: Path, fault: str) -> None:
    data = bytearray(path.read_bytes())
    if fault == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    artifacts._VERIFIED.clear()


CALIB = "results/tiny/calib/c4-standin-n8-t64-s0-fp"


def _calibrate(w):
    return (calibrate.CalibrateSettings(num_windows=8, window_tokens=64, device="cpu"),
            calibrate.CalibratePaths(model_dir=w / "resources/models/tiny", corpus=w / "resources/data/c4-standin.parquet",
                                     output_dir=w / "out"))


def _quantize(w, layer="model.layers.0.mlp.up_proj"):
    return (quantize_layer.QuantizeLayerSettings(device="cpu", quiet=True),
            quantize_layer.QuantizeLayerPaths(model_dir=w / "resources/models/tiny", calibration_dir=w / CALIB,
                                              layer=layer, output=w / "out.safetensors", metrics=w / "out.json"))


# A layer job verifies the bytes it reads (its site's array, against the manifest's digest), not
# the whole block file: the XᵀX fault is read by the job of the site whose array holds the file's
# middle, where `_corrupt` flips a byte (checked in the test); other sites' jobs read around it
# (tests/test_calibration.py checks both).
NPZ_READER, NPZ_MEMBER = "model.layers.0.mlp.down_proj", "xtx/mlp.down_proj.npy"


def _npz_member_span(path: Path, member: str) -> range:
    """The bytes of NPZ member `member` in the file (local header, name and extra field skipped)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, "rb") as handle:
        handle.seek(info.header_offset + 26)
        header = handle.read(4)
    start = info.header_offset + 30 + int.from_bytes(header[:2], "little") + int.from_bytes(header[2:], "little")
    return range(start, start + info.compress_size)


def _stitch(w):
    return (stitch.StitchSettings(num_codebooks=2, nbits=6, dtype="float32"),
            stitch.StitchPaths(model_dir=w / "resources/models/tiny", layers_dir=(w / VARIANT / "layers",),
                               output_dir=w / "out"))


def _report(w, pv_logs=()):
    return (report.ReportSettings(),
            report.ReportPaths(evals=(w / VARIANT / "eval.json",), csv=w / "s.csv", parquet=w / "s.parquet",
                               pareto=w / "p.png", layers=w / "l.png", pv_curves=w / "c.png" if pv_logs else None,
                               pv_logs=pv_logs))


STAGE_READS = {  # artifact (relative to the run) -> the stage and the settings and paths it reads it with
    "corpus parquet": ("resources/data/c4-standin.parquet", calibrate, _calibrate),
    "model safetensors": ("resources/models/tiny/model.safetensors", calibrate, _calibrate),
    "XᵀX npz": (f"{CALIB}/block0.npz", quantize_layer, lambda w: _quantize(w, NPZ_READER)),
    "XᵀX manifest parquet": (f"{CALIB}/manifest.parquet", quantize_layer, _quantize),
    "layer safetensors": (f"{VARIANT}/layers/model.layers.0.self_attn.q_proj.safetensors", stitch, _stitch),
    "layer metrics json": (f"{VARIANT}/layers/model.layers.0.self_attn.q_proj.json", stitch, _stitch),
    "checkpoint folder": (f"{VARIANT}/model/model.safetensors", pvtune, lambda w: (
        pvtune.PvtuneSettings(device="cpu", quiet=True),
        pvtune.PvtunePaths(model_dir=w / "resources/models/tiny", checkpoint_dir=w / VARIANT / "model",
                           corpus=w / "resources/data/c4-standin.parquet", output_dir=w / "out",
                           train_log=w / "log.parquet", metrics=w / "out.json"))),
    "PV-tuned folder": (f"{VARIANT}/pv/model/config.json", evaluate, lambda w: (
        evaluate.EvaluateSettings(device="cpu"),
        evaluate.EvaluatePaths(model_dir=w / VARIANT / "pv" / "model", output=w / "out.json",
                               data_dir=w / "resources/data"))),
    "PV-tuning log parquet": (f"{VARIANT}/pv/train_log.parquet", report,
                              lambda w: _report(w, pv_logs=(w / VARIANT / "pv" / "train_log.parquet",))),
    "eval json": (f"{VARIANT}/eval.json", report, _report),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["flip", "truncate"])
@pytest.mark.parametrize("kind", list(STAGE_READS))
def test_a_corrupt_or_truncated_artifact_is_an_error_naming_it(reference, tmp_path, capsys, kind, fault):
    relative, stage, request = STAGE_READS[kind]
    workdir = tmp_path / "run"
    subprocess.run(["cp", "-a", str(reference), str(workdir)], check=True)
    if kind == "XᵀX npz":
        assert (workdir / relative).stat().st_size // 2 in _npz_member_span(workdir / relative, NPZ_MEMBER)
    _corrupt(workdir / relative, fault)
    before = sorted(workdir.rglob("*"))
    code = run_stage_module(stage, *request(workdir))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{workdir / relative}: corrupt: sha256" in err[0] and "rerun" in err[0]
    assert sorted(workdir.rglob("*")) == before  # nothing written


# --- a full disk and a read-only results folder -------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only, as in CI); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("needs root to mount a tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _quantize_layer(inputs: Path, out: Path, seed: int = 42) -> int:
    """quantize-layer on a random 64x64 layer written to `inputs`, its result to `out`/l.*: its exit code."""
    if not (inputs / "w.safetensors").exists():
        generator = torch.Generator().manual_seed(0)
        weight, x = torch.randn(64, 64, generator=generator), torch.randn(256, 64, generator=generator)
        artifacts.save_safetensors(inputs / "w.safetensors", {"w": weight})
        artifacts.save_npz(inputs / "xtx.npz", {"xtx": (x.T @ x).double().numpy()})
    settings = quantize_layer.QuantizeLayerSettings(
        quantizer=QuantizerSettings(num_codebooks=1, nbits=4, max_epochs=1, kmeans_max_iter=5, seed=seed),
        device="cpu", quiet=True)
    paths = quantize_layer.QuantizeLayerPaths(weight=inputs / "w.safetensors", xtx=inputs / "xtx.npz",
                                              output=out / "l.safetensors", metrics=out / "l.json")
    return run_stage_module(quantize_layer, settings, paths)


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_no_half_pair(small_tmpfs, tmp_path, capsys):
    filler = small_tmpfs / "filler"
    out = small_tmpfs / "layers"
    out.mkdir()
    with open(filler, "wb") as handle:  # fill it
        handle.write(b"\0" * (os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize))
    code = _quantize_layer(tmp_path, out)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    assert str(out / "l.") in err[0]
    assert list(out.iterdir()) == []  # no lone metrics, no temporaries


def test_a_read_only_results_folder_is_one_line_and_keeps_the_finished_artifact(small_tmpfs, tmp_path, capsys):
    out = small_tmpfs / "layers"
    assert _quantize_layer(tmp_path, out) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert {path.stat().st_mode & 0o777 for path in out.iterdir()} == {0o666 & ~umask}  # not private 0600
    finished = {path.name: path.read_bytes() for path in out.iterdir()}
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    code = _quantize_layer(tmp_path, out, seed=7)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Read-only file system" in err[-1] and str(out / "l.json") in err[-1], err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == finished


def test_a_half_pair_is_refused_by_stitch(tmp_path):
    """A layer job killed between its two renames: the new metrics name other tensors than the old
    file beside them. (Built here directly; the kill window is too short to hit by timing.)"""
    from aqflow.checkpoint import check_layer_pair

    out = tmp_path / "layers"
    assert _quantize_layer(tmp_path, out) == 0
    old = {name: (out / name).read_bytes() for name in ("l.safetensors", "l.safetensors.sha256")}
    assert _quantize_layer(tmp_path, out, seed=7) == 0
    check_layer_pair(out / "l.safetensors")
    for name, data in old.items():  # the old tensors and their (valid) record, the new metrics
        (out / name).write_bytes(data)
    artifacts._VERIFIED.clear()
    with pytest.raises(ArtifactError, match="its metrics l.json were written for other tensors"):
        check_layer_pair(out / "l.safetensors")


def test_a_bug_keeps_its_traceback_and_an_input_error_does_not(tmp_path, capsys, monkeypatch):
    _quantize_layer(tmp_path, tmp_path / "first")  # writes the inputs
    argv = ["--weight", str(tmp_path / "w.safetensors"), "--xtx", str(tmp_path / "xtx.npz"), "--num-codebooks", "1",
            "--nbits", "4", "--max-epochs", "1", "--device", "cpu", "--quiet",
            "--output", str(tmp_path / "l.safetensors"), "--metrics", str(tmp_path / "l.json")]  # from a shell
    capsys.readouterr()
    monkeypatch.setattr(quantize_layer, "quantize_layer", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        quantize_layer.main(argv)
    (tmp_path / "w.safetensors").write_bytes(b"\0" * 16)
    assert quantize_layer.main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_aqflow_clean_removes_only_temporaries(tmp_path, capsys):
    from aqflow.__main__ import main

    artifacts.write_json(tmp_path / "results" / "a.json", {"x": 1})
    (tmp_path / "results" / ".a.json.abc.tmp").write_text("half")
    (tmp_path / "results" / "x" / ".model.k.partial").mkdir(parents=True)
    artifacts.write_json(tmp_path / "results" / "x" / "gone.json", {})
    (tmp_path / "results" / "x" / "gone.json").unlink()  # as Snakemake removes a failed job's outputs
    assert main(["clean", str(tmp_path / "results")]) == 0
    assert sorted(p.name for p in (tmp_path / "results").rglob("*")) == ["a.json", "a.json.sha256", "x"]
    assert "removed 3 temporaries" in capsys.readouterr().out


def test_a_child_started_by_a_job_dies_with_it(tmp_path):
    """What run_stage_on_gpus and calibrate do for torchrun (and torchrun's workers for
    themselves): a SIGKILLed job takes its child along, so nothing writes outputs afterwards."""
    pid_file = tmp_path / "child.pid"
    job = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from aqflow.stagekit.processes import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], preexec_fn=die_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n")], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _alive(child):
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its killed parent")
