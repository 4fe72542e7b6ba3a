"""PV-tuning on GPUs: torchrun over two GPUs (NCCL) agrees with one process, and a model of
Llama-3.2-3B's shape fits one 80 GB card at the paper's window (4096 tokens, micro-batch 1).

    PYTHONPATH=src python3 benchmarks/pvtune_gpu_check.py --work /root/pvcheck --out $OUT/pvtune_gpu.json
    PYTHONPATH=src python3 benchmarks/pvtune_gpu_check.py --smoke ...   # small shapes, CPU + gloo (a dry run)

Both parts use random weights: memory depends on shapes, not values. The 3B model's student is
a 2x8-bit AQLM checkpoint of random codes written by the pipeline's own stitching code; the
teacher is a random bf16 model of the same config. The PV run uses the config.yaml defaults
(gradient checkpointing, KL chunks of 1024 tokens, codebooks + scales + non-quantized weights
trained, V-step on) for two steps of two 4096-token windows. Prints a table last and writes JSON.
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

from aqflow.io import artifacts
from aqflow import checkpoint
from aqflow.models.structure import meta_model
from aqflow.models.tiny import build_tiny_llama
from aqflow.stages.quantize_layer import quantize_every_linear
from aqflow.stages import pvtune
from synthetic_models import random_teacher
from synthetic_text import synthetic_corpus

LLAMA_3B = dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOKE_3B = dict(LLAMA_3B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32)


# --- part 1: two processes == one ----------------------------------------------------------------

def quantized_tiny_model(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama and its stitched 2x6-bit checkpoint (a quick quantization, XᵀX = I)."""
    model_dir = build_tiny_llama(root / "fp", hidden_size=128, intermediate_size=256, seed=0)
    quantize_every_linear(model_dir, root / "layers", nbits=6, num_codebooks=2)
    aqlm_dir = checkpoint.write_aqlm_checkpoint(model_dir, root / "layers", root / "aqlm", num_codebooks=2, nbits=6,
                                                dtype="float32")
    return model_dir, aqlm_dir


def multi_process_agreement(root: Path, device: str, processes: int) -> dict:
    """Held-out KL of the same PV run as `processes` torchrun processes and as one process, with
    the V-step off (codes fixed: a bitwise-stable comparison) and on."""
    model_dir, aqlm_dir = quantized_tiny_model(root)
    corpus = synthetic_corpus(root / "corpus.parquet", 24, 300)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                          os.environ.get("PYTHONPATH", "")]))
    result = {}
    for codes_flag in ("--no-update-codes", "--update-codes"):
        common = ["--model-dir", str(model_dir), "--checkpoint-dir", str(aqlm_dir), "--corpus", str(corpus),
                  "--num-samples", "16", "--heldout-samples", "8", "--window-tokens", "48", "--heldout-fraction", "0.25",
                  "--epochs", "1", "--batch-size", "8", "--micro-batch-size", "2", "--eval-every-steps", "1",
                  "--amp-dtype", "none", "--teacher-dtype", "float32", codes_flag, "--device", device, "--quiet"]
        runs = {}
        for label, launcher in (("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nproc-per-node", str(processes)]), ("single", [sys.executable])):
            out = root / f"{label}{codes_flag}"
            started = time.perf_counter()
            done = subprocess.run([*launcher, "-m", "aqflow", "pvtune", *common, "--output-dir", str(out / "model"),
                                   "--train-log", str(out / "log.parquet"), "--metrics", str(out / "pv.json")],
                                  env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{label} {codes_flag} failed:\n{done.stderr[-3000:]}")
            record = json.loads((out / "pv.json").read_text())
            runs[label] = {"world_size": record["settings"]["world_size"], "best_heldout_kl": record["best_heldout_kl"],
                           "initial_heldout_kl": record["initial_heldout_kl"],
                           "codes_changed_fraction": record["codes_changed_fraction"],
                           "wall_seconds": time.perf_counter() - started}
        relative = abs(runs["torchrun"]["best_heldout_kl"] - runs["single"]["best_heldout_kl"]) / runs["single"]["best_heldout_kl"]
        result[codes_flag.removeprefix("--")] = {**runs, "relative_difference": relative}
    return result


# --- part 2: memory of a 3B model ----------------------------------------------------------------

def random_codes_checkpoint(teacher: Path, root: Path) -> Path:
    """The teacher's 2x8-bit AQLM checkpoint with random codes, stitched by `write_aqlm_checkpoint`."""
    layers = root / "layers"
    layers.mkdir(parents=True, exist_ok=True)
    meta = meta_model(teacher)
    generator = torch.Generator().manual_seed(0)
    for name in checkpoint.quantized_linear_names(meta):
        out_features, in_features = meta.get_submodule(name).weight.shape
        # the pipeline's writer: the layer files carry the checksums stitch verifies
        artifacts.save_safetensors(checkpoint.layer_artifact_path(layers, name), {
            "codes": torch.randint(-128, 128, (out_features, in_features // 8, 2), dtype=torch.int8, generator=generator),
            "codebooks": (0.01 * torch.randn(2, 256, 1, 8, generator=generator)).half(),
            "scales": torch.ones(out_features, 1, 1, 1, dtype=torch.float16)})
    return checkpoint.write_aqlm_checkpoint(teacher, layers, root / "aqlm", num_codebooks=2, nbits=8, dtype="float16")


def peak_memory_of_pv(root: Path, shape: dict, device: str, window_tokens: int) -> dict:
    started = time.perf_counter()
    teacher = random_teacher(root / "teacher", shape, device)
    student = random_codes_checkpoint(teacher, root)
    corpus = synthetic_corpus(root / "corpus.parquet", 24, max(4 * window_tokens, 400))
    prepared = time.perf_counter() - started
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    out = root / "pv"
    code = pvtune.main(["--model-dir", str(teacher), "--checkpoint-dir", str(student), "--corpus", str(corpus),
                        "--num-samples", "4", "--heldout-samples", "1", "--window-tokens", str(window_tokens),
                        "--batch-size", "2", "--micro-batch-size", "1", "--epochs", "1", "--max-steps", "2",
                        "--eval-every-steps", "100", "--device", device, "--quiet", "--output-dir", str(out / "model"),
                        "--train-log", str(out / "log.parquet"), "--metrics", str(out / "pv.json")])
    if code != 0:
        raise RuntimeError(f"pvtune exited {code}")
    record = json.loads((out / "pv.json").read_text())
    log = pd.read_parquet(out / "log.parquet")
    train = log[log["split"] == "train"]
    gib = 2 ** 30
    parameters = sum(int(np.prod(t.shape)) for t in meta_model(teacher).parameters())
    return {
        "shape": shape, "parameters": parameters, "window_tokens": window_tokens, "micro_batch_size": 1, "steps": int(record["steps"]),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib if device.startswith("cuda") else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib if device.startswith("cuda") else None,
        "card_gib": torch.cuda.get_device_properties(0).total_memory / gib if device.startswith("cuda") else None,
        "seconds_per_step": float(np.diff(np.concatenate([[0.0], train["seconds"].to_numpy()])).mean()),
        "timings": record["timings"], "prepare_seconds": prepared,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (the 3B model needs ~10 GB)")
    parser.add_argument("--out", type=Path, required=True, help="JSON to write")
    parser.add_argument("--smoke", action="store_true", help="small shapes on CPU (gloo): checks the script itself")
    parser.add_argument("--skip", choices=("processes", "memory"), action="append", default=[])
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "gpus": torch.cuda.device_count() if device == "cuda" else 0}
    if "processes" not in args.skip:
        report["processes"] = multi_process_agreement(args.work / "processes", device, processes=2)
        args.out.write_text(json.dumps(report, indent=2))
    if "memory" not in args.skip:
        report["memory"] = peak_memory_of_pv(args.work / "memory", SMOKE_3B if args.smoke else LLAMA_3B, device,
                                             window_tokens=64 if args.smoke else 4096)
        args.out.write_text(json.dumps(report, indent=2))
    print(f"device: {report['device']} x{report['gpus']}")
    for mode, runs in report.get("processes", {}).items():
        print(f"{mode:16s} held-out KL 2 processes {runs['torchrun']['best_heldout_kl']:.6f}  1 process "
              f"{runs['single']['best_heldout_kl']:.6f}  relative difference {runs['relative_difference']:.2e}  "
              f"(from {runs['single']['initial_heldout_kl']:.4f}; codes changed {runs['single']['codes_changed_fraction']:.4f})")
    if "memory" in report:
        memory = report["memory"]
        print(f"{memory['parameters'] / 1e9:.2f}B-parameter Llama, {memory['window_tokens']} tokens x micro-batch 1: "
              f"peak allocated {memory['peak_allocated_gib']} GiB, reserved {memory['peak_reserved_gib']} GiB "
              f"of {memory['card_gib']} GiB; {memory['seconds_per_step']:.1f} s per step of 2 windows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
