"""`python -m aqflow pvtune`: PV-tune a stitched AQLM checkpoint against its full-precision model.

Teacher: --model-dir (the full-precision model). Student: --checkpoint-dir (the AQLM checkpoint
that `stitch` wrote). Loss: token-level KL(teacher || student) on windows of calibration-role
documents of --corpus; a held-out slice of those documents (never the evaluation documents,
never WikiText-2 or C4 evaluation text) scores the student before training, every
--eval-every-steps steps and at the end, and the best held-out state is what is written.

Writes, atomically: --output-dir (a standard AQLM checkpoint again, same layout and dtypes as
the input), --train-log (Parquet: step, epoch, split, kl, perplexity, codes_changed_fraction,
seconds, selected) and --metrics (JSON: settings, data, results, timings per phase).

Several GPUs of one host: `torchrun --nproc-per-node N -m aqflow pvtune ...` averages gradients
over the processes (each takes its share of every batch); process 0 writes the outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import fields
from pathlib import Path

import torch

from aqflow import artifacts
from aqflow.finite import require_finite
from aqflow.models.fetch import load_tokenizer, model_compute_dtype
from aqflow.pvtune.data import pv_windows
from aqflow.pvtune.resume import Resumer, run_fingerprint
from aqflow.pvtune.student import StudentError, load_student, load_teacher, pv_linears, save_student
from aqflow.pvtune.train import SELECTION_METRICS, PVSettings, settings_record, train, world
from aqflow.quant.representation import pack_codes
from aqflow.artifacts import verify_inputs
from aqflow.processes import die_with_parent
from aqflow.stage_errors import EXPECTED_ERRORS, report as report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqflow pvtune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    io = parser.add_argument_group("inputs and outputs")
    io.add_argument("--model-dir", required=True, type=Path, help="full-precision model folder (the teacher)")
    io.add_argument("--checkpoint-dir", required=True, type=Path, help="AQLM checkpoint folder (the student)")
    io.add_argument("--corpus", required=True, type=Path, help="split corpus .parquet (fetch-data); its calibration documents are used")
    io.add_argument("--output-dir", required=True, type=Path, help="PV-tuned AQLM checkpoint folder to write")
    io.add_argument("--train-log", required=True, type=Path, help="training log .parquet to write")
    io.add_argument("--metrics", required=True, type=Path, help="metrics .json to write")
    io.add_argument("--state-dir", type=Path, default=None,
                    help="folder for the loop's full state, saved every --save-state-every steps; a run finding "
                         "a state of the same settings and inputs there resumes from it (removed when done)")
    io.add_argument("--save-state-every", type=int, default=25, help="steps between saved states (0: never)")
    data = parser.add_argument_group("data")
    data.add_argument("--num-samples", type=int, default=10000, help="training windows (all there are, if fewer)")
    data.add_argument("--heldout-samples", type=int, default=128, help="held-out windows (all there are, if fewer)")
    data.add_argument("--window-tokens", type=int, default=4096)
    data.add_argument("--heldout-fraction", type=float, default=0.1, help="calibration documents held out for selection")
    data.add_argument("--data-seed", type=int, default=0)
    loop = parser.add_argument_group("training (defaults: the paper / AQLM recipe)")
    for spec in fields(PVSettings):
        if spec.name in ("amp_dtype",):
            continue
        flag = "--" + spec.name.replace("_", "-")
        if spec.name == "selection_metric":
            loop.add_argument(flag, choices=SELECTION_METRICS, default=spec.default,
                              help="held-out metric that selects the state written out")
        elif spec.type in ("bool", bool):
            loop.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default)
        elif spec.name == "max_steps":
            loop.add_argument(flag, type=int, default=None, help="stop after this many steps (default: all epochs)")
        else:
            kind = {"int": int, "float": float}[spec.type if isinstance(spec.type, str) else spec.type.__name__]
            loop.add_argument(flag, type=kind, default=spec.default)
    run = parser.add_argument_group("run")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                     help="cpu, cuda or cuda:N (under torchrun: each process takes cuda:LOCAL_RANK)")
    run.add_argument("--amp-dtype", choices=("auto", "none", "bfloat16", "float16"), default="auto",
                     help="autocast dtype of the forward passes (auto: none on CPU or for a float32 model, else bfloat16)")
    run.add_argument("--teacher-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                     help="teacher weights (auto: the model folder's dtype on GPU, float32 on CPU)")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_inputs(args: argparse.Namespace) -> None:
    """Raise naming the first bad input, before anything is loaded."""
    _require((args.model_dir / "config.json").is_file(), f"--model-dir: {args.model_dir} has no config.json")
    _require((args.checkpoint_dir / "config.json").is_file(), f"--checkpoint-dir: {args.checkpoint_dir} has no config.json")
    _require(args.corpus.is_file(), f"--corpus: {args.corpus} does not exist")
    _require(args.num_samples >= 1 and args.heldout_samples >= 1, "--num-samples and --heldout-samples must be >= 1")
    _require(args.window_tokens >= 2, f"--window-tokens must be >= 2, got {args.window_tokens}")
    _require(args.save_state_every >= 0, f"--save-state-every must be >= 0, got {args.save_state_every}")
    _require(not str(args.device).startswith("cuda") or torch.cuda.is_available(), f"--device {args.device}: CUDA is not available")


def auto_amp_dtype(model_dtype: str) -> str:
    """The student's autocast dtype for a model computing in `model_dtype`: none for float32 (CPU
    runs, float32 models), else bfloat16. A float16 model trains under bfloat16 autocast too:
    float16's range overflows in some models and, with no loss scaling here, underflows gradients."""
    return "none" if model_dtype == "float32" else "bfloat16"


def pv_settings(args: argparse.Namespace, device: torch.device) -> PVSettings:
    values = {spec.name: getattr(args, spec.name) for spec in fields(PVSettings) if spec.name != "amp_dtype"}
    amp = args.amp_dtype if args.amp_dtype != "auto" else auto_amp_dtype(model_compute_dtype(args.model_dir, device))
    return PVSettings(**values, amp_dtype=None if amp == "none" else amp)


def setup_device(args: argparse.Namespace) -> torch.device:
    """The process's device; under torchrun also joins the process group (nccl on GPU, gloo on CPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        die_with_parent()  # a torchrun worker dies with torchrun, never outliving a killed job
        cuda = str(args.device).startswith("cuda")
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
    return torch.device(args.device)


def _codes_changed_fraction(student, initial_codes: dict[str, torch.Tensor]) -> float:
    """Fraction of all groups whose codes differ from the input checkpoint's."""
    changed = total = 0
    for name, layer in pv_linears(student).items():
        changed += int((pack_codes(layer.codes, layer.nbits).cpu() != initial_codes[name]).any(dim=-1).sum())
        total += layer.codes.shape[0] * layer.codes.shape[1]
    return changed / total


def pvtune(args: argparse.Namespace) -> dict:
    """Run PV-tuning; return the metrics record (outputs written by process 0)."""
    check_inputs(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    timings: dict[str, float] = {}
    started = time.perf_counter()
    device = setup_device(args)
    rank, size = world()
    settings = pv_settings(args, device)
    torch.manual_seed(settings.seed)
    say = print if rank == 0 else (lambda *a, **k: None)

    phase = time.perf_counter()
    tokenizer = load_tokenizer(args.model_dir)
    data = pv_windows(args.corpus, tokenizer, args.num_samples, args.heldout_samples, args.window_tokens,
                      args.heldout_fraction, args.data_seed)
    timings["data_seconds"] = time.perf_counter() - phase
    say(f"data: {data.record['samples']} training windows ({data.record['requested_samples']} asked), "
        f"{data.record['heldout_samples']} held-out windows of {args.window_tokens} tokens "
        f"({timings['data_seconds']:.1f} s)", flush=True)

    phase = time.perf_counter()
    teacher_dtype = args.teacher_dtype if args.teacher_dtype != "auto" else model_compute_dtype(args.model_dir, device)
    teacher = load_teacher(args.model_dir, device, teacher_dtype)
    student = load_student(args.checkpoint_dir, device)
    initial_codes = {name: pack_codes(layer.codes, layer.nbits).cpu() for name, layer in pv_linears(student).items()}
    timings["load_seconds"] = time.perf_counter() - phase
    say(f"load: teacher ({teacher_dtype}) and student ({len(initial_codes)} quantized linears) on {device} "
        f"in {timings['load_seconds']:.1f} s", flush=True)

    def report(row: dict) -> None:
        say(f"step {row['step']}: held-out KL {row['kl']:.5f}, perplexity {row['perplexity']:.4f} "
            f"({row['seconds']:.1f} s)", flush=True)

    resumer = None
    if args.state_dir is not None:
        resumer = Resumer(args.state_dir, args.save_state_every, run_fingerprint(
            settings_record(settings) | {"world_size": size}, data.record,
            [args.model_dir, args.checkpoint_dir, args.corpus]))
    result = train(student, teacher, data.train.input_ids, data.heldout.input_ids, settings, device,
                   progress=not args.quiet, on_eval=report, resumer=resumer)
    timings.update(result.timings)
    record = {
        "settings": settings_record(settings) | {"device": str(device), "world_size": size, "teacher_dtype": teacher_dtype},
        "data": data.record,
        "model_dir": str(args.model_dir),
        "checkpoint_dir": str(args.checkpoint_dir),
        "steps": result.steps,
        "micro_batch_size_used": result.micro_batch_size,
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
                   "pvtune", str(args.checkpoint_dir))
    if rank == 0:
        import pandas as pd

        phase = time.perf_counter()
        save_student(student, args.checkpoint_dir, args.output_dir, {k: record[k] for k in ("settings", "data", "best_step")})
        log = pd.DataFrame(result.log)
        log["selected"] = (log["split"] == "heldout") & (log["step"] == result.best_step)
        artifacts.write_parquet(args.train_log, log)
        timings["save_seconds"] = time.perf_counter() - phase
        timings["total_seconds"] = time.perf_counter() - started
        record["timings"] = timings
        artifacts.write_json(args.metrics, record)
        if resumer is not None:
            resumer.finish()
    if size > 1:
        torch.distributed.barrier()
    record.setdefault("timings", timings)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        verify_inputs(args.model_dir, args.checkpoint_dir, args.corpus)
        record = pvtune(args)
        rank = world()[0]  # before the process group is gone
    except (*EXPECTED_ERRORS, StudentError, KeyError, ValueError) as error:
        return report_error("pvtune", error)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if rank == 0:
        phases = ", ".join(f"{key.removesuffix('_seconds')} {value:.1f} s" for key, value in record["timings"].items())
        print(f"held-out KL {record['initial_heldout_kl']:.5f} -> {record['best_heldout_kl']:.5f}, perplexity "
              f"{record['initial_heldout_perplexity']:.4f} -> {record['best_heldout_perplexity']:.4f} (selected step {record['best_step']} of {record['steps']}), {record['codes_changed_fraction']:.2%} of code "
              f"groups changed -> {args.output_dir}\nwall time: {phases}")
    return 0
