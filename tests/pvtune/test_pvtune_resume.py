"""Resumable PV-tuning on a tiny random Llama, on CPU: a run killed after some step and resumed
from its saved state gives exactly the held-out curve, the selected step and the final weights
of an uninterrupted run; a state of other settings is never resumed from."""

from __future__ import annotations

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
