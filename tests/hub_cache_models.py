"""Write tiny random models into a Hugging Face hub cache, as `snapshot_download` leaves it.

Layout (checked against the installed huggingface_hub by tests/test_hub_models.py, which fetches
from it with HF_HUB_OFFLINE=1):

    $HF_HOME/hub/models--ORG--NAME/
        blobs/<sha256 of the file>                     the bytes
        snapshots/<revision>/<file> -> ../../blobs/<sha256>   relative symlinks
        refs/main                                      the revision (40 hex digits, no newline)

`write_hub_model(hf_home, hub_id, architecture)` returns (hub_id, revision). Architectures:
"llama", "qwen2" (q/k/v biases) and, to test refusals, "gpt2" (Conv1D projections) and "t5"
(encoder-decoder); `hidden_size` not divisible by the group size gives another refusal case.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from aqflow.models.tiny import build_tiny_tokenizer


def _config(architecture: str, vocab_size: int, hidden_size: int, dtype: str, num_heads: int):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config, T5Config

    common = dict(vocab_size=vocab_size, tie_word_embeddings=False, dtype=dtype)
    if architecture == "llama":
        return LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                           num_attention_heads=num_heads, num_key_value_heads=2, max_position_embeddings=4096, **common)
    if architecture == "qwen2":
        return Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                           num_attention_heads=num_heads, num_key_value_heads=2, max_position_embeddings=4096, **common)
    if architecture == "gpt2":
        return GPT2Config(n_embd=hidden_size, n_layer=2, n_head=4, n_positions=512, **common)
    if architecture == "t5":
        return T5Config(d_model=hidden_size, d_ff=2 * hidden_size, num_layers=2, num_heads=4, d_kv=hidden_size // 4, **common)
    raise ValueError(f"unknown architecture {architecture!r}")


def build_tiny_model(out_dir: str | os.PathLike, architecture: str = "llama", hidden_size: int = 64,
                     dtype: str = "bfloat16", seed: int = 0, num_heads: int = 4) -> Path:
    """Save a seeded random model of `architecture` with a tiny BPE tokenizer to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer(out_dir)
    config = _config(architecture, len(tokenizer), hidden_size, dtype, num_heads)
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir)
    return out_dir


def _place(repo_dir: Path, revision: str, relative: str, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    blob = repo_dir / "blobs" / digest
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = repo_dir / "snapshots" / revision / relative
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))


def write_hub_model(hf_home: str | os.PathLike, hub_id: str = "aqflow-tests/tiny-llama", architecture: str = "llama",
                    hidden_size: int = 64, dtype: str = "bfloat16", seed: int = 0, num_heads: int = 4) -> tuple[str, str]:
    """Put a tiny random `architecture` model under `hub_id` into the hub cache of `hf_home`.

    Returns (hub_id, revision); the revision (a commit-like 40-hex id derived from the files) is
    what refs/main points to.
    """
    org, name = hub_id.split("/")
    repo_dir = Path(hf_home) / "hub" / f"models--{org}--{name}"
    with tempfile.TemporaryDirectory() as scratch:
        folder = build_tiny_model(Path(scratch) / "model", architecture, hidden_size, dtype, seed, num_heads)
        files = {path.relative_to(folder).as_posix(): path.read_bytes()
                 for path in sorted(folder.rglob("*")) if path.is_file()}
    revision = hashlib.sha1(b"".join(name.encode() + hashlib.sha256(data).digest()
                                     for name, data in files.items())).hexdigest()
    for relative, data in files.items():
        _place(repo_dir, revision, relative, data)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return hub_id, revision
