"""PV-tuning throughput: one code against another on the same card in one call, several cards of
a node, and the figures of pv_scale_<card>.json and node_<cards>x<card>.json.

    # before = another copy of the source tree (e.g. `git archive 65c68e1 src`), after = this one
    PYTHONPATH=src python3 benchmarks/throughput.py pv --shape llama3b --before before/src --after src \\
        --work /root/tp --out $OUT/pv_llama3b.json --run 32 3 32 3 [--profile] [--processes N]
    PYTHONPATH=src python3 benchmarks/throughput.py scale --pv3b pv_llama3b.json [--pv8b pv_llama8b.json] \\
        --out benchmarks/results/pv_scale_h100.json
    PYTHONPATH=src python3 benchmarks/throughput.py node pv_llama3b_x1.json pv_llama3b_x4.json \\
        --pv8b pv_llama8b_x2.json --out benchmarks/results    (benchmarks/throughput_node.sh runs it all)

Every run of a shape shares its inputs: a random bf16 teacher, its 2x8 AQLM student (one pass of
residual nearest-codeword assignment, so it starts near its teacher) and a corpus of random words;
each run is `python -m aqflow pvtune` from its own source tree with the same data, seed and steps.
Tokens/s is the median of the steps that neither come first nor follow a held-out evaluation; the
paper's budget (1,563 steps of 32 windows, 157 evaluations of 128 windows) is projected from them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from synthetic_models import random_teacher
from synthetic_text import synthetic_corpus

PAPER_PV_STEPS = 1563  # 10,000 windows x 5 epochs / 32 a step
PAPER_PV_EVALUATIONS = 157  # one before training, one every 10 steps and one after the last
PAPER_HELDOUT_WINDOWS = 128  # config.yaml's heldout_samples
# dense bf16 peak of a card (NVIDIA's figure without sparsity), for the model FLOP utilisation
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                    num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "smoke": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),  # checks this script on a CPU
}
# steps of the measured run per shape: (batch windows, steps, held-out windows, eval every)
# llama8b: the paper's batch of 32 windows, one held-out evaluation before the timed steps (the
# headline's 8B PV step: benchmarks/headline_results.py --synthetic-pv)
RUNS = {"smollm2": (32, 8, 16, 4), "llama3b": (8, 6, 4, 3), "llama8b": (32, 4, 32, 1000), "smoke": (4, 4, 2, 2)}
# documents x words of the random corpus; llama8b's holds 128 training and 32 held-out windows of 4096
CORPUS = {"smollm2": (48, 40_000), "llama3b": (48, 40_000), "llama8b": (200, 20_000), "smoke": (48, 2000)}
WINDOW_TOKENS = {"smoke": 64}


# --- inputs --------------------------------------------------------------------------------------

@torch.no_grad()
def nearest_codeword_codes(weight: torch.Tensor, num_codebooks: int, nbits: int, generator: torch.Generator):
    """One pass of residual quantization: codebook m = 2^nbits groups of the current residual drawn
    at random, codes = each group's nearest codeword. weight [out, in] -> codes [out, in/8, M] int64,
    codebooks [M, K, 8] float32."""
    groups = weight.float().reshape(-1, 8)
    residual = groups.clone()
    codes, codebooks = [], []
    for _ in range(num_codebooks):
        picks = torch.randint(0, groups.shape[0], (1 << nbits,), generator=generator).to(weight.device)
        codebook = residual[picks].clone()  # [K, 8]
        chosen = torch.empty(groups.shape[0], dtype=torch.int64, device=weight.device)
        for start in range(0, groups.shape[0], 1 << 20):
            part = residual[start:start + (1 << 20)]
            distance = (codebook * codebook).sum(-1)[None, :] - 2 * part @ codebook.T  # ||c||² - 2<x, c>
            chosen[start:start + (1 << 20)] = distance.argmin(-1)
        residual -= codebook[chosen]
        codes.append(chosen)
        codebooks.append(codebook)
    return torch.stack(codes, -1).reshape(weight.shape[0], weight.shape[1] // 8, num_codebooks), torch.stack(codebooks)


def build_student(teacher: Path, root: Path, device: str) -> Path:
    """The teacher's 2x8-bit AQLM checkpoint (`nearest_codeword_codes`), stitched by the pipeline."""
    from aqflow.io import artifacts
    from aqflow import checkpoint
    from aqflow.models.folder import read_tensors
    from aqflow.models.structure import meta_model
    from aqflow.quant.representation import pack_codes

    layers = root / "layers"
    layers.mkdir(parents=True, exist_ok=True)
    tensors = read_tensors(teacher)
    generator = torch.Generator().manual_seed(0)
    for name in checkpoint.quantized_linear_names(meta_model(teacher)):
        codes, codebooks = nearest_codeword_codes(tensors[f"{name}.weight"].to(device), 2, 8, generator)
        # the pipeline's writer: the layer files carry the checksums stitch verifies
        artifacts.save_safetensors(checkpoint.layer_artifact_path(layers, name), {
            "codes": pack_codes(codes, 8).cpu(), "codebooks": codebooks[:, :, None, :].half().cpu(),
            "scales": torch.ones(codes.shape[0], 1, 1, 1, dtype=torch.float16)})
    return checkpoint.write_aqlm_checkpoint(teacher, layers, root / "aqlm", num_codebooks=2, nbits=8, dtype="float16")


def forward_flops_per_token(shape: dict, window_tokens: int) -> float:
    """Matmul FLOPs of one token's forward pass through a Llama of `shape` in a causal window of
    `window_tokens`: 2 per weight of every linear and the head, and the attention's scores and
    weighted sum over the (on average) window_tokens / 2 positions before it."""
    width, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", width // heads)
    block = (width * heads * head_dim * 2 + width * kv_heads * head_dim * 2 + 3 * width * shape["intermediate_size"])
    attention = 2 * 2 * heads * head_dim * window_tokens / 2
    return shape["num_hidden_layers"] * (2 * block + attention) + 2 * shape["vocab_size"] * width


def pv_flops_per_token(shape: dict, window_tokens: int) -> float:
    """Model FLOPs of one PV-tuning token, recomputation not counted: the teacher's forward pass,
    the student's forward pass and its backward pass (twice a forward: dL/dx and dL/dW)."""
    return 4 * forward_flops_per_token(shape, window_tokens)


def peak_flops(device_name: str) -> float | None:
    return next((peak for card, peak in PEAK_BF16_FLOPS.items() if card in device_name), None)


def evaluation_seconds(log: pd.DataFrame) -> list[float]:
    """Duration of each held-out evaluation, in order (the first, before training, counted from
    the loop's start; each later one from the training step before it)."""
    rows = log.sort_values(["seconds"]).to_dict("records")
    durations, previous = [], 0.0
    for row in rows:
        if row["split"] == "heldout":
            durations.append(row["seconds"] - previous)
        previous = row["seconds"]
    return durations


def paper_hours(step_seconds: float, evaluations: list[float], heldout_windows: int) -> float:
    """The paper's PV budget at a measured step and held-out evaluation time: the first evaluation
    as measured, every later one as the last measured (the teacher's held-out states are kept after
    the first, where the code does), both scaled from `heldout_windows` to the paper's 128."""
    scale = PAPER_HELDOUT_WINDOWS / heldout_windows
    later = evaluations[-1] if len(evaluations) > 1 else evaluations[0]
    return (PAPER_PV_STEPS * step_seconds + scale * (evaluations[0] + (PAPER_PV_EVALUATIONS - 1) * later)) / 3600


# --- one variant ---------------------------------------------------------------------------------

def steady_step_seconds(log: pd.DataFrame) -> list[float]:
    """Durations of training steps that neither come first nor follow a held-out evaluation."""
    rows = log.sort_values(["seconds"]).to_dict("records")
    durations = []
    for previous, row in zip(rows, rows[1:]):
        if row["split"] == "train" and previous["split"] == "train":
            durations.append(row["seconds"] - previous["seconds"])
    return durations


def run_variant(label: str, source: Path, inputs: dict, shape_name: str, work: Path, extra: list[str],
                device: str, run: tuple[int, int, int, int], processes: int = 1) -> dict:
    batch, steps, heldout, every = run
    tokens = WINDOW_TOKENS.get(shape_name, 4096)
    out = work / label
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source.resolve()), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command = [*launcher, "-m", "aqflow", "pvtune", "--model-dir", str(inputs["teacher"]),
               "--checkpoint-dir", str(inputs["student"]), "--corpus", str(inputs["corpus"]),
               "--num-samples", str(batch * steps), "--heldout-samples", str(heldout), "--window-tokens", str(tokens),
               "--batch-size", str(batch), "--epochs", "1", "--max-steps", str(steps), "--eval-every-steps", str(every),
               "--device", device, "--quiet", "--output-dir", str(out / "model"), "--train-log", str(out / "train_log.parquet"),
               "--metrics", str(out / "pvtune.json"), *extra]  # the pvtune rule's names: `out` reads as a pv/ folder
    out.mkdir(parents=True, exist_ok=True)  # the whole output, for a run that fails (an out-of-memory's place)
    started = time.perf_counter()
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
        _, status, usage = os.wait4(process.pid, 0)  # its own peak resident memory, not its siblings'
    wall = time.perf_counter() - started
    host_rss_gib = usage.ru_maxrss * 1024 / 2**30  # Linux reports KiB
    print((out / "stdout.log").read_text()[-1500:], flush=True)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{label} failed:\n{(out / 'stderr.log').read_text()[-4000:]}")
    record = json.loads((out / "pvtune.json").read_text())
    log = pd.read_parquet(out / "train_log.parquet")
    durations = steady_step_seconds(log)
    heldout_rows = log[log["split"] == "heldout"]
    step_seconds = float(np.median(durations))
    evaluations = evaluation_seconds(log)
    model_flops = pv_flops_per_token(SHAPES[shape_name], tokens) * batch * tokens / step_seconds
    return {
        "source": str(source), "extra_flags": extra, "wall_seconds": wall, "processes": processes,
        "host_rss_gib": host_rss_gib, "step_seconds": step_seconds, "heldout_evaluation_seconds": evaluations,
        "heldout_windows": record["data"]["heldout_samples"],
        "paper_pv_hours_projected": paper_hours(step_seconds, evaluations, record["data"]["heldout_samples"]),
        "model_flops_per_second": model_flops,
        "model_flop_utilisation": model_flops / processes / peak_flops(record.get("device_name", "")) if peak_flops(
            record.get("device_name", "")) else None,
        "gradient_checkpointing_used": record.get("gradient_checkpointing_used", record["settings"].get(
            "gradient_checkpointing")),
        "v_state": record["settings"].get("v_state", "device"),
        "compiled_blocks": record.get("compiled_blocks_used", False),
        "state_bytes_per_process": record.get("state_bytes_per_process"),
        "device_name": record.get("device_name"),
        "batch_windows, steps, heldout_windows, eval_every": run,
        "micro_batch_size": record.get("micro_batch_size_used", record["settings"]["micro_batch_size"]),
        "peak_memory_allocated_gib": record.get("peak_memory_allocated_gib"),
        "steady_step_seconds": durations,
        "tokens_per_s": batch * tokens / float(np.median(durations)),
        "heldout_kl": dict(zip(heldout_rows["step"].astype(int).tolist(), heldout_rows["kl"].tolist())),
        "train_kl": log[log["split"] == "train"]["kl"].tolist(),
        "codes_changed_fraction": record["codes_changed_fraction"],
        "timings": record["timings"],
    }


def profile_in_process(inputs: dict, shape_name: str, rows: int = 25) -> str:
    """Two PV steps of whatever aqflow is importable, under torch.profiler; the top CUDA ops."""
    from torch.profiler import ProfilerActivity, profile

    from aqflow.models.fetch import load_tokenizer
    from aqflow.pvtune.data import pv_windows
    from aqflow.pvtune.student import load_student, load_teacher
    from aqflow.pvtune.train import PVSettings, train

    batch, _, _, _ = RUNS[shape_name]
    data = pv_windows(inputs["corpus"], load_tokenizer(inputs["teacher"]), 2 * batch, 1, 4096, 0.1, 0)
    teacher = load_teacher(inputs["teacher"], "cuda", "bfloat16")
    student = load_student(inputs["student"], "cuda")
    settings = PVSettings(batch_size=batch, epochs=1, max_steps=2, eval_every_steps=100, amp_dtype="bfloat16")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train(student, teacher, data.train.input_ids, data.heldout.input_ids, settings, "cuda", progress=False)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


# --- commands ------------------------------------------------------------------------------------

def command_pv(args: argparse.Namespace) -> int:
    shape = SHAPES[args.shape]
    work = args.work / args.shape
    started = time.perf_counter()
    if args.reuse and (work / "aqlm").is_dir() and (work / "corpus.parquet").is_file():
        inputs = {"teacher": work / "teacher", "student": work / "aqlm", "corpus": work / "corpus.parquet"}
    else:
        teacher = random_teacher(work / "teacher", shape, args.device)
        inputs = {"teacher": teacher, "student": build_student(teacher, work, args.device), "corpus": synthetic_corpus(
            work / "corpus.parquet", *CORPUS[args.shape])}
    if args.prepare_only:  # e.g. on the CPUs while another run has the card; a later --reuse runs it
        print(f"inputs ready in {time.perf_counter() - started:.0f} s: {inputs}", flush=True)
        return 0
    if args.device == "cuda":  # the pvtune processes get the card; this one keeps only its context
        torch.cuda.empty_cache()
    run = tuple(args.run) if args.run else RUNS[args.shape]
    report = {"shape_name": args.shape, "shape": shape,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "cards": torch.cuda.device_count() if args.device == "cuda" else 0,
              "batch_windows, steps, heldout_windows, eval_every": run,
              "prepare_seconds": time.perf_counter() - started}
    print(f"inputs ready in {report['prepare_seconds']:.0f} s", flush=True)
    for label, source, extra in (("before", args.before, args.before_flags), ("after", args.after, args.after_flags)):
        if label in args.variants:
            report[label] = run_variant(label, source, inputs, args.shape, work, extra, args.device, run,
                                        args.processes)
            args.out.write_text(json.dumps(report, indent=2))
    if args.profile:
        text = profile_in_process(inputs, args.shape)
        (args.out.with_suffix(".profile.txt")).write_text(text)
        print(text[-6000:])
    print_pv(report)
    return 0


def print_pv(report: dict) -> None:
    """One line per variant run, and the held-out KL of each at every evaluation."""
    for label in ("before", "after"):
        if label in report:
            row = report[label]
            print(f"{report['shape_name']} {label} on {report['device']} x{row['processes']}: {row['tokens_per_s']:.0f} "
                  f"tokens/s, micro-batch {row['micro_batch_size']}, peak GiB {row['peak_memory_allocated_gib']}, "
                  f"held-out KL {row['heldout_kl']}")


def shape_headers(shape: dict, num_codebooks: int = 2, nbits: int = 8, group_size: int = 8) -> tuple[dict, dict]:
    """(student, teacher) safetensors headers of a Llama of `shape` and its AQLM checkpoint, as
    `aqflow.pvtune.memory` reads them (nothing is built)."""
    from aqflow.models.folder import TensorHeader
    from headline_kit import tensor_shapes  # the checkpoint's tensors, as the headline's kit writes them

    student, teacher = {}, {}
    for name, size in tensor_shapes(shape).items():
        teacher[name] = TensorHeader("BF16", size)
        if not name.endswith("_proj.weight"):
            student[name] = teacher[name]
            continue
        prefix, (out, inp) = name.removesuffix(".weight"), size
        student[f"{prefix}.codes"] = TensorHeader("U8", (out, inp // group_size, num_codebooks))
        student[f"{prefix}.codebooks"] = TensorHeader("F16", (num_codebooks, 1 << nbits, 1, group_size))
        student[f"{prefix}.scales"] = TensorHeader("F16", (out, 1, 1, 1))
    return student, teacher


def memory_plan(shape_name: str, cards: int, card_bytes: int) -> dict:
    """One process's state on its card (GiB per part) for PV-tuning `shape_name` at config.yaml's
    settings over `cards` processes, and whether it fits `card_bytes`."""
    from aqflow.pvtune.memory import state_bytes
    from aqflow.pvtune.train import PVSettings

    student, teacher = shape_headers(SHAPES[shape_name])
    parts = state_bytes(student, teacher, 2, PVSettings(), cards, "device")
    return {"cards": cards, "card_gib": card_bytes / 2**30, "parts_gib": {k: v / 2**30 for k, v in parts.items()},
            "total_gib": sum(parts.values()) / 2**30, "fits": sum(parts.values()) <= card_bytes}


def kl_deviation(row: dict, reference: dict) -> float:
    """Largest relative difference of two runs' held-out KL over the steps both evaluated."""
    steps = set(row["heldout_kl"]) & set(reference["heldout_kl"])
    return max(abs(row["heldout_kl"][s] - reference["heldout_kl"][s]) / reference["heldout_kl"][s] for s in steps)


def command_scale(args: argparse.Namespace) -> int:
    """pv_scale_<card>.json from a 3B report (before and after) and an 8B report (after, one card),
    and optionally a later after-only 3B report of newer code (`latest_3b`)."""
    three, eight = json.loads(args.pv3b.read_text()), json.loads(args.pv8b.read_text()) if args.pv8b else None
    before, after = three["before"], three["after"]
    for row in (before, after):  # the projection at the paper's 128 held-out windows, whatever was measured
        windows = row.get("heldout_windows") or three["batch_windows, steps, heldout_windows, eval_every"][2]
        row["paper_pv_hours_projected"] = paper_hours(row["step_seconds"], row["heldout_evaluation_seconds"], windows)
    deviation = kl_deviation(after, before)
    card_bytes = int(args.card_gib * 2**30)
    baseline = args.baseline_tokens or before["tokens_per_s"]
    report = {
        "card": three["device"], "shape_3b": "llama3b", "batch_windows, steps, heldout_windows, eval_every":
            three["batch_windows, steps, heldout_windows, eval_every"],
        "tokens_per_second_3b": after["tokens_per_s"], "tokens_per_second_3b_before": before["tokens_per_s"],
        "speedup_3b": after["tokens_per_s"] / before["tokens_per_s"],
        "step_seconds_3b": after["step_seconds"], "step_seconds_3b_before": before["step_seconds"],
        "heldout_evaluation_seconds_3b": after["heldout_evaluation_seconds"],
        "heldout_evaluation_seconds_3b_before": before["heldout_evaluation_seconds"],
        "paper_pv_hours_projected_3b": after["paper_pv_hours_projected"],
        "paper_pv_hours_projected_3b_before": before["paper_pv_hours_projected"],
        "model_flop_utilisation_3b": after["model_flop_utilisation"],
        "model_flop_utilisation_3b_before": before["model_flop_utilisation"],
        "heldout_kl_3b": after["heldout_kl"], "heldout_kl_3b_before": before["heldout_kl"],
        "heldout_kl_3b_largest_relative_deviation": deviation,
        "micro_batch_size_3b": after["micro_batch_size"], "micro_batch_size_3b_before": before["micro_batch_size"],
        "gradient_checkpointing_3b": after["gradient_checkpointing_used"],
        "peak_gib_3b": after["peak_memory_allocated_gib"], "peak_gib_3b_before": before["peak_memory_allocated_gib"],
        "memory_plan_8b": {f"{cards}x{args.card_gib:.0f}gib": memory_plan("llama8b", cards, card_bytes)
                           for cards in (1, 2, 4)},
        # the target is 1.5x the figure it was filed with; without one, the same call's before
        "tokens_per_second_3b_baseline": baseline,
        "speedup_3b_over_baseline": after["tokens_per_s"] / baseline,
        "targets": {"tokens_per_second_3b_at_least_1.5x": after["tokens_per_s"] >= 1.5 * baseline,
                    "paper_pv_hours_3b_at_most_5": after["paper_pv_hours_projected"] <= 5.0,
                    "heldout_kl_within_1_percent": deviation <= 0.01},
        "commands": args.commands,
        "date": time.strftime("%Y-%m-%d"), "commit": args.commit,
    }
    if args.latest_3b is not None:  # a later after-only run of newer code (no same-call before)
        later = json.loads(args.latest_3b.read_text())
        row = later["after"]
        row["paper_pv_hours_projected"] = paper_hours(row["step_seconds"], row["heldout_evaluation_seconds"],
                                                      row["heldout_windows"])
        drift = kl_deviation(row, before)
        report["latest_3b"] = {
            "file": args.latest_3b.name, "card": later["device"], "tokens_per_second": row["tokens_per_s"],
            "speedup_over_baseline": row["tokens_per_s"] / baseline, "step_seconds": row["step_seconds"],
            "heldout_evaluation_seconds": row["heldout_evaluation_seconds"],
            "paper_pv_hours_projected": row["paper_pv_hours_projected"],
            "model_flop_utilisation": row["model_flop_utilisation"], "peak_gib": row["peak_memory_allocated_gib"],
            "heldout_kl": row["heldout_kl"], "heldout_kl_largest_relative_deviation_from_before": drift}
        report["targets"].update({"tokens_per_second_3b_at_least_1.5x": row["tokens_per_s"] >= 1.5 * baseline,
                                  "paper_pv_hours_3b_at_most_5": row["paper_pv_hours_projected"] <= 5.0,
                                  "heldout_kl_within_1_percent": max(deviation, drift) <= 0.01})
    if eight is not None:
        row = eight["after"]
        report.update({"pv_step_seconds_8b_one_card": row["step_seconds"],
                       "peak_gib_8b_one_card": row["peak_memory_allocated_gib"], "card_8b": eight["device"],
                       "v_state_8b": row["v_state"], "micro_batch_size_8b": row["micro_batch_size"],
                       "host_rss_gib_8b": row.get("host_rss_gib"), "heldout_kl_8b": row["heldout_kl"],
                       "batch_windows_8b": eight["batch_windows, steps, heldout_windows, eval_every"][0]})
        report["targets"]["8b_steps_on_one_80gb_card"] = bool(row["steady_step_seconds"]) and "H100" in eight["device"]
    args.out.write_text(json.dumps(report, indent=2))
    print(f"card: {report['card']}")
    print(f"{'figure':44s} {'before':>10s} {'after':>10s}")
    for label, key in (("3B tokens/s (paper batch)", "tokens_per_second_3b"), ("3B step s", "step_seconds_3b"),
                       ("3B paper budget, h (projected)", "paper_pv_hours_projected_3b"),
                       ("3B model FLOP utilisation", "model_flop_utilisation_3b"), ("3B peak GiB", "peak_gib_3b")):
        shown = ["-" if value is None else f"{value:10.3f}" for value in (report.get(f"{key}_before"), report.get(key))]
        print(f"{label:44s} {shown[0]:>10s} {shown[1]:>10s}")
    print(f"3B held-out KL, largest relative deviation: {deviation:.4f}")
    if "latest_3b" in report:
        latest = report["latest_3b"]
        print(f"3B latest ({latest['file']}, {latest['card']}): {latest['tokens_per_second']:.0f} tokens/s, "
              f"{latest['speedup_over_baseline']:.2f}x the baseline, {latest['paper_pv_hours_projected']:.2f} h "
              f"projected, held-out KL within {latest['heldout_kl_largest_relative_deviation_from_before']:.4f} of before")
    if eight is not None:
        print(f"8B on one card ({report['card_8b']}, V-step state {report['v_state_8b']}): "
              f"{report['pv_step_seconds_8b_one_card']:.1f} s a step of {report['batch_windows_8b']} windows, "
              f"peak {report['peak_gib_8b_one_card']} GiB, host RSS {report['host_rss_gib_8b']:.1f} GiB")
    for name, plan in report["memory_plan_8b"].items():
        print(f"8B memory plan {name}: {plan['total_gib']:.1f} GiB per process, fits: {plan['fits']}")
    print("targets:", report["targets"])
    return 0


def command_node(args: argparse.Namespace) -> int:
    """node_<cards>x<card>.json from after-only 3B reports at several process counts (one of them
    1) and an 8B report over several cards."""
    runs = {}
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        runs[report["after"]["processes"]] = report
    if 1 not in runs:
        raise SystemExit("node: one of the 3B reports must be of one process (the scaling's baseline)")
    one = runs[1]["after"]["tokens_per_s"]
    cards = max(runs)
    card = runs[cards]["device"]
    rows = {str(n): {"tokens_per_second": r["after"]["tokens_per_s"], "tokens_per_second_per_card":
                     r["after"]["tokens_per_s"] / n, "scaling_efficiency": r["after"]["tokens_per_s"] / (n * one),
                     "step_seconds": r["after"]["step_seconds"], "paper_pv_hours_projected": paper_hours(
                         r["after"]["step_seconds"], r["after"]["heldout_evaluation_seconds"],
                         r["after"].get("heldout_windows") or r["batch_windows, steps, heldout_windows, eval_every"][2]),
                     "peak_gib_per_card": r["after"]["peak_memory_allocated_gib"],
                     "micro_batch_size": r["after"]["micro_batch_size"]} for n, r in sorted(runs.items())}
    node = {"cards": cards, "card": card, "date": time.strftime("%Y-%m-%d"), "pv_3b": rows,
            "pv_3b_paper_hours_projected": rows[str(cards)]["paper_pv_hours_projected"],
            "pv_3b_scaling_efficiency": rows[str(cards)]["scaling_efficiency"],
            "targets": {"pv_3b_paper_hours_at_most_1.5_on_4_cards": cards >= 4 and rows[str(cards)][
                "paper_pv_hours_projected"] <= 1.5}}
    if args.pv8b:
        eight = json.loads(args.pv8b.read_text())["after"]
        node.update({"pv_8b_cards": eight["processes"], "pv_8b_step_seconds": eight["step_seconds"],
                     "pv_8b_peak_gib": eight["peak_memory_allocated_gib"], "pv_8b_v_state": eight["v_state"]})
    name = f"node_{cards}x{card.split()[1].lower() if len(card.split()) > 1 else card.lower()}.json"
    (args.out / name).write_text(json.dumps(node, indent=2))
    print(f"{'processes':>9s} {'tokens/s':>10s} {'per card':>9s} {'efficiency':>10s} {'paper h':>8s} {'peak GiB':>9s}")
    for n, row in rows.items():
        peak = row["peak_gib_per_card"]
        print(f"{n:>9s} {row['tokens_per_second']:10.0f} {row['tokens_per_second_per_card']:9.0f} "
              f"{row['scaling_efficiency']:10.2f} {row['paper_pv_hours_projected']:8.2f} "
              f"{'-' if peak is None else f'{peak:9.1f}':>9s}")
    if args.pv8b:
        print(f"8B over {node['pv_8b_cards']} cards: {node['pv_8b_step_seconds']:.1f} s a step, peak {node['pv_8b_peak_gib']} GiB")
    print(f"-> {args.out / name}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pv = commands.add_parser("pv", help="PV-tuning before/after at one shape")
    pv.add_argument("--shape", choices=sorted(SHAPES), required=True)
    pv.add_argument("--before", type=Path, required=True, help="source tree (the folder holding aqflow/) of the old code")
    pv.add_argument("--after", type=Path, required=True, help="source tree of the new code")
    pv.add_argument("--before-flags", type=str.split, default=[], help="extra pvtune flags, one string")
    pv.add_argument("--after-flags", type=str.split, default=[], help="extra pvtune flags, one string")
    pv.add_argument("--work", type=Path, required=True)
    pv.add_argument("--out", type=Path, required=True)
    pv.add_argument("--profile", action="store_true", help="also print a torch.profiler table of the new code")
    pv.add_argument("--device", default="cuda", help="cuda; cpu only for --shape smoke")
    pv.add_argument("--reuse", action="store_true", help="use the inputs an earlier run left in --work")
    pv.add_argument("--prepare-only", action="store_true", help="build the inputs (on --device) and stop")
    pv.add_argument("--variants", nargs="+", default=["before", "after"], choices=["before", "after"])
    pv.add_argument("--processes", type=int, default=1, help="torchrun processes (one per GPU)")
    pv.add_argument("--run", type=int, nargs=4, metavar=("BATCH", "STEPS", "HELDOUT", "EVAL_EVERY"),
                    help="override the shape's run (windows per step, steps, held-out windows, eval every)")
    scale = commands.add_parser("scale", help="pv_scale_<card>.json: 3B before/after, 8B on one card, memory plans")
    scale.add_argument("--pv3b", type=Path, required=True, help="pv report of --shape llama3b (before and after)")
    scale.add_argument("--pv8b", type=Path, default=None, help="pv report of --shape llama8b (after, one card)")
    scale.add_argument("--card-gib", type=float, default=79.19, help="card memory for the 8B memory plans")
    scale.add_argument("--latest-3b", type=Path, default=None,
                       help="a later after-only 3B report of newer code; the 3B targets are judged on it")
    scale.add_argument("--baseline-tokens", type=float, default=None,
                       help="3B tokens/s the 1.5x target is against (default: the report's before)")
    scale.add_argument("--commands", nargs="*", default=[], help="the commands that made the reports (recorded)")
    scale.add_argument("--commit", default=None, help="the commit the reports were made at (recorded)")
    scale.add_argument("--out", type=Path, required=True)
    node = commands.add_parser("node", help="node_<cards>x<card>.json: 3B scaling over cards, the 8B over several")
    node.add_argument("reports", nargs="+", help="after-only pv reports of --shape llama3b, one per process count")
    node.add_argument("--pv8b", type=Path, default=None, help="after-only pv report of --shape llama8b over cards")
    node.add_argument("--out", type=Path, required=True, help="folder for node_<cards>x<card>.json")
    args = parser.parse_args()
    return {"pv": command_pv, "scale": command_scale, "node": command_node}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
