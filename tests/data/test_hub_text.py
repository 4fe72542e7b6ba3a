"""Hub corpora (WikiText-2, C4) through a hub cache a fixture writes, offline; the windows each
protocol takes from them; user text files as corpora; the text each model reads in the DAG plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from aqflow.data.corpus_catalog import HUB_MODEL_PRESETS, model_text_world
from aqflow.data.offline_text import load_split_corpus, read_split_record, role_texts
from aqflow.data.user_text import read_user_corpus
from aqflow.data.windows import sample_calibration_windows
from aqflow.evaluation.protocol import windows_sha256
from aqflow.models import build_tiny_llama, load_tokenizer
from aqflow.pvtune.data import pv_windows
from aqflow.experiments.reporting import summary_table
from aqflow.stages import evaluate as evaluate_stage

from hub_cache_datasets import (
    C4_REPO, C4_REVISION, C4_TRAIN_FILE, C4_VALIDATION_FILE, TRAIN_WORD, VALIDATION_WORD, WIKITEXT_FILE, WIKITEXT_REPO,
    WIKITEXT_REVISION, write_hub_dataset_cache,
)

REPO = Path(__file__).resolve().parents[2]
# Runs a stage with every socket connection refused: a test passing proves no network was touched.
NO_NETWORK_RUNNER = (
    "import socket, sys\n"
    "def refuse(*args, **kwargs):\n"
    "    raise OSError('network access in an offline test')\n"
    "socket.socket.connect = refuse\n"
    "socket.create_connection = refuse\n"
    "from aqflow.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_offline(hf_home: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", NO_NETWORK_RUNNER, *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A filled hub cache, and the two hub corpora fetched from it offline."""
    root = tmp_path_factory.mktemp("hub")
    written = write_hub_dataset_cache(root / "hf")
    for name in ("wikitext2", "c4"):
        result = run_offline(root / "hf", "fetch-data", "--corpus", name, "--output", str(root / f"{name}.parquet"))
        assert result.returncode == 0, result.stderr
    return {"root": root, "written": written, "wikitext2": root / "wikitext2.parquet", "c4": root / "c4.parquet"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_the_fixture_cache_uses_huggingface_hubs_layout(hub):
    repo_dir = hub["written"]["hub_dir"] / "datasets--allenai--c4"
    assert (repo_dir / "refs" / "main").read_text() == C4_REVISION
    link = repo_dir / "snapshots" / C4_REVISION / C4_VALIDATION_FILE
    assert link.is_symlink() and link.resolve().parent == (repo_dir / "blobs").resolve()


def test_wikitext2_is_every_test_row_in_file_order_and_evaluation_only(hub):
    frame = load_split_corpus(hub["wikitext2"])
    assert (frame["role"] == "evaluation").all() and (frame["source"] == "wikitext2").all()
    _, texts = role_texts(frame, "evaluation")
    assert texts == hub["written"]["wikitext_rows"]  # blank rows kept: the protocol joins them all
    origin = read_split_record(hub["wikitext2"])["origin"]
    assert origin["kind"] == "hub" and origin["split"] == "by file"
    [record] = origin["files"]
    assert (record["repo_id"], record["filename"], record["revision"]) == (WIKITEXT_REPO, WIKITEXT_FILE, WIKITEXT_REVISION)
    assert record["rows"] == len(texts) and len(record["sha256"]) == 64


def test_c4_roles_come_from_the_files(hub):
    frame = load_split_corpus(hub["c4"])
    _, calibration = role_texts(frame, "calibration")
    _, evaluation = role_texts(frame, "evaluation")
    assert calibration == [doc["text"] for doc in hub["written"]["c4_train"]]
    assert evaluation == [doc["text"] for doc in hub["written"]["c4_validation"]]
    files = {f["filename"]: f for f in read_split_record(hub["c4"])["origin"]["files"]}
    assert files[C4_TRAIN_FILE]["role"] == "calibration" and files[C4_VALIDATION_FILE]["role"] == "evaluation"
    assert {f["repo_id"] for f in files.values()} == {C4_REPO} and {f["revision"] for f in files.values()} == {C4_REVISION}


def test_calibration_and_pvtune_windows_come_only_from_the_train_file(hub, tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    doc_ids, texts = role_texts(load_split_corpus(hub["c4"]), "calibration")
    windows = sample_calibration_windows(doc_ids, texts, tokenizer, num_windows=12, window_tokens=64, seed=0)
    assert all(doc.startswith("en/c4-train.00000-of-01024/") for doc in windows.doc_ids)
    decoded = tokenizer.batch_decode(windows.input_ids)
    assert all(VALIDATION_WORD not in text for text in decoded) and any(TRAIN_WORD in text for text in decoded)
    data = pv_windows(hub["c4"], tokenizer, num_samples=8, heldout_samples=2, window_tokens=64, heldout_fraction=0.25,
                      seed=0)
    for part in (data.train, data.heldout):
        assert all(doc.startswith("en/c4-train.00000-of-01024/") for doc in part.doc_ids)


def test_evaluate_windows_follow_each_protocol_on_the_hub_files(hub, tiny_dir, tmp_path):
    """WikiText-2: the test rows joined with blank lines, tokenised once, cut in order. C4: every
    window is a slice of one validation document, at the recorded start."""
    context = 32
    output = tmp_path / "eval.json"
    assert evaluate_stage.main([
        "--model-dir", str(tiny_dir), "--output", str(output), "--domain", "wikitext2", "joined", str(hub["wikitext2"]),
        "--domain", "c4", "sampled", str(hub["c4"]), "--context", str(context), "--c4-windows", "6", "--tasks",
        "--device", "cpu", "--quiet",
    ]) == 0
    record = json.loads(output.read_text())
    tokenizer = load_tokenizer(tiny_dir)
    joined = tokenizer("\n\n".join(hub["written"]["wikitext_rows"]))["input_ids"]
    count = len(joined) // context
    expected = torch.tensor(joined[: count * context]).view(count, context)
    assert record["metrics"]["wikitext2"]["windows"] == count
    assert record["data"]["wikitext2"]["windows_sha256"] == windows_sha256(expected)
    validation = {f"en/c4-validation.00000-of-00008/{i:06d}": doc["text"]
                  for i, doc in enumerate(hub["written"]["c4_validation"])}
    rows = []
    for doc_id, start in record["data"]["c4"]["window_sources"]:
        assert doc_id in validation  # never a train document
        rows.append(tokenizer(validation[doc_id])["input_ids"][start:start + context])
    assert record["data"]["c4"]["windows_sha256"] == windows_sha256(torch.tensor(rows))
    # eval.json says which text each number is on
    assert record["data"]["wikitext2"]["text"]["files"][0]["repo_id"] == WIKITEXT_REPO
    assert {f["filename"] for f in record["data"]["c4"]["text"]["files"]} == {C4_TRAIN_FILE, C4_VALIDATION_FILE}
    row = summary_table([output]).iloc[0]
    assert row["wikitext2_ppl"] == record["metrics"]["wikitext2"]["perplexity"]
    assert row["eval_text"] == (f"wikitext2=hub {WIKITEXT_REPO}@{WIKITEXT_REVISION[:7]}; "
                                f"c4=hub {C4_REPO}@{C4_REVISION[:7]}")


def test_a_missing_hub_file_is_a_clear_error_and_writes_nothing(tmp_path):
    write_hub_dataset_cache(tmp_path / "hf", include=(WIKITEXT_FILE, C4_TRAIN_FILE))
    output = tmp_path / "c4.parquet"
    result = run_offline(tmp_path / "hf", "fetch-data", "--corpus", "c4", "--output", str(output))
    assert result.returncode == 2
    for needle in (C4_REPO, C4_VALIDATION_FILE, "HF_HUB_OFFLINE", "hf download --repo-type dataset", str(tmp_path / "hf")):
        assert needle in result.stderr
    assert not output.exists() and not output.with_name("c4.split.json").exists()


# --- user corpora --------------------------------------------------------------------------------

def test_user_corpora_read_plain_text_json_lines_and_parquet(tmp_path):
    (tmp_path / "notes.txt").write_text("First document.\nStill the first.\n\n\nSecond document.\n  \nThird.\n")
    frame, origin = read_user_corpus("notes", tmp_path / "notes.txt")
    assert frame["text"].tolist() == ["First document.\nStill the first.", "Second document.", "Third."]
    assert frame["doc_id"].tolist() == ["notes/000000", "notes/000001", "notes/000002"] and origin["format"] == "text"
    (tmp_path / "cut.txt").write_text("a\n\nb@@c")
    assert read_user_corpus("cut", tmp_path / "cut.txt", separator="@@")[0]["text"].tolist() == ["a\n\nb", "c"]
    lines = [{"body": f"doc {i}", "key": f"k{i}"} for i in range(3)] + [{"body": "  ", "key": "empty"}]
    (tmp_path / "mail.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    frame, _ = read_user_corpus("mail", tmp_path / "mail.jsonl", text_column="body", id_column="key")
    assert frame["doc_id"].tolist() == ["mail/k0", "mail/k1", "mail/k2"]  # the empty document is dropped
    pd.DataFrame({"content": ["x y", "z w"]}).to_parquet(tmp_path / "t.parquet")
    assert read_user_corpus("t", tmp_path / "t.parquet", text_column="content")[0]["text"].tolist() == ["x y", "z w"]


@pytest.mark.parametrize("name, content, kwargs, needle", [
    ("a.jsonl", '{"text": "x"}\n{"body": "y"}\n', {}, "line 2 has no text column 'text'"),
    ("b.jsonl", '{"text": "x"}\nnot json\n', {}, "line 2 is not JSON"),
    ("c.parquet", None, {"text_column": "body"}, "has no text column 'body'; it has ['text']"),
    ("d.csv", "text\nx\n", {}, "cannot tell its format"),
    ("e.txt", "only one document", {}, "at least 2 are needed"),
    ("f.jsonl", '{"text": 3}\n{"text": "y"}\n', {}, "document 0 in column 'text' is int"),
])
def test_bad_user_corpora_are_refused_naming_the_file(tmp_path, name, content, kwargs, needle):
    path = tmp_path / name
    if content is None:
        pd.DataFrame({"text": ["x", "y"]}).to_parquet(path)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as raised:
        read_user_corpus("mine", path, **kwargs)
    assert needle in str(raised.value) and (name in str(raised.value) or "'mine'" in str(raised.value))
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        read_user_corpus("mine", tmp_path / "nowhere.txt")


def test_a_user_corpus_is_an_evaluation_domain_with_its_own_perplexity_and_report_column(tiny_dir, tmp_path):
    docs = [f"Paragraph {i} about river stones and winter gardens, told at some length." * 3 for i in range(8)]
    (tmp_path / "notes.txt").write_text("\n\n".join(docs))
    corpus = tmp_path / "notes.parquet"
    from aqflow.stagekit.stage_cli import run_stage_module
    from aqflow.stages import fetch_data

    assert run_stage_module(fetch_data, fetch_data.FetchDataSettings(corpus="notes"),
                            fetch_data.FetchDataPaths(output=corpus, file=tmp_path / "notes.txt")) == 0
    record = read_split_record(corpus)
    assert record["origin"]["kind"] == "user" and record["num_documents"] == {"calibration": 4, "evaluation": 4}
    output = tmp_path / "eval.json"
    assert run_stage_module(evaluate_stage, evaluate_stage.EvaluateSettings(context=32, tasks=(), device="cpu", quiet=True),
                            evaluate_stage.EvaluatePaths(model_dir=tiny_dir, output=output,
                                                         domain=(("notes", "joined", str(corpus)),))) == 0
    payload = json.loads(output.read_text())
    assert list(payload["metrics"]) == ["notes"] and payload["metrics"]["notes"]["perplexity"] > 1
    row = summary_table([output]).iloc[0]
    assert row["notes_ppl"] == payload["metrics"]["notes"]["perplexity"] and row["eval_text"] == "notes=user notes.txt"


# --- which text each model reads -----------------------------------------------------------------

def test_hub_model_presets_agree_with_the_model_presets():
    from aqflow.models.presets import HUB_PRESETS

    assert set(HUB_MODEL_PRESETS) == set(HUB_PRESETS)


@pytest.mark.parametrize("entry, world", [
    ({"preset": "llama3b"}, "hub"), ({"preset": "smollm2"}, "offline"), ({"preset": "tiny"}, "offline"),
    ({"hub_id": "org/name"}, "hub"), ({"path": "/models/mine"}, "offline"),
    ({"preset": "llama3b", "text": "offline"}, "offline"), ({"preset": "smollm2", "text": "hub"}, "hub"),
])
def test_model_text_world(entry, world):
    assert model_text_world(entry) == world


SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]


def dry_run_jobs(workdir: Path, target: str, config: dict | None = None) -> dict[str, list[str]]:
    """rule -> the input files of its planned jobs (a dry run; checkpoint-dependent inputs show as <TBD>)."""
    configs = [str(REPO / "config.yaml")]
    if config is not None:
        configs.append(str(workdir / "override.yaml"))
        Path(configs[-1]).write_text(yaml.safe_dump(config))
    argv = [*SNAKEMAKE, "--configfile", *configs, "--directory", str(workdir), "-n", target]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    jobs: dict[str, list[str]] = {}
    rule = None
    for line in result.stdout.splitlines():
        stripped = line.strip()
        if stripped.startswith(("rule ", "checkpoint ")) and stripped.endswith(":"):
            rule = stripped.split()[1].rstrip(":")
            jobs.setdefault(rule, [])
        elif rule and stripped.startswith("input:"):
            jobs[rule] += [item.strip() for item in stripped[len("input:"):].split(",")]
    return jobs


def test_the_llama3b_plan_calibrates_on_hub_c4_and_evaluates_on_hub_wikitext2_and_c4(tmp_path):
    jobs = dry_run_jobs(tmp_path, "results/llama3b/2bpp/oaem/b8/eval.json")
    assert "resources/data/c4.parquet" in jobs["calibrate"]
    assert "resources/data/c4.parquet" in jobs["pvtune"]
    for rule in ("evaluate_quantized", "evaluate_pvtuned"):
        corpora = [item for item in jobs[rule] if item.startswith("resources/data/")]
        assert corpora == ["resources/data/wikitext2.parquet", "resources/data/c4.parquet"]
    assert not any("standin" in item for items in jobs.values() for item in items)


def test_an_offline_model_keeps_the_standins_and_mixing_is_explicit(tmp_path):
    jobs = dry_run_jobs(tmp_path, "results/smollm2/fp/eval.json")
    assert [i for i in jobs["evaluate_fp"] if i.startswith("resources/data/")] == [
        "resources/data/wikitext2-standin.parquet", "resources/data/c4-standin.parquet"]
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "a"}\n{"text": "b"}\n')
    config = {"models": {"llama3b": {"preset": "llama3b", "text": "offline"}},
              "corpora": {"notes": {"path": str(notes)}},
              "text": {"offline": {"calibration": "c4-standin", "pvtune": "notes",
                                   "evaluation": ["wikitext2-standin", "notes"]}}}
    jobs = dry_run_jobs(tmp_path, "results/llama3b/2bpp/oaem/b8/eval.json", config)
    assert "resources/data/c4-standin.parquet" in jobs["calibrate"] and "resources/data/notes.parquet" in jobs["pvtune"]
    assert [i for i in jobs["evaluate_quantized"] if i.startswith("resources/data/")] == [
        "resources/data/wikitext2-standin.parquet", "resources/data/notes.parquet"]
    assert str(notes) in jobs["fetch_data"]  # the user file is an input: editing it refetches


@pytest.mark.parametrize("text, needle", [
    ({"hub": {"calibration": "wikitext2", "pvtune": "c4", "evaluation": ["c4"]}}, "evaluation text only"),
    ({"hub": {"calibration": "c4", "pvtune": "c4", "evaluation": ["nope"]}}, "unknown corpus 'nope'"),
])
def test_a_bad_text_choice_is_refused_before_any_job(tmp_path, text, needle):
    argv = [*SNAKEMAKE, "--configfile", str(REPO / "config.yaml"), str(tmp_path / "bad.yaml"),
            "--directory", str(tmp_path), "-n"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"text": text}))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and needle in result.stderr + result.stdout


def test_config_yaml_spells_out_the_default_text_choice():
    from aqflow.data.corpus_catalog import DEFAULT_TEXT, text_choice

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    assert config["text"] == DEFAULT_TEXT and text_choice(None) == DEFAULT_TEXT
    assert text_choice({"hub": {"pvtune": "notes"}})["hub"] == {**DEFAULT_TEXT["hub"], "pvtune": "notes"}


@pytest.mark.parametrize("extra, needle", [
    (["--domain", "a", "windowed", "{corpus}"], "protocol 'windowed' is not one of"),
    (["--domain", "a", "joined", "{corpus}", "--domain", "a", "sampled", "{corpus}"], "--domain a is given twice"),
    (["--domain", "a", "joined", "{corpus}", "--c4-corpus", "{corpus}"], "drop ['--c4-corpus']"),
    (["--domain", "a", "joined", "/nowhere/x.parquet"], "corpus /nowhere/x.parquet does not exist"),
])
def test_bad_evaluation_domains_are_refused_before_any_work(hub, tiny_dir, tmp_path, capsys, extra, needle):
    output = tmp_path / "eval.json"
    argv = ["--model-dir", str(tiny_dir), "--output", str(output), "--tasks", "--device", "cpu", "--quiet"]
    assert evaluate_stage.main(argv + [item.format(corpus=hub["c4"]) for item in extra]) == 2
    assert needle in capsys.readouterr().err and not output.exists()
