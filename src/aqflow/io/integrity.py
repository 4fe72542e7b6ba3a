"""Finished artifacts checked against their checksum records without re-hashing unchanged files.

`artifacts.verified` hashes a whole file on every call of a new process: right for a stage about
to read it, too slow for Snakemake's DAG build, which would hash a 3B run's ~200 layers and ~10 GB
of XᵀX on every `snakemake -n`. A `DigestCache` remembers each file's sha256 with the stat fields
that move whenever its bytes are written through the file system (size, mtime_ns, ctime_ns,
inode) and hashes a file again only when one of them moved. The ctime cannot be set back from user
space (`touch -r` restores a file's mtime, not its ctime), so a flipped byte is caught even when
the size and mtime were kept.

Not seen here: a change that bypasses the file system and leaves the stat alone (a failing disk's
bit rot, a write to the block device). The stage that reads the file verifies it whole before
any use (`artifacts.verified`: no stat shortcut across processes) and refuses it by name.

`damage(path, cache)` checks a file against its record (its sidecar, or the SHA256SUMS of an
enclosing folder) and a folder against its SHA256SUMS, and returns what is wrong, or None.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aqflow.io.artifacts import SIDECAR_SUFFIX, SUMS_FILE, ArtifactError, file_sha256, has_record, recorded_sha256
# the folder record's reader and the files it covers, shared with artifacts.verified_tree (same package)
from aqflow.io.artifacts import _content_files, _parse_sums

CORRUPT = "corrupt"  # bytes differ from the record, or the record itself is unreadable
MISSING = "missing"  # a file a folder's SHA256SUMS lists is not there
UNLISTED = "unlisted"  # a file in a checksummed folder that its SHA256SUMS does not list


@dataclass(frozen=True)
class Damage:
    """What is wrong with an artifact: `path` the damaged file, `folder` the checksummed folder it
    belongs to (None for a file with its own sidecar), `kind` one of CORRUPT, MISSING, UNLISTED."""

    path: Path
    kind: str
    detail: str
    folder: Path | None = None

    def describe(self) -> str:
        return f"{self.path}: {self.kind}: {self.detail}"


def stat_signature(path: str | os.PathLike) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode): what a write through the file system always changes."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino


class DigestCache:
    """sha256 of files, kept in a JSON file (`path` -> [size, mtime_ns, ctime_ns, inode, sha256])
    and recomputed only for a file whose stat signature moved. Written atomically at most once a
    second while files are hashed and at exit (a DAG build killed halfway keeps nearly all it
    hashed); a damaged cache file is ignored. `path` None: in memory only."""

    SAVE_EVERY_SECONDS = 1.0

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path).absolute() if path is not None else None  # the cwd may change before exit
        self.entries: dict[str, list] = {}
        self.hashed_files = 0
        self.hashed_bytes = 0
        self._unsaved, self._saved_at = False, time.monotonic()
        if self.path is not None and self.path.is_file():
            try:
                loaded = json.loads(self.path.read_text())
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self.entries = {}
        if self.path is not None:
            atexit.register(self.save_if_changed)

    def sha256(self, file: str | os.PathLike) -> str:
        key = os.path.normpath(str(file))
        signature = list(stat_signature(file))
        entry = self.entries.get(key)
        if isinstance(entry, list) and entry[:4] == signature and len(entry) == 5:
            return entry[4]
        digest = file_sha256(file)
        if list(stat_signature(file)) == signature:  # not written meanwhile: the digest is of these bytes
            self.entries[key] = signature + [digest]
            self._unsaved = True
            if time.monotonic() - self._saved_at >= self.SAVE_EVERY_SECONDS:
                self.save_if_changed()
        self.hashed_files += 1
        self.hashed_bytes += signature[0]
        return digest

    def save_if_changed(self) -> None:
        if self.path is None or not self._unsaved:
            return
        self._unsaved, self._saved_at = False, time.monotonic()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as handle:
                json.dump(self.entries, handle, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError:  # a cache that cannot be written costs time, not correctness
            pass


def _file_damage(path: Path, expected: str, cache: DigestCache, folder: Path | None) -> Damage | None:
    found = cache.sha256(path)
    if found == expected:
        return None
    return Damage(path, CORRUPT, f"sha256 {found[:16]}..., recorded {expected[:16]}... when it was written", folder)


def _folder_damage(folder: Path, cache: DigestCache) -> Damage | None:
    sums = folder / SUMS_FILE
    if not sums.is_file():  # no record (an older aqflow's folder): only files with sidecars
        for sidecar in sorted(folder.glob("*" + SIDECAR_SUFFIX)):
            data = sidecar.with_name(sidecar.name[: -len(SIDECAR_SUFFIX)])
            if data.is_file():
                found = _recorded_damage(data, cache, folder)
                if found:
                    return found
        return None
    try:
        listed = _parse_sums(sums)
    except ArtifactError as error:
        return Damage(sums, CORRUPT, str(error).split(": ", 1)[-1], folder)
    for name in listed:
        if not (folder / name).is_file():
            return Damage(folder / name, MISSING, f"listed in {sums} but not there", folder)
    for file in _content_files(folder):
        if file.relative_to(folder).as_posix() not in listed:
            return Damage(file, UNLISTED, f"not in {sums} (added after the folder was written)", folder)
    for name, expected in listed.items():
        found = _file_damage(folder / name, expected, cache, folder)
        if found:
            return found
    return None


def _recorded_damage(path: Path, cache: DigestCache, folder: Path | None = None) -> Damage | None:
    try:
        expected = recorded_sha256(path)
    except ArtifactError as error:
        return Damage(path, CORRUPT, str(error).split(": ", 1)[-1], folder)
    return _file_damage(path, expected, cache, folder)


def damage(path: str | os.PathLike, cache: DigestCache) -> Damage | None:
    """What is wrong with the finished artifact at `path` (a file or a folder), or None: intact,
    or without any checksum record (made by hand or by an older aqflow), or not there at all."""
    path = Path(path)
    if path.is_dir():
        return _folder_damage(path, cache)
    if not path.is_file() or not has_record(path):
        return None
    sums_folder = None if (path.parent / (path.name + SIDECAR_SUFFIX)).is_file() else _enclosing_sums(path)
    return _recorded_damage(path, cache, sums_folder)


def _enclosing_sums(path: Path) -> Path | None:
    for folder in list(path.parents)[:4]:
        if (folder / SUMS_FILE).is_file():
            return folder
    return None
