"""XᵀX at the headline's size: stored in float32 (what the quantizer computes with), and summed in
several passes over the windows when all blocks' float64 sums do not fit the card at once."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pandas as pd
import pytest
import torch

from aqflow.calibration import load_block_xtx
from aqflow.data.offline_text import split_documents, write_split_corpus
from aqflow.models import build_tiny_llama
from aqflow.quant.quantize import QuantizerSettings, quantize_layer
from aqflow.stages import calibrate as calibrate_stage
from tests.conftest import anisotropic_xtx

WORDS = "a quiet river ran past old walls while birds crossed the grey sky above the market".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", num_layers=3, seed=5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(3)
    docs = pd.DataFrame({"doc_id": [f"d/{i}" for i in range(6)],
                         "text": [" ".join(rng.choice(WORDS, size=200)) for _ in range(6)], "source": "d"})
    path = tmp_path_factory.mktemp("corpus") / "docs.parquet"
    write_split_corpus(split_documents(docs, 0.5, seed=0), path, 0, 0.5)
    return path


def calibrate(model_dir, corpus, out_dir, **settings):
    calibrate_stage.run(
        calibrate_stage.CalibrateSettings(num_windows=4, window_tokens=16, batch_size=2, device="cpu", quiet=True, **settings),
        calibrate_stage.CalibratePaths(model_dir=model_dir, corpus=corpus, output_dir=out_dir))
    return json.loads((out_dir / "calibration.json").read_text())


def test_block_groups_are_consecutive_maximal_and_within_budget():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 10) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(1, 30)
        groups = calibrate_stage.block_groups(sizes, budget)
        assert [block for group in groups for block in group] == list(range(len(sizes)))
        for group, following in zip(groups, groups[1:] + [None]):
            used = sum(sizes[block] for block in group)
            assert used <= budget or len(group) == 1  # a block larger than the budget goes alone
            if following is not None:  # greedy: the next block would not have fitted
                assert used + sizes[following[0]] > budget
    assert calibrate_stage.block_groups([5, 5, 5], float("inf")) == [[0, 1, 2]]


def test_blocks_summed_in_several_passes_equal_one_pass(model_dir, corpus, tmp_path, capsys):
    one = calibrate(model_dir, corpus, tmp_path / "one")
    capsys.readouterr()
    # room for one block's sums at a time: three passes over the windows
    several = calibrate(model_dir, corpus, tmp_path / "three", xtx_memory_gib=1e-9)
    assert "pass 3 of 3" in capsys.readouterr().out
    assert several["layers"] == one["layers"] and several["sites"] == one["sites"] == 12
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "three" / "manifest.parquet").drop(columns="source_data_id"),
                                  pd.read_parquet(tmp_path / "one" / "manifest.parquet").drop(columns="source_data_id"))
    for block in range(3):
        a, b = (load_block_xtx(tmp_path / run / f"block{block}.npz") for run in ("one", "three"))
        for site in a.sites:
            assert torch.equal(a.xtx[site.site_id], b.xtx[site.site_id])  # bit for bit


def test_stored_xtx_is_float32_and_the_quantizer_gives_the_same_layer_as_from_the_float64_sums(rng):
    xtx64 = anisotropic_xtx(64, 2048, rng)
    stored = torch.from_numpy(xtx64.numpy().astype(np.float32))  # what save_block_xtx writes
    weight = torch.randn(32, 64, generator=rng)
    settings = QuantizerSettings(num_codebooks=2, nbits=4, beam_size=4, max_epochs=3, steps_per_epoch=20,
                                 relative_tolerance=0.0, oaem_steps=20, kmeans_max_iter=30)
    for init in ("greedy", "oaem"):
        a, report_a = quantize_layer(weight, xtx64, dataclasses.replace(settings, init=init), progress=False)
        b, report_b = quantize_layer(weight, stored, dataclasses.replace(settings, init=init), progress=False)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.codebooks, b.codebooks) and torch.equal(a.scales, b.scales)
        assert report_a.final_relative_mse == report_b.final_relative_mse


def test_calibration_files_hold_float32(model_dir, corpus, tmp_path):
    calibrate(model_dir, corpus, tmp_path / "c")
    manifest = pd.read_parquet(tmp_path / "c" / "manifest.parquet")
    assert set(manifest["dtype"]) == {"float32"}
    assert load_block_xtx(tmp_path / "c" / "block0.npz").xtx[manifest["site"][0]].dtype == torch.float32


def test_cpu_budget_is_the_hosts_available_memory_less_a_forward_pass(monkeypatch):
    """On a CPU the sums get what the host has free, not everything: a 1.5B model's float64 sums
    (~20 GB) would otherwise be allocated at once and the process killed on a 24 GB machine."""
    import psutil

    available = 40 * 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": available})())
    settings = calibrate_stage.CalibrateSettings(device="cpu", batch_size=2)
    budget = calibrate_stage.xtx_budget_bytes(settings, window_tokens=128, widest_input=1024)
    assert budget == available - (4 * 2**30 + 2 * 8 * 2 * 128 * 1024)
    explicit = calibrate_stage.xtx_budget_bytes(dataclasses.replace(settings, xtx_memory_gib=2.0), 128, 1024)
    assert explicit == 2 * 2**30
