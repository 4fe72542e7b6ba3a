"""Perplexity windows kept between evaluations.

Every evaluation of a model tokenizes its whole evaluation text again to cut the same windows
(WikiText-2's joined text in one single-threaded call): a fixed cost of each evaluation (about
1.7 s of ~9 s on a 2-core CPU, benchmarks/eval_overhead.py in the git history), while the five evaluations of a DAG
share one tokenizer and one text. Here the windows (and the protocol's record of where sampled
windows come from) are stored under a key that fixes them: the protocol and its settings, the
source of the code that cuts them, the text's sha256, and a fingerprint of the tokenizer's
behaviour (its serialized fast tokenizer, class, settings and the transformers/tokenizers
versions). A slow tokenizer, or an unreadable entry, simply means no cache: the windows are
computed as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

WINDOWS_FORMAT = 1  # of the stored entry
# Tokenizer settings that name files, not behaviour: two copies of one tokenizer share a fingerprint.
_PATH_SETTINGS = ("name_or_path", "vocab_file", "merges_file", "tokenizer_file", "is_local", "local_files_only",
                  "chat_template")


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of what fixes a fast tokenizer's ids, or None for a tokenizer without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import tokenizers
    import transformers

    settings = {key: value for key, value in tokenizer.init_kwargs.items() if key not in _PATH_SETTINGS}
    described = json.dumps({"class": type(tokenizer).__name__, "settings": settings,
                            "add_bos_token": getattr(tokenizer, "add_bos_token", None),
                            "add_eos_token": getattr(tokenizer, "add_eos_token", None),
                            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
                           sort_keys=True, default=str)
    digest = hashlib.sha256(described.encode())
    digest.update(backend.to_str().encode())
    return digest.hexdigest()


def protocol_code_sha256() -> str:
    """sha256 of the source of the code that cuts windows: a change to it is a change of key."""
    from aqflow.data import windows
    from aqflow.evaluation import protocol

    digest = hashlib.sha256()
    for module in (protocol, windows):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def windows_key(protocol: str, settings: Mapping[str, Any], texts_sha256: str, fingerprint: str) -> str:
    """The cache key (hex sha256) of one domain's windows."""
    described = json.dumps({"format": WINDOWS_FORMAT, "code": protocol_code_sha256(), "protocol": protocol,
                            "settings": dict(settings), "texts_sha256": texts_sha256, "tokenizer": fingerprint},
                           sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()


def load_windows(folder: Path, key: str) -> tuple[torch.Tensor, dict] | None:
    """(windows [num_windows, context] int64, protocol extras) stored under `key`, or None."""
    from safetensors import safe_open

    from aqflow.io.artifacts import verified

    path = folder / f"{key}.safetensors"
    if not path.is_file():
        return None
    try:
        verified(path)
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor("windows"), json.loads(handle.metadata()["extras"])
    except Exception:  # an unreadable or half-written entry: compute the windows again (and rewrite it)
        return None


def store_windows(folder: Path, key: str, windows: torch.Tensor, extras: Mapping[str, Any]) -> None:
    """Store one domain's windows under `key` (atomically); a folder that cannot be written is skipped."""
    from aqflow.io.artifacts import ArtifactError, save_safetensors

    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_safetensors(folder / f"{key}.safetensors", {"windows": windows}, {"extras": json.dumps(extras)})
    except (OSError, ArtifactError):
        pass


def cache_folder(cache_dir: str | os.PathLike) -> Path:
    """Where windows are kept: `<cache>/perplexity-windows`."""
    return Path(cache_dir) / "perplexity-windows"
