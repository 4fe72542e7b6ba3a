"""The Brown corpus as offline evaluation domains: tags stripped, one document per file, one source per genre."""

import pytest

from aqflow.data.brown import detokenize_file, detokenize_sentence, load_brown
from aqflow.data.offline_text import split_documents
from aqflow.fetching import default_cache_dir


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
    assert docs["source"].nunique() == 15 and {"brown-news", "brown-learned", "brown-humor"} <= set(docs["source"])
    assert 0.95e6 < docs["text"].str.split().str.len().sum() < 1.1e6
    assert not docs["text"].str.contains(r"\w/(?:at|nn|nns|np|vbd|jj|in)\b", regex=True).any()  # no word/tag left
    split = split_documents(docs, 0.5, seed=0)
    roles = split.groupby("source")["role"].nunique()
    assert (roles == 2).all()  # every genre has calibration and evaluation documents
