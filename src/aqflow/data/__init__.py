"""Text data: offline corpora as documents, split by document, and token windows."""

from .offline_text import (
    CALIBRATION,
    CORPORA,
    EVALUATION,
    ROLES,
    fetch_gensim_wheel,
    fetch_nlp_corpus_tarball,
    load_c4_standin,
    load_split_corpus,
    load_wikipedia_standin,
    parse_mediawiki_articles,
    prepare_corpus,
    read_nlp_corpus,
    read_wikipedia_standin,
    role_texts,
    split_documents,
    write_split_corpus,
)
from .wiki_markup import strip_wiki_markup
from .windows import CalibrationWindows, perplexity_windows, sample_calibration_windows

__all__ = [
    "CALIBRATION", "CORPORA", "EVALUATION", "ROLES", "CalibrationWindows", "fetch_gensim_wheel",
    "fetch_nlp_corpus_tarball", "load_c4_standin", "load_split_corpus", "load_wikipedia_standin",
    "parse_mediawiki_articles", "perplexity_windows", "prepare_corpus", "read_nlp_corpus",
    "read_wikipedia_standin", "role_texts", "sample_calibration_windows", "split_documents",
    "strip_wiki_markup", "write_split_corpus",
]
