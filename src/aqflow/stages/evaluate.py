"""`python -m aqflow evaluate`: perplexity and zero-shot accuracy of one model folder -> eval.json.

Perplexity is measured per evaluation domain: `--domain NAME PROTOCOL CORPUS` (repeatable) names a
corpus written by `fetch-data` (hub WikiText-2/C4, a stand-in or a user file; its evaluation-role
documents are read) and one of the GPTQ/AQLM protocols (see `aqflow.evaluation.protocol`):
`joined` (WikiText-2's: the text joined with blank lines, cut into non-overlapping windows of
--context tokens, remainder dropped, optionally only the first --max-windows) or `sampled` (C4's:
--c4-windows seeded windows of --context tokens drawn from single documents). eval.json holds one
perplexity per domain under its name, with what text it is (the corpus's split record) in `data`.
Without --domain, `--perplexity wikitext2 c4` with --wikitext2-corpus/--c4-corpus/--data-dir name
two domains "wikitext2" (joined) and "c4" (sampled).

Zero-shot: lm-eval's standard arc_easy, arc_challenge, hellaswag, piqa, winogrande and
lambada_openai, on local JSONL copies of their data (`aqflow.data.zero_shot`), at most
--task-limit examples per task.

The model folder is a plain (fp16/bf16/fp32) model or an AQLM checkpoint. eval.json holds the
metrics, every setting (with the upstream settings of --settings embedded), timings, the bits
per parameter the checkpoint stores and what data was used. Inputs are checked before any work;
on a bad input the stage exits with status 2 and writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.data.zero_shot import ZERO_SHOT_TASKS, TaskDataError, prepare_zero_shot_data, read_manifest, task_data_files
from aqflow.evaluation import window_cache
from aqflow.evaluation.dense_aqlm import dequantize_aqlm_linears
from aqflow.models.folder import quantization_config, stored_bits_per_parameter
from aqflow.evaluation.logits_budget import DEFAULT_LOGITS_BUDGET_BYTES
from aqflow.evaluation.perplexity import perplexity
from aqflow.data.corpus_catalog import BUILTIN_PROTOCOLS, PROTOCOLS
from aqflow.evaluation.protocol import (
    DEFAULT_C4_SEED, DEFAULT_C4_WINDOWS, c4_windows, texts_sha256, wikitext2_windows, windows_sha256,
)
from aqflow.evaluation.zero_shot import DEFAULT_BOOTSTRAP_ITERS, average_accuracy, run_zero_shot
from aqflow.io.fetching import default_cache_dir
from aqflow.io.finite import NonFiniteMetricError, require_finite
from aqflow.models.fetch import load_causal_lm, load_tokenizer, model_compute_dtype
from aqflow.io.artifacts import verify_inputs
from aqflow.data.offline_text import CorpusError
from aqflow.models.fetch import ModelInputError
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

PERPLEXITY_SETS = ("wikitext2", "c4")
# lm-eval requests per forward pass on a GPU when none is set. The requests are short (~100
# tokens), and a batch past the logits budget or the card's free memory is scored in pieces, so
# a large batch is safe; at 1, the six tasks of a Llama-3.2-3B shape ran at ~38 requests/s on an
# H100 (~30 min for 66k requests) against ~2,600/s at 256.
GPU_TASK_BATCH_SIZE = 256
STANDIN_FILES = {"wikitext2": "wikitext2-standin.parquet", "c4": "c4-standin.parquet"}
EVALUATION_ROLE = "evaluation"


class EvaluationInputError(StageInputError):
    """A bad input to the evaluate stage; the message names it."""


STAGE = "evaluate"
INPUT_ERRORS = (*EXPECTED_ERRORS, NonFiniteMetricError, CorpusError, ModelInputError, TaskDataError)


# --- arguments -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvaluateSettings:
    label: str | None = field(default=None, metadata=option("what this evaluation is, e.g. 'pre-pv'"))
    # perplexity
    perplexity: tuple[str, ...] | None = field(default=None, metadata=option(
        f"without --domain: sets among {list(PERPLEXITY_SETS)} (default both; none: skip perplexity)", metavar="SET"))
    context: int = field(default=4096, metadata=option("tokens per perplexity window"))
    max_windows: int | None = field(default=None, metadata=option("keep only the first WikiText-2 windows"))
    c4_windows: int = DEFAULT_C4_WINDOWS
    c4_seed: int = DEFAULT_C4_SEED
    # zero-shot
    tasks: tuple[str, ...] = field(default=tuple(ZERO_SHOT_TASKS), metadata=option(
        f"among {list(ZERO_SHOT_TASKS)} (none: skip zero-shot)", metavar="TASK"))
    task_limit: int | None = field(default=None, metadata=option("at most this many examples per task"))
    bootstrap_iters: int = field(default=DEFAULT_BOOTSTRAP_ITERS, metadata=option(
        "lm-eval bootstrap draws (lambada perplexity stderr)"))
    # run
    batch_size: int = field(default=1, metadata=option("perplexity windows per forward pass"))
    task_batch_size: int | None = field(default=None, metadata=option(
        f"lm-eval requests per forward pass (default: {GPU_TASK_BATCH_SIZE} on a GPU, --batch-size on a CPU); "
        "requests are short, so a GPU takes far more of them than of 4096-token windows"))
    logits_budget_gib: float = field(default=DEFAULT_LOGITS_BUDGET_BYTES / 2**30, metadata=option(
        "the most GiB of logits one forward pass may hold: a batch that would hold more (a large vocabulary) "
        "is scored in pieces, with the same metrics"))
    device: str = field(default_factory=stage_cli.default_device)
    dtype: str = field(default="auto", metadata=option(
        "compute dtype (auto: float32 on CPU, the model folder's dtype on GPU)",
        choices=("auto", "float16", "bfloat16", "float32")))
    cpu_kernel: str = field(default="fast", metadata=option(
        "AQLM layers on a CPU: fast (aqflow.inference's FastQuantizedLinear: the model stays 2-bit in RAM, "
        "each forward dequantizes a chunk of rows at a time), dense (dequantized once after loading, "
        "multi-threaded; RAM holds the dense model) or aqlm (aqlm's numba kernel, one thread, 5-14x slower per "
        "layer)", choices=("dense", "fast", "aqlm")))
    gpu_kernel: str = field(default="dense", metadata=option(
        "AQLM layers on a GPU: dense (dequantized once after loading, cuBLAS matmuls) or aqlm (aqlm's CUDA "
        "kernels: its 2x8 kernel runs one matrix-vector product per token)", choices=("dense", "aqlm")))
    quiet: bool = field(default=False, metadata=option("no progress bars"))
    # the upstream settings to embed (a rule's: quantizer, calibration, layers...); from the command
    # line, --settings names a JSON file of them instead
    upstream: dict | None = field(default=None, metadata={"cli": False})


@dataclass(frozen=True)
class EvaluatePaths:
    model_dir: Path = field(metadata=option("HF model folder (plain or AQLM)"))
    output: Path = field(metadata=option("eval.json to write"))
    settings: Path | None = field(default=None, metadata=option("JSON file of upstream settings to embed"))
    pre_pv: Path | None = field(default=None, metadata=option(
        "eval.json of the same model before PV-tuning, embedded whole as 'pre_pv'"))
    domain: tuple[tuple[str, str, str], ...] | None = field(default=None, metadata=option(
        f"an evaluation domain: its name in eval.json, protocol ({' or '.join(PROTOCOLS)}) and corpus .parquet "
        "(fetch-data); repeatable", append=3, metavar=("NAME", "PROTOCOL", "CORPUS")))
    data_dir: Path | None = field(default=None, metadata=option(
        f"folder holding {STANDIN_FILES['wikitext2']} and {STANDIN_FILES['c4']} (fetch-data outputs)"))
    wikitext2_corpus: Path | None = field(default=None, metadata=option("WikiText-2 stand-in .parquet (overrides --data-dir)"))
    c4_corpus: Path | None = field(default=None, metadata=option("C4 stand-in .parquet (overrides --data-dir)"))
    task_data_dir: Path | None = field(default=None, metadata=option(
        "prepared task JSONL folder (default: <cache>/zero-shot, prepared on first use)"))
    work_dir: Path | None = field(default=None, metadata=option("keep task configs here (default: a temporary folder)"))
    cache_dir: Path | None = field(default=None, metadata=option(
        "download cache, also where evaluations keep the task data's Arrow copies (zero-shot-arrow/) and "
        "perplexity windows (perplexity-windows/) between them (default: $AQFLOW_CACHE or resources/cache)"))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise EvaluationInputError(message)


def evaluation_domains(settings: EvaluateSettings, paths: EvaluatePaths) -> dict[str, tuple[str, Path]]:
    """{domain name: (protocol, corpus .parquet)}, in the order given; checked."""
    if paths.domain:
        legacy = [flag for flag, value in (("--perplexity", settings.perplexity), ("--data-dir", paths.data_dir),
                                           ("--wikitext2-corpus", paths.wikitext2_corpus),
                                           ("--c4-corpus", paths.c4_corpus)) if value is not None]
        _require(not legacy, f"--domain names every perplexity set; drop {legacy}")
        domains = {}
        for name, protocol, corpus in paths.domain:
            _require(name not in domains, f"--domain {name} is given twice")
            _require(protocol in PROTOCOLS, f"--domain {name}: protocol {protocol!r} is not one of {list(PROTOCOLS)}")
            _require(Path(corpus).is_file(), f"--domain {name}: corpus {corpus} does not exist")
            domains[name] = (protocol, Path(corpus))
        return domains
    sets = list(PERPLEXITY_SETS) if settings.perplexity is None else list(settings.perplexity)
    bad_sets = [name for name in sets if name not in PERPLEXITY_SETS]
    _require(not bad_sets, f"--perplexity: unknown sets {bad_sets}; known: {list(PERPLEXITY_SETS)}")
    explicit = {"wikitext2": paths.wikitext2_corpus, "c4": paths.c4_corpus}
    domains = {}
    for name in sets:
        path = explicit[name] or (paths.data_dir / STANDIN_FILES[name] if paths.data_dir else None)
        _require(path is not None, f"--perplexity {name} needs --{name}-corpus or --data-dir")
        _require(path.is_file(), f"--{name}-corpus / --data-dir: {path} does not exist")
        domains[name] = (BUILTIN_PROTOCOLS[name], path)  # the hub corpora's protocols
    return domains


def _read_json_file(flag: str, path: Path):
    """The JSON value in `path`, or an EvaluationInputError naming `flag` and the file."""
    _require(path.is_file(), f"{flag}: {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise EvaluationInputError(f"{flag}: {path} is not valid JSON ({error})") from None


def check_inputs(settings: EvaluateSettings, paths: EvaluatePaths) -> None:
    """Raise EvaluationInputError naming the first bad input; nothing has been done yet."""
    s = settings
    _require((paths.model_dir / "config.json").is_file(), f"--model-dir: {paths.model_dir} has no config.json")
    bad_tasks = [task for task in s.tasks if task not in ZERO_SHOT_TASKS]
    _require(not bad_tasks, f"--tasks: unknown tasks {bad_tasks}; known: {list(ZERO_SHOT_TASKS)}")
    _require(s.context >= 2, f"--context must be >= 2 tokens, got {s.context}")
    for flag, value in (("--max-windows", s.max_windows), ("--task-limit", s.task_limit)):
        _require(value is None or value >= 1, f"{flag} must be >= 1, got {value}")
    _require(s.c4_windows >= 1, f"--c4-windows must be >= 1, got {s.c4_windows}")
    _require(s.batch_size >= 1, f"--batch-size must be >= 1, got {s.batch_size}")
    _require(s.task_batch_size is None or s.task_batch_size >= 1,
             f"--task-batch-size must be >= 1, got {s.task_batch_size}")
    _require(s.logits_budget_gib > 0, f"--logits-budget-gib must be > 0, got {s.logits_budget_gib}")
    _require(s.bootstrap_iters >= 0, f"--bootstrap-iters must be >= 0, got {s.bootstrap_iters}")
    _require(not str(s.device).startswith("cuda") or torch.cuda.is_available(),
             f"--device {s.device}: CUDA is not available")
    evaluation_domains(settings, paths)
    if s.tasks and paths.task_data_dir is not None:
        try:
            task_data_files(paths.task_data_dir, s.tasks)
        except FileNotFoundError as error:
            raise EvaluationInputError(f"--task-data-dir: {error}") from None
    if paths.settings is not None:
        upstream = _read_json_file("--settings", paths.settings)
        _require(isinstance(upstream, dict), f"--settings: {paths.settings} must hold a JSON object")
    if paths.pre_pv is not None:
        pre_pv = _read_json_file("--pre-pv", paths.pre_pv)
        _require(isinstance(pre_pv, dict) and "metrics" in pre_pv, f"--pre-pv: {paths.pre_pv} is not an eval.json")
    try:
        quantization_config(paths.model_dir)
    except json.JSONDecodeError as error:
        raise EvaluationInputError(f"--model-dir: {paths.model_dir}/config.json is not valid JSON ({error})") from None


def compute_dtype(settings: EvaluateSettings, model_dir: Path) -> str:
    if settings.dtype != "auto":
        return settings.dtype
    return model_compute_dtype(model_dir, settings.device)


# --- work ----------------------------------------------------------------------------------------

@contextmanager
def _timed(timings: dict, key: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - started


def load_model(model_dir: Path, dtype: str, device: str, cpu_kernel: str = "dense", gpu_kernel: str = "dense"):
    """Load a plain or AQLM model folder, offline, in eval mode. With the kernel of the device
    (`cpu_kernel` on a CPU, `gpu_kernel` otherwise) "dense", the AQLM layers loaded by
    transformers + aqlm become equal dense linears; with "fast" (CPU), FastQuantizedLinear layers
    holding the same codes."""
    config = quantization_config(model_dir)
    is_aqlm = config is not None and config.get("quant_method") == "aqlm"
    kernel = cpu_kernel if device == "cpu" else gpu_kernel
    if is_aqlm:
        if device == "cpu" and kernel == "aqlm":
            # aqlm's numba kernel for 8-bit codebooks races with more than one thread (wrong
            # outputs); numba reads this when it is first imported.
            os.environ["NUMBA_NUM_THREADS"] = "1"
        # transformers 5: the quantizers must be imported before transformers.integrations.aqlm
        # (circular import otherwise).
        import transformers.quantizers  # noqa: F401

    model = load_causal_lm(model_dir, dtype=dtype, device=device)
    if is_aqlm and kernel == "dense":
        dequantize_aqlm_linears(model)
    elif is_aqlm and kernel == "fast":
        # imported here: it imports numba, which must not start before NUMBA_NUM_THREADS is set above
        from aqflow.inference.fast_linear import install_fast_linears

        install_fast_linears(model)
    return model


def evaluation_texts(path: Path) -> tuple[list[str], list[str], dict]:
    """(doc_ids, texts, data record) of the evaluation-role documents of a split corpus.

    The record names the corpus file and carries its split record's `origin` (hub repo/files/
    revisions, stand-in package, or user file and sha256) as `text`."""
    from aqflow.data.offline_text import load_split_corpus, read_split_record, role_texts

    doc_ids, texts = role_texts(load_split_corpus(path), EVALUATION_ROLE)
    split_record = read_split_record(path) or {}
    return doc_ids, texts, {"corpus": str(path), "corpus_name": path.stem, "text": split_record.get("origin"),
                            "role": EVALUATION_ROLE, "documents": len(texts), "order": "sorted by doc_id"}


def perplexity_windows_for(settings: EvaluateSettings, cache_dir: Path, name: str, protocol: str, path: Path,
                           tokenizer, fingerprint: str | None = None) -> tuple[torch.Tensor, dict]:
    """(windows [num_windows, context] int64, data record) of one evaluation domain, by its protocol.

    fingerprint: the tokenizer's (`window_cache.tokenizer_fingerprint`); with it, windows cut once
    for this text, protocol and tokenizer are read from `<cache_dir>/perplexity-windows` instead."""
    doc_ids, texts, record = evaluation_texts(path)
    record["texts_sha256"] = texts_sha256(texts)
    if protocol == "joined":
        cut = {"context": settings.context, "max_windows": settings.max_windows}
    else:
        cut = {"context": settings.context, "num_windows": settings.c4_windows, "seed": settings.c4_seed}
    folder = window_cache.cache_folder(cache_dir)
    key = window_cache.windows_key(protocol, cut, record["texts_sha256"], fingerprint) if fingerprint else None
    cached = window_cache.load_windows(folder, key) if key else None
    if cached is None:
        windows, extras = protocol_windows(settings, name, protocol, path, doc_ids, texts, tokenizer)
        if key:
            window_cache.store_windows(folder, key, windows, extras)
    else:
        windows, extras = cached
    if protocol == "joined":
        record["protocol"] = "joined with blank lines, consecutive non-overlapping windows, remainder dropped"
    else:
        record.update(protocol="AQLM get_c4(eval_mode=True): seeded document + offset per window",
                      seed=settings.c4_seed, **extras)
    record["protocol_name"] = protocol
    record["windows_sha256"] = windows_sha256(windows)
    return windows, record


def protocol_windows(settings: EvaluateSettings, name: str, protocol: str, path: Path, doc_ids: list[str],
                     texts: list[str], tokenizer) -> tuple[torch.Tensor, dict]:
    """(windows [num_windows, context] int64, extras for the record) cut from `texts` by `protocol`;
    extras: nothing for joined, eligible_documents and window_sources for sampled."""
    s = settings
    where = f"{name} ({path}, --context {s.context})"
    try:
        if protocol == "joined":
            return wikitext2_windows(texts, tokenizer, s.context, max_windows=s.max_windows), {}
        sampled = c4_windows(doc_ids, texts, tokenizer, s.context, num_windows=s.c4_windows, seed=s.c4_seed)
    except ValueError as error:
        raise EvaluationInputError(f"{where}: {error}") from None
    return sampled.input_ids, {"eligible_documents": sampled.eligible_documents, "window_sources": sampled.sources()}


def logits_budget_bytes(settings: EvaluateSettings) -> int:
    return int(settings.logits_budget_gib * 2**30)


def perplexity_metrics(settings: EvaluateSettings, model, windows: torch.Tensor) -> dict:
    value = perplexity(model, windows, batch_size=settings.batch_size, progress=not settings.quiet,
                       logits_budget_bytes=logits_budget_bytes(settings))
    return {"perplexity": value, "windows": int(windows.shape[0]), "context": int(windows.shape[1])}


def download_cache(paths: EvaluatePaths) -> Path:
    """The download cache (--cache-dir, else $AQFLOW_CACHE or resources/cache)."""
    return paths.cache_dir or default_cache_dir()


def task_batch_size(settings: EvaluateSettings) -> int:
    """lm-eval requests per forward pass: the one set, else GPU_TASK_BATCH_SIZE on a GPU and the
    perplexity batch on a CPU (where a batch buys little and costs RAM)."""
    if settings.task_batch_size is not None:
        return settings.task_batch_size
    return GPU_TASK_BATCH_SIZE if str(settings.device).startswith("cuda") else settings.batch_size


def zero_shot_data_dir(paths: EvaluatePaths) -> Path:
    if paths.task_data_dir is not None:
        return paths.task_data_dir
    return prepare_zero_shot_data(download_cache(paths) / "zero-shot", download_cache(paths))


def datasets_cache_dir(cache_dir: Path) -> Path | None:
    """`<cache_dir>/zero-shot-arrow`: the Arrow copies `datasets` makes of the task JSONL, kept between
    evaluations (rebuilding them was a fixed cost of every evaluation); None (the run's work folder)
    where the cache cannot be written."""
    folder = cache_dir / "zero-shot-arrow"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def run_tasks(settings: EvaluateSettings, paths: EvaluatePaths, model, tokenizer, data_dir: Path) -> tuple[dict, dict]:
    """(task metrics with averages, data record) of the zero-shot tasks."""
    files = task_data_files(data_dir, settings.tasks)
    manifest = read_manifest(data_dir)
    with tempfile.TemporaryDirectory(prefix="aqflow-eval-") as scratch:
        work_dir = paths.work_dir or Path(scratch)
        metrics = run_zero_shot(model, tokenizer, files, work_dir, limit=settings.task_limit,
                                batch_size=task_batch_size(settings),
                                bootstrap_iters=settings.bootstrap_iters,
                                datasets_cache_dir=datasets_cache_dir(download_cache(paths)),
                                logits_budget_bytes=logits_budget_bytes(settings))
    provenance = {key: value for key, value in manifest.items() if key != "tasks"}  # source, wheel, sha256
    record = {"data_dir": str(data_dir), **provenance, "files": {task: manifest["tasks"][task] for task in settings.tasks}}
    return {"tasks": metrics, **average_accuracy(metrics)}, record


def upstream_settings(settings: EvaluateSettings, paths: EvaluatePaths) -> dict | None:
    """The upstream settings to embed: given directly, or read from the --settings file."""
    if settings.upstream is not None:
        return settings.upstream
    return json.loads(paths.settings.read_text()) if paths.settings else None


def settings_record(settings: EvaluateSettings, paths: EvaluatePaths) -> dict:
    """Every setting and input path of the evaluation (the upstream settings embedded), the compute
    dtype, and the software and device it ran on."""
    import transformers

    fields = {spec.name: getattr(instance, spec.name) for instance in (settings, paths)
              for spec in dataclasses.fields(instance)}
    record = {key: (str(value) if isinstance(value, Path) else value) for key, value in fields.items()
              if key not in ("output", "settings", "quiet", "pre_pv", "upstream")}
    record["dtype"] = compute_dtype(settings, paths.model_dir)
    record["task_batch_size_used"] = task_batch_size(settings)
    record["num_fewshot"] = 0
    record["upstream"] = upstream_settings(settings, paths)
    try:
        from importlib.metadata import version

        lm_eval_version = version("lm_eval")
    except Exception:  # lm-eval is optional when no task runs
        lm_eval_version = None
    record["software"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                          "lm_eval": lm_eval_version, "python": platform.python_version()}
    record["device_name"] = (torch.cuda.get_device_name() if str(settings.device).startswith("cuda")
                             else platform.processor() or "cpu")
    return record


def evaluate(settings: EvaluateSettings, paths: EvaluatePaths) -> dict:
    """Run every requested evaluation and return the eval.json payload (nothing written)."""
    check_inputs(settings, paths)
    domains = evaluation_domains(settings, paths)
    # every input is a local file (corpora from fetch-data, prepared task data): never the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    timings: dict[str, float] = {}
    started = time.perf_counter()
    bits = stored_bits_per_parameter(paths.model_dir)
    tokenizer = load_tokenizer(paths.model_dir)
    data: dict = {}
    windows: dict[str, torch.Tensor] = {}
    # Data first (cheap), so that an unusable corpus or task folder fails before the model loads.
    with _timed(timings, "data_seconds"):
        fingerprint = window_cache.tokenizer_fingerprint(tokenizer) if domains else None
        for name, (protocol, path) in domains.items():
            windows[name], data[name] = perplexity_windows_for(settings, download_cache(paths), name, protocol, path,
                                                               tokenizer, fingerprint)
        task_dir = zero_shot_data_dir(paths) if settings.tasks else None
    with _timed(timings, "load_seconds"):
        model = load_model(paths.model_dir, compute_dtype(settings, paths.model_dir), settings.device,
                           settings.cpu_kernel, settings.gpu_kernel)
    metrics: dict = {}
    for name in domains:
        with _timed(timings, f"{name}_seconds"):
            metrics[name] = perplexity_metrics(settings, model, windows[name])
    timings["perplexity_seconds"] = sum(timings[f"{name}_seconds"] for name in domains)
    timings["zero_shot_seconds"] = 0.0
    if settings.tasks:
        with _timed(timings, "zero_shot_seconds"):
            zero_shot, data["zero_shot"] = run_tasks(settings, paths, model, tokenizer, task_dir)
        metrics.update(zero_shot)
    require_finite(metrics, "evaluate", settings.label or str(paths.model_dir))
    timings["total_seconds"] = time.perf_counter() - started
    payload = {
        "label": settings.label,
        "model_dir": str(paths.model_dir),
        "metrics": metrics,
        "settings": settings_record(settings, paths),
        "timings": timings,
        "bits_per_parameter": bits["bits_per_parameter"],
        "storage": bits,
        "data": data,
    }
    if paths.pre_pv is not None:  # the model before PV-tuning, with its own settings and timings
        payload["pre_pv"] = json.loads(paths.pre_pv.read_text())
    return payload


def summary_line(payload: dict) -> str:
    metrics = payload["metrics"]
    parts = [f"{name} ppl {value['perplexity']:.3f}" for name, value in metrics.items()
             if isinstance(value, dict) and "perplexity" in value and name != "tasks"]
    if metrics.get("avg_acc") is not None:
        parts.append(f"avg acc {metrics['avg_acc']:.4f} over {len(metrics['tasks'])} tasks")
    parts.append(f"{payload['bits_per_parameter']:.3f} bits/parameter")
    return f"{payload['label'] or payload['model_dir']}: " + ", ".join(parts) + f" ({payload['timings']['total_seconds']:.1f} s)"


summary = summary_line  # the stage's report line, under the name every stage gives it


def run(settings: EvaluateSettings, paths: EvaluatePaths) -> dict:
    """Evaluate and write eval.json; its payload."""
    verify_inputs(paths.model_dir, paths.settings, paths.pre_pv, paths.data_dir, paths.wikitext2_corpus,
                  paths.c4_corpus, paths.task_data_dir, *(Path(corpus) for _, _, corpus in paths.domain or []))
    payload = evaluate(settings, paths)
    artifacts.write_json(paths.output, payload)
    return payload


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
