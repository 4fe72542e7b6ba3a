"""Text data: the corpus catalog (`corpus_catalog`), offline corpora as documents split by document,
hub text, user files, and token windows.
Names are imported on first use (PEP 562), so that the pure-Python catalog loads without torch or
pandas, e.g. in Snakemake's DAG build.
"""

from importlib import import_module

_EXPORTS = {
    **{name: "offline_text" for name in (
        "CALIBRATION", "CORPORA", "EVALUATION", "ROLES", "fetch_gensim_wheel", "fetch_nlp_corpus_tarball",
        "load_c4_standin", "load_split_corpus", "load_wikipedia_standin", "parse_mediawiki_articles",
        "prepare_corpus", "read_nlp_corpus", "read_wikipedia_standin", "role_texts", "split_documents",
        "write_split_corpus")},
    "strip_wiki_markup": "wiki_markup",
    **{name: "windows" for name in ("CalibrationWindows", "perplexity_windows", "sample_calibration_windows")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
