"""`python -m aqflow pvtune`: PV-tune a stitched AQLM checkpoint against its full-precision model.

Teacher: --model-dir (the full-precision model). Student: --checkpoint-dir (the AQLM checkpoint
that `stitch` wrote). Loss: token-level KL(teacher || student) on windows of calibration-role
documents of --corpus; a held-out slice of those documents (never the evaluation documents,
never WikiText-2 or C4 evaluation text) scores the student before training, every
--eval-every-steps steps and at the end, and the best held-out state is what is written.

Writes, atomically: --output-dir (a standard AQLM checkpoint again, same layout and dtypes as
the input), --train-log (Parquet: step, epoch, split, kl, perplexity, codes_changed_fraction,
seconds, selected) and --metrics (JSON: settings, data, results, timings per phase).

Several GPUs of one host: `torchrun --nproc-per-node N -m aqflow pvtune ...` shards the state over
the processes (FSDP2, and the V-step's state by rows: `aqflow.pvtune.distributed`), each taking
its share of every batch; the checkpoint is gathered once and process 0 writes the outputs.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

# PV-tuning frees and allocates activations of many sizes beside ~100 GB of long-lived state at
# 8B: with fixed-size segments 10 GB sat reserved but unusable and the step ran out of memory on
# a 141 GB card. Growable segments (read at the first CUDA allocation) keep that waste small.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402 (after the allocator setting)

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import verify_inputs
from aqflow.data.offline_text import CorpusError
from aqflow.io.finite import NonFiniteMetricError, require_finite
from aqflow.models.fetch import ModelInputError, load_tokenizer, model_compute_dtype, torch_dtype
from aqflow.models.folder import tensor_headers
from aqflow.stagekit.processes import die_with_parent
from aqflow.pvtune.data import pv_windows
from aqflow.pvtune.memory import PVMemoryError, host_bytes, plan_v_state, wait_for_free_memory
from aqflow.pvtune.resume import Resumer, run_fingerprint
from aqflow.pvtune.student import StudentError, load_student, load_teacher, pv_linears, save_student
from aqflow.pvtune.train import PVSettings, settings_record, train, world
from aqflow.quant.representation import pack_codes
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "pvtune"
INPUT_ERRORS = (*EXPECTED_ERRORS, NonFiniteMetricError, StudentError, CorpusError, ModelInputError, PVMemoryError)


@dataclass(frozen=True)
class PvtuneSettings:
    num_samples: int = field(default=10000, metadata=option("training windows (all there are, if fewer)"))
    heldout_samples: int = field(default=128, metadata=option("held-out windows (all there are, if fewer)"))
    window_tokens: int = 4096
    heldout_fraction: float = field(default=0.1, metadata=option("calibration documents held out for selection"))
    data_seed: int = 0
    # the loop (defaults: the paper / AQLM recipe, but the V-step's step relative to each layer's weights)
    training: PVSettings = field(default_factory=PVSettings)
    save_state_every: int = field(default=25, metadata=option("steps between saved states (0: never)"))
    memory_wait_seconds: float = field(default=300, metadata=option(
        "on a card that other processes fill, wait up to this long for the state's memory to be free before loading"))
    device: str = field(default_factory=stage_cli.default_device, metadata=option(
        "cpu, cuda or cuda:N (under torchrun: each process takes cuda:LOCAL_RANK)"))
    amp_dtype: str = field(default="auto", metadata=option(
        "autocast dtype of the forward passes (auto: none on CPU or for a float32 model, else bfloat16)",
        choices=("auto", "none", "bfloat16", "float16")))
    teacher_dtype: str = field(default="auto", metadata=option(
        "teacher weights (auto: the model folder's dtype on GPU, float32 on CPU)",
        choices=("auto", "float32", "bfloat16", "float16")))
    quiet: bool = field(default=False, metadata=option("no progress bars"))


@dataclass(frozen=True)
class PvtunePaths:
    model_dir: Path = field(metadata=option("full-precision model folder (the teacher)"))
    checkpoint_dir: Path = field(metadata=option("AQLM checkpoint folder (the student)"))
    corpus: Path = field(metadata=option("split corpus .parquet (fetch-data); its calibration documents are used"))
    output_dir: Path = field(metadata=option("PV-tuned AQLM checkpoint folder to write"))
    train_log: Path = field(metadata=option("training log .parquet to write"))
    metrics: Path = field(metadata=option("metrics .json to write"))
    state_dir: Path | None = field(default=None, metadata=option(
        "folder for the loop's full state, saved every --save-state-every steps; a run finding a state of "
        "the same settings and inputs there resumes from it (removed when done)"))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise StageInputError(message)


def check_inputs(settings: PvtuneSettings, paths: PvtunePaths) -> None:
    """Raise naming the first bad input, before anything is loaded."""
    _require((paths.model_dir / "config.json").is_file(), f"--model-dir: {paths.model_dir} has no config.json")
    _require((paths.checkpoint_dir / "config.json").is_file(), f"--checkpoint-dir: {paths.checkpoint_dir} has no config.json")
    _require(paths.corpus.is_file(), f"--corpus: {paths.corpus} does not exist")
    _require(settings.num_samples >= 1 and settings.heldout_samples >= 1, "--num-samples and --heldout-samples must be >= 1")
    _require(settings.window_tokens >= 2, f"--window-tokens must be >= 2, got {settings.window_tokens}")
    _require(settings.save_state_every >= 0, f"--save-state-every must be >= 0, got {settings.save_state_every}")
    _require(settings.memory_wait_seconds >= 0, f"--memory-wait-seconds must be >= 0, got {settings.memory_wait_seconds}")
    _require(not str(settings.device).startswith("cuda") or torch.cuda.is_available(),
             f"--device {settings.device}: CUDA is not available")


def auto_amp_dtype(model_dtype: str) -> str:
    """The student's autocast dtype for a model computing in `model_dtype`: none for float32 (CPU
    runs, float32 models), else bfloat16. A float16 model trains under bfloat16 autocast too:
    float16's range overflows in some models and, with no loss scaling here, underflows gradients."""
    return "none" if model_dtype == "float32" else "bfloat16"


def pv_settings(settings: PvtuneSettings, model_dir: Path, device: torch.device) -> PVSettings:
    """The loop's settings with the autocast dtype resolved."""
    amp = settings.amp_dtype if settings.amp_dtype != "auto" else auto_amp_dtype(model_compute_dtype(model_dir, device))
    return dataclasses.replace(settings.training, amp_dtype=None if amp == "none" else amp)


def setup_device(device: str) -> torch.device:
    """The process's device; under torchrun also joins the process group (nccl on GPU, gloo on CPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        die_with_parent()  # a torchrun worker dies with torchrun, never outliving a killed job
        cuda = str(device).startswith("cuda")
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
    return torch.device(device)


def _codes_changed_fraction(student, initial_codes: dict[str, torch.Tensor]) -> float:
    """Fraction of all groups whose codes differ from the input checkpoint's."""
    changed = total = 0
    for name, layer in pv_linears(student).items():
        changed += int((pack_codes(layer.codes, layer.nbits).cpu() != initial_codes[name]).any(dim=-1).sum())
        total += layer.codes.shape[0] * layer.codes.shape[1]
    return changed / total


def run(settings: PvtuneSettings, paths: PvtunePaths) -> dict:
    """Run PV-tuning; return the metrics record (outputs written by process 0) with `rank`, this
    process's rank. Leaves the process group (under torchrun) when done."""
    try:
        verify_inputs(paths.model_dir, paths.checkpoint_dir, paths.corpus)
        record = pvtune(settings, paths)
        return record | {"rank": world()[0], "output_dir": str(paths.output_dir)}  # rank: before the group is gone
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def wait_for_card(needed: int, device: torch.device, timeout_seconds: float, rank: int) -> None:
    """Wait (at most `timeout_seconds`) until `device` has `needed` bytes free: on a node whose
    jobs share cards, evaluations holding tens of GiB end within minutes, and loading beside them
    would run out of memory. Each process waits for its own card."""
    gib = 2.0**30
    free_bytes = lambda: torch.cuda.mem_get_info(device)[0]  # noqa: E731
    free = free_bytes()
    if free >= needed or timeout_seconds <= 0:
        return
    print(f"memory (process {rank}): {free / gib:.1f} GiB free on {device}, other processes hold the rest; "
          f"waiting up to {timeout_seconds:.0f} s for {needed / gib:.1f} GiB", flush=True)
    free, waited = wait_for_free_memory(needed, free_bytes, timeout_seconds)
    print(f"memory (process {rank}): {free / gib:.1f} GiB free after {waited:.0f} s"
          + ("" if free >= needed else "; loading anyway"), flush=True)


def plan_memory(settings: PVSettings, paths: PvtunePaths, teacher_bytes: int, device: torch.device, size: int,
                say) -> PVSettings:
    """The loop's settings with `v_state` decided from the memory plan (`pvtune.memory`): the
    V-step's state on the card where one process's share fits it, else in host memory (one
    process); PVMemoryError naming what would fit where nothing does."""
    import psutil

    card_bytes = torch.cuda.get_device_properties(device).total_memory
    v_state, parts = plan_v_state(tensor_headers(paths.checkpoint_dir), tensor_headers(paths.model_dir), teacher_bytes,
                                  settings, size, card_bytes, psutil.virtual_memory().available, str(device))
    listed = ", ".join(f"{name} {value / 2**30:.1f}" for name, value in parts.items())
    say(f"memory: {sum(parts.values()) / 2**30:.1f} GiB of state per process before activations ({listed} GiB) on a "
        f"{card_bytes / 2**30:.1f} GiB card, {size} process(es)", flush=True)
    if v_state == "host":
        say(f"memory: the V-step's straight-through weights and moments and the P-step's Adam moments ("
            f"{host_bytes(tensor_headers(paths.checkpoint_dir), settings) / 2**30:.1f} GiB) live in host memory and "
            f"stream through the card once a step (the card is too small for them)", flush=True)
    return dataclasses.replace(settings, v_state=v_state)


def settings_bytes_on_card(settings: PVSettings, paths: PvtunePaths, teacher_dtype: str, size: int) -> int:
    """One process's state on its card for the decided settings (`memory.state_bytes`)."""
    from aqflow.pvtune.memory import state_bytes

    return sum(state_bytes(tensor_headers(paths.checkpoint_dir), tensor_headers(paths.model_dir),
                           torch_dtype(teacher_dtype).itemsize, settings, size, settings.v_state).values())


def pvtune(options: PvtuneSettings, paths: PvtunePaths) -> dict:
    """PV-tuning; the metrics record (outputs written by process 0)."""
    check_inputs(options, paths)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    timings: dict[str, float] = {}
    started = time.perf_counter()
    device = setup_device(options.device)
    rank, size = world()
    settings = pv_settings(options, paths.model_dir, device)
    torch.manual_seed(settings.seed)
    say = print if rank == 0 else (lambda *a, **k: None)

    phase = time.perf_counter()
    tokenizer = load_tokenizer(paths.model_dir)
    data = pv_windows(paths.corpus, tokenizer, options.num_samples, options.heldout_samples, options.window_tokens,
                      options.heldout_fraction, options.data_seed)
    timings["data_seconds"] = time.perf_counter() - phase
    say(f"data: {data.record['samples']} training windows ({data.record['requested_samples']} asked), "
        f"{data.record['heldout_samples']} held-out windows of {options.window_tokens} tokens "
        f"({timings['data_seconds']:.1f} s)", flush=True)

    phase = time.perf_counter()
    teacher_dtype = options.teacher_dtype if options.teacher_dtype != "auto" else model_compute_dtype(paths.model_dir, device)
    if device.type == "cuda":  # a card too small is named before minutes of loading
        settings = plan_memory(settings, paths, torch_dtype(teacher_dtype).itemsize, device, size, say)
        wait_for_card(settings_bytes_on_card(settings, paths, teacher_dtype, size), device, options.memory_wait_seconds,
                      rank)
    elif settings.v_state == "auto":
        settings = dataclasses.replace(settings, v_state="device")
    teacher = load_teacher(paths.model_dir, device, teacher_dtype)
    student = load_student(paths.checkpoint_dir, device)
    initial_codes = {name: pack_codes(layer.codes, layer.nbits).cpu() for name, layer in pv_linears(student).items()}
    timings["load_seconds"] = time.perf_counter() - phase
    say(f"load: teacher ({teacher_dtype}) and student ({len(initial_codes)} quantized linears) on {device} "
        f"in {timings['load_seconds']:.1f} s", flush=True)

    def report(row: dict) -> None:
        say(f"step {row['step']}: held-out KL {row['kl']:.5f}, perplexity {row['perplexity']:.4f} "
            f"({row['seconds']:.1f} s)", flush=True)

    resumer = None
    if paths.state_dir is not None:
        # where the V-step's state lives changes no step: a state saved with it on the card resumes in host memory
        run_settings = {key: value for key, value in settings_record(settings).items() if key != "v_state"}
        resumer = Resumer(paths.state_dir, options.save_state_every, run_fingerprint(
            run_settings | {"world_size": size}, data.record,
            [paths.model_dir, paths.checkpoint_dir, paths.corpus]))
    result = train(student, teacher, data.train.input_ids, data.heldout.input_ids, settings, device,
                   progress=not options.quiet, on_eval=report, resumer=resumer)
    timings.update(result.timings)
    record = {
        "settings": settings_record(settings) | {"device": str(device), "world_size": size, "teacher_dtype": teacher_dtype},
        "data": data.record,
        "model_dir": str(paths.model_dir),
        "checkpoint_dir": str(paths.checkpoint_dir),
        "steps": result.steps,
        "budget_steps": result.budget_steps,
        "stopped_at_plateau": result.stopped_at_plateau,
        "micro_batch_size_used": result.micro_batch_size,
        "gradient_checkpointing_used": result.gradient_checkpointing,
        "compiled_blocks_used": result.compiled_blocks,
        "state_bytes_per_process": result.state_bytes,
        "best_step": result.best_step,
        "initial_heldout_kl": result.initial_heldout["kl"],
        "best_heldout_kl": result.best_heldout["kl"],
        "initial_heldout_perplexity": result.initial_heldout["perplexity"],
        "best_heldout_perplexity": result.best_heldout["perplexity"],
        "codes_changed_fraction": _codes_changed_fraction(student, initial_codes),
        "peak_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "software": {"torch": torch.__version__, "python": platform.python_version()},
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    # every rank holds the same all-reduced losses, so every rank stops here alike; the log's other
    # columns are NaN by design where a row has no such value (no perplexity on training rows)
    losses = {f"step {row['step']} {row['split']} kl": row["kl"] for row in result.log}
    require_finite({**losses, **{key: value for key, value in record.items() if "heldout" in key}},
                   "pvtune", str(paths.checkpoint_dir))
    if rank == 0:
        import pandas as pd

        phase = time.perf_counter()
        save_student(student, paths.checkpoint_dir, paths.output_dir, {k: record[k] for k in ("settings", "data", "best_step")},
                     result.student_state)
        log = pd.DataFrame(result.log)
        log["selected"] = (log["split"] == "heldout") & (log["step"] == result.best_step)
        artifacts.write_parquet(paths.train_log, log)
        timings["save_seconds"] = time.perf_counter() - phase
        timings["total_seconds"] = time.perf_counter() - started
        record["timings"] = timings
        artifacts.write_json(paths.metrics, record)
        if resumer is not None:
            resumer.finish()
    if size > 1:
        torch.distributed.barrier()
    record.setdefault("timings", timings)
    return record


def summary(record: dict) -> str | None:
    if record["rank"] != 0:
        return None
    phases = ", ".join(f"{key.removesuffix('_seconds')} {value:.1f} s" for key, value in record["timings"].items())
    return (f"held-out KL {record['initial_heldout_kl']:.5f} -> {record['best_heldout_kl']:.5f}, perplexity "
            f"{record['initial_heldout_perplexity']:.4f} -> {record['best_heldout_perplexity']:.4f} (selected step "
            f"{record['best_step']} of {record['steps']}"
            f"{', stopped early: the held-out metric reached a plateau' if record.get('stopped_at_plateau') else ''}), "
            f"{record['codes_changed_fraction']:.2%} of code groups "
            f"changed -> {record['output_dir']}\nwall time: {phases}")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
