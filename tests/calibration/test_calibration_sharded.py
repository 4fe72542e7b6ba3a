"""Calibration sharded over processes (torchrun, gloo on CPU) equals the single-process result."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from aqflow.calibration import load_block_xtx
from aqflow.calibration.sharded import collect_xtx_fp_sharded, shard_bounds, shard_devices
from aqflow.data.offline_text import split_documents, write_split_corpus
from aqflow.models import build_tiny_llama, load_causal_lm
from aqflow.stages import calibrate as calibrate_stage

WORDS = ("the river ran past old stone walls while birds crossed a grey sky and children counted "
         "boats under the bridge near a quiet market full of bread fruit and loud voices").split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(7)
    docs = pd.DataFrame({
        "doc_id": [f"docs/{i:02d}" for i in range(8)],
        "text": [" ".join(rng.choice(WORDS, size=300)) for _ in range(8)],
        "source": "docs",
    })
    path = tmp_path_factory.mktemp("corpus") / "docs.parquet"
    write_split_corpus(split_documents(docs, 0.5, seed=0), path, 0, 0.5)
    return path


def calibrate(model_dir, corpus, out_dir, *extra: str) -> subprocess.CompletedProcess:
    argv = ["calibrate", "--model-dir", str(model_dir), "--corpus", str(corpus), "--output-dir", str(out_dir),
            "--num-windows", "5", "--window-tokens", "16", "--seed", "1", "--batch-size", "2", "--device", "cpu",
            "--quiet", *extra]
    return subprocess.run([sys.executable, "-m", "aqflow", *argv], capture_output=True, text=True, timeout=600)


def test_shards_cover_every_window_once_and_differ_by_at_most_one():
    for num_windows, world in [(5, 2), (128, 3), (7, 7), (10, 4)]:
        bounds = [shard_bounds(num_windows, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == num_windows
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [stop - start for start, stop in bounds]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="3 calibration windows cannot be shared by 4 devices"):
        shard_bounds(3, 4, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        shard_bounds(8, 2, 2)


def test_two_processes_sum_to_the_single_process_xtx(model_dir, corpus, tmp_path):
    single = calibrate(model_dir, corpus, tmp_path / "one")
    assert single.returncode == 0, single.stderr[-3000:]
    sharded = calibrate(model_dir, corpus, tmp_path / "two", "--num-devices", "2")
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-3000:]
    assert "torch.distributed.run" in sharded.stdout and "--nproc-per-node=2" in sharded.stdout

    one = json.loads((tmp_path / "one" / "calibration.json").read_text())
    two = json.loads((tmp_path / "two" / "calibration.json").read_text())
    assert two["devices"] == ["cpu", "cpu"] and one["devices"] == ["cpu"]
    assert two["layers"] == one["layers"] and len(one["layers"]) == 14
    assert two["tokens"] == one["tokens"] == 5 * 16
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "one" / "windows.parquet"),
                                  pd.read_parquet(tmp_path / "two" / "windows.parquet"))
    for block in range(2):
        a = load_block_xtx(tmp_path / "one" / f"block{block}.npz")
        b = load_block_xtx(tmp_path / "two" / f"block{block}.npz")
        assert [s.site_id for s in a.sites] == [s.site_id for s in b.sites] and len(a.sites) == 4
        for site in a.sites:
            assert b.tokens[site.site_id] == a.tokens[site.site_id] == 80
            assert a.xtx[site.site_id].abs().max() > 0
            # float64 sums in another order, stored in float32: equal up to one float32 rounding
            torch.testing.assert_close(b.xtx[site.site_id], a.xtx[site.site_id], rtol=2.5e-7, atol=1e-12)


def test_one_shard_alone_is_not_the_whole_sum(model_dir, corpus, tmp_path):
    """The comparison above can fail: XᵀX of the first shard's windows differs from the total."""
    from aqflow.calibration import collect_xtx_fp
    from aqflow.data.offline_text import load_split_corpus, role_texts
    from aqflow.data.windows import sample_calibration_windows
    from aqflow.models import load_tokenizer

    ids, texts = role_texts(load_split_corpus(corpus), "calibration")
    windows = sample_calibration_windows(ids, texts, load_tokenizer(model_dir), 5, 16, seed=1).input_ids
    model = load_causal_lm(model_dir)
    start, stop = shard_bounds(5, 2, 0)
    part = collect_xtx_fp(model, windows[start:stop], batch_size=2, progress=False)
    whole = collect_xtx_fp(model, windows, batch_size=2, progress=False)
    site = whole[0].sites[0].site_id
    assert part[0].tokens[site] == 3 * 16 and whole[0].tokens[site] == 5 * 16
    assert not torch.allclose(part[0].xtx[site], whole[0].xtx[site])


def test_sharding_needs_a_process_group(model_dir):
    with pytest.raises(RuntimeError, match="process group"):
        collect_xtx_fp_sharded(load_causal_lm(model_dir), torch.zeros(2, 8, dtype=torch.long))


def test_bad_requests_are_refused_before_anything_starts(model_dir, corpus, tmp_path, capsys):
    base = ["--model-dir", str(model_dir), "--corpus", str(corpus), "--output-dir", str(tmp_path / "out"),
            "--window-tokens", "16", "--quiet"]
    assert calibrate_stage.main([*base, "--num-windows", "1", "--device", "cpu", "--num-devices", "2"]) == 2
    assert "1 calibration windows cannot be shared by 2 devices" in capsys.readouterr().err
    if torch.cuda.device_count() < 3:
        assert calibrate_stage.main([*base, "--num-windows", "8", "--device", "cuda", "--num-devices", "3"]) == 2
        assert "3 devices asked for, but" in capsys.readouterr().err
    # a propagation mode other than fp (block after block) is not sharded
    args = calibrate_stage.build_parser().parse_args([*base, "--num-windows", "8", "--device", "cpu",
                                                      "--num-devices", "2"])
    args.propagation = "sequential"
    with pytest.raises(ValueError, match="shards fp propagation only, not 'sequential'"):
        calibrate_stage.launch_sharded(args, [])
    assert not (tmp_path / "out").exists()
    assert shard_devices("cpu", 3) == ["cpu", "cpu", "cpu"]
