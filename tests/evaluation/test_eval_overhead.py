"""The fixed costs removed from an evaluation leave lm-eval's requests and numbers as they were:
tasks built without a few-shot sampler give the same requests, the in-process bootstrap the same
stderr, and the caches kept between evaluations (datasets' Arrow copies, perplexity windows) are
reused but never stale."""

from __future__ import annotations

import json
import os
import random

import pytest

from aqflow.data.zero_shot import ZERO_SHOT_TASKS, task_data_files, write_task_files
from aqflow.evaluation.zero_shot import bootstrap_in_process, run_zero_shot, write_task_configs, zero_shot_tasks_only

from aqflow.evaluation import window_cache
from aqflow.stages import evaluate as evaluate_stage

from test_evaluation import HANDWRITTEN_TASKS, _evaluate, corpora_dir, tiny, tiny_dir  # noqa: F401  (fixtures)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def handwritten_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("handwritten")
    write_task_files(HANDWRITTEN_TASKS, folder, {"source": "handwritten"})
    return task_data_files(folder, ZERO_SHOT_TASKS)


def _zero_shot_requests(files, tmp_path, label: str) -> dict:
    """{task: (whether it has a sampler, [(doc_id, idx, request_type, args, target) of every request])}
    built by lm-eval for a zero-shot run from our task configs."""
    from lm_eval.tasks import TaskManager, get_task_dict

    config_dir = write_task_configs(files, tmp_path / label / "tasks", tmp_path / label / "datasets")
    tasks = get_task_dict(list(files), TaskManager(include_path=str(config_dir), include_defaults=False))
    built = {}
    for name, task in tasks.items():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(limit=None, rank=0, world_size=1)
        built[name] = (hasattr(task, "sampler"), [(i.doc_id, i.idx, i.request_type, i.arguments, i.doc.get("label"))
                                                  for i in task.instances])
    return built


def test_tasks_built_without_a_sampler_give_lm_evals_zero_shot_requests(handwritten_files, tmp_path):
    shipped = _zero_shot_requests(handwritten_files, tmp_path, "shipped")
    with zero_shot_tasks_only():
        lean = _zero_shot_requests(handwritten_files, tmp_path, "lean")
    assert sorted(lean) == sorted(shipped) == sorted(ZERO_SHOT_TASKS)
    for task in ZERO_SHOT_TASKS:
        assert shipped[task][0] and not lean[task][0], task  # the sampler (a list of every document) is gone
        assert lean[task][1] == shipped[task][1], task  # request for request
        assert len(lean[task][1]) > 0
    has_sampler, requests = _zero_shot_requests(handwritten_files, tmp_path, "after")["piqa"]
    assert has_sampler and requests == shipped["piqa"][1]  # lm-eval's own method is back after the block


def test_bootstrap_in_process_gives_the_pools_stderr_and_restores_the_environment(monkeypatch):
    from lm_eval.api.metrics import bootstrap_stderr, perplexity

    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    rng = random.Random(0)
    loglikelihoods = [-rng.random() * 5 for _ in range(200)]
    pooled = bootstrap_stderr(perplexity, loglikelihoods, 1000)
    with bootstrap_in_process():
        assert os.environ["DISABLE_MULTIPROC"] == "1"
        serial = bootstrap_stderr(perplexity, loglikelihoods, 1000)
    assert serial == pooled  # same seeds, same draws: the same number, not a close one
    assert "DISABLE_MULTIPROC" not in os.environ
    monkeypatch.setenv("DISABLE_MULTIPROC", "yes")
    with bootstrap_in_process():
        pass
    assert os.environ["DISABLE_MULTIPROC"] == "yes"


def test_a_kept_datasets_cache_is_reused_and_follows_a_changed_data_file(tiny, handwritten_files, tmp_path,
                                                                        monkeypatch):
    from datasets.builder import ArrowBasedBuilder

    model, tokenizer = tiny
    files = {task: tmp_path / "data" / path.name for task, path in handwritten_files.items()}
    files["piqa"].parent.mkdir()
    for task, path in handwritten_files.items():
        files[task].write_bytes(path.read_bytes())
    prepared = []
    prepare_split = ArrowBasedBuilder._prepare_split
    monkeypatch.setattr(ArrowBasedBuilder, "_prepare_split",
                        lambda self, *args, **kwargs: prepared.append(self.config.data_files)
                        or prepare_split(self, *args, **kwargs))
    kept = tmp_path / "arrow"
    first = run_zero_shot(model, tokenizer, files, tmp_path / "a", batch_size=4, datasets_cache_dir=kept)
    assert len(prepared) == len(ZERO_SHOT_TASKS)
    second = run_zero_shot(model, tokenizer, files, tmp_path / "b", batch_size=4, datasets_cache_dir=kept)
    assert len(prepared) == len(ZERO_SHOT_TASKS)  # every task read from the kept Arrow copies
    assert second == first
    # a data file rewritten in place (one document fewer) is read again, not served from the cache
    lines = files["piqa"].read_text().splitlines()
    files["piqa"].write_text("\n".join(lines[:-1]) + "\n")
    stat = files["piqa"].stat()
    os.utime(files["piqa"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    changed = run_zero_shot(model, tokenizer, files, tmp_path / "c", batch_size=4, datasets_cache_dir=kept)
    assert [files_of["validation"] for files_of in prepared[len(ZERO_SHOT_TASKS):]] == [[str(files["piqa"].resolve())]]
    fresh = run_zero_shot(model, tokenizer, files, tmp_path / "d", batch_size=4)
    assert changed == fresh


def _perplexity_run(model_dir, corpora_dir, folder, cache_dir, monkeypatch, **changes) -> tuple[dict, int]:
    """(eval.json, how many domains were tokenized) of a perplexity-only evaluation."""
    cut = []
    protocol_windows = evaluate_stage.protocol_windows
    monkeypatch.setattr(evaluate_stage, "protocol_windows",
                        lambda *args: cut.append(args[2]) or protocol_windows(*args))
    output = folder / "eval.json"
    assert _evaluate(model_dir, output, corpora_dir, None, tasks=(), cache_dir=cache_dir, **changes) == 0
    monkeypatch.setattr(evaluate_stage, "protocol_windows", protocol_windows)
    return json.loads(output.read_text()), len(cut)


def test_perplexity_windows_are_cut_once_per_text_tokenizer_and_settings(tiny_dir, corpora_dir, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    cache = tmp_path / "cache"
    first, cut = _perplexity_run(tiny_dir, corpora_dir, tmp_path / "a", cache, monkeypatch)
    assert cut == 2 and len(list(window_cache.cache_folder(cache).glob("*.safetensors"))) == 2
    again, cut = _perplexity_run(tiny_dir, corpora_dir, tmp_path / "b", cache, monkeypatch)
    assert cut == 0  # both domains' windows read back
    assert again["data"] == first["data"]  # windows_sha256, window sources, eligible documents: all equal
    assert again["metrics"] == first["metrics"]
    fresh, cut = _perplexity_run(tiny_dir, corpora_dir, tmp_path / "c", tmp_path / "empty-cache", monkeypatch)
    assert cut == 2 and fresh["data"] == first["data"] and fresh["metrics"] == first["metrics"]
    # other settings: cut again (another tokenizer: the fingerprint test below)
    _, cut = _perplexity_run(tiny_dir, corpora_dir, tmp_path / "d", cache, monkeypatch, c4_seed=1)
    assert cut == 1  # C4's windows depend on the seed, WikiText-2's do not
    # a damaged entry is cut again and rewritten, not an error
    for entry in window_cache.cache_folder(cache).glob("*.safetensors"):
        entry.write_bytes(entry.read_bytes()[:-8])
    damaged, cut = _perplexity_run(tiny_dir, corpora_dir, tmp_path / "e", cache, monkeypatch)
    assert cut == 2 and damaged["data"] == first["data"]
    _, cut = _perplexity_run(tiny_dir, corpora_dir, tmp_path / "f", cache, monkeypatch)
    assert cut == 0


def test_the_tokenizer_fingerprint_follows_behaviour_not_the_folder(tiny_dir, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.save_pretrained(tmp_path / "copy")
    copy = AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert window_cache.tokenizer_fingerprint(copy) == window_cache.tokenizer_fingerprint(tokenizer)
    copy.add_tokens(["<an-added-token>"])
    assert window_cache.tokenizer_fingerprint(copy) != window_cache.tokenizer_fingerprint(tokenizer)
