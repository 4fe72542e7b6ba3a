"""An aarch64 compiler and a way to run what it builds, for the NEON kernel's tests on any machine: on
aarch64 the system's C compiler, natively; elsewhere Debian's cross compiler gcc-aarch64-linux-gnu (with
the arm64 C library) and qemu-user's emulator, installed with apt-get when missing (the tests skip only
where installing is impossible: no apt-get, not root)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.apt_packages import ensure_debian_packages

PACKAGES = ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user")
CROSS_COMPILER = "aarch64-linux-gnu-gcc"
EMULATOR = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the arm64 C library's loader and libraries, for qemu's -L


def native() -> bool:
    """Whether this machine is aarch64 itself (then nothing is emulated)."""
    return platform.machine() in ("aarch64", "arm64")


def compiler() -> str:
    return os.environ.get("CC", "cc") if native() else CROSS_COMPILER


def installed() -> bool:
    if native():
        return shutil.which(compiler()) is not None
    tools = all(shutil.which(tool) for tool in (CROSS_COMPILER, EMULATOR))
    return tools and (SYSROOT / "include" / "stdio.h").is_file()


def ensure_installed() -> None:
    """Install the cross compiler, the arm64 C library and qemu-user with apt-get unless present (on
    aarch64: the system's compiler must be there); skip only where that is impossible."""
    if native() and not installed():
        pytest.skip(f"no C compiler ({compiler()}) on this aarch64 machine")
    ensure_debian_packages(PACKAGES, installed)


def run(executable: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """An aarch64 executable run natively on aarch64, elsewhere under qemu-user (its loader and C library
    from SYSROOT)."""
    emulator = [] if native() else [EMULATOR, "-L", str(SYSROOT)]
    return subprocess.run([*emulator, str(executable), *args], capture_output=True, text=True, timeout=timeout)
