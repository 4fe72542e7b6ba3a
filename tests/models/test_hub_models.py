"""Hub and local-folder models, offline through a hub cache the fixture writes (HF_HUB_OFFLINE=1):
fetch records the resolved revision, keeps the model's own dtype (or converts to a given one),
refuses unsupported models by name with nothing written, and gives one clear line for missing or
gated ids. Also: stages compute in the model's dtype on GPUs, and NaN metrics are errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqflow.io.finite import NonFiniteMetricError, non_finite_metrics, require_finite
from aqflow.models.entries import entry_problems, fetch_model_request, parse_model_entry
from aqflow.models.fetch import MARKER_FILE, config_dtype, model_compute_dtype, stored_dtypes
from aqflow.models.folder import TENSOR_SUMS_FILE, read_tensor, read_tensors
from aqflow.models.hub import cached_config
from aqflow.stages import fetch_model
from hub_cache_models import build_tiny_model, write_hub_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub_home(tmp_path, monkeypatch):
    """An empty HF_HOME, offline: nothing may come from the network."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    # huggingface_hub reads these once at import; point them at this test's cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def logits(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
    with torch.no_grad():
        return model(torch.arange(1, 17)[None]).logits


def nothing_left(parent: Path, name: str) -> bool:
    """No `name` folder and no staging folder of it in `parent`."""
    return not parent.exists() or not [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


def _tensor_record_matches(folder) -> bool:
    """The folder's tensor checksum record is listed in its SHA256SUMS and every tensor reads
    through it (a record of other bytes is refused by read_tensor)."""
    listed = TENSOR_SUMS_FILE in (folder / "SHA256SUMS").read_text().split()
    return listed and all(torch.equal(read_tensor(folder, name), tensor) for name, tensor in read_tensors(folder).items())


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_fetch_from_the_hub_cache_records_the_revision_and_keeps_the_model(hub_home, tmp_path, architecture, capsys):
    hub_id, revision = write_hub_model(hub_home, f"aqflow-tests/tiny-{architecture}", architecture, dtype="bfloat16")
    out = tmp_path / "models" / "mine"
    assert fetch_model.main(["--hub-id", hub_id, "--output-dir", str(out)]) == 0, capsys.readouterr().err
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["hub_id"] == hub_id and marker["commit"] == revision and marker["revision"] == "main"
    assert marker["dtype"] == "bfloat16" and config_dtype(out) == "bfloat16" and stored_dtypes(out) == {"bfloat16"}
    snapshot = hub_home / "hub" / f"models--aqflow-tests--tiny-{architecture}" / "snapshots" / revision
    # the model's own dtype: the weights are the cache's files (hard-linked on one file system)
    assert (out / "model.safetensors").read_bytes() == (snapshot / "model.safetensors").read_bytes()
    assert os.path.samefile(out / "model.safetensors", (snapshot / "model.safetensors").resolve())
    assert torch.equal(logits(out), logits(snapshot)) and _tensor_record_matches(out)
    # the cache's config.json is never written through the link
    assert json.loads((snapshot / "config.json").read_text()).get("torch_dtype") is None


def test_fetch_in_another_dtype_converts_and_a_revision_pins_the_commit(hub_home, tmp_path):
    hub_id, revision = write_hub_model(hub_home, "aqflow-tests/tiny-llama", "llama", dtype="bfloat16")
    out = tmp_path / "mine"
    assert fetch_model.main(["--hub-id", hub_id, "--revision", revision, "--dtype", "float32", "--output-dir", str(out)]) == 0
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["commit"] == revision and marker["dtype"] == "float32" and marker["source_dtype"] == "bfloat16"
    assert stored_dtypes(out) == {"float32"} and config_dtype(out) == "float32"
    snapshot = hub_home / "hub" / "models--aqflow-tests--tiny-llama" / "snapshots" / revision
    assert torch.equal(logits(out), logits(snapshot))  # bfloat16 -> float32 is exact
    assert _tensor_record_matches(out)  # the record of the converted weights, not the source's


def test_local_folder_model_and_its_dtype(tmp_path):
    source = build_tiny_model(tmp_path / "src", "qwen2", dtype="float32")
    out = tmp_path / "mine"
    assert fetch_model.main(["--path", str(source), "--output-dir", str(out)]) == 0
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["source"] == "path" and marker["path"] == str(source.resolve()) and marker["dtype"] == "float32"
    assert torch.equal(logits(out), logits(source))
    assert model_compute_dtype(out, "cpu") == "float32"


def test_missing_model_offline_is_one_clear_line_and_writes_nothing(hub_home, tmp_path, capsys):
    out = tmp_path / "models" / "mine"
    assert fetch_model.main(["--hub-id", "aqflow-tests/not-there", "--output-dir", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "aqflow-tests/not-there" in error and "hf auth login" in error and "huggingface-cli login" in error and "HF_TOKEN" in error
    assert "HF_HUB_OFFLINE" in error
    assert nothing_left(out.parent, "mine")


@pytest.mark.parametrize("failure", ["gated", "missing"])
def test_gated_or_missing_on_the_hub_names_the_id_and_what_to_do(tmp_path, monkeypatch, capsys, failure):
    """What the hub answers online (403 gated, 404 missing), without a network: snapshot_download
    raises the exceptions huggingface_hub raises for those answers."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    def refuse(repo_id, **_):
        status, error = (403, GatedRepoError) if failure == "gated" else (404, RepositoryNotFoundError)
        response = httpx2.Response(status, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}"))
        raise error("refused", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    out = tmp_path / "mine"
    assert fetch_model.main(["--preset", "llama3b", "--output-dir", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "meta-llama/Llama-3.2-3B" in error
    assert "hf auth login" in error and "huggingface-cli login" in error and "HF_TOKEN" in error and "accept the license" in error
    assert ("is gated and" in error) == (failure == "gated") and ("was not found" in error) == (failure == "missing")
    assert nothing_left(tmp_path, "mine")


@pytest.mark.parametrize("architecture, hidden, reason", [
    ("gpt2", 64, "Conv1D"),
    ("t5", 64, "encoder-decoder"),
    ("llama", 36, "hidden_size 36 is not divisible by the quantization group size 8"),
])
def test_unsupported_models_are_refused_by_name_before_anything_is_written(hub_home, tmp_path, capsys,
                                                                           architecture, hidden, reason):
    hub_id, _ = write_hub_model(hub_home, f"aqflow-tests/bad-{architecture}", architecture, hidden_size=hidden, num_heads=2)
    out = tmp_path / "bad"
    assert fetch_model.main(["--hub-id", hub_id, "--output-dir", str(out)]) == 2
    error = capsys.readouterr().err
    assert hub_id in error and reason in error
    assert nothing_left(tmp_path, "bad")
    # the same is known at DAG-build time from the cached config.json alone
    entry = parse_model_entry("bad", {"hub_id": hub_id})
    assert any(reason in problem for problem in entry_problems(entry, group_size=8))


def test_a_linear_only_the_built_model_shows_is_refused(tmp_path, capsys):
    """o_proj reads heads x head_dim = 3 x 6 = 18 features: config.json's sizes are fine, the
    model built on the meta device is not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=6)
    source = tmp_path / "odd"
    LlamaForCausalLM(config).save_pretrained(source)
    entry = parse_model_entry("odd", {"path": str(source)})
    assert entry_problems(entry, group_size=8) == []
    assert fetch_model.main(["--path", str(source), "--output-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "self_attn.o_proj" in error and "18" in error and nothing_left(tmp_path, "out")


def test_model_entries_parse_and_become_fetch_flags(tmp_path):
    assert parse_model_entry("m", {"hub_id": "org/name", "revision": "v1", "dtype": "bfloat16"}).kind == "hub"
    assert parse_model_entry("m", {"preset": "llama3b"}).hub_repo == "meta-llama/Llama-3.2-3B"
    assert parse_model_entry("m", {"preset": "smollm2"}).kind == "gguf"
    assert fetch_model_request(parse_model_entry("m", {"hub_id": "org/name", "revision": "v1"}), 8) == {
        "hub_id": "org/name", "revision": "v1", "group_size": 8}
    assert fetch_model_request(parse_model_entry("m", {"path": str(tmp_path)}), 16) == {
        "path": str(tmp_path.resolve()), "group_size": 16}
    for bad, words in [({"preset": "smollm2", "hub_id": "a/b"}, "exactly one"), ({}, "exactly one"),
                       ({"preset": "nope"}, "unknown preset"), ({"preset": "smollm2", "revision": "x"}, "hub models only"),
                       ({"hub_id": "no-slash"}, "ORG/NAME")]:
        with pytest.raises(ValueError, match=words):
            parse_model_entry("m", bad)
    assert entry_problems(parse_model_entry("m", {"path": str(tmp_path / "none")}), 8)[0].startswith("path")


def test_cached_config_resolves_refs_and_commits_without_huggingface_hub(hub_home):
    hub_id, revision = write_hub_model(hub_home, "aqflow-tests/tiny-qwen2", "qwen2")
    assert cached_config(hub_id)["model_type"] == "qwen2"
    assert cached_config(hub_id, revision)["model_type"] == "qwen2"
    assert cached_config(hub_id, "other-branch") is None and cached_config("aqflow-tests/absent") is None


def test_gpu_compute_dtype_follows_the_model_folder(tmp_path):
    """On a GPU every stage computes in the folder's declared dtype; on a CPU in float32."""
    from aqflow.stages.evaluate import EvaluateSettings, compute_dtype
    from aqflow.stages.pvtune import auto_amp_dtype

    folder = build_tiny_model(tmp_path / "bf16", "llama", dtype="bfloat16")
    assert model_compute_dtype(folder, "cuda") == "bfloat16" and model_compute_dtype(folder, "cuda:1") == "bfloat16"
    assert model_compute_dtype(folder, "cpu") == "float32"
    assert compute_dtype(EvaluateSettings(device="cuda"), folder) == "bfloat16"
    assert compute_dtype(EvaluateSettings(device="cuda", dtype="float16"), folder) == "float16"  # an explicit --dtype wins
    assert [auto_amp_dtype(d) for d in ("float32", "float16", "bfloat16")] == ["none", "bfloat16", "bfloat16"]


def test_non_finite_metrics_are_errors_naming_stage_and_model():
    metrics = {"wikitext2": {"perplexity": float("nan")}, "tasks": {"piqa": {"acc": 0.5, "acc_stderr": float("nan")}},
               "log": [{"kl": 1.0}, {"kl": float("inf")}]}
    assert non_finite_metrics(metrics) == {"wikitext2.perplexity": metrics["wikitext2"]["perplexity"], "log[1].kl": float("inf")}
    with pytest.raises(NonFiniteMetricError, match=r"evaluate: model gemma/fp: .*wikitext2.perplexity = nan.*log\[1\].kl = inf"):
        require_finite(metrics, "evaluate", "gemma/fp")
    require_finite({"a": 1.0, "b": {"c": 2}, "d": "text", "e_stderr": float("nan")}, "x", "y")


def test_evaluate_refuses_a_nan_perplexity_and_writes_no_eval_json(tmp_path, capsys):
    """A model whose output overflows: the stage fails naming itself and the model, no eval.json."""
    import pandas as pd
    from safetensors.torch import load_file, save_file

    from aqflow.stages import evaluate

    folder = build_tiny_model(tmp_path / "model", "llama", dtype="float32")
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"][0, 0] = float("inf")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog, again and again." * 8 for i in range(6)]
    corpus = tmp_path / "wiki.parquet"
    pd.DataFrame({"doc_id": [str(i) for i in range(6)], "text": texts, "role": ["evaluation"] * 6}).to_parquet(corpus)
    output = tmp_path / "eval.json"
    code = evaluate.main(["--model-dir", str(folder), "--output", str(output), "--label", "tiny/fp", "--wikitext2-corpus",
                          str(corpus), "--perplexity", "wikitext2", "--tasks", "--context", "32", "--device", "cpu", "--quiet"])
    error = capsys.readouterr().err
    assert code != 0 and "evaluate: model tiny/fp" in error and "wikitext2.perplexity" in error
    assert not output.exists()


def test_snakemake_refuses_an_unsupported_local_model_by_name_before_any_job(tmp_path):
    source = build_tiny_model(tmp_path / "gpt2-folder", "gpt2")
    config = tmp_path / "models.yaml"
    config.write_text(f"models: {{mine: {{path: {source}}}}}\ntargets: [{{model: mine, bpp: 2, init: greedy, beam: 2}}]\n")
    result = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-n",
                             "--configfile", str(REPO / "tests/workflow/config.tiny.yaml"), str(config),
                             "--directory", str(tmp_path / "work")], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "model 'mine' cannot be quantized" in output and "Conv1D" in output
    assert not (tmp_path / "work" / "resources").exists()


def test_snakemake_fetches_a_hub_id_model_from_the_cache_offline(hub_home, tmp_path):
    """The fetch_model rule wires a `hub_id` entry (with its dtype and revision) to the stage."""
    hub_id, revision = write_hub_model(hub_home, "aqflow-tests/tiny-qwen2", "qwen2", dtype="bfloat16")
    config = tmp_path / "models.yaml"
    config.write_text(f"models: {{mine: {{hub_id: {hub_id}, revision: {revision}, dtype: float32}}}}\n")
    work = tmp_path / "work"
    result = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1",
                             "--configfile", str(REPO / "tests/workflow/config.tiny.yaml"), str(config),
                             "--directory", str(work), "resources/models/mine"], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    marker = json.loads((work / "resources/models/mine" / MARKER_FILE).read_text())
    assert marker["hub_id"] == hub_id and marker["commit"] == revision and marker["dtype"] == "float32"
