"""DigestCache and damage(): a finished artifact checked against its record, hashing a file again
only when its stat signature moved; what that catches and what only the reading stage catches."""

import json
import os

import pytest

from aqflow.io import artifacts
from aqflow.io.integrity import (CORRUPT, MISSING, UNLISTED, DigestCache, damage, journal_folder, journal_written,
                                 stat_signature)


def _flip(path, keep_mtime=False):
    """Flip one byte in the middle of `path`, keeping its size (and with keep_mtime its mtime)."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size


@pytest.fixture
def finished(tmp_path):
    """A file with a sidecar and a checksummed folder, as aqflow writes them."""
    artifacts.write_json(tmp_path / "layer.json", {"codes": list(range(100))})
    with artifacts.atomic_dir(tmp_path / "calib") as staging:
        (staging / "block0.npz").write_bytes(bytes(range(256)) * 64)
        (staging / "calibration.json").write_text('{"layers": []}')
    return tmp_path


def test_an_intact_artifact_is_hashed_once_then_recognised_by_its_stat(finished, tmp_path):
    cache = DigestCache(tmp_path / "cache.json")
    assert damage(finished / "layer.json", cache) is None and damage(finished / "calib", cache) is None
    assert cache.hashed_files == 3
    cache.save_if_changed()  # at exit
    again = DigestCache(tmp_path / "cache.json")  # the next Snakemake invocation
    assert damage(finished / "layer.json", again) is None and damage(finished / "calib", again) is None
    assert again.hashed_files == 0
    assert json.loads((tmp_path / "cache.json").read_text())[str(finished / "layer.json")][:4] == list(
        stat_signature(finished / "layer.json"))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_flipped_byte_is_caught_with_or_without_its_mtime_kept(finished, tmp_path, keep_mtime):
    """`touch -r` puts an mtime back, never a ctime: the cached digest is not trusted after either."""
    cache = DigestCache(tmp_path / "cache.json")
    assert damage(finished / "layer.json", cache) is None and damage(finished / "calib", cache) is None
    cache.save_if_changed()
    _flip(finished / "layer.json", keep_mtime)
    _flip(finished / "calib" / "block0.npz", keep_mtime)
    again = DigestCache(tmp_path / "cache.json")
    found = damage(finished / "layer.json", again)
    assert found.kind == CORRUPT and found.path == finished / "layer.json" and found.folder is None
    found = damage(finished / "calib", again)
    assert found.kind == CORRUPT and found.path == finished / "calib" / "block0.npz"
    assert found.folder == finished / "calib"


def test_a_change_the_stat_does_not_show_passes_the_cache_but_not_the_reading_stage(finished, tmp_path):
    """What the cache cannot see: bytes changed under an unchanged stat (a failing disk). Simulated
    by a cache entry that vouches for the old bytes at the new stat: damage() trusts it, the stage's
    full verification before use (artifacts.verified, no stat shortcut across processes) refuses."""
    layer = finished / "layer.json"
    cache = DigestCache(tmp_path / "cache.json")
    assert damage(layer, cache) is None
    recorded = artifacts.recorded_sha256(layer)
    _flip(layer)
    cache.entries[str(layer)] = list(stat_signature(layer)) + [recorded]
    assert damage(layer, cache) is None
    artifacts._VERIFIED.clear()  # a new job process
    with pytest.raises(artifacts.ArtifactError, match="layer.json: corrupt: sha256"):
        artifacts.verified(layer)


def test_a_folder_missing_a_listed_file_or_holding_an_unlisted_one_is_named(finished, tmp_path):
    cache = DigestCache(None)
    (finished / "calib" / "extra.txt").write_text("added by hand")
    found = damage(finished / "calib", cache)
    assert found.kind == UNLISTED and found.path.name == "extra.txt"
    (finished / "calib" / "extra.txt").unlink()
    (finished / "calib" / "block0.npz").unlink()
    found = damage(finished / "calib", cache)
    assert found.kind == MISSING and found.path == finished / "calib" / "block0.npz"


def test_a_truncated_file_a_damaged_record_and_an_unrecorded_file(finished, tmp_path):
    cache = DigestCache(None)
    npz = finished / "calib" / "block0.npz"
    npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    assert damage(finished / "calib", cache).kind == CORRUPT
    (finished / "layer.json.sha256").write_text("not a checksum\n")
    found = damage(finished / "layer.json", cache)
    assert found.kind == CORRUPT and "is not '<sha256>  <file>'" in found.detail
    (tmp_path / "by-hand.json").write_text("{}")  # no record: passes, as stages read it unchecked
    assert damage(tmp_path / "by-hand.json", cache) is None and damage(tmp_path / "absent", cache) is None


def test_a_damaged_cache_file_is_ignored(finished, tmp_path):
    (tmp_path / "cache.json").write_text("{half")
    cache = DigestCache(tmp_path / "cache.json")
    assert damage(finished / "layer.json", cache) is None and cache.hashed_files == 1


@pytest.mark.parametrize("flip_after_journal", [False, True])
def test_what_a_job_journaled_is_not_hashed_again_but_a_later_flip_still_is(finished, tmp_path, monkeypatch,
                                                                          flip_after_journal):
    monkeypatch.chdir(finished)  # jobs name their outputs relative to the working directory
    cache_path = tmp_path / ".snakemake" / "aqflow" / "digests.json"
    journal_written(["layer.json", "calib", "not-written-yet.json"], cache_path)
    assert len(list(journal_folder(cache_path).glob("*.json"))) == 1
    if flip_after_journal:
        _flip(finished / "calib" / "block0.npz", keep_mtime=True)
    cache = DigestCache(cache_path)  # the next DAG build
    found = [damage(path, cache) for path in ("layer.json", "calib")]
    if flip_after_journal:  # the ctime moved: hashed again and caught
        assert found[0] is None and found[1].kind == CORRUPT and found[1].path.name == "block0.npz"
        assert cache.hashed_files == 1
    else:
        assert found == [None, None] and cache.hashed_files == 0
    cache.save_if_changed()
    assert not list(journal_folder(cache_path).glob("*.json"))  # merged into the cache, then removed
    assert damage("layer.json", DigestCache(cache_path)) is None
