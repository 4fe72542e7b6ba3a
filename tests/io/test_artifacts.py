"""Atomic, checksummed writers: a file or folder appears whole or not at all, and a reader notices
any later change by name."""

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from aqflow.io import artifacts
from aqflow.io.artifacts import ArtifactError, atomic_dir
from aqflow.io.tensor_files import load_tensor


def test_atomic_dir_replaces_on_success_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_dir(target) as staging:
        (staging / "new.txt").write_text("new")
        assert not (target / "new.txt").exists()  # invisible until the block ends
    assert sorted(p.name for p in target.iterdir()) == ["SHA256SUMS", "new.txt"]
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as staging:
            (staging / "half.txt").write_text("half")
            raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["SHA256SUMS", "new.txt"]
    with pytest.raises(FileExistsError, match="out exists"):
        with atomic_dir(target, replace=False):
            pass


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "renamed-aside"])
def test_a_folder_killed_while_being_replaced_is_whole_old_or_whole_new(tmp_path, monkeypatch, exchange):
    """Replacing a folder (a PV-tuning state saved every step): at any point where a kill can land,
    the target holds every file of one version, and what is left beside it is a stale temporary.
    The kill is simulated where the old version is being removed; the second case is the path for
    file systems without an atomic exchange."""
    target = tmp_path / "state"
    with atomic_dir(target) as staging:
        for name in ("state.json", "state.safetensors"):
            (staging / name).write_text(f"old {name}")
    if not exchange:
        monkeypatch.setattr(artifacts, "_exchange", lambda first, second: False)
    real_rmtree = artifacts.shutil.rmtree

    def killed_halfway(path, *args, **kwargs):  # one file gone, then the kill
        next(iter(sorted(Path(path).iterdir()))).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(target) as staging:
            for name in ("state.json", "state.safetensors"):
                (staging / name).write_text(f"new {name}")
    monkeypatch.setattr(artifacts.shutil, "rmtree", real_rmtree)
    assert {path.name: path.read_text() for path in target.iterdir() if path.name != "SHA256SUMS"} == {
        "state.json": "new state.json", "state.safetensors": "new state.safetensors"}
    artifacts.verified_tree(target)
    leftovers = artifacts.remove_stale_temporaries(target)
    assert leftovers and sorted(path.name for path in tmp_path.iterdir()) == ["state"]


def _write_each_kind(folder):
    """One artifact of each kind, written the way the stages write them; name -> (path, reader)."""
    artifacts.save_npz(folder / "a.npz", {"x": np.arange(64.0).reshape(8, 8)})
    artifacts.save_safetensors(folder / "a.safetensors", {"x": torch.arange(64.0).reshape(8, 8)})
    artifacts.write_parquet(folder / "a.parquet", pd.DataFrame({"x": np.arange(64)}))
    artifacts.write_json(folder / "a.json", {"x": list(range(64))})
    with atomic_dir(folder / "model") as staging:
        (staging / "config.json").write_text(json.dumps({"hidden": 8}))
    return {
        "npz": (folder / "a.npz", lambda path: load_tensor(path, "x", verify=True)),
        "safetensors": (folder / "a.safetensors", artifacts.load_safetensors),
        "parquet": (folder / "a.parquet", artifacts.read_parquet),
        "json": (folder / "a.json", artifacts.read_json),
        "folder": (folder / "model" / "config.json", lambda path: artifacts.verified_tree(path.parent)),
    }


@pytest.mark.parametrize("kind", ["npz", "safetensors", "parquet", "json", "folder"])
@pytest.mark.parametrize("fault", ["flip", "truncate", "no record"])
def test_every_artifact_kind_detects_a_fault_by_name(tmp_path, kind, fault):
    path, read = _write_each_kind(tmp_path)[kind]
    read(path)  # reads whole
    data = bytearray(path.read_bytes())
    if fault == "flip":  # same size, one byte in the middle changed: only a checksum sees it
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif fault == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "folder":
        (path.parent / "SHA256SUMS").write_text("")
    else:
        artifacts.sidecar_path(path).unlink()
    artifacts._VERIFIED.clear()
    with pytest.raises(ArtifactError) as caught:
        read(path)
    message = str(caught.value)
    named = str(path) in message or (kind == "folder" and str(path.parent) in message and path.name in message)
    assert named and ("delete" in message or "rerun" in message)
    if fault != "no record":
        assert "corrupt: sha256" in message


def test_checksum_record_is_the_sha256sum_format(tmp_path):
    artifacts.write_json(tmp_path / "a.json", {"x": 1})
    digest, name = (tmp_path / "a.json.sha256").read_text().split()
    assert name == "a.json" and digest == artifacts.file_sha256(tmp_path / "a.json")


def test_an_undecodable_file_without_a_record_is_named(tmp_path):
    path = tmp_path / "hand.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ArtifactError, match="hand.npz: not a readable NPZ file"):
        load_tensor(path)


def test_stale_temporaries_of_a_target_are_removed_by_its_next_write_only(tmp_path):
    stale_file = tmp_path / ".a.json.x1y2.tmp"
    stale_dir = tmp_path / ".model.k3l4.partial"
    other = tmp_path / ".b.json.z5.tmp"  # another target's: not this write's business
    for path in (stale_file, other):
        path.write_text("half")
    stale_dir.mkdir()
    (stale_dir / "weights").write_text("half")
    artifacts.write_json(tmp_path / "b-finished.json", {})
    assert artifacts.stale_temporaries(tmp_path) == sorted([other, stale_file, stale_dir])
    artifacts.write_json(tmp_path / "a.json", {"x": 1})
    assert not stale_file.exists() and other.exists() and stale_dir.exists()
    with atomic_dir(tmp_path / "model") as staging:
        (staging / "w").write_text("whole")
    assert not stale_dir.exists() and (tmp_path / "model" / "w").read_text() == "whole"
    assert artifacts.stale_temporaries(tmp_path) == [other]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_a_named_write_error_and_leaves_the_old_file(tmp_path):
    artifacts.write_json(tmp_path / "a.json", {"x": 1})
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(ArtifactError, match=f"{tmp_path / 'a.json'}: cannot write"):
            artifacts.write_json(tmp_path / "a.json", {"x": 2})
    finally:
        tmp_path.chmod(0o755)
    assert artifacts.read_json(tmp_path / "a.json") == {"x": 1}


def test_safetensors_artifacts_get_the_umask_mode_not_private(tmp_path):
    """safetensors' own writer creates 0600 files; artifacts are shared like any other output."""
    import os

    import torch

    from aqflow.io.artifacts import save_safetensors

    save_safetensors(tmp_path / "x.safetensors", {"a": torch.zeros(4, 4)})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "x.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_files_another_writer_makes_private_in_an_atomic_dir_get_the_umask_mode(tmp_path):
    """transformers' save_pretrained writes model.safetensors 0600 through safetensors' own writer;
    a model folder in a shared cache must be readable like any other output."""
    import os

    from safetensors.torch import save_file
    import torch

    from aqflow.io.artifacts import atomic_dir

    with atomic_dir(tmp_path / "model") as staging:
        save_file({"w": torch.zeros(2)}, str(staging / "model.safetensors"))
        (staging / "sub").mkdir()
        (staging / "sub" / "x.json").write_text("{}")
        (staging / "sub" / "x.json").chmod(0o600)
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.relative_to(tmp_path).as_posix(): path.stat().st_mode & 0o777
             for path in (tmp_path / "model").rglob("*") if path.is_file()}
    assert modes == {name: 0o666 & ~umask for name in modes} and "model/model.safetensors" in modes
