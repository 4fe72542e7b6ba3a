"""Debian packages a test needs, installed with apt-get when missing: the tests skip only where
installing is impossible (no apt-get, not root) and fail where apt-get tried and could not."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

import pytest


def ensure_debian_packages(packages: tuple[str, ...], installed: Callable[[], bool]) -> None:
    """Install `packages` unless `installed()` already says they are there; afterwards `installed()`
    must hold (the package lists are refreshed once where the first try fails)."""
    if installed():
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"needs Debian packages {' '.join(packages)} and apt-get is not available to install them")
    if os.geteuid() != 0:
        pytest.skip(f"needs Debian packages {' '.join(packages)}; installing them needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:  # stale or missing package lists
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=600)
        result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0 or not installed():
        pytest.fail(f"apt-get could not install {' '.join(packages)}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
