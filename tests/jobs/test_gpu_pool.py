"""Jobs of one node spread over its cards: the least-held cards are chosen, live jobs keep theirs,
exited jobs free theirs, and concurrent jobs never pick from a stale view."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest

from aqflow.jobs import gpu_pool


def test_least_loaded_takes_the_cards_with_fewest_holders_earlier_first():
    cards = ["0", "1", "2", "3"]
    assert gpu_pool.least_loaded({}, cards, 1) == ["0"]
    assert gpu_pool.least_loaded({"0": [11], "1": [12, 13], "2": [14]}, cards, 1) == ["3"]
    assert gpu_pool.least_loaded({"0": [11], "1": [12, 13], "2": [14]}, cards, 2) == ["0", "3"]
    assert gpu_pool.least_loaded({"0": [1, 2], "3": [4]}, cards, 3) == ["1", "2", "3"]
    with pytest.raises(ValueError, match="cannot choose 5"):
        gpu_pool.least_loaded({}, cards, 5)


def test_visible_gpus_follow_cuda_visible_devices():
    assert gpu_pool.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5,7"}) == ["2", "5", "7"]
    assert gpu_pool.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_nvidia_smi_is_asked_once_per_boot_and_never_for_a_cpu_job(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    asked = []
    monkeypatch.setattr(gpu_pool, "nvidia_smi_gpus", lambda: asked.append(1) or ["0", "1"])
    monkeypatch.setattr(gpu_pool, "boot_id", lambda: "boot-a")
    assert gpu_pool.pin_job_gpus(0, tmp_path) == [] and asked == []  # a CPU job lists nothing
    assert gpu_pool.visible_gpus(pool_dir=tmp_path) == ["0", "1"]
    assert gpu_pool.visible_gpus(pool_dir=tmp_path) == ["0", "1"]
    assert gpu_pool.pin_job_gpus(1, tmp_path, pid=os.getpid()) in (["0"], ["1"])
    assert len(asked) == 1  # later jobs of this boot read the kept listing
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # set by the pin
    monkeypatch.setattr(gpu_pool, "boot_id", lambda: "boot-b")  # a reboot (cards may have changed)
    assert gpu_pool.visible_gpus(pool_dir=tmp_path) == ["0", "1"] and len(asked) == 2
    monkeypatch.setattr(gpu_pool, "nvidia_smi_gpus", lambda: asked.append(1) or [])
    monkeypatch.setattr(gpu_pool, "boot_id", lambda: "boot-c")
    assert gpu_pool.visible_gpus(pool_dir=tmp_path) == [] and gpu_pool.visible_gpus(pool_dir=tmp_path) == []
    assert len(asked) == 4  # a failed or empty listing is not kept: asked again


def _hold_a_card(pool_dir, chosen, release):
    chosen.put((os.getpid(), gpu_pool.pin_job_gpus(1, pool_dir)))
    release.wait(60)  # stay alive (holding the card) until the test lets this job go


def test_concurrent_jobs_spread_evenly_and_exited_jobs_free_their_cards(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    context = multiprocessing.get_context("fork")
    chosen = context.Queue()
    releases = [context.Event() for _ in range(8)]
    jobs = [context.Process(target=_hold_a_card, args=(tmp_path, chosen, release)) for release in releases]
    for job in jobs:
        job.start()
    picks = dict(chosen.get(timeout=60) for _ in jobs)  # {pid: [card]}
    assert Counter(cards[0] for cards in picks.values()) == {"0": 2, "1": 2, "2": 2, "3": 2}
    state = json.loads((tmp_path / f"{socket.gethostname()}.json").read_text())
    assert sorted(len(pids) for pids in state.values()) == [2, 2, 2, 2]
    # the two jobs on card 2 end: the next job goes there, and takes nothing from the live ones
    for job, release in zip(jobs, releases):
        if picks[job.pid] == ["2"]:
            release.set()
            job.join(60)
    assert gpu_pool.pin_job_gpus(1, tmp_path) == ["2"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    for job, release in zip(jobs, releases):
        release.set()
        job.join(60)


def test_a_multi_gpu_job_takes_several_cards_and_one_card_or_none_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert gpu_pool.pin_job_gpus(2, tmp_path, pid=os.getpid()) == ["4", "5"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert gpu_pool.pin_job_gpus(9, tmp_path) == ["4", "5", "6"]  # more than visible: all of them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_pool.pin_job_gpus(1, tmp_path) == ["3"]
    assert gpu_pool.pin_job_gpus(0, tmp_path) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_pool.pin_job_gpus(1, tmp_path) == []


def test_the_chosen_card_reaches_a_rule_script_before_torch_starts(tmp_path):
    """The pin happens in `run_stage` before the stage module (and torch) is imported, so the
    stage's process sees only its card."""
    script = (
        "import os, sys, types\n"
        "from aqflow.jobs import workflow_glue\n"
        "snakemake = types.SimpleNamespace(resources=types.SimpleNamespace(gpu=1), log=[sys.argv[1]])\n"
        "workflow_glue.pin_job_gpus(workflow_glue.job_gpus(snakemake))\n"
        "print(os.environ['CUDA_VISIBLE_DEVICES'], 'torch' in sys.modules)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1", AQFLOW_GPU_POOL_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", script, str(tmp_path / "log")], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["0", "False"]


def test_gpu_node_profile_gives_pvtune_two_cards(tmp_path):
    """profiles/gpu-node parses and reaches the jobs: pvtune asks for 2 GPUs (torchrun over two
    cards), the rest as config.yaml says (dry run of the tiny model's PV target)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(repo / "Snakefile"), "--profile", str(repo / "profiles" / "gpu-node"),
         "--directory", str(tmp_path), "--dry-run", "results/tiny/2bpp/greedy/b8/pv/pvtune.json"],
        capture_output=True, text=True, cwd=repo, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = dict(re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", result.stdout, flags=re.M))
    assert re.search(r"\bgpu=2\b", jobs["pvtune"]) and re.search(r"\bgpu=0\b", jobs["fetch_model"])
