"""Atomic writers: a folder appears whole or not at all, and never as a half-written one."""

import pytest

from aqflow.artifacts import atomic_dir


def test_atomic_dir_replaces_on_success_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_dir(target) as staging:
        (staging / "new.txt").write_text("new")
        assert not (target / "new.txt").exists()  # invisible until the block ends
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as staging:
            (staging / "half.txt").write_text("half")
            raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    with pytest.raises(FileExistsError, match="out exists"):
        with atomic_dir(target, replace=False):
            pass
