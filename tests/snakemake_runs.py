"""Snakemake on the repository's Snakefile in a scratch folder, for the workflow tests of any folder."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def snakemake(tmp_path: Path, configs: list[Path], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Snakemake on the repository's Snakefile in `tmp_path` with these config files and arguments."""
    env = dict(os.environ, AQFLOW_CACHE=os.environ.get("AQFLOW_CACHE", str(REPO / "resources" / "cache")))
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile", *map(str, configs),
                           "--directory", str(tmp_path), *args], capture_output=True, text=True, env=env, timeout=timeout)
