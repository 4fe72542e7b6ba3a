"""Evaluation: perplexity protocol, zero-shot tasks through lm-eval, bits per parameter, the evaluate stage."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from aqflow.data.offline_text import prepare_corpus, split_documents, write_split_corpus
from aqflow.data.zero_shot import (
    EXPECTED_EXAMPLES, ZERO_SHOT_TASKS, arc_example, lambada_example, prepare_zero_shot_data, read_manifest,
    task_data_files, unique_docs, write_task_files,
)
from aqflow.evaluation import perplexity
from aqflow.models.folder import stored_bits_per_parameter
from aqflow.evaluation.logits_budget import score_in_pieces, sequences_within_budget
from aqflow.evaluation.protocol import c4_windows, wikitext2_windows, windows_sha256
from aqflow.evaluation.zero_shot import (
    HEADLINE_METRIC, TASK_TEMPLATES_DIR, average_accuracy, run_zero_shot, write_task_configs,
)
from aqflow.io.fetching import default_cache_dir
from aqflow.models import build_tiny_llama, load_causal_lm, load_tokenizer, prepare_model
from aqflow.quant.representation import bits_per_parameter, dequantize_weight, pack_codes
from aqflow.stagekit.stage_cli import run_stage_module
from aqflow.stages import evaluate as evaluate_stage

WORDS = ("the quick brown fox jumps over lazy dog while calibration and evaluation text never overlap "
         "additive quantization represents groups of weights as sums of codewords").split()


def _document(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)) + "."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_causal_lm(tiny_dir), load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def corpora_dir(tmp_path_factory) -> Path:
    """Stand-in-shaped corpora (Parquet + split record), small and handwritten."""
    folder = tmp_path_factory.mktemp("corpora")
    rng = random.Random(0)
    for name, source, lengths in (("wikitext2-standin", "wikitext2-standin", [60, 200, 90, 150, 120, 80]),
                                  ("c4-standin", "c4-standin", [30, 400, 50, 300, 20, 350, 40, 250])):
        docs = pd.DataFrame({"doc_id": [f"{source}/{i:02d}" for i in range(len(lengths))],
                             "text": [_document(rng, n) for n in lengths], "source": source})
        write_split_corpus(split_documents(docs, 0.5, seed=0), folder / f"{name}.parquet", 0, 0.5)
    return folder


# --- handwritten task data in the layouts lm-eval's tasks read -----------------------------------

HANDWRITTEN_TASKS = {
    "arc_easy": [
        {"id": "q1", "question": "Which is a mammal?", "answerKey": "B",
         "choices": {"text": ["trout", "whale", "frog"], "label": ["A", "B", "C"]}},
        {"id": "q2", "question": "What melts ice?", "answerKey": "A",
         "choices": {"text": ["heat", "cold", "dark", "salt water"], "label": ["A", "B", "C", "D"]}},
    ],
    "hellaswag": [
        {"ind": 1, "activity_label": "Cooking", "ctx_a": "A man cracks eggs into a bowl.", "ctx_b": "he",
         "ctx": "A man cracks eggs into a bowl. he", "endings": ["whisks them.", "sings [title] loudly.",
                                                                 "flies away.", "paints the bowl."],
         "source_id": "x", "split": "val", "split_type": "indomain", "label": "0"},
        {"ind": 2, "activity_label": "Running", "ctx_a": "A woman ties her shoes.", "ctx_b": "she",
         "ctx": "A woman ties her shoes. she", "endings": ["eats them.", "starts to jog.", "falls asleep.", "swims."],
         "source_id": "y", "split": "val", "split_type": "zeroshot", "label": "1"},
    ],
    "piqa": [
        {"goal": "How do you open a jar?", "sol1": "Twist the lid.", "sol2": "Bake the lid.", "label": 0},
        {"goal": "How do you dry hair?", "sol1": "Use water.", "sol2": "Use a towel.", "label": 1},
    ],
    "winogrande": [
        {"sentence": "The trophy did not fit in the case because _ was too big.", "option1": "trophy",
         "option2": "case", "answer": "1"},
        {"sentence": "The trophy did not fit in the case because _ was too small.", "option1": "trophy",
         "option2": "case", "answer": "2"},
    ],
    "lambada_openai": [
        {"text": "She opened the door and let the dog out into the garden"},
        {"text": "He poured the coffee and handed her the cup"},
    ],
}
HANDWRITTEN_TASKS["arc_challenge"] = HANDWRITTEN_TASKS["arc_easy"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    write_task_files(HANDWRITTEN_TASKS, folder, {"source": "handwritten"})
    return folder


# --- perplexity protocol -------------------------------------------------------------------------

def test_wikitext2_windows_are_consecutive_non_overlapping_and_drop_the_remainder(tiny):
    _, tokenizer = tiny
    texts = [_document(random.Random(i), 80) for i in range(4)]
    joined = tokenizer("\n\n".join(texts))["input_ids"]
    context = 37
    windows = wikitext2_windows(texts, tokenizer, context)
    assert windows.shape == (len(joined) // context, context) and len(joined) % context  # a remainder exists
    assert windows.flatten().tolist() == joined[: windows.numel()]  # consecutive, each token once
    assert torch.equal(wikitext2_windows(texts, tokenizer, context, max_windows=2), windows[:2])


def _aqlm_get_c4_eval(texts, tokenizer, seqlen, nsamples, seed):
    """AQLM's datautils.get_c4(eval_mode=True), transcribed (global `random`, per-sample tokenising)."""
    random.seed(seed)
    valenc = []
    for _ in range(nsamples):
        while True:
            i = random.randint(0, len(texts) - 1)
            tmp = tokenizer(texts[i], return_tensors="pt")
            if tmp.input_ids.shape[1] >= seqlen:
                break
        if tmp.input_ids.shape[1] == seqlen:
            valenc.append(tmp.input_ids)
        else:
            i = random.randint(0, tmp.input_ids.shape[1] - seqlen - 1)
            valenc.append(tmp.input_ids[:, i:i + seqlen])
    return torch.cat(valenc, dim=0)


def test_c4_windows_follow_aqlm_are_seeded_and_lie_inside_single_documents(tiny):
    _, tokenizer = tiny
    rng = random.Random(1)
    texts = [_document(rng, n) for n in (10, 120, 15, 90, 200, 8)]
    doc_ids = [f"doc{i}" for i in range(len(texts))]
    context = 64
    sampled = c4_windows(doc_ids, texts, tokenizer, context, num_windows=12, seed=0)
    assert sampled.input_ids.shape == (12, context)
    assert torch.equal(sampled.input_ids, _aqlm_get_c4_eval(texts, tokenizer, context, 12, seed=0))
    again = c4_windows(doc_ids, texts, tokenizer, context, num_windows=12, seed=0)
    assert windows_sha256(again.input_ids) == windows_sha256(sampled.input_ids) and again.sources() == sampled.sources()
    other = c4_windows(doc_ids, texts, tokenizer, context, num_windows=12, seed=1)
    assert not torch.equal(other.input_ids, sampled.input_ids)
    lengths = {d: len(tokenizer(t)["input_ids"]) for d, t in zip(doc_ids, texts)}
    assert sampled.eligible_documents == sum(n >= context for n in lengths.values())
    for window, (doc_id, start) in zip(sampled.input_ids, sampled.sources()):
        assert lengths[doc_id] >= context  # short documents are never used
        ids = tokenizer(texts[doc_ids.index(doc_id)])["input_ids"]
        assert window.tolist() == ids[start:start + context]
    with pytest.raises(ValueError, match="no C4 evaluation document has 1000 tokens"):
        c4_windows(doc_ids, texts, tokenizer, 1000)


def test_random_tiny_model_perplexity_is_exp_mean_nll_and_about_the_vocabulary_size(tiny):
    model, _ = tiny
    vocab = model.config.vocab_size
    windows = torch.randint(0, vocab, (5, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), dim=-1)
    nll = -log_probs.gather(-1, windows[:, 1:, None]).squeeze(-1)  # [5, 39]
    by_hand = math.exp(float(nll.mean()))
    measured = perplexity(model, windows, batch_size=2, progress=False)
    assert measured == pytest.approx(by_hand, rel=1e-5)
    assert 0.8 * vocab < measured < 1.25 * vocab  # random init: near-uniform next-token distribution


def test_perplexity_cuts_its_batch_to_the_logits_budget_and_keeps_its_value(tiny, monkeypatch):
    module = importlib.import_module("aqflow.evaluation.perplexity")  # the package exports the function by that name
    model, _ = tiny
    vocab = model.config.vocab_size
    windows = torch.randint(0, vocab, (5, 40), generator=torch.Generator().manual_seed(1))
    whole = perplexity(model, windows, batch_size=5, progress=False, logits_budget_bytes=None)
    forwards = []
    scored = module.window_nll
    monkeypatch.setattr(module, "window_nll", lambda m, batch: forwards.append(batch.shape[0]) or scored(m, batch))
    # float32 logits of two 40-token windows fit, three do not
    cut = perplexity(model, windows, batch_size=5, progress=False, logits_budget_bytes=2 * 40 * vocab * 4 + 1)
    assert forwards == [2, 2, 1]
    assert cut == pytest.approx(whole, rel=1e-6)


def test_perplexity_on_a_card_that_runs_out_goes_on_in_smaller_passes_with_the_same_value(tiny, monkeypatch, capsys):
    module = importlib.import_module("aqflow.evaluation.perplexity")
    model, _ = tiny
    windows = torch.randint(0, model.config.vocab_size, (7, 40), generator=torch.Generator().manual_seed(2))
    whole = perplexity(model, windows, batch_size=7, progress=False, logits_budget_bytes=None)
    forwards = []
    scored = module.window_nll

    def shared_card(m, batch):  # another job holds all but room for two windows
        forwards.append(batch.shape[0])
        if batch.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.66 GiB")
        return scored(m, batch)

    monkeypatch.setattr(module, "window_nll", shared_card)
    assert perplexity(model, windows, batch_size=7, progress=False, logits_budget_bytes=None) == pytest.approx(whole, rel=1e-6)
    assert forwards == [7, 4, 2, 2, 2, 1]  # halved until it held, then kept at what held
    assert "going on with 4" in capsys.readouterr().err


def test_score_in_pieces_raises_when_a_single_item_does_not_fit():
    def never_fits(start, stop):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        score_in_pieces(never_fits, 4, 4)
    assert score_in_pieces(lambda start, stop: list(range(start, stop)), 5, 2) == ([0, 1, 2, 3, 4], 2)


def test_sequences_within_budget_is_the_most_that_fit_and_never_zero():
    assert sequences_within_budget(32, 4096, 49152, 2, 16 * 2**30) == 32  # SmolLM2's batch stays whole
    assert sequences_within_budget(32, 4096, 262144, 2, 16 * 2**30) == 8  # Gemma 3: 2 GiB a window
    assert sequences_within_budget(32, 4096, 262144, 2, 2**30) == 1  # a window over the budget still runs
    assert sequences_within_budget(7, 10, 100, 4, None) == 7
    with pytest.raises(ValueError, match="requested"):
        sequences_within_budget(0, 10, 100, 4, None)


# --- zero-shot data and tasks --------------------------------------------------------------------

def test_olmes_records_become_lm_eval_fields_and_duplicates_are_dropped():
    doc = {"id": "Mercury_1", "query": "Question: Why?\nAnswer:", "choices": ["a", "b", "c"], "gold": 2}
    second = {**doc, "id": "Mercury_2"}
    requests = [{"doc_id": 0, "doc": doc}, {"doc_id": 0, "doc": doc}, {"doc_id": 1, "doc": second},
                {"doc_id": 1_000_000, "doc": doc}, {"doc_id": 1_000_001, "doc": second}]
    assert unique_docs(requests) == [doc, second]
    assert arc_example(doc) == {"id": "Mercury_1", "question": "Why?", "answerKey": "C",
                                "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}}
    assert lambada_example({"id": 0, "query": "He said  hello to", "answers_text": ["Shane"]}) == \
        {"text": "He said  hello to Shane"}
    with pytest.raises(ValueError, match="two different docs"):
        unique_docs(requests + [{"doc_id": 2, "doc": {**doc, "gold": 0}}])


def _standard_config(task: str) -> dict:
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    paths = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
             "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
             "winogrande": "winogrande/default.yaml", "lambada_openai": "lambada/lambada_openai.yaml"}
    return load_yaml(Path(lm_eval.__file__).parent / "tasks" / paths[task])


def _comparable(value):
    # functions loaded from two YAMLs are distinct objects; the same module and source is the same function
    return (value.__module__, inspect.getsource(value)) if callable(value) else value


def test_task_configs_reproduce_lm_evals_standard_tasks(tmp_path):
    from lm_eval.tasks._yaml_loader import load_yaml

    files = {task: tmp_path / f"{task}.jsonl" for task in ZERO_SHOT_TASKS}
    config_dir = write_task_configs(files, tmp_path / "configs", tmp_path / "cache")
    same_keys = ("task", "output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_docs",
                 "metric_list", "should_decontaminate", "doc_to_decontamination_query", "metadata")
    for task in ZERO_SHOT_TASKS:
        ours, standard = load_yaml(config_dir / f"{task}.yaml"), _standard_config(task)
        for key in same_keys:
            assert _comparable(ours.get(key)) == _comparable(standard.get(key)), (task, key)
        split = standard.get("test_split") or standard["validation_split"]  # the split lm-eval evaluates
        assert (ours.get("test_split") or ours["validation_split"]) == split, task
        assert ours["dataset_path"] == "json"
        assert ours["dataset_kwargs"]["data_files"] == {split: str(files[task].resolve())}
    assert sorted(p.stem for p in TASK_TEMPLATES_DIR.glob("*.yaml")) == sorted(ZERO_SHOT_TASKS)


def test_zero_shot_pipeline_runs_all_six_tasks_on_a_tiny_model(tiny, task_dir, tmp_path):
    model, tokenizer = tiny
    metrics = run_zero_shot(model, tokenizer, task_data_files(task_dir, ZERO_SHOT_TASKS), tmp_path, limit=2)
    assert sorted(metrics) == sorted(ZERO_SHOT_TASKS)
    for task, values in metrics.items():
        for name in ("acc", "acc_norm"):
            if name in values:
                assert 0.0 <= values[name] <= 1.0, (task, name)
        assert "acc_norm" in values or task in ("winogrande", "lambada_openai")
    assert metrics["lambada_openai"]["perplexity"] > 1.0
    summary = average_accuracy(metrics)
    assert summary["avg_acc"] == pytest.approx(sum(m["acc"] for m in metrics.values()) / 6)
    assert summary["headline_metrics"] == HEADLINE_METRIC


# --- bits per parameter --------------------------------------------------------------------------

def _write_aqlm_checkpoint(fp_dir: Path, out_dir: Path, nbits: int = 8, group_size: int = 8, seed: int = 0):
    """A standard AQLM folder from the tiny model: every decoder linear replaced by random codes
    (1 codebook of 2^nbits codewords over groups of `group_size`). Returns {linear: dequantized weight}."""
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(fp_dir / "model.safetensors"))
    linears = sorted(name[: -len(".weight")] for name, t in tensors.items()
                     if name.startswith("model.layers.") and t.dim() == 2)
    weights = {}
    for name in linears:
        out_features, in_features = tensors.pop(f"{name}.weight").shape
        codes = torch.randint(0, 1 << nbits, (out_features, in_features // group_size, 1), generator=generator)
        codebooks = torch.randn(1, 1 << nbits, 1, group_size, generator=generator).half() * 0.05
        scales = (1 + torch.rand(out_features, 1, 1, 1, generator=generator)).half()
        tensors.update({f"{name}.codes": pack_codes(codes, nbits), f"{name}.codebooks": codebooks,
                        f"{name}.scales": scales})
        weights[name] = dequantize_weight(codes, codebooks.float(), scales.float())
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp_dir / "config.json").read_text())
    # lm_head is tied to the embeddings (absent from the file) but must still stay unquantized
    keep = sorted({n.rsplit(".", 1)[0] for n in tensors if not n.endswith((".codes", ".codebooks", ".scales"))} | {"lm_head"})
    config["quantization_config"] = {"quant_method": "aqlm", "in_group_size": group_size, "out_group_size": 1,
                                     "num_codebooks": 1, "nbits_per_codebook": nbits,
                                     "linear_weights_not_to_quantize": keep + [f"{k}.weight" for k in keep]}
    (out_dir / "config.json").write_text(json.dumps(config))
    for item in fp_dir.iterdir():
        if item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
            (out_dir / item.name).write_bytes(item.read_bytes())
    return weights


def test_bits_per_parameter_read_from_the_stored_tensors(tiny_dir, tmp_path):
    assert stored_bits_per_parameter(tiny_dir)["bits_per_parameter"] == 32.0  # the tiny model is stored in fp32
    _write_aqlm_checkpoint(tiny_dir, tmp_path / "aqlm", nbits=8, group_size=8)
    stored = stored_bits_per_parameter(tmp_path / "aqlm")
    config = json.loads((tiny_dir / "config.json").read_text())
    hidden, mlp, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * config["head_dim"]
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden), (hidden, mlp)]
    shapes = shapes * config["num_hidden_layers"]
    expected_bits = sum(bits_per_parameter(o, i, 1, 8, 8) * o * i for o, i in shapes)
    assert stored["format"] == "aqlm" and stored["quantized_linears"] == len(shapes)
    assert stored["quantized_parameters"] == sum(o * i for o, i in shapes)
    assert stored["bits_per_parameter"] == pytest.approx(expected_bits / stored["quantized_parameters"])
    assert stored["nominal_bits_per_parameter"] == stored["bits_per_parameter"]  # 8-bit codes fill int8


# --- the stage -----------------------------------------------------------------------------------

def _evaluate(model_dir, output, corpora_dir, task_dir, **changes) -> int:
    """The evaluate stage on the small test settings (any field of its settings or paths changed),
    through its typed entry point; its exit code."""
    settings = {"context": 32, "max_windows": 3, "c4_windows": 4, "task_limit": 2, "batch_size": 2, "device": "cpu",
                "quiet": True}
    paths = {"model_dir": model_dir, "output": output, "data_dir": corpora_dir, "task_data_dir": task_dir}
    settings_fields = {spec.name for spec in dataclasses.fields(evaluate_stage.EvaluateSettings)}
    for key, value in changes.items():
        (settings if key in settings_fields else paths)[key] = value
    return run_stage_module(evaluate_stage, evaluate_stage.EvaluateSettings(**settings),
                            evaluate_stage.EvaluatePaths(**paths))


def test_evaluate_stage_embeds_the_pre_pv_evaluation_whole(tiny_dir, corpora_dir, task_dir, tmp_path, capsys):
    pre = tmp_path / "eval_pre_pv.json"
    only = {"perplexity": ("wikitext2",), "tasks": ()}
    assert _evaluate(tiny_dir, pre, corpora_dir, task_dir, **only) == 0
    post = tmp_path / "eval.json"
    assert _evaluate(tiny_dir, post, corpora_dir, task_dir, **only, pre_pv=pre) == 0
    assert json.loads(post.read_text())["pre_pv"] == json.loads(pre.read_text())
    not_an_eval = tmp_path / "other.json"
    not_an_eval.write_text("{}")
    refused = tmp_path / "refused.json"
    assert _evaluate(tiny_dir, refused, corpora_dir, task_dir, **only, pre_pv=not_an_eval) == 2
    assert "--pre-pv" in capsys.readouterr().err and not refused.exists()


def test_evaluate_stage_writes_a_complete_eval_json(tiny_dir, corpora_dir, task_dir, tmp_path):
    upstream = tmp_path / "settings.json"
    upstream.write_text(json.dumps({"num_codebooks": 1, "nbits": 16}))
    output = tmp_path / "out" / "eval.json"
    assert _evaluate(tiny_dir, output, corpora_dir, task_dir, label="pre-pv", settings=upstream) == 0
    payload = json.loads(output.read_text())
    assert set(payload) == {"label", "model_dir", "metrics", "settings", "timings", "bits_per_parameter", "storage", "data"}
    metrics = payload["metrics"]
    assert metrics["wikitext2"]["windows"] == 3 and metrics["wikitext2"]["context"] == 32
    assert metrics["c4"]["windows"] == 4 and metrics["c4"]["context"] == 32
    assert all(metrics[name]["perplexity"] > 1 for name in ("wikitext2", "c4"))
    assert sorted(metrics["tasks"]) == sorted(ZERO_SHOT_TASKS) and 0 <= metrics["avg_acc"] <= 1
    assert payload["label"] == "pre-pv" and payload["bits_per_parameter"] == 32.0
    assert payload["settings"]["upstream"] == {"num_codebooks": 1, "nbits": 16}
    assert payload["settings"]["context"] == 32 and payload["settings"]["task_limit"] == 2
    assert payload["settings"]["task_batch_size_used"] == payload["settings"]["batch_size"]  # CPU, none set
    timings = payload["timings"]
    assert {"load_seconds", "wikitext2_seconds", "c4_seconds", "perplexity_seconds", "zero_shot_seconds",
            "total_seconds"} <= set(timings) and timings["total_seconds"] > 0
    data = payload["data"]
    assert data["wikitext2"]["role"] == "evaluation" and data["c4"]["role"] == "evaluation"
    assert len(data["c4"]["window_sources"]) == 4 and data["zero_shot"]["source"] == "handwritten"
    assert len(data["wikitext2"]["windows_sha256"]) == 64


def test_unset_task_batch_is_large_on_a_gpu_and_the_perplexity_batch_on_a_cpu():
    # at 1 a 3B's six tasks took ~30 min on an H100 for a user without the GPU profile
    settings = evaluate_stage.EvaluateSettings
    assert evaluate_stage.task_batch_size(settings(device="cuda", batch_size=2)) == evaluate_stage.GPU_TASK_BATCH_SIZE
    assert evaluate_stage.task_batch_size(settings(device="cuda:1")) == evaluate_stage.GPU_TASK_BATCH_SIZE
    assert evaluate_stage.task_batch_size(settings(device="cpu", batch_size=3)) == 3
    assert evaluate_stage.task_batch_size(settings(device="cuda", task_batch_size=8)) == 8


@pytest.mark.parametrize("cpu_kernel", ["dense", "fast", "aqlm"])
def test_evaluate_stage_on_an_aqlm_checkpoint_matches_its_dequantized_weights(tiny_dir, corpora_dir, task_dir, tmp_path,
                                                                              cpu_kernel):
    weights = _write_aqlm_checkpoint(tiny_dir, tmp_path / "aqlm")
    output = tmp_path / "eval.json"
    assert _evaluate(tmp_path / "aqlm", output, corpora_dir, task_dir, perplexity=("wikitext2",), tasks=(),
                     cpu_kernel=cpu_kernel) == 0
    payload = json.loads(output.read_text())
    reference = load_causal_lm(tiny_dir)
    with torch.no_grad():
        for name, weight in weights.items():
            reference.get_submodule(name).weight.copy_(weight)
    tokenizer = load_tokenizer(tiny_dir)
    from aqflow.data.offline_text import load_split_corpus, role_texts

    _, texts = role_texts(load_split_corpus(corpora_dir / "wikitext2-standin.parquet"), "evaluation")
    expected = perplexity(reference, wikitext2_windows(texts, tokenizer, 32, max_windows=3), progress=False)
    assert payload["metrics"]["wikitext2"]["perplexity"] == pytest.approx(expected, rel=1e-3)
    assert payload["storage"]["format"] == "aqlm" and 7 < payload["bits_per_parameter"] < 16
    assert "tasks" not in payload["metrics"] and "c4" not in payload["metrics"]
    assert payload["settings"]["cpu_kernel"] == cpu_kernel


@pytest.mark.parametrize("nbits", [8, 4])  # 8: aqlm's numba kernel on a CPU; 4: its dequantize-and-matmul path
def test_dense_cpu_layers_give_the_logits_of_aqlms_own_kernels(tiny_dir, tmp_path, nbits):
    _write_aqlm_checkpoint(tiny_dir, tmp_path / "aqlm", nbits=nbits)
    through_aqlm = evaluate_stage.load_model(tmp_path / "aqlm", "float32", "cpu", "aqlm")
    dense = evaluate_stage.load_model(tmp_path / "aqlm", "float32", "cpu", "dense")
    quantized = [name for name, m in through_aqlm.named_modules() if type(m).__name__ == "QuantizedLinear"]
    assert len(quantized) == 7 * through_aqlm.config.num_hidden_layers
    assert not any(type(m).__name__ == "QuantizedLinear" for m in dense.modules())
    assert all(type(dense.get_submodule(name)) is torch.nn.Linear for name in quantized)
    ids = torch.randint(0, through_aqlm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = through_aqlm(ids).logits, dense(ids).logits
    assert float((got - expected).abs().max()) < 1e-5 * float(expected.abs().max())


@pytest.mark.parametrize("change, flag", [
    ({"--model-dir": "/nonexistent/model"}, "--model-dir"),
    ({"--context": "1"}, "--context"),
    ({"--task-limit": "0"}, "--task-limit"),
    ({"--logits-budget-gib": "0"}, "--logits-budget-gib"),
    ({"--data-dir": "/nonexistent/corpora"}, "--wikitext2-corpus"),
    ({"--task-data-dir": "/nonexistent/tasks"}, "--task-data-dir"),
    ({"--settings": "BROKEN"}, "--settings"),
    ({"--tasks": "arc_easy mmlu"}, "--tasks"),
    ({"--context": "100000"}, "wikitext2 ("),  # longer than the whole text: no window
    ({"--perplexity": "c4", "--context": "5000"}, "c4 ("),  # no document that long
])
def test_evaluate_stage_rejects_bad_inputs_and_writes_nothing(change, flag, tiny_dir, corpora_dir, task_dir,
                                                              tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    args = ["--model-dir", str(tiny_dir), "--output", str(tmp_path / "eval.json"), "--data-dir", str(corpora_dir),
            "--task-data-dir", str(task_dir), "--context", "32", "--max-windows", "3", "--c4-windows", "4",
            "--task-limit", "2", "--batch-size", "2", "--device", "cpu", "--quiet"]  # the command line: its errors name flags
    for key, value in change.items():
        value = str(broken) if value == "BROKEN" else value
        if key in args:
            index = args.index(key)
            args[index + 1: index + 2] = value.split()
        else:
            args += [key, *value.split()]
    assert evaluate_stage.main(args) == 2
    assert flag in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [broken]


# --- slow: real task data and the real SmolLM2 ---------------------------------------------------

@pytest.fixture(scope="module")
def real_task_dir(tmp_path_factory) -> Path:
    return prepare_zero_shot_data(tmp_path_factory.mktemp("zero-shot"), default_cache_dir())


@pytest.mark.slow
def test_local_task_data_holds_the_standard_evaluation_splits(real_task_dir):
    manifest = read_manifest(real_task_dir)
    assert {task: entry["examples"] for task, entry in manifest["tasks"].items()} == EXPECTED_EXAMPLES
    rows = {task: [json.loads(line) for line in path.read_text().splitlines()]
            for task, path in task_data_files(real_task_dir, ZERO_SHOT_TASKS).items()}
    for subset in ("arc_easy", "arc_challenge"):
        assert len({row["id"] for row in rows[subset]}) == EXPECTED_EXAMPLES[subset]  # duplicates dropped
        assert all(row["answerKey"] in row["choices"]["label"] for row in rows[subset])
        assert {len(row["choices"]["text"]) for row in rows[subset]} <= {3, 4, 5}
    assert rows["arc_easy"][0]["id"] == "Mercury_417466" and rows["arc_challenge"][0]["id"] == "Mercury_7175875"
    assert {row["label"] for row in rows["hellaswag"]} == {"0", "1", "2", "3"}
    assert all(len(row["endings"]) == 4 for row in rows["hellaswag"])
    assert {row["label"] for row in rows["piqa"]} == {0, 1}
    assert {row["answer"] for row in rows["winogrande"]} == {"1", "2"}
    assert all(row["sentence"].count("_") >= 1 for row in rows["winogrande"])
    assert rows["lambada_openai"][0]["text"].endswith("I don't care about signs")
    assert all(set(row) == {"text"} for row in rows["lambada_openai"])


@pytest.mark.slow
def test_zero_shot_on_the_real_task_data_with_a_tiny_model(tiny, real_task_dir, tmp_path):
    model, tokenizer = tiny
    metrics = run_zero_shot(model, tokenizer, task_data_files(real_task_dir, ZERO_SHOT_TASKS), tmp_path, limit=3)
    assert sorted(metrics) == sorted(ZERO_SHOT_TASKS)
    assert all(0.0 <= value <= 1.0 for m in metrics.values() for name, value in m.items() if name.startswith("acc")
               and not name.endswith("stderr"))


@pytest.mark.slow
def test_smollm2_through_the_evaluate_stage(real_task_dir, tmp_path):
    cache = default_cache_dir()
    model_dir = prepare_model("smollm2", cache)
    for corpus in ("wikitext2-standin", "c4-standin"):
        prepare_corpus(corpus, cache, tmp_path / "corpora" / f"{corpus}.parquet")
    output = tmp_path / "eval.json"
    settings = evaluate_stage.EvaluateSettings(context=256, max_windows=8, c4_windows=8, task_limit=10, batch_size=4,
                                               device="cpu", label="fp16", quiet=True)
    paths = evaluate_stage.EvaluatePaths(model_dir=model_dir, output=output, data_dir=tmp_path / "corpora",
                                         task_data_dir=real_task_dir)
    assert run_stage_module(evaluate_stage, settings, paths) == 0
    payload = json.loads(output.read_text())
    metrics = payload["metrics"]
    print("SmolLM2 eval:", json.dumps({k: v for k, v in metrics.items() if k != "tasks"}),
          json.dumps({t: {n: round(v, 3) for n, v in m.items() if not n.endswith("stderr")}
                      for t, m in metrics["tasks"].items()}), json.dumps(payload["timings"]))
    assert 10 < metrics["wikitext2"]["perplexity"] < 60
    assert 5 < metrics["c4"]["perplexity"] < 500
    assert all(0 <= m["acc"] <= 1 for m in metrics["tasks"].values())
    assert payload["bits_per_parameter"] == 16.0
