"""`python -m aqflow generate MODEL_DIR --prompt "..."`: text streamed from any model folder the pipeline wrote.

Tokens print as they are made; then how fast they came and how much memory the weights take.

MODEL_DIR is a plain model folder (resources/models/<model>) or an AQLM checkpoint (a stitched or
PV-tuned `model/`). The model runs on --device (auto: a GPU where one is visible) through the
fast path (aqflow.inference: AQLM layers kept 2-bit; on the CPU the lookup-table kernel chosen by the
CPU's features, AVX-512, AVX2, NEON or numba (AQFLOW_CPU_KERNEL forces one; printed and recorded); on a GPU
the CUDA C++ lookup-table GEMV for 2x8 layers (inference/cuda_kernels.py) and Triton kernels for other
geometries, the decode step a CUDA graph there) or, with --path plain, as transformers + aqlm load
it (aqlm's kernels, eager steps, nothing fused).
Greedy by default; --temperature > 0 samples (with --top-p, seeded by --seed). Decoding stops at
--max-new-tokens or at the tokenizer's end-of-text token. With --output, a JSON record of the text,
settings and timings is written (atomically).
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Collection

import torch

from aqflow.inference.decode import (DecodeTimings, greedy_decode, model_device, new_static_cache, one_token_paths,
                                     step_logits)
from aqflow.inference.runtime import (
    PATHS, decode_options, decoding_context, disk_weight_bytes, is_aqlm_folder, load_for_decoding, lookup_kernel,
    resident_weight_bytes, resolve_dtype, torch_threads,
)
from aqflow.io import artifacts
from aqflow.io.artifacts import verify_inputs
from aqflow.models.fetch import ModelInputError, load_tokenizer
from aqflow.stagekit import stage_cli
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "generate"
INPUT_ERRORS = (*EXPECTED_ERRORS, ModelInputError)


@dataclass(frozen=True)
class GenerateSettings:
    prompt: str = field(default="The meaning of life is", metadata=option("text to continue"))
    max_new_tokens: int = field(default=64, metadata=option("at most this many new tokens"))
    temperature: float = field(default=0.0, metadata=option("0: greedy; above: sample from softmax(logits / T)"))
    top_p: float = field(default=1.0, metadata=option("sampling: keep the smallest set of tokens of this total probability"))
    seed: int = field(default=0, metadata=option("sampling seed"))
    device: str = field(default="auto", metadata=option("cpu, cuda, cuda:N or auto (a GPU where one is visible)"))
    dtype: str = field(default="auto", metadata=option(
        "compute dtype of the unquantized parts (auto: float32 on a CPU, the folder's dtype on a GPU)",
        choices=("auto", "float16", "bfloat16", "float32")))
    path: str = field(default="fast", metadata=option(
        "fast: aqflow's kernels and decode loop; plain: transformers + aqlm as loaded", choices=PATHS))
    threads: int | None = field(default=None, metadata=option("CPU threads (default: all cores)"))
    stream: bool = field(default=True, metadata=option("print tokens as they come"))


@dataclass(frozen=True)
class GeneratePaths:
    model_dir: Path = field(metadata=option("model folder: plain or AQLM", positional=True))
    output: Path | None = field(default=None, metadata=option("also write the text and timings here (JSON)"))


def resolve_device(device: str) -> str:
    return stage_cli.default_device() if device == "auto" else device


def check_settings(settings: GenerateSettings, paths: GeneratePaths) -> None:
    if not (paths.model_dir / "config.json").is_file():
        raise StageInputError(f"{paths.model_dir}: not a model folder (no config.json)")
    if settings.max_new_tokens < 1:
        raise StageInputError(f"--max-new-tokens {settings.max_new_tokens}: at least 1")
    if settings.temperature < 0 or not 0 < settings.top_p <= 1:
        raise StageInputError(f"--temperature {settings.temperature} / --top-p {settings.top_p}: need T >= 0 and 0 < p <= 1")
    device = resolve_device(settings.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StageInputError(f"--device {device}: no GPU is visible")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [V] with every token outside the smallest set of total probability >= top_p set to -inf."""
    if top_p >= 1:
        return logits
    ordered, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p  # tokens after the set is complete
    return logits.scatter(0, order[drop], float("-inf"))


@torch.inference_mode()
def sample_decode(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, *, temperature: float,
                  top_p: float, generator: torch.Generator, on_token: Callable[[int], None] | None = None,
                  stop_tokens: Collection[int] = (), fast_attention: bool | None = None,
                  cpu_layers: bool | None = None) -> tuple[torch.Tensor, DecodeTimings]:
    """Sampled decoding with the static KV cache of decode.greedy_decode, eagerly (a host draw per
    token), through the same one-token attention and CPU layers (`fast_attention`, `cpu_layers`: as
    greedy_decode's). input_ids [1, P] -> (tokens [n] int64, timings), n <= new_tokens."""
    with one_token_paths(model, fast_attention, False, cpu_layers) as (implementation, switched):
        tokens, timings = _sample_decode(model, input_ids, new_tokens, temperature=temperature, top_p=top_p,
                                         generator=generator, on_token=on_token, stop_tokens=stop_tokens)
    return tokens, replace(timings, attention=implementation or "model's own", cpu_layers=switched)


def _sample_decode(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, *, temperature: float,
                   top_p: float, generator: torch.Generator, on_token: Callable[[int], None] | None,
                   stop_tokens: Collection[int]) -> tuple[torch.Tensor, DecodeTimings]:
    """sample_decode with the model's attention and layers as they are set."""
    device = model_device(model)
    prompt_tokens = input_ids.shape[1]
    cache = new_static_cache(model, prompt_tokens + new_tokens)

    def draw(logits: torch.Tensor) -> int:
        probabilities = torch.softmax(top_p_filter(logits.float().cpu() / temperature, top_p), dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=generator))

    start = time.perf_counter()
    out = model(input_ids=input_ids.to(device), position_ids=torch.arange(prompt_tokens, device=device)[None],
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens = [draw(out.logits[0, -1])]
    prefill_seconds = time.perf_counter() - start
    if on_token is not None:
        on_token(tokens[0])
    start = time.perf_counter()
    while len(tokens) < new_tokens and tokens[-1] not in stop_tokens:
        token = torch.tensor([[tokens[-1]]], device=device)
        position = torch.tensor([[prompt_tokens + len(tokens) - 1]], device=device)
        tokens.append(draw(step_logits(model, cache, token, position)[0]))
        if on_token is not None:
            on_token(tokens[-1])
    decode_seconds = time.perf_counter() - start
    return torch.tensor(tokens), DecodeTimings(prompt_tokens=prompt_tokens, prefill_seconds=prefill_seconds,
                                               new_tokens=len(tokens), decode_seconds=decode_seconds,
                                               timed_steps=len(tokens) - 1)


class TextStream:
    """Prints the text of the tokens so far as it grows (decoding the whole sequence each time, so
    tokens that only form a character together print when complete)."""

    def __init__(self, tokenizer, out=None, enabled: bool = True):
        self.tokenizer, self.out, self.enabled = tokenizer, out or sys.stdout, enabled
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.enabled and text.startswith(self.printed) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def stop_token_ids(tokenizer, model) -> set[int]:
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def run(settings: GenerateSettings, paths: GeneratePaths) -> dict:
    """Generate, streaming to stdout; the record (also written to paths.output when given)."""
    check_settings(settings, paths)
    verify_inputs(paths.model_dir)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(paths.model_dir, device, settings.dtype)
    with torch_threads(settings.threads):
        started = time.perf_counter()
        tokenizer = load_tokenizer(paths.model_dir)
        model = load_for_decoding(paths.model_dir, device, dtype, settings.path)
        load_seconds = time.perf_counter() - started
        input_ids = tokenizer(settings.prompt, return_tensors="pt").input_ids
        if input_ids.shape[1] == 0:
            raise StageInputError("--prompt: the prompt has no tokens")
        stream = TextStream(tokenizer, enabled=settings.stream)
        if settings.stream:
            sys.stdout.write(settings.prompt)
            sys.stdout.flush()
        stops = stop_token_ids(tokenizer, model)
        with decoding_context(paths.model_dir, device, settings.path):
            if settings.temperature > 0:
                generator = torch.Generator().manual_seed(settings.seed)
                tokens, timings = sample_decode(
                    model, input_ids, settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                    generator=generator, on_token=stream, stop_tokens=stops,
                    fast_attention=decode_options(settings.path).get("fast_attention"))
            else:
                tokens, timings = greedy_decode(model, input_ids, settings.max_new_tokens, on_token=stream, stop_tokens=stops,
                                                 **decode_options(settings.path))
        if settings.stream:
            sys.stdout.write("\n")
    record = {
        "model_dir": str(paths.model_dir), "format": "aqlm" if is_aqlm_folder(paths.model_dir) else "plain",
        "prompt": settings.prompt, "text": tokenizer.decode(tokens.tolist(), skip_special_tokens=True),
        "tokens": tokens.tolist(),
        "settings": {**asdict(settings), "device": device, "dtype": dtype},
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
        "threads": torch.get_num_threads() if settings.threads is None else settings.threads,
        "cpu_kernel": lookup_kernel(paths.model_dir, device, settings.path),
        "load_seconds": load_seconds,
        "timings": {**asdict(timings), "prefill_tokens_per_second": timings.prefill_tokens_per_second,
                    "decode_tokens_per_second": timings.decode_tokens_per_second},
        "resident_weight_bytes": resident_weight_bytes(model),
        "disk_weight_bytes": disk_weight_bytes(paths.model_dir),
    }
    if paths.output is not None:
        artifacts.write_json(paths.output, record)
    return record


def summary(record: dict) -> str:
    timings = record["timings"]
    kernel = f", CPU kernel {record['cpu_kernel']}" if record.get("cpu_kernel") else ""
    return (f"{timings['prompt_tokens']} prompt tokens at {timings['prefill_tokens_per_second']:.1f} tokens/s, "
            f"{timings['new_tokens']} new at {timings['decode_tokens_per_second']:.2f} tokens/s "
            f"({timings['mode']}, {record['settings']['path']} path, {record['settings']['device']}, "
            f"{record['settings']['dtype']}{kernel}); weights {record['resident_weight_bytes'] / 2**20:.1f} MiB in memory, "
            f"{record['disk_weight_bytes'] / 2**20:.1f} MiB on disk")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
