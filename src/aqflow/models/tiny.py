"""A tiny random Llama, built on the fly, for tests of the whole pipeline.

It is saved as an ordinary Hugging Face folder, so every stage reads it exactly as it reads a real
model. Its tokenizer is either copied from a real model folder (e.g. the converted SmolLM2) or a
small byte-level BPE trained offline with the `tokenizers` library on a handful of sentences,
which encodes any text (byte fallback) without downloading anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

_DEFAULT_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "Anarchism is a political philosophy that advocates self-governed societies.",
    "Calibration and evaluation text must never overlap: split by document, record the split.",
    "Additive quantization represents each group of weights as a sum of codewords.",
    "It wasn't worth it. An important inquiry will soon report its findings.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2013 1539 = == === ( ) [ ] { } , . ; : ! ?",
)


def build_tiny_tokenizer(out_dir: str | os.PathLike, texts: Sequence[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on `texts` (a few default sentences if None) and save it.

    Returns the transformers tokenizer (also saved to `out_dir`). The 256 byte symbols are always
    in the vocabulary, so any string is encodable; merges fill the rest up to `vocab_size`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(list(texts or _DEFAULT_TRAINING_TEXT) * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=special[0], eos_token=special[0],
                                        unk_token=special[0], pad_token=special[0])
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_llama(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None,
                     hidden_size: int = 64, num_layers: int = 2, intermediate_size: int = 128,
                     num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a randomly initialised LlamaForCausalLM (seeded) with a tokenizer to `out_dir`.

    The vocabulary is the tokenizer's: copied from `tokenizer_dir` if given, else a tiny BPE.
    Weights are float32 by default so CPU tests compare numbers without fp16 rounding.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        tokenizer.save_pretrained(out_dir)
    else:
        tokenizer = build_tiny_tokenizer(out_dir)
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size {hidden_size} must divide by num_heads {num_heads}, "
                         f"which must divide by num_kv_heads {num_kv_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to({"float32": torch.float32, "float16": torch.float16}[dtype])
    model.save_pretrained(out_dir)
    return out_dir
