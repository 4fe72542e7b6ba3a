"""Distance of evaluation text from calibration text: the divergence's properties on cases whose
answer is known, and the domain-distances stage end to end on a tiny model and stand-in-shaped corpora."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aqflow.data.domain_distance import (
    Distance,
    jensen_shannon,
    near_to_far,
    sampled_distance,
    subsample_counts,
    text_token_counts,
    token_counts,
)
from aqflow.data.offline_text import write_split_corpus

LN2 = math.log(2)


def test_identical_distributions_are_at_distance_zero():
    counts = np.array([5, 0, 3, 9, 1])
    assert jensen_shannon(counts, counts) == 0.0
    assert jensen_shannon(counts, 3 * counts) == pytest.approx(0.0, abs=1e-15)  # only the proportions count


def test_a_hand_computed_case():
    # P = (1, 0), Q = (1/2, 1/2): M = (3/4, 1/4); KL(P||M) = ln 4/3, KL(Q||M) = 1/2 ln 2/3 + 1/2 ln 2
    expected = 0.5 * math.log(4 / 3) + 0.5 * (0.5 * math.log(2 / 3) + 0.5 * math.log(2))
    assert jensen_shannon(np.array([4, 0]), np.array([1, 1])) == pytest.approx(expected, rel=1e-12)


def test_symmetric_and_bounded_by_ln2_which_disjoint_supports_reach():
    rng = np.random.default_rng(0)
    for _ in range(50):
        p, q = rng.integers(0, 20, size=(2, 30))
        p[0] += 1
        q[1] += 1
        value = jensen_shannon(p, q)
        assert value == pytest.approx(jensen_shannon(q, p), abs=1e-15)
        assert 0.0 <= value <= LN2
    assert jensen_shannon(np.array([3, 2, 0, 0]), np.array([0, 0, 7, 1])) == pytest.approx(LN2, abs=1e-15)


def test_a_shifted_distribution_is_farther_than_a_near_one():
    base = np.exp(-0.5 * ((np.arange(200) - 80) / 15.0) ** 2)
    near, far = np.roll(base, 5), np.roll(base, 40)
    assert 0 < jensen_shannon(base, near) < jensen_shannon(base, far) < LN2


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="shapes"):
        jensen_shannon(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="positive total"):
        jensen_shannon(np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="token id 7 outside the vocabulary of 5"):
        token_counts([[1, 2], [7]], 5)


def test_token_counts_and_subsamples():
    counts = token_counts([[0, 1, 1], [4, 1]], 6)
    assert counts.tolist() == [1, 3, 0, 0, 1, 0]
    rng = np.random.default_rng(0)
    for n in (1, 3, 5):
        drawn = subsample_counts(counts, n, rng)
        assert drawn.sum() == n and (drawn <= counts).all() and (drawn >= 0).all()
    with pytest.raises(ValueError, match="cannot draw 6 tokens from a text of 5"):
        subsample_counts(counts, 6, rng)


def test_sampling_bias_is_why_every_domain_is_compared_at_one_size():
    """Two samples of ONE distribution look farther apart the smaller the sample: the plug-in
    divergence is biased upwards, so domains of different sizes are subsampled to one size."""
    rng = np.random.default_rng(1)
    zipf = 1.0 / np.arange(1, 2001)
    population = rng.multinomial(400_000, zipf / zipf.sum())
    same_source = rng.multinomial(100_000, zipf / zipf.sum())
    small, large = (sampled_distance(population, same_source, n, draws=8, seed=0) for n in (2_000, 50_000))
    assert small.mean > 2 * large.mean
    # at one size, a genuinely different text is farther than the same source
    shifted = np.roll(zipf, 300)
    other = rng.multinomial(100_000, shifted / shifted.sum())
    assert sampled_distance(population, other, 2_000, draws=8, seed=0).mean > small.mean + 10 * small.sd


def test_sampled_distance_is_seeded():
    rng = np.random.default_rng(2)
    p, q = rng.integers(0, 50, size=(2, 100))
    first, second = (sampled_distance(p, q, 500, draws=4, seed=3) for _ in range(2))
    assert first == second and first.draws == 4 and first.sample_tokens == 500 and first.sd > 0
    with pytest.raises(ValueError, match="draws"):
        sampled_distance(p, q, 500, draws=0, seed=0)


def test_text_token_counts_caps_tokens_in_a_seeded_document_order():
    texts = [f"doc{i} " * (i + 1) for i in range(10)]
    encode = lambda batch: [[int(word[3:]) for word in text.split()] for text in batch]  # noqa: E731
    counts, tokens, documents = text_token_counts(texts, encode, 10, None, seed=0)
    assert tokens == 55 and documents == 10 and counts.tolist() == list(range(1, 11))
    capped, tokens, documents = text_token_counts(texts, encode, 10, 12, seed=0)
    assert tokens == 12 == capped.sum() and documents <= 10
    again, _, _ = text_token_counts(texts, encode, 10, 12, seed=0)
    assert (again == capped).all()


def test_near_to_far_orders_by_mean_then_name():
    distances = {name: Distance(mean, 0.0, 1, 10) for name, mean in (("b", 0.2), ("a", 0.2), ("c", 0.1))}
    assert near_to_far(distances) == ["c", "a", "b"]


# --- the stage ------------------------------------------------------------------------------------

COMMON = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
FORMAL = "government policy committee report federal program public state administration budget".split()
STORY = "she looked door night dark ran smiled heart whispered window".split()


def _documents(rng: random.Random, vocabulary_mix: list[tuple[list[str], float]], count: int, words: int) -> list[str]:
    pools, weights = zip(*vocabulary_mix)
    return [" ".join(rng.choice(rng.choices(pools, weights)[0]) for _ in range(words)) for _ in range(count)]


def _corpus(folder: Path, name: str, calibration: list[str], evaluation: list[str]) -> Path:
    """A fetch-data-shaped corpus (Parquet + split record) with the given documents per role."""
    docs = pd.DataFrame({"doc_id": [f"{name}/{i:03d}" for i in range(len(calibration) + len(evaluation))],
                         "text": calibration + evaluation, "source": name,
                         "role": ["calibration"] * len(calibration) + ["evaluation"] * len(evaluation)})
    path = folder / f"{name}.parquet"
    write_split_corpus(docs, path, seed=0, calibration_fraction=0.5)
    return path


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    """A tiny model, a calibration corpus of common + formal words, and evaluation corpora drawn
    from the same mix (near), half story words (mid) and story words alone (far)."""
    from aqflow.models import build_tiny_llama

    root = tmp_path_factory.mktemp("distances")
    model = build_tiny_llama(root / "model", seed=0)
    rng = random.Random(0)
    formal, mid, story = [(COMMON, 0.5), (FORMAL, 0.5)], [(COMMON, 0.5), (FORMAL, 0.25), (STORY, 0.25)], [(COMMON, 0.5), (STORY, 0.5)]
    corpora = {
        "calib": _corpus(root, "calib", _documents(rng, formal, 30, 200), _documents(rng, formal, 10, 200)),
        "near": _corpus(root, "near", [], _documents(rng, formal, 8, 150)),
        "mid": _corpus(root, "mid", [], _documents(rng, mid, 6, 150)),
        "far": _corpus(root, "far", [], _documents(rng, story, 12, 150)),
    }
    return root, model, corpora


def _run(root: Path, model: Path, corpora: dict, *extra: str) -> int:
    from aqflow.stages import domain_distances

    return domain_distances.main(["--model-dir", str(model), "--calibration", str(corpora["calib"]),
                                  *(str(corpora[name]) for name in ("far", "calib", "mid", "near")),
                                  "--output", str(root / "domains.json"), "--quiet", *extra])


def test_the_stage_orders_domains_from_near_to_far(stage_inputs):
    from aqflow.io.artifacts import read_json

    root, model, corpora = stage_inputs
    assert _run(root, model, corpora, "--draws", "8") == 0
    record = read_json(root / "domains.json")  # verified against its checksum record
    order = [row["domain"] for row in record["domains"]]
    assert order[-2:] == ["mid", "far"] and set(order[:2]) == {"calib", "near"}
    rows = {row["domain"]: row for row in record["domains"]}
    # the calibration corpus's own evaluation text and a text of the same mix differ by sampling noise only
    assert abs(rows["calib"]["distance"] - rows["near"]["distance"]) < rows["mid"]["distance"] - rows["near"]["distance"]
    assert all(0 < row["distance"] < LN2 and row["tokens"] > 0 for row in record["domains"])
    smallest = min(row["tokens"] for row in record["domains"])
    assert record["settings"]["sample_tokens"] == smallest and record["calibration"]["corpus"] == "calib"
    # seeded: a rerun writes the same numbers
    assert _run(root, model, corpora, "--draws", "8") == 0
    assert json.loads((root / "domains.json").read_text())["domains"] == record["domains"]


def test_the_stage_refuses_what_it_cannot_compare(stage_inputs, capsys):
    root, model, corpora = stage_inputs
    assert _run(root, model, corpora, "--sample-tokens", "10000000") == 2
    assert "fewer tokens" in capsys.readouterr().err
    assert _run(root, model, {**corpora, "mid": corpora["far"]}) == 2
    assert "named twice: ['far']" in capsys.readouterr().err
