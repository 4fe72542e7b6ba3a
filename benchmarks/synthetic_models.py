"""Random Llama models for the benchmarks: real shapes, seeded random weights (what a benchmark
times does not depend on the weights' values). Imports of aqflow stay inside the functions, so
the same module serves a benchmark's "before" and "after" source trees."""

from __future__ import annotations

from pathlib import Path

import torch


def random_llama(shape: dict, tokenizer, device: str, dtype: torch.dtype = torch.bfloat16):
    """A LlamaForCausalLM of `shape` (LlamaConfig fields) with seed-0 random weights in `dtype` on
    `device`, its special token ids from `tokenizer`; in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def random_teacher(folder: Path, shape: dict, device: str) -> Path:
    """A random bf16 Llama of `shape` saved to `folder` with a small BPE tokenizer (its ids fit any
    vocabulary); the card's memory is given back afterwards."""
    from aqflow.models.tiny import build_tiny_tokenizer

    model = random_llama(shape, build_tiny_tokenizer(folder), device)
    model.save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder
