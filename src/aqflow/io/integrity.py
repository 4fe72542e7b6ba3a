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

A job records what it wrote (`journal_written`): the digests its stage recorded when writing, with
the files' stat signatures, in a small journal file the next DAG build merges into its cache. So
the first `snakemake -n` after a 3B run does not hash the ~15 GB the run just wrote (10.1 s on an
H100 box, against 3.2-3.5 s once the digests were known).

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
        self._merged_journals: list[Path] = []
        if self.path is not None and self.path.is_file():
            self.entries = _read_entries(self.path)
        if self.path is not None:
            self._merge_journals(journal_folder(self.path))
            atexit.register(self.save_if_changed)

    def _merge_journals(self, folder: Path) -> None:
        """Take in what jobs recorded of the files they wrote (newer than this cache's entries; an
        entry is used only while its file's stat signature still matches)."""
        for journal in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            self.entries.update(_read_entries(journal))
            self._merged_journals.append(journal)
            self._unsaved = True

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
            for journal in self._merged_journals:  # now in the cache itself
                journal.unlink(missing_ok=True)
            self._merged_journals = []
        except OSError:  # a cache that cannot be written costs time, not correctness
            pass


def _read_entries(path: Path) -> dict[str, list]:
    """A cache or journal file's entries; {} for a damaged one (it costs hashing, not correctness)."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {key: entry for key, entry in loaded.items() if isinstance(entry, list) and len(entry) == 5} \
        if isinstance(loaded, dict) else {}


def journal_folder(cache_path: str | os.PathLike) -> Path:
    """Where jobs leave their journals for the DigestCache kept at `cache_path`."""
    return Path(cache_path).parent / "written"


def recorded_digests(path: str | os.PathLike) -> dict[str, list]:
    """The finished artifact at `path` (a file with a record, or a folder with its SHA256SUMS or
    sidecars): each covered file -> [size, mtime_ns, ctime_ns, inode, sha256], the sha256 as its
    record gives it (written by the stage that wrote the file; nothing is hashed here). Files
    without a record are left out."""
    path = Path(path)
    if path.is_file():
        return {os.path.normpath(str(path)): list(stat_signature(path)) + [recorded_sha256(path)]} if has_record(path) else {}
    if not path.is_dir():
        return {}
    sums = path / SUMS_FILE
    if sums.is_file():
        listed = {path / name: digest for name, digest in _parse_sums(sums).items()}
    else:
        listed = {data: recorded_sha256(data) for data in
                  (sidecar.with_name(sidecar.name[: -len(SIDECAR_SUFFIX)]) for sidecar in path.glob("*" + SIDECAR_SUFFIX))
                  if data.is_file()}
    return {os.path.normpath(str(file)): list(stat_signature(file)) + [digest]
            for file, digest in listed.items() if file.is_file()}


def journal_written(outputs: list[str], cache_path: str | os.PathLike) -> None:
    """Record, for the DigestCache at `cache_path`, the digests of what a finished job wrote to
    `outputs` (paths as the job names them, relative to the working directory the DAG is built
    in). Best effort: an output without a readable record is left for the cache to hash."""
    entries: dict[str, list] = {}
    for output in outputs:
        try:
            entries.update(recorded_digests(output))
        except (ArtifactError, OSError):
            continue
    if not entries:
        return
    folder = journal_folder(cache_path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".journal.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as handle:
            json.dump(entries, handle, separators=(",", ":"))
        os.replace(tmp, folder / f"{os.getpid()}-{time.time_ns()}.json")
    except OSError:
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
