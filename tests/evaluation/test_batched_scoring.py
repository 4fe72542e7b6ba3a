"""Batched scoring of lm-eval requests gives lm-eval's own answers, request for request."""

from __future__ import annotations

import random

import pytest
import torch

from aqflow.data.zero_shot import ZERO_SHOT_TASKS, task_data_files, write_task_files
from aqflow.evaluation.batched_scoring import BatchedScoringLM, batch_layout, model_input
from aqflow.evaluation.zero_shot import run_zero_shot
from aqflow.models import build_tiny_llama, load_causal_lm, load_tokenizer

from test_evaluation import HANDWRITTEN_TASKS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return load_causal_lm(folder), load_tokenizer(folder)


def _requests(rng: random.Random, vocab: int, count: int) -> list:
    """(request key, context tokens, continuation tokens): multi-token continuations, groups of
    one-token continuations sharing a context (lm-eval's cache hits), and over-long inputs."""
    requests = []
    for index in range(count):
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        kind = index % 3
        if kind == 0:  # four one-token choices of one context, as a multiple-choice question
            for choice in rng.sample(range(vocab), 4):
                requests.append(((f"c{index}", str(choice)), context, [choice]))
        else:
            continuation = [rng.randrange(vocab) for _ in range(rng.randint(1, 6 if kind == 1 else 60))]
            requests.append(((f"c{index}", "cont"), context, continuation))
    return requests


def test_layout_points_each_token_at_the_position_that_predicts_it():
    inputs = [model_input([5, 6, 7], [8, 9], max_length=100), model_input([1], [2], max_length=100)]
    layout = batch_layout(inputs, [[[8, 9]], [[2], [3]]])
    assert layout.input_ids.tolist() == [[5, 6, 7, 8], [1, 0, 0, 0]]
    # 8 is predicted at position 2 (token 7), 9 at position 3; both one-token choices at row 1, position 0
    assert layout.rows.tolist() == [[0, 2], [0, 3], [1, 0]]
    assert layout.token_rows.tolist() == [0, 1, 2, 2]
    assert layout.targets.tolist() == [8, 9, 2, 3]
    assert layout.owners.tolist() == [0, 0, 1, 2]
    assert model_input(list(range(10)), [10, 11], max_length=5) == [6, 7, 8, 9, 10]


@pytest.mark.parametrize("batch_size", [1, 7])
def test_batched_answers_equal_lm_evals_request_for_request(tiny, batch_size):
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = tiny
    requests = _requests(random.Random(0), model.config.vocab_size, 30)
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=64)
    batched = BatchedScoringLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=64)
    expected = reference._loglikelihood_tokens(requests, disable_tqdm=True)
    answers = batched._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(answers) == len(requests) == len(expected)
    assert [greedy for _, greedy in answers] == [greedy for _, greedy in expected]
    assert [value for value, _ in answers] == pytest.approx([value for value, _ in expected], rel=1e-6, abs=1e-6)
    # a request's answer does not depend on the batch it was scored in
    alone = batched._loglikelihood_tokens(requests[:1], disable_tqdm=True)
    assert alone[0][0] == pytest.approx(answers[0][0], rel=1e-5)


def test_greedy_match_is_true_for_the_models_own_argmax_continuation(tiny):
    model, tokenizer = tiny
    context = [3, 17, 42, 9]
    with torch.no_grad():
        greedy = []
        ids = list(context)
        for _ in range(3):
            next_token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            greedy.append(next_token)
            ids.append(next_token)
    lm = BatchedScoringLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    other = (greedy[0] + 1) % model.config.vocab_size
    answers = lm._loglikelihood_tokens([(("a", "g"), context, greedy), (("a", "o"), context, [other, *greedy[1:]])],
                                       disable_tqdm=True)
    assert answers[0][1] is True and answers[1][1] is False
    assert answers[0][0] > answers[1][0]


def test_zero_shot_metrics_equal_with_either_scoring(tiny, tmp_path):
    model, tokenizer = tiny
    write_task_files(HANDWRITTEN_TASKS, tmp_path / "tasks", {"source": "handwritten"})
    files = task_data_files(tmp_path / "tasks", ZERO_SHOT_TASKS)
    shipped = run_zero_shot(model, tokenizer, files, tmp_path / "a", batch_size=3, scoring="lm-eval")
    batched = run_zero_shot(model, tokenizer, files, tmp_path / "b", batch_size=3, scoring="batched")
    assert shipped.keys() == batched.keys()
    for task in shipped:
        assert batched[task] == pytest.approx(shipped[task], rel=1e-5), task  # float32 sums in another order


class _Request:
    """What lm-eval's loglikelihood reads of an Instance: its (context, continuation) args."""

    def __init__(self, context: str, continuation: str):
        self.args = (context, continuation)


def _text_requests(tokenizer) -> list[_Request]:
    """Contexts with and without trailing spaces, an empty context, one starting with the BOS
    string, repeated contexts (multiple choice) and non-ASCII text."""
    bos = tokenizer.decode([tokenizer.bos_token_id]) if tokenizer.bos_token_id is not None else ""
    pairs = [("Question: what is two plus two?\nAnswer:", " four"), ("The cat sat on the ", "mat."),
             ("", "An empty context."), (bos + "Starts with BOS", " then more"), ("Café au lait  ", "déjà vu")]
    pairs += [("Which is heavier, a kilo of iron or a kilo of feathers?", f" {choice}")
              for choice in ("iron", "feathers", "neither", "both")]
    return [_Request(context, continuation) for context, continuation in pairs]


def test_strings_tokenized_in_one_batch_give_lm_evals_requests_and_answers(tiny):
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = tiny
    requests = _text_requests(tokenizer)
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=64)
    batched = BatchedScoringLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=64)
    batched.prefetch_encodings([request.args for request in requests])
    for context, continuation in (request.args for request in requests if request.args[0]):
        assert batched._encode_pair(context, continuation) == reference._encode_pair(context, continuation)
    batched._encoded = None
    expected = reference.loglikelihood(requests, disable_tqdm=True)
    one_at_a_time = []
    encode = tokenizer.encode
    tokenizer.encode = lambda *args, **kwargs: one_at_a_time.append(args) or encode(*args, **kwargs)
    try:
        answers = batched.loglikelihood(requests, disable_tqdm=True)
    finally:
        tokenizer.encode = encode
    assert one_at_a_time == []  # every string came from the one batched call
    assert [greedy for _, greedy in answers] == [greedy for _, greedy in expected]
    assert [value for value, _ in answers] == pytest.approx([value for value, _ in expected], rel=1e-6, abs=1e-6)
    assert batched._encoded is None  # the batch's strings are not kept past the call


def test_cached_templates_render_lm_evals_text_and_compile_each_template_once(monkeypatch):
    from lm_eval import utils

    from aqflow.evaluation.batched_scoring import cached_templates

    templates = ["Question: {{question}}\nAnswer:", "{{ choices[label] | regex_replace('a', 'b') }}", "{{question}}"]
    docs = [{"question": f"q{i}?", "choices": ["alpha", "beta"], "label": i % 2} for i in range(5)]
    expected = [utils.apply_template(template, doc) for template in templates for doc in docs]
    compiled = []
    from_string = utils.env.from_string
    monkeypatch.setattr(utils.env, "from_string", lambda source: compiled.append(source) or from_string(source))
    with cached_templates():
        rendered = [utils.apply_template(template, doc) for template in templates for doc in docs]
    assert rendered == expected
    assert sorted(compiled) == sorted(templates)  # once each, not once per document
    utils.apply_template("{{question}}", docs[0])
    assert len(compiled) == len(templates) + 1  # lm-eval's own function is back after the block


def _reference_layout(inputs, scored):
    """batch_layout's definition, one token at a time: what the array version must equal."""
    padded_len = max(len(ids) for ids in inputs)
    input_ids = [ids + [0] * (padded_len - len(ids)) for ids in inputs]
    rows, token_rows, targets, owners = [], [], [], []
    for batch_index, (ids, continuations) in enumerate(zip(inputs, scored)):
        longest = max(len(cont) for cont in continuations)
        first_row = len(rows)
        rows.extend([batch_index, position] for position in range(len(ids) - longest, len(ids)))
        for continuation in continuations:
            offset = first_row + longest - len(continuation)
            token_rows.extend(range(offset, offset + len(continuation)))
            targets.extend(continuation)
            owners.extend([len({owner for owner in owners})] * len(continuation))
    return input_ids, rows, token_rows, targets, owners


def test_the_layout_equals_its_token_by_token_definition_on_random_batches():
    rng = random.Random(3)
    for _ in range(50):
        inputs, scored = [], []
        for _ in range(rng.randint(1, 9)):
            continuations = [[rng.randrange(100) for _ in range(rng.randint(1, 5))]]
            if rng.random() < 0.4:  # one-token cache hits sharing the input's context
                continuations = [[rng.randrange(100)] for _ in range(rng.randint(1, 4))]
            context = [rng.randrange(100) for _ in range(rng.randint(1, 12))]
            inputs.append(model_input(context, continuations[0], max_length=rng.choice([4, 64])))
            scored.append(continuations)
        layout = batch_layout(inputs, scored)
        input_ids, rows, token_rows, targets, owners = _reference_layout(inputs, scored)
        assert layout.input_ids.tolist() == input_ids
        assert layout.rows.tolist() == rows and layout.token_rows.tolist() == token_rows
        assert layout.targets.tolist() == targets and layout.owners.tolist() == owners
        assert layout.num_requests == sum(len(continuations) for continuations in scored)


def test_strings_from_the_tokenizers_backend_equal_its_own_call_and_a_differing_backend_is_not_used(tiny):
    from aqflow.evaluation.batched_scoring import CHECKED_STRINGS, batch_input_ids

    _, tokenizer = tiny
    rng = random.Random(1)
    words = ["the", "cat", "Café", "déjà", "vu", "?", "Answer:", "  ", "\n", "iron", "feathers", "1984"]
    strings = ["".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(rng.randint(1, 12)))
               for _ in range(3 * CHECKED_STRINGS)]
    for kwargs in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
        assert batch_input_ids(tokenizer, strings, kwargs) == tokenizer(strings, **kwargs)["input_ids"], kwargs

    class WithBackend:
        """The tokenizer's own call (counted), with `backend` as its Rust backend."""

        def __init__(self, backend):
            self._tokenizer, self.calls = backend, []

        def __call__(self, batch, **kwargs):
            self.calls.append(len(batch))
            return tokenizer(batch, **kwargs)

    class Disagreeing:  # a backend whose ids differ from the tokenizer's own call
        truncation = padding = None

        def encode_batch(self, batch, add_special_tokens=True):
            return [type("Encoding", (), {"ids": [7]})() for _ in batch]

    expected = tokenizer(strings)["input_ids"]
    trusted, distrusted = WithBackend(tokenizer._tokenizer), WithBackend(Disagreeing())
    assert batch_input_ids(trusted, strings, {}) == expected and trusted.calls == [CHECKED_STRINGS]
    assert batch_input_ids(distrusted, strings, {}) == expected
    assert distrusted.calls == [CHECKED_STRINGS, len(strings) - CHECKED_STRINGS]


def _batches_of_16_and_their_answers(tiny, seed: int):
    """A scorer of 16 requests a batch, 30 random requests, and its answers scored whole."""
    model, tokenizer = tiny
    requests = _requests(random.Random(seed), model.config.vocab_size, 30)
    batched = BatchedScoringLM(pretrained=model, tokenizer=tokenizer, batch_size=16, max_length=64)
    return batched, requests, batched._loglikelihood_tokens(requests, disable_tqdm=True)


def _assert_same_answers(pieces, whole):
    assert [greedy for _, greedy in pieces] == [greedy for _, greedy in whole]
    assert [value for value, _ in pieces] == pytest.approx([value for value, _ in whole], rel=1e-5, abs=1e-6)


def test_a_batch_over_the_logits_budget_is_scored_in_pieces_with_the_same_answers(tiny, monkeypatch):
    model, _ = tiny
    batched, requests, whole = _batches_of_16_and_their_answers(tiny, seed=1)
    forwards = []
    scored_alone = batched._score
    monkeypatch.setattr(batched, "_score", lambda inputs, scored: forwards.append(
        (len(inputs), max(map(len, inputs)))) or scored_alone(inputs, scored))
    # room for the float32 logits of 192 positions: three 64-token sequences, more shorter ones
    batched.logits_budget_bytes = 3 * 64 * model.config.vocab_size * 4
    pieces = batched._loglikelihood_tokens(requests, disable_tqdm=True)
    assert all(rows * length <= 3 * 64 for rows, length in forwards)
    assert forwards[0] == (3, 64) and len(forwards) > len(requests) / 16
    _assert_same_answers(pieces, whole)


def test_a_card_that_runs_out_of_memory_gets_smaller_passes_with_the_same_answers(tiny, monkeypatch):
    batched, requests, whole = _batches_of_16_and_their_answers(tiny, seed=2)
    forwards = []
    scored_alone = batched._score

    def shared_card(inputs, scored):  # another job on the card leaves room for five sequences
        forwards.append(len(inputs))
        if len(inputs) > 5:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return scored_alone(inputs, scored)

    monkeypatch.setattr(batched, "_score", shared_card)
    pieces = batched._loglikelihood_tokens(requests, disable_tqdm=True)
    assert forwards[:3] == [16, 8, 4] and max(forwards[3:]) == 4  # later batches start from what held
    _assert_same_answers(pieces, whole)
