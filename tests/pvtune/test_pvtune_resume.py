"""Resumable PV-tuning on a tiny random Llama, on CPU: a run killed after some step and resumed
from its saved state gives exactly the held-out curve, the selected step and the final weights
of an uninterrupted run; a state of other settings is never resumed from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aqflow.pvtune import train as pvtrain
from aqflow.pvtune.resume import Resumer, whole_steps
from aqflow.pvtune.student import load_student
from test_pvtune import QUICK, _teacher, setup  # noqa: F401  (setup is a fixture)

# 16 training windows, 8 per step: 2 steps per epoch, 3 epochs; a large lr so that codes move
SETTINGS = pvtrain.PVSettings(epochs=3, **(QUICK | dict(lr=3e-2, code_lr=3e-2, eval_every_steps=1)))


class Killed(Exception):
    """Stands for the job being killed right after a held-out evaluation."""


def _run(setup, resumer=None, kill_at=None):
    student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)

    def maybe_kill(row):
        if kill_at is not None and row["step"] == kill_at:
            raise Killed

    result = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                           SETTINGS, "cpu", progress=False, on_eval=maybe_kill, resumer=resumer)
    return result, student


def _curve(result):
    return [(row["step"], row["kl"], row["perplexity"]) for row in result.log if row["split"] == "heldout"]


@pytest.fixture(scope="module")
def uninterrupted(setup):
    torch.manual_seed(0)
    return _run(setup)


@pytest.mark.parametrize("every, kill_at, resumed_after", [(2, 3, 2), (1, 4, 3)])  # an epoch boundary; mid-epoch
def test_a_resumed_run_equals_an_uninterrupted_one(setup, uninterrupted, tmp_path, capsys, every, kill_at, resumed_after):
    reference, reference_student = uninterrupted
    resumer = Resumer(tmp_path / "state", every, {"run": "test"})
    torch.manual_seed(0)
    with pytest.raises(Killed):
        _run(setup, resumer, kill_at=kill_at)
    assert whole_steps(tmp_path / "state", 1) == [resumed_after]  # the older whole states are gone
    torch.manual_seed(123)  # the saved RNG state, not this one, must drive the rest
    resumed, resumed_student = _run(setup, resumer)
    assert f"resuming PV-tuning after step {resumed_after}" in capsys.readouterr().out
    assert _curve(resumed) == _curve(reference) and len(_curve(reference)) == 7
    assert [row["kl"] for row in resumed.log if row["split"] == "train"] == \
           [row["kl"] for row in reference.log if row["split"] == "train"]
    assert resumed.best_step == reference.best_step and resumed.steps == reference.steps
    reference_state, resumed_state = reference_student.state_dict(), resumed_student.state_dict()
    assert reference_state.keys() == resumed_state.keys()
    for key in reference_state:
        assert torch.equal(reference_state[key], resumed_state[key]), key


def test_a_state_of_other_settings_is_not_resumed_from(setup, uninterrupted, tmp_path, capsys):
    with pytest.raises(Killed):
        _run(setup, Resumer(tmp_path / "state", 1, {"lr": 1}), kill_at=3)
    torch.manual_seed(0)
    other, _ = _run(setup, Resumer(tmp_path / "state", 0, {"lr": 2}))
    assert "other settings or inputs; starting from step 0" in capsys.readouterr().out
    assert _curve(other) == _curve(uninterrupted[0])


def _two_process_worker(rank: int, world_size: int, init_file: str, setup: dict, out_dir: str) -> None:
    """Rank `rank` of two gloo processes: an uninterrupted run, a run killed after step 3 with its
    state saved every 2 steps, and its resumed run; writes what the two full runs ended with."""
    import json
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        settings = pvtrain.PVSettings(epochs=2, **(QUICK | dict(lr=3e-2, code_lr=3e-2, eval_every_steps=1,
                                                                micro_batch_size=2)))
        resumer = Resumer(Path(out_dir) / "state", 2, {"run": "two processes"})
        runs = {}
        for name, kill_at, with_state in (("uninterrupted", None, False), ("killed", 3, True), ("resumed", None, True)):
            student, teacher = load_student(setup["aqlm_dir"]), _teacher(setup)

            def maybe_kill(row, kill_at=kill_at):
                if kill_at is not None and row["step"] == kill_at:
                    raise Killed

            torch.manual_seed(0 if name != "resumed" else 123)
            try:
                result = pvtrain.train(student, teacher, setup["data"].train.input_ids, setup["data"].heldout.input_ids,
                                       settings, "cpu", progress=False, on_eval=maybe_kill,
                                       resumer=resumer if with_state else None)
            except Killed:
                continue
            runs[name] = {"curve": _curve(result), "codes": {k: v.tolist() for k, v in result.student_state.items()
                                                             if k.endswith(".codes")},
                          "weights": {k: v.flatten()[:64].tolist() for k, v in result.student_state.items()
                                      if k.endswith("weight") and v.is_floating_point()}}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(runs, handle)
    finally:
        dist.destroy_process_group()


def test_two_processes_resume_their_sharded_state_where_they_stopped(setup, tmp_path):
    """Each process saves its own shards; killed after step 3 and started again, the two resume
    from step 2's whole state and end exactly where an uninterrupted two-process run does."""
    import json

    import torch.multiprocessing as mp

    setup_plain = {key: setup[key] for key in ("aqlm_dir", "model_dir", "data")}
    mp.start_processes(_two_process_worker, args=(2, str(tmp_path / "init"), setup_plain, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert runs.keys() == {"uninterrupted", "resumed"}
        assert runs["resumed"] == runs["uninterrupted"] and len(runs["resumed"]["curve"]) == 5
    assert whole_steps(tmp_path / "state", 2) == [2]  # one folder per process, the kill's last whole step
