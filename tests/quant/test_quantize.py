"""The alternating loop: a decreasing objective, reproducibility, and inputs refused by name."""

import dataclasses
import math
import re

import pytest
import torch

from aqflow.quant import QuantizerSettings, quantize_layer
from aqflow.quant.objective import relative_output_mse
from aqflow.quant.validation import QuantizationInputError
from tests.conftest import anisotropic_xtx

SMALL = QuantizerSettings(
    num_codebooks=2, nbits=4, beam_size=4, max_epochs=6, steps_per_epoch=30, relative_tolerance=0.0, oaem_steps=30, kmeans_max_iter=50
)


@pytest.fixture
def layer(rng):
    xtx = anisotropic_xtx(64, 1024, rng).float()
    weight = torch.randn(48, 64, generator=rng)
    return weight, xtx


@pytest.mark.parametrize("init", ["greedy", "oaem"])
def test_loop_lowers_the_objective_epoch_after_epoch(layer, init):
    weight, xtx = layer
    quantized, report = quantize_layer(weight, xtx, dataclasses.replace(SMALL, init=init), progress=False)
    history = [report.init_relative_mse] + [e["relative_mse"] for e in report.epochs]
    assert len(report.epochs) == SMALL.max_epochs
    assert all(b <= a * (1 + 1e-6) for a, b in zip(history, history[1:])), history
    assert history[-1] < 0.9 * history[0], history
    # the report is the truth about the returned layer
    assert float(relative_output_mse(weight, quantized.weight(), xtx)) == pytest.approx(history[-1], rel=1e-4)
    assert quantized.codes.shape == (48, 8, 2) and quantized.codebooks.shape == (2, 16, 1, 8)
    assert quantized.scales.shape == (48, 1, 1, 1)


def test_tolerance_stops_early(layer):
    weight, xtx = layer
    _, report = quantize_layer(weight, xtx, dataclasses.replace(SMALL, max_epochs=50, relative_tolerance=0.05), progress=False)
    assert report.stopped_because == "relative_tolerance"
    assert len(report.epochs) < 50
    last, before = report.epochs[-1]["relative_mse"], report.epochs[-2]["relative_mse"] if len(report.epochs) > 1 else report.init_relative_mse
    assert before - last < 0.05 * before


def test_same_seed_same_result_and_other_seed_differs(layer):
    weight, xtx = layer
    a, ra = quantize_layer(weight, xtx, SMALL, progress=False)
    b, rb = quantize_layer(weight, xtx, SMALL, progress=False)
    c, _ = quantize_layer(weight, xtx, dataclasses.replace(SMALL, seed=7), progress=False)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.codebooks, b.codebooks) and torch.equal(a.scales, b.scales)
    assert ra.final_relative_mse == rb.final_relative_mse
    assert not torch.equal(a.codes, c.codes)


def _bad_cases(weight, xtx):
    nan_weight = weight.clone()
    nan_weight[3, 5] = math.nan
    inf_xtx = xtx.clone()
    inf_xtx[0, 0] = math.inf
    return [
        (weight[:, :60], xtx[:60, :60], SMALL, "not divisible by group_size"),
        (nan_weight, xtx, SMALL, "weight contains NaN"),
        (weight, inf_xtx, SMALL, "XᵀX contains Inf"),
        (weight, xtx[:, :32], SMALL, "must be a square matrix"),
        (weight, xtx[:32, :32], SMALL, "must be 64x64"),
        (weight, xtx, dataclasses.replace(SMALL, nbits=0), "nbits=0 is out of range"),
        (weight, xtx, dataclasses.replace(SMALL, nbits=17), "nbits=17 is out of range"),
        (weight, xtx, dataclasses.replace(SMALL, nbits=12), "only 384 weight groups"),
        (weight, xtx, dataclasses.replace(SMALL, init="kmeans++"), "init='kmeans++' is unknown"),
        (weight, xtx, dataclasses.replace(SMALL, beam_size=0), "beam_size=0"),
    ]


def test_bad_inputs_fail_with_an_error_naming_the_problem(layer):
    for weight, xtx, settings, message in _bad_cases(*layer):
        with pytest.raises(QuantizationInputError, match=re.escape(message)):
            quantize_layer(weight, xtx, settings, progress=False)


def test_a_patient_stop_rule_continues_the_same_trajectory_to_a_lower_error(layer):
    """oaem-patient is OA-EM's start and loop; only the stop waits for three slow epochs in a row:
    its history extends OA-EM's epoch for epoch and ends no higher."""
    weight, xtx = layer
    settings = dataclasses.replace(SMALL, max_epochs=40, relative_tolerance=0.02)
    _, plain = quantize_layer(weight, xtx, dataclasses.replace(settings, init="oaem"), progress=False)
    _, patient = quantize_layer(weight, xtx, dataclasses.replace(settings, init="oaem-patient"), progress=False)
    assert plain.stopped_because == "relative_tolerance" and len(patient.epochs) >= len(plain.epochs) + 2
    assert patient.init_relative_mse == plain.init_relative_mse
    assert [e["relative_mse"] for e in patient.epochs[:len(plain.epochs)]] == [e["relative_mse"] for e in plain.epochs]
    assert patient.epochs[-1]["relative_mse"] <= plain.epochs[-1]["relative_mse"]
    if patient.stopped_because == "relative_tolerance":  # the last three epochs each gained < 2 %
        history = [patient.init_relative_mse] + [e["relative_mse"] for e in patient.epochs]
        assert all(a - b < 0.02 * a for a, b in zip(history[-4:], history[-3:]))
    # an explicit stop_patience does the same for any init
    _, explicit = quantize_layer(weight, xtx, dataclasses.replace(settings, init="oaem", stop_patience=3), progress=False)
    assert [e["relative_mse"] for e in explicit.epochs] == [e["relative_mse"] for e in patient.epochs]
