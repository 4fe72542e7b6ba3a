"""Warm workers (aqflow.jobs.warm_workers): a job's stage call run by a long-lived worker of its slot
gives the same artifacts as the job's own process, one worker serves a slot's jobs one after
another, slots are exclusive, and failures reach the job as they would in process."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from aqflow.io import artifacts
from aqflow.jobs import warm_workers
from aqflow.jobs.stage_jobs import execute_logged

pytestmark = pytest.mark.skipif(not warm_workers.supported(), reason="warm workers need Linux")

IDLE_SECONDS = 5.0


def layer_inputs(folder: Path) -> dict:
    """A random 64x96 layer and its XᵀX on disk: quantize-layer's paths for it (outputs under folder)."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 96, generator=generator), torch.randn(512, 96, generator=generator)
    artifacts.save_safetensors(folder / "w.safetensors", {"w": weight})
    artifacts.save_npz(folder / "xtx.npz", {"xtx": (x.T @ x).double().numpy()})
    return {"weight": str(folder / "w.safetensors"), "xtx": str(folder / "xtx.npz")}


SETTINGS = {"quantizer": {"num_codebooks": 2, "nbits": 4, "group_size": 8, "beam_size": 2, "max_epochs": 2,
                          "steps_per_epoch": 20, "kmeans_max_iter": 20, "init": "oaem", "seed": 7},
            "device": "cpu", "quiet": True}


def request(folder: Path, inputs: dict, name: str, settings: dict = SETTINGS) -> dict:
    outputs = [str(folder / f"{name}.safetensors"), str(folder / f"{name}.json")]
    return {"stage": "quantize-layer", "settings": settings,
            "paths": inputs | {"output": outputs[0], "metrics": outputs[1]},
            "log": str(folder / f"{name}.log"), "outputs": outputs, "cwd": str(folder)}


def worker_pid(log: Path) -> int:
    """The worker that ran a job, from the note in the job's log."""
    return int(re.search(r"run by warm worker (\d+)", log.read_text()).group(1))


def test_a_workers_artifacts_equal_the_jobs_own_and_one_worker_serves_the_slots_jobs(tmp_path):
    inputs = layer_inputs(tmp_path)
    pool = tmp_path / "pool"
    in_process = request(tmp_path, inputs, "own")
    assert execute_logged(in_process["stage"], in_process["settings"], in_process["paths"], in_process["log"],
                          in_process["outputs"]) == (0, "")
    first, second = request(tmp_path, inputs, "first"), request(tmp_path, inputs, "second")
    assert warm_workers.run_in_worker(first, pool, IDLE_SECONDS) == (0, "")
    assert warm_workers.run_in_worker(second, pool, IDLE_SECONDS) == (0, "")
    own = artifacts.load_safetensors(tmp_path / "own.safetensors")
    for name in ("first", "second"):
        served = artifacts.load_safetensors(tmp_path / f"{name}.safetensors")
        assert served.keys() == own.keys()
        for key in own:
            assert torch.equal(served[key], own[key]), (name, key)
    # the second job found the first job's worker warm (the slot's one worker, its job 2)
    assert worker_pid(tmp_path / "first.log") == worker_pid(tmp_path / "second.log") != os.getpid()
    assert "its job 2" in (tmp_path / "second.log").read_text()


def test_slots_are_exclusive_while_held_and_reused_when_free(tmp_path):
    first_lock, first = warm_workers.take_slot(tmp_path, "0")
    second_lock, second = warm_workers.take_slot(tmp_path, "0")
    other_card_lock, other_card = warm_workers.take_slot(tmp_path, "1")
    assert first_lock.name.endswith(".0.slot0.lock") and second_lock.name.endswith(".0.slot1.lock")
    assert other_card_lock.name.endswith(".1.slot0.lock")
    assert len({warm_workers.worker_address(path) for path in (first_lock, second_lock, other_card_lock)}) == 3
    first.close()
    again_lock, again = warm_workers.take_slot(tmp_path, "0")
    assert again_lock == first_lock
    for handle in (second, other_card, again):
        handle.close()


def test_an_input_error_or_a_bug_fails_only_its_job_and_the_worker_survives_it(tmp_path):
    inputs = layer_inputs(tmp_path)
    pool = tmp_path / "pool"
    broken = request(tmp_path, inputs | {"weight": str(tmp_path / "missing.safetensors")}, "broken")
    code, message = warm_workers.run_in_worker(broken, pool, IDLE_SECONDS)
    assert code == 2 and "missing.safetensors" in message and "\n" not in message
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "after"), pool, IDLE_SECONDS) == (0, "")
    assert worker_pid(tmp_path / "broken.log") == worker_pid(tmp_path / "after.log")
    assert not (tmp_path / "broken.safetensors").exists()
    # a bug (here: a setting the stage does not have) fails its job alone, naming the error
    code, message = warm_workers.run_in_worker(request(tmp_path, inputs, "buggy", dict(SETTINGS, bogus=1)), pool,
                                               IDLE_SECONDS)
    assert code == 1 and "TypeError" in message and "bogus" in message
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "survived"), pool, IDLE_SECONDS) == (0, "")
    assert worker_pid(tmp_path / "survived.log") == worker_pid(tmp_path / "after.log")


def test_a_worker_that_dies_during_a_job_fails_that_job_and_the_next_job_starts_a_new_one(tmp_path):
    inputs = layer_inputs(tmp_path)
    pool = tmp_path / "pool"
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "warm"), pool, IDLE_SECONDS) == (0, "")
    doomed = worker_pid(tmp_path / "warm.log")
    slow = dict(SETTINGS, quantizer=SETTINGS["quantizer"] | {"max_epochs": 200, "relative_tolerance": 0.0})
    killer = threading.Timer(1.0, os.kill, (doomed, signal.SIGKILL))
    killer.start()
    code, message = warm_workers.run_in_worker(request(tmp_path, inputs, "killed", slow), pool, IDLE_SECONDS)
    killer.join()
    assert code == 1 and "warm worker running this job died" in message
    assert not (tmp_path / "killed.safetensors").exists()
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "next"), pool, IDLE_SECONDS) == (0, "")
    assert worker_pid(tmp_path / "next.log") != doomed


def test_an_idle_worker_exits(tmp_path):
    inputs = layer_inputs(tmp_path)
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "one"), tmp_path / "pool", 1.0) == (0, "")
    pid = worker_pid(tmp_path / "one.log")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid):
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def test_the_dags_layer_jobs_in_warm_workers_write_what_they_write_in_their_own_processes(tmp_path):
    """The tiny DAG's layer jobs with `execution.warm_workers` on: the same layer artifacts as with
    it off, and two job slots (--cores 2) served by at most two workers."""
    import yaml

    from snakemake_runs import REPO, snakemake

    target = "results/tiny/2bpp/greedy/b2e2/model"
    runs = {}
    for warm in (False, True):
        workdir = tmp_path / ("warm" if warm else "own")
        workdir.mkdir()
        overrides = workdir / "execution.yaml"
        overrides.write_text(yaml.safe_dump({"execution": {"warm_workers": warm, "warm_worker_idle_seconds": 5}}))
        started = time.perf_counter()
        result = snakemake(workdir, [REPO / "tests" / "workflow" / "config.tiny.yaml", overrides], "--cores", "2", target)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[warm] = (workdir, time.perf_counter() - started)
    layers = sorted((runs[False][0] / target).parent.glob("layers/*.safetensors"))
    assert len(layers) > 2
    for path in layers:
        own = artifacts.load_safetensors(path)
        served = artifacts.load_safetensors(runs[True][0] / path.relative_to(runs[False][0]))
        assert all(torch.equal(served[key], own[key]) for key in own), path.name
    logs = sorted((runs[True][0] / "logs" / "quantize_layer").rglob("*.log"))
    assert len(logs) == len(layers) and len({worker_pid(log) for log in logs}) <= 2
    assert not any("warm worker" in log.read_text() for log in (runs[False][0] / "logs" / "quantize_layer").rglob("*.log"))
    print(f"tiny DAG to {target}: {runs[False][1]:.1f} s with a process per job, {runs[True][1]:.1f} s with warm workers")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_worker_serves_only_its_own_users_jobs(tmp_path):
    """Another user's process reaches the abstract socket (no file permissions) but gets no answer,
    and nothing is run for it."""
    inputs = layer_inputs(tmp_path)
    pool = tmp_path / "pool"
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "mine"), pool, IDLE_SECONDS) == (0, "")
    slot_lock, held = warm_workers.take_slot(pool, warm_workers.card_key())
    held.close()
    address = warm_workers.worker_address(slot_lock)
    child = os.fork()
    if child == 0:  # as nobody: connect to the worker and ask for a job
        try:
            os.setgid(65534)
            os.setuid(65534)
            client = warm_workers.connect(address)
            with client, client.makefile("rw") as stream:
                warm_workers.send_message(stream, request(tmp_path, inputs, "theirs"))
                os._exit(0 if warm_workers.receive_message(stream) is None else 1)
        except (BrokenPipeError, ConnectionResetError):  # the worker hung up at once
            os._exit(0)
        except BaseException as error:
            os.write(2, f"the child as nobody: {error!r}\n".encode())
            os._exit(2)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (tmp_path / "theirs.safetensors").exists() and not (tmp_path / "theirs.log").exists()
    assert warm_workers.run_in_worker(request(tmp_path, inputs, "mine-again"), pool, IDLE_SECONDS) == (0, "")
    assert worker_pid(tmp_path / "mine.log") == worker_pid(tmp_path / "mine-again.log")


def test_auto_wants_workers_only_where_the_job_sees_a_card_and_is_no_batch_job(tmp_path):
    cards = tmp_path / "gpus"
    assert warm_workers.wanted(True, {"SLURM_JOB_ID": "7"}, cards) is True  # as given
    assert warm_workers.wanted(False, {}, cards) is False
    assert warm_workers.wanted("auto", {}, cards) is False  # no driver folder: a CPU machine
    cards.mkdir()
    assert warm_workers.wanted("auto", {}, cards) is False  # the driver sees no card
    (cards / "0000:19:00.0").mkdir()
    assert warm_workers.wanted("auto", {}, cards) is True
    assert warm_workers.wanted("auto", {"CUDA_VISIBLE_DEVICES": "0"}, cards) is True
    for hidden in ("", "-1"):
        assert warm_workers.wanted("auto", {"CUDA_VISIBLE_DEVICES": hidden}, cards) is False
    for batch in warm_workers.BATCH_JOB_VARIABLES:
        assert warm_workers.wanted("auto", {batch: "123"}, cards) is False


def test_a_workers_address_names_its_code_so_an_edit_gets_a_new_worker(tmp_path):
    package = tmp_path / "aqflow"
    package.mkdir()
    module = package / "stage.py"
    module.write_text("x = 1\n")
    before = warm_workers.code_fingerprint.__wrapped__(package)
    assert warm_workers.code_fingerprint.__wrapped__(package) == before
    module.write_text("x = 22\n")
    after = warm_workers.code_fingerprint.__wrapped__(package)
    assert after != before
    lock = tmp_path / "host.0.slot0.lock"
    assert warm_workers.worker_address(lock, before) != warm_workers.worker_address(lock, after)
    assert warm_workers.worker_address(lock, before) == warm_workers.worker_address(lock, before)
