"""`python -m aqflow quantize-layer`: files in, artifacts out, nothing written on bad input."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from aqflow.io import artifacts
from aqflow.quant.objective import relative_output_mse
from aqflow.quant.representation import dequantize_weight, unpack_codes
from aqflow.stages import quantize_layer as stage
from tests.conftest import anisotropic_xtx

ARGS = ["--num-codebooks", "2", "--nbits", "4", "--beam-size", "2", "--max-epochs", "3", "--steps-per-epoch", "20",
        "--oaem-steps", "20", "--kmeans-max-iter", "30", "--device", "cpu", "--quiet"]


@pytest.fixture
def inputs(tmp_path, rng):
    weight = torch.randn(32, 64, generator=rng)
    xtx = anisotropic_xtx(64, 512, rng)
    save_file({"weight": weight}, str(tmp_path / "w.safetensors"))
    np.savez(tmp_path / "block0.npz", **{"self_attn.q_proj": xtx.numpy(), "mlp.down_proj": np.eye(8)})
    return tmp_path, weight, xtx


def test_writes_codes_codebooks_scales_and_metrics(inputs):
    tmp_path, weight, xtx = inputs
    out, metrics_path = tmp_path / "out" / "layer.safetensors", tmp_path / "out" / "layer.json"
    code = stage.main(["--weight", str(tmp_path / "w.safetensors"), "--xtx", str(tmp_path / "block0.npz"),
                       "--xtx-key", "self_attn.q_proj", "--output", str(out), "--metrics", str(metrics_path), *ARGS])
    assert code == 0
    tensors = load_file(str(out))
    assert tensors["codes"].dtype == torch.int8 and tensors["codes"].shape == (32, 8, 2)
    assert tensors["codebooks"].shape == (2, 16, 1, 8) and tensors["scales"].shape == (32, 1, 1, 1)
    metrics = json.loads(metrics_path.read_text())
    assert len(metrics["epochs"]) == 3 and metrics["settings"]["nbits"] == 4
    assert metrics["rho"] == pytest.approx(32 * 64 / 8 / 16**2)
    assert all(e["adam_seconds"] >= 0 and e["beam_seconds"] > 0 for e in metrics["epochs"])
    rebuilt = dequantize_weight(unpack_codes(tensors["codes"], 4), tensors["codebooks"], tensors["scales"])
    assert float(relative_output_mse(weight.double(), rebuilt.double(), xtx)) == pytest.approx(metrics["final_relative_mse"], rel=1e-4)
    assert metrics["final_relative_mse"] < metrics["init_relative_mse"]
    assert sorted(p.name for p in out.parent.iterdir()) == [  # no temp files left; each file's checksum beside it
        "layer.json", "layer.json.sha256", "layer.safetensors", "layer.safetensors.sha256"]
    assert metrics["tensors_sha256"] == artifacts.file_sha256(out)  # the pair is bound


@pytest.mark.parametrize("extra,message", [
    (["--nbits", "20"], "nbits=20 is out of range"),
    (["--xtx-key", "mlp.down_proj"], "XᵀX is 8x8 but the weight has in_features=64"),
    (["--xtx-key", "nope"], "has no tensor 'nope'"),
])
def test_bad_input_writes_nothing(inputs, capsys, extra, message):
    tmp_path, _, _ = inputs
    out = tmp_path / "out"
    argv = ["--weight", str(tmp_path / "w.safetensors"), "--xtx", str(tmp_path / "block0.npz"), "--xtx-key", "self_attn.q_proj",
            "--output", str(out / "l.safetensors"), "--metrics", str(out / "l.json"), *ARGS, *extra]
    assert stage.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_nan_weight_refused(inputs, capsys):
    tmp_path, weight, _ = inputs
    weight = weight.clone()
    weight[0, 0] = math.nan
    save_file({"weight": weight}, str(tmp_path / "nan.safetensors"))
    argv = ["--weight", str(tmp_path / "nan.safetensors"), "--xtx", str(tmp_path / "block0.npz"), "--xtx-key", "self_attn.q_proj",
            "--output", str(tmp_path / "o.safetensors"), "--metrics", str(tmp_path / "o.json"), *ARGS]
    assert stage.main(argv) == 2
    assert "weight contains NaN" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "o.json").exists()


def test_module_entry_point_lists_stages():
    result = subprocess.run([sys.executable, "-m", "aqflow", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "quantize-layer" in result.stdout
