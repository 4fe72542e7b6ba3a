"""Atomic, checksummed artifacts: every file appears whole or not at all, and a reader can tell.

Each writer saves to a temporary file in the destination folder, flushes it to disk and renames
it over the target, so a crash or a killed cluster job never leaves a half-written artifact that a
later run would mistake for a finished one. Formats are safetensors, NPZ, Parquet and JSON: no pickles.

Checksums: a file written with `atomic_path` gets a sidecar `<name>.sha256` (the `sha256sum`
format), written *before* the file is renamed into place, so a crash between the two leaves a
sidecar that disagrees with the old file (or with no file): never an unchecked file. A folder
written with `atomic_dir` gets one `SHA256SUMS` listing every file in it, written inside the
staging folder before the one rename. Readers call `verified(path)`, which finds the record (the
sidecar, else the `SHA256SUMS` of an enclosing folder), hashes the file and raises
`ArtifactError` naming the file, the expected and found checksums, and how to redo it.

Temporaries are named `.<target name>.<random>.tmp` (files) and `.<target name>.<random>.partial`
(folders); a killed writer's leftovers are removed by the next write of the same target
(`remove_stale_temporaries`) or by `python -m aqflow clean`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

SUMS_FILE = "SHA256SUMS"
SIDECAR_SUFFIX = ".sha256"
_HASH_CHUNK = 1 << 22


class ArtifactError(ValueError):
    """An artifact that is missing its checksum record, disagrees with it, or cannot be decoded or
    written; the message names the file and how to redo it."""


def redo_hint(path: str | os.PathLike) -> str:
    return (f"redo it: delete {path} and rerun (or `snakemake --forcerun <the rule that writes it>`)")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (the one file hash of aqflow: artifacts, downloads, wheels)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _sums_line(digest: str, name: str) -> str:
    return f"{digest}  {name}\n"


def _parse_sums(path: Path) -> dict[str, str]:
    """name -> sha256 of a `sha256sum`-format file; ArtifactError naming it if malformed."""
    sums = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ArtifactError(f"{path}: line {number} is not '<sha256>  <file>' (the checksum record "
                                f"is corrupt); {redo_hint(path.parent if path.name == SUMS_FILE else path)}")
        sums[name] = digest
    return sums


def recorded_sha256(path: str | os.PathLike) -> str:
    """The sha256 recorded for `path`: its sidecar, else the SHA256SUMS of the nearest enclosing
    folder that has one. ArtifactError if there is no record."""
    path = Path(path)
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        return _parse_sums(sidecar).get(path.name) or _missing_record(path, sidecar)
    for folder in list(path.parents)[:4]:
        sums = folder / SUMS_FILE
        if sums.is_file():
            relative = path.relative_to(folder).as_posix()
            return _parse_sums(sums).get(relative) or _missing_record(path, sums)
    return _missing_record(path, None)


def _missing_record(path: Path, record: Path | None) -> str:
    where = f"{record} does not list it" if record else f"neither {sidecar_path(path).name} nor a {SUMS_FILE} beside it"
    raise ArtifactError(f"{path}: no checksum recorded ({where}); it was not written whole by aqflow; "
                        + redo_hint(path))


_VERIFIED: dict[tuple[str, int, int], str] = {}


def has_record(path: str | os.PathLike) -> bool:
    """Whether a checksum of `path` is recorded (sidecar, or an enclosing SHA256SUMS)."""
    path = Path(path)
    return sidecar_path(path).is_file() or any((folder / SUMS_FILE).is_file() for folder in list(path.parents)[:4])


def verified(path: str | os.PathLike, required: bool = True) -> Path:
    """`path`, after checking its bytes against its recorded sha256 (once per process per file
    version). Raises FileNotFoundError or ArtifactError naming the file. required=False: a file
    with no record at all (made by hand, or by an older aqflow) passes unchecked; a crash can never
    produce one, since the record is written before the file appears."""
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
    if not required and not has_record(path):
        return path
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    expected = recorded_sha256(path)
    if _VERIFIED.get(key) == expected:
        return path
    found = file_sha256(path)
    if found != expected:
        raise ArtifactError(f"{path}: corrupt: sha256 {found[:16]}..., recorded {expected[:16]}... "
                            f"(changed after it was written, or its write was interrupted); " + redo_hint(path))
    _VERIFIED[key] = expected
    return path


def verified_tree(folder: str | os.PathLike, required: bool = False) -> Path:
    """`folder`, after checking every file its SHA256SUMS lists (each must exist), or, without
    one, every file in it that has a sidecar. required=True: the SHA256SUMS must exist."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(folder))
    sums = folder / SUMS_FILE
    if sums.is_file():
        listed = _parse_sums(sums)
        unlisted = [path.relative_to(folder).as_posix() for path in _content_files(folder)
                    if path.relative_to(folder).as_posix() not in listed]
        if unlisted:
            raise ArtifactError(f"{folder}: {unlisted[:3]} not in its {SUMS_FILE} (added or renamed after the "
                                f"folder was written, or the record is damaged); " + redo_hint(folder))
        for name in listed:
            verified(folder / name)
    elif required:
        raise ArtifactError(f"{folder}: no {SUMS_FILE} (the folder was not written whole by aqflow); "
                            + redo_hint(folder))
    else:
        for sidecar in sorted(folder.glob("*" + SIDECAR_SUFFIX)):
            data = sidecar.with_name(sidecar.name[: -len(SIDECAR_SUFFIX)])
            if data.exists():
                verified(data)
    return folder


def verify_inputs(*paths: str | os.PathLike | None) -> None:
    """Check every given input file or folder against its recorded checksums (None is skipped);
    a stage calls this before any work, so a corrupt input fails it at once, by name."""
    for path in paths:
        if path is None:
            continue
        path = Path(path)
        if path.is_dir():
            verified_tree(path)
        elif path.exists():
            verified(path, required=False)


def decoding(path: str | os.PathLike, what: str):
    """A context that turns a decoder's exception (bad zip, bad safetensors header, bad Parquet,
    bad JSON) into an ArtifactError naming the file."""
    return _Decoding(Path(path), what)


class _Decoding(contextlib.AbstractContextManager):
    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what

    def __exit__(self, kind, error, traceback):
        if error is None or isinstance(error, (ArtifactError, OSError, KeyError, MemoryError, KeyboardInterrupt)):
            return False
        if isinstance(error, Exception):
            raise ArtifactError(f"{self.path}: not a readable {self.what} ({type(error).__name__}: {error}); "
                                + redo_hint(self.path)) from error
        return False


def read_json(path: str | os.PathLike, verify: bool = True, required: bool = True) -> Any:
    """A JSON artifact, checked against its checksum (required=False: if one is recorded)."""
    path = verified(path, required) if verify else Path(path)
    with decoding(path, "JSON file"):
        return json.loads(path.read_text())


def read_parquet(path: str | os.PathLike, verify: bool = True, required: bool = True):
    """A Parquet artifact as a DataFrame, checked against its checksum (required=False: if one is recorded)."""
    import pandas as pd

    path = verified(path, required) if verify else Path(path)
    with decoding(path, "Parquet file"):
        return pd.read_parquet(path)


def load_safetensors(path: str | os.PathLike, verify: bool = True, required: bool = True) -> dict:
    """Every tensor of a safetensors artifact (torch), checked against its checksum (required=False:
    if one is recorded)."""
    from safetensors.torch import load_file

    path = verified(path, required) if verify else Path(path)
    with decoding(path, "safetensors file"):
        return load_file(str(path))


def remove_stale_temporaries(target: str | os.PathLike) -> list[Path]:
    """Remove leftovers of earlier, killed writes of `target`: `.<name>.*.tmp` files and
    `.<name>.*.partial` folders beside it. Only one job writes a given target at a time (Snakemake
    locks outputs), so these are never a live writer's. Returns what was removed."""
    target = Path(target)
    removed = []
    if not target.parent.is_dir():
        return removed
    for candidate in target.parent.glob(f".{glob_escape(target.name)}.*"):
        if candidate.name.endswith(".tmp") and candidate.is_file() and not candidate.is_symlink():
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
        elif candidate.name.endswith(".partial") and candidate.is_dir() and not candidate.is_symlink():
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Every `.*.tmp` file and `.*.partial` folder under `root` (not inside a .partial folder),
    and every checksum sidecar whose file is gone (Snakemake removed a failed job's outputs, or a
    `temp()` output after use)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        for name in list(subfolders):
            if name.startswith(".") and name.endswith(".partial"):
                found.append(Path(folder) / name)
                subfolders.remove(name)
            elif name.startswith(".snakemake"):
                subfolders.remove(name)
        found += [Path(folder) / name for name in files if name.startswith(".") and name.endswith(".tmp")]
        found += [Path(folder) / name for name in files
                  if name.endswith(SIDECAR_SUFFIX) and name[: -len(SIDECAR_SUFFIX)] not in files]
    return sorted(found)


def _write_error(target: Path, error: OSError) -> ArtifactError:
    cause = error.strerror or str(error)
    where = f" ({error.filename})" if error.filename and Path(str(error.filename)).name != target.name else ""
    return ArtifactError(f"{target}: cannot write: {cause}{where}; nothing was replaced")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, checksum: bool | None = None) -> Iterator[Path]:
    """Yield a temporary path next to `target`; if the block succeeds, record the file's sha256
    (sidecar `<target>.sha256`, first) and rename it onto `target`. checksum=None: a sidecar unless
    the target is inside an `atomic_dir` staging folder (whose SHA256SUMS covers it).
    An OSError while writing (disk full, read-only) becomes an ArtifactError naming `target`."""
    target = Path(target)
    if checksum is None:
        checksum = not _inside_staging(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as error:
        raise _write_error(target, error) from error
    tmp = Path(tmp_name)
    umask = os.umask(0)
    os.umask(umask)
    try:
        tmp.chmod(0o666 & ~umask)  # mkstemp makes files private; artifacts are shared like any other output
        try:
            yield tmp
            # again: a writer may have replaced the file (and its mode) with its own
            tmp.chmod(0o666 & ~umask)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            if checksum:
                _write_sidecar(target, file_sha256(tmp))
            os.replace(tmp, target)
        except OSError as error:
            raise _write_error(target, error) from error
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_sidecar(target: Path, digest: str) -> None:
    sidecar = sidecar_path(target)
    with atomic_path(sidecar, checksum=False) as tmp:
        tmp.write_text(_sums_line(digest, target.name))


def _inside_staging(target: Path) -> bool:
    return any(part.startswith(".") and part.endswith(".partial") for part in target.parent.parts)


def _content_files(folder: Path) -> list[Path]:
    """The files a folder's SHA256SUMS covers: all but itself and hidden ones (Snakemake's
    `.snakemake_timestamp`, temporaries)."""
    return sorted(path for path in folder.rglob("*")
                  if path.is_file() and path.name != SUMS_FILE
                  and not any(part.startswith(".") for part in path.relative_to(folder).parts))


def write_checksums(folder: str | os.PathLike) -> Path:
    """Write `folder/SHA256SUMS` listing every file under it (relative paths, sorted)."""
    folder = Path(folder)
    lines = []
    for path in _content_files(folder):
        lines.append(_sums_line(file_sha256(path), path.relative_to(folder).as_posix()))
    sums = folder / SUMS_FILE
    with open(sums, "w") as handle:
        handle.write("".join(lines))
        handle.flush()
        os.fsync(handle.fileno())
    return sums


def replace_folder(staging: Path, target: Path) -> None:
    """Put folder `staging` at `target` in place of the folder there, and remove the old one,
    such that a kill at any point leaves a whole `target`: deleting the old folder first left a
    half-deleted one (a PV-tuning state without its state.json) when killed meanwhile. Linux swaps
    the two in one step (renameat2 RENAME_EXCHANGE); elsewhere, or where the file system refuses,
    the old one is renamed aside first (then `target` is missing between two renames, never half).
    The old folder is left under `staging`'s name (a stale temporary) until it is removed."""
    if not _exchange(staging, target):
        aside = staging.with_name(staging.name.removesuffix(".partial") + "-old.partial")
        os.replace(target, aside)
        os.replace(staging, target)
        staging = aside
    shutil.rmtree(staging)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # glibc before 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # file system or kernel without it
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(second))


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a fresh staging folder next to `target`; if the block succeeds, SHA256SUMS of its
    files is written into it and it replaces `target` (replace=False: refuse an existing one),
    else it is removed. A crash never leaves a half folder. OSErrors become ArtifactErrors naming `target`."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and not replace:
            raise FileExistsError(f"{target} exists")
        remove_stale_temporaries(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; output folders are shared like any other output
    except FileExistsError:
        raise
    except OSError as error:
        raise _write_error(target, error) from error
    try:
        try:
            yield staging
            _share_files(staging)
            write_checksums(staging)
            if target.exists():
                replace_folder(staging, target)
            else:
                os.replace(staging, target)
        except FileExistsError:
            raise
        except OSError as error:
            raise _write_error(target, error) from error
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _share_files(folder: Path) -> None:
    """Give every file under `folder` the umask's mode: writers that are not ours (safetensors'
    own, under transformers' save_pretrained) make them private 0600, and a model folder in a
    shared cache must be readable by the group like any other output."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def write_json(target: str | os.PathLike, payload: Any) -> None:
    """Write `payload` as indented JSON, atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def save_safetensors(target: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> None:
    """Save a dict of torch tensors as safetensors, atomically (tensors are made contiguous)."""
    from safetensors.torch import save_file

    with atomic_path(target) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=dict(metadata or {}))


def save_npz(target: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Save named numpy arrays as an uncompressed NPZ, atomically."""
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)


def write_parquet(target: str | os.PathLike, frame) -> None:
    """Write a pandas DataFrame as Parquet (pyarrow), atomically."""
    with atomic_path(target) as tmp:
        frame.to_parquet(tmp, index=False)
