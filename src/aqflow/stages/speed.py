"""`python -m aqflow speed MODEL_DIR --output speed.json`: decode speed and memory of one model folder.

How fast and how big the model is on each of --devices (auto: the GPU and the CPU where a GPU is
visible, the CPU alone otherwise), through the project's fastest path for the device and through
plain transformers + aqlm.

For each device and path (aqflow.inference.runtime: `fast` = FastQuantizedLinear kernels, fused
projections and a CUDA graph per decode step on a GPU; `plain` = the folder as transformers + aqlm
load it, eager, nothing fused) a fresh child process loads the model and measures:

- batch-1 decode: a prompt of seeded random token ids, then greedy new tokens
  (aqflow.inference.decode.greedy_decode, a static KV cache; a warm-up decode of --warmup-tokens
  first, untimed: kernels compiled, caches filled); decode tokens/s over the timed steps;
- prefill: one forward of a long prompt into the static cache, tokens/s;
- both timed --repeats times, the fastest kept (every run's figure is recorded); on a CPU also the
  decode steps' tokens per CPU second of the measuring process (with one thread: the speed the
  decode would have alone on a core that other processes share);
- weights: bytes of the folder's weight files on disk, and of the model's parameters and buffers
  as held in memory after loading (tied tensors once);
- the CPU kernel of an AQLM folder's 2-bit layers (`cpu_kernel`: on the fast path the one chosen by the
  CPU's features or AQFLOW_CPU_KERNEL, avx512, avx2, neon or numba; "aqlm" on the plain path; null on a GPU);
- peak memory: on a GPU torch's max allocated bytes; on a CPU the child's peak RSS (VmHWM; the
  interpreter and libraries included, their share is `rss_before_load_bytes`).

Token counts (`token_counts`): on a GPU --prompt-tokens, --new-tokens and --prefill-tokens. On a
CPU a 3B model's step is a read of its weights from RAM (12.8 GB dense in float32: about half a
second at 25 GB/s), so the CPU has its own, smaller counts, chosen to keep a 3B measurement to about
a minute a path: --cpu-new-tokens 16 (15 timed steps; a step's time varies little from token to
token, so more steps add time, not accuracy) and --cpu-prefill-tokens 128 (well past the 8 tokens up
to which the fast path uses lookup tables, so the prefill is the dequantized BLAS path a long prompt
takes, yet ~0.8 TFLOP at 3B: seconds on a few cores where the GPU's 1024 would take tens). The
plain path of an AQLM folder on a CPU runs aqlm's numba kernel on one thread (it races with more),
seconds a token at 3B, one input row at a time, a prompt's rows included: its prefill tokens/s is
its per-row rate whatever the prompt's length. So its prompt, its new tokens and its prefill are
each --cpu-plain-tokens (4: three timed steps, 11 rows a repeat) after a one-token warm-up (which
compiles the kernels), and --cpu-plain-tokens 0 skips it (the device's section says so).

A child per path keeps one path's memory out of the other's peak. speed.json holds a section per
device under `devices` (its name, dtype, threads and per path the figures above with the token
counts used), the first device's section also at the top level (`device`, `device_name`, `paths`),
every setting and the versions; it is written atomically.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from aqflow.inference.runtime import (
    PATHS, call_in_child, decode_options, decoding_context, disk_weight_bytes, is_aqlm_folder, load_for_decoding,
    lookup_kernel, resident_weight_bytes, resolve_dtype, torch_threads,
)
from aqflow.io import artifacts
from aqflow.io.artifacts import verify_inputs
from aqflow.models.fetch import ModelInputError
from aqflow.models.folder import read_config, stored_bits_per_parameter
from aqflow.stagekit import stage_cli
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "speed"
INPUT_ERRORS = (*EXPECTED_ERRORS, ModelInputError)


@dataclass(frozen=True)
class SpeedSettings:
    devices: tuple[str, ...] = field(default=("auto",), metadata=option(
        "devices to measure on, each cpu, cuda or cuda:N; auto: the GPU and the CPU where a GPU is visible, "
        "else the CPU", metavar="DEVICE"))
    dtype: str = field(default="auto", metadata=option(
        "compute dtype of the unquantized parts on every device (auto: float32 on a CPU, the folder's dtype on a GPU)",
        choices=("auto", "float16", "bfloat16", "float32")))
    paths: tuple[str, ...] = field(default=PATHS, metadata=option(
        f"paths to measure, among {list(PATHS)}", metavar="PATH"))
    prompt_tokens: int = field(default=32, metadata=option("prompt tokens before the timed decode"))
    new_tokens: int = field(default=128, metadata=option("new tokens decoded (timed after the first)"))
    warmup_tokens: int = field(default=8, metadata=option("tokens of an untimed warm-up decode first"))
    prefill_tokens: int = field(default=1024, metadata=option("tokens of the long prompt whose prefill is timed"))
    cpu_new_tokens: int = field(default=16, metadata=option("on a CPU: new tokens decoded (instead of --new-tokens)"))
    cpu_prefill_tokens: int = field(default=128, metadata=option(
        "on a CPU: tokens of the long prompt (instead of --prefill-tokens)"))
    cpu_plain_tokens: int = field(default=4, metadata=option(
        "on a CPU, the plain path of an AQLM folder (aqlm's one-thread numba kernel): tokens of its prompt, "
        "its decode and its prefill each; 0 skips it"))
    repeats: int = field(default=1, metadata=option(
        "time the decode and the prefill this many times and keep the fastest (on a shared machine the "
        "slower runs measure the other processes)"))
    threads: int | None = field(default=None, metadata=option("CPU threads (default: all cores)"))
    seed: int = field(default=0, metadata=option("seed of the random prompt ids"))


@dataclass(frozen=True)
class SpeedPaths:
    model_dir: Path = field(metadata=option("model folder: plain or AQLM", positional=True))
    output: Path = field(metadata=option("speed.json to write"))


DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


def resolve_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """The devices to measure on: `auto` alone is the GPU and the CPU where a GPU is visible (the GPU
    first: the top level of speed.json is the first device's), the CPU alone otherwise."""
    if tuple(devices) == ("auto",):
        return ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
    return tuple(devices)


def device_kind(device: str) -> str:
    """`gpu` or `cpu`: the suffix of the device's columns in the report."""
    return "cpu" if torch.device(device).type == "cpu" else "gpu"


def token_counts(settings: SpeedSettings, device: str, path: str, aqlm: bool) -> dict | None:
    """{prompt_tokens, new_tokens, warmup_tokens, prefill_tokens} of `path` on `device` (see the
    module's doc), None where the path is skipped there."""
    if device_kind(device) == "gpu":
        return {"prompt_tokens": settings.prompt_tokens, "new_tokens": settings.new_tokens,
                "warmup_tokens": settings.warmup_tokens, "prefill_tokens": settings.prefill_tokens}
    if path == "plain" and aqlm:
        tokens = settings.cpu_plain_tokens
        return None if tokens == 0 else {"prompt_tokens": tokens, "new_tokens": tokens,
                                          "warmup_tokens": min(settings.warmup_tokens, 1), "prefill_tokens": tokens}
    return {"prompt_tokens": settings.prompt_tokens, "new_tokens": settings.cpu_new_tokens,
            "warmup_tokens": settings.warmup_tokens, "prefill_tokens": settings.cpu_prefill_tokens}


def check_settings(settings: SpeedSettings, paths: SpeedPaths) -> None:
    if not (paths.model_dir / "config.json").is_file():
        raise StageInputError(f"{paths.model_dir}: not a model folder (no config.json)")
    unknown = sorted(set(settings.paths) - set(PATHS))
    if unknown or not settings.paths:
        raise StageInputError(f"--paths {list(settings.paths)}: expected some of {list(PATHS)}")
    for name in ("prompt_tokens", "new_tokens", "prefill_tokens", "cpu_new_tokens", "cpu_prefill_tokens", "repeats"):
        if getattr(settings, name) < 1:
            raise StageInputError(f"--{name.replace('_', '-')} {getattr(settings, name)}: at least 1")
    for name in ("new_tokens", "cpu_new_tokens"):
        if getattr(settings, name) < 2:
            raise StageInputError(f"--{name.replace('_', '-')}: at least 2 (the first new token comes from the prefill)")
    if settings.cpu_plain_tokens == 1 or settings.cpu_plain_tokens < 0:
        raise StageInputError(f"--cpu-plain-tokens {settings.cpu_plain_tokens}: 0 (skip) or at least 2")
    if "auto" in settings.devices and len(settings.devices) > 1 or not settings.devices:
        raise StageInputError(f"--devices {list(settings.devices)}: auto alone, or a list of cpu, cuda, cuda:N")
    devices = resolve_devices(settings.devices)
    bad = [device for device in devices if not DEVICE_PATTERN.fullmatch(device)]
    if bad or len(set(devices)) < len(devices):
        raise StageInputError(f"--devices {list(devices)}: each once, each cpu, cuda or cuda:N")
    if any(device.startswith("cuda") for device in devices) and not torch.cuda.is_available():
        raise StageInputError(f"--devices {list(devices)}: no GPU is visible")


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM of /proc/self/status on Linux (the peak of this
    program's memory since its exec), else ru_maxrss. Not ru_maxrss on Linux: it keeps the peak
    from before the exec, so a child spawned by a big parent would report the parent's size."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def random_prompt(vocab_size: int, tokens: int, seed: int) -> torch.Tensor:
    """[1, tokens] int64 token ids, seeded (speed does not depend on which tokens)."""
    return torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))


class CpuClock:
    """An on_token callback for greedy_decode recording this process's CPU time at every token:
    the CPU seconds of the decode steps are those between the first token (the prefill's) and
    the last. On a CPU shared with other processes, one thread's CPU seconds are what the decode
    would take alone (wall seconds include the time other processes held the core)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, token: int) -> None:
        self.times.append(time.process_time())

    def decode_tokens_per_cpu_second(self) -> float:
        steps = len(self.times) - 1
        return steps / (self.times[-1] - self.times[0]) if steps > 0 and self.times[-1] > self.times[0] else float("nan")


def timed_decode(model, prompt: torch.Tensor, new_tokens: int, options: dict, cpu_clock: bool):
    """greedy_decode's timings (with the path's `options`, runtime.decode_options), and the decode
    steps' tokens per CPU second (NaN unless cpu_clock: the per-token callback syncs a GPU every
    token, so it is only used on a CPU)."""
    from aqflow.inference.decode import greedy_decode

    clock = CpuClock() if cpu_clock else None
    _, timings = greedy_decode(model, prompt, new_tokens, on_token=clock, **options)
    return timings, clock.decode_tokens_per_cpu_second() if clock else float("nan")


def measure(model_dir: str, device: str, dtype: str, path: str, settings: dict) -> dict:
    """One path's measurements, in this process (run it in a fresh one: see `run`)."""
    from aqflow.inference.decode import greedy_decode

    rss_before = peak_rss_bytes()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with torch_threads(settings["threads"]):
        started = time.perf_counter()
        model = load_for_decoding(model_dir, device, dtype, path)
        load_seconds = time.perf_counter() - started
        vocab = model.config.vocab_size
        options = decode_options(path)
        with decoding_context(model_dir, device, path):
            if settings["warmup_tokens"] > 0:
                greedy_decode(model, random_prompt(vocab, settings["prompt_tokens"], settings["seed"] + 1),
                              settings["warmup_tokens"] + 1, **options)
            decodes, cpu_rates = zip(*[timed_decode(model, random_prompt(vocab, settings["prompt_tokens"], settings["seed"]),
                                                    settings["new_tokens"], options, not cuda)
                                       for _ in range(settings["repeats"])])
            prefills = [greedy_decode(model, random_prompt(vocab, settings["prefill_tokens"], settings["seed"] + 2), 1,
                                      **{**options, "graphs": False})[1] for _ in range(settings["repeats"])]
        decode = max(decodes, key=lambda timings: timings.decode_tokens_per_second)
        prefill = max(prefills, key=lambda timings: timings.prefill_tokens_per_second)
        threads = torch.get_num_threads()
    result = {
        "path": path, "load_seconds": load_seconds, "threads": threads,
        "tokens": {key: settings[key] for key in ("prompt_tokens", "new_tokens", "warmup_tokens", "prefill_tokens")},
        "decode_tokens_per_second": decode.decode_tokens_per_second, "decode_mode": decode.mode,
        "decode_tokens_per_second_runs": [timings.decode_tokens_per_second for timings in decodes],
        "decode_tokens_per_cpu_second": max(cpu_rates),
        "decode_tokens_per_cpu_second_runs": list(cpu_rates),
        "prefill_tokens_per_second_runs": [timings.prefill_tokens_per_second for timings in prefills],
        "decode": asdict(decode),
        "prefill_tokens_per_second": prefill.prefill_tokens_per_second, "prefill": asdict(prefill),
        "resident_weight_bytes": resident_weight_bytes(model),
        "cpu_kernel": lookup_kernel(model_dir, device, path),
    }
    if cuda:
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peak_memory_kind"] = "cuda max allocated"
    else:
        result["peak_memory_bytes"] = peak_rss_bytes()
        result["peak_memory_kind"] = "peak RSS of the measuring process"
        result["rss_before_load_bytes"] = rss_before
    return result


def measure_in_child(model_dir: Path, device: str, dtype: str, path: str, settings: dict) -> dict:
    """`measure` in a fresh spawned process: its peak memory is this path's alone."""
    return call_in_child(measure, str(model_dir), device, dtype, path, settings, what=f"measuring the {path} path")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "aqlm", "numba", "triton"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return model or platform.processor() or platform.machine()


def measure_device(settings: SpeedSettings, model_dir: Path, device: str) -> dict:
    """speed.json's section of one device: its name, dtype and threads, and every path's figures
    (each measured in a child of its own); a path skipped there under `skipped_paths`, with why."""
    dtype = resolve_dtype(model_dir, device, settings.dtype)
    aqlm = is_aqlm_folder(model_dir)
    results, skipped = {}, {}
    for path in settings.paths:
        counts = token_counts(settings, device, path, aqlm)
        if counts is None:
            skipped[path] = "cpu_plain_tokens is 0 (aqlm's CPU kernel takes seconds a token at billions of weights)"
            continue
        child_settings = {"threads": settings.threads, "seed": settings.seed, "repeats": settings.repeats, **counts}
        # a path takes minutes where its decode step is compiled first: say which one is running
        print(f"speed: the {path} path on {device} ({dtype}, {counts['new_tokens']} new tokens x {settings.repeats})",
              flush=True)
        started = time.perf_counter()
        results[path] = measure_in_child(model_dir, device, dtype, path, child_settings)
        print(f"speed: the {path} path on {device}: {results[path]['decode_tokens_per_second']:.1f} tokens/s, "
              f"measured in {time.perf_counter() - started:.0f} s", flush=True)
    threads = next((result["threads"] for result in results.values()), settings.threads)
    section = {"device": device, "kind": device_kind(device), "name": device_name(device), "dtype": dtype,
               "threads": threads, "paths": results}
    return {**section, "skipped_paths": skipped} if skipped else section


def run(settings: SpeedSettings, paths: SpeedPaths) -> dict:
    """Measure every requested path on every device and write speed.json; its payload."""
    check_settings(settings, paths)
    verify_inputs(paths.model_dir)
    devices = resolve_devices(settings.devices)
    sections = {device: measure_device(settings, paths.model_dir, device) for device in devices}
    first = sections[devices[0]]
    payload = {
        "model_dir": str(paths.model_dir),
        "format": "aqlm" if is_aqlm_folder(paths.model_dir) else "plain",
        "model_type": read_config(paths.model_dir).get("model_type"),
        "bits_per_parameter": stored_bits_per_parameter(paths.model_dir)["bits_per_parameter"],
        "disk_weight_bytes": disk_weight_bytes(paths.model_dir),
        "cpu_cores": os.cpu_count(),
        "settings": {**asdict(settings), "devices": list(devices), "paths": list(settings.paths)},
        "versions": versions(),
        "devices": sections,
        # the first device's figures, as the one-device layout had them
        "device": first["device"], "device_name": first["name"], "paths": first["paths"],
    }
    artifacts.write_json(paths.output, payload)
    return payload


def summary(payload: dict) -> str:
    lines = []
    for device, section in payload["devices"].items():
        parts = [f"{name}: decode {r['decode_tokens_per_second']:.2f} tokens/s, prefill {r['prefill_tokens_per_second']:.1f} "
                 f"tokens/s, weights {r['resident_weight_bytes'] / 2**20:.1f} MiB, peak {r['peak_memory_bytes'] / 2**20:.0f} MiB"
                 + (f", CPU kernel {r['cpu_kernel']}" if r.get("cpu_kernel") else "")
                 for name, r in section["paths"].items()]
        parts += [f"{name}: skipped" for name in section.get("skipped_paths", {})]
        lines.append(f"{payload['model_dir']} on {device} ({section['dtype']}, {section['threads']} threads): "
                     + "; ".join(parts))
    return "\n".join(lines)


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
