"""An aarch64 cross compiler and user-mode emulator for the NEON kernel's tests on any x86-64 machine:
Debian's gcc-aarch64-linux-gnu (with the arm64 C library) and qemu-user, installed with apt-get when
missing; the tests skip only where installing is impossible (no apt-get, not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGES = ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user")
COMPILER = "aarch64-linux-gnu-gcc"
EMULATOR = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the arm64 C library's loader and libraries, for qemu's -L


def installed() -> bool:
    return all(shutil.which(tool) for tool in (COMPILER, EMULATOR)) and (SYSROOT / "include" / "stdio.h").is_file()


def ensure_installed() -> None:
    """Install the cross compiler, the arm64 C library and qemu-user with apt-get unless present; skip
    only where that is impossible."""
    if installed():
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"needs Debian packages {' '.join(PACKAGES)} and apt-get is not available to install them")
    if os.geteuid() != 0:
        pytest.skip(f"needs Debian packages {' '.join(PACKAGES)}; installing them needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:  # stale or missing package lists
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=600)
        result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0 or not installed():
        pytest.fail(f"apt-get could not install {' '.join(PACKAGES)}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def run_emulated(executable: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """An aarch64 executable run under qemu-user (its loader and C library from SYSROOT)."""
    return subprocess.run([EMULATOR, "-L", str(SYSROOT), str(executable), *args], capture_output=True, text=True,
                          timeout=timeout)
