"""Where registry downloads are cached."""

from pathlib import Path

from aqflow.io.fetching import default_cache_dir

REPO = Path(__file__).resolve().parents[2]


def test_the_default_cache_is_resources_cache_at_the_repository_root(monkeypatch):
    monkeypatch.delenv("AQFLOW_CACHE", raising=False)
    assert default_cache_dir() == REPO / "resources" / "cache"
    monkeypatch.setenv("AQFLOW_CACHE", "/elsewhere")
    assert default_cache_dir() == Path("/elsewhere")
