"""Layer jobs on a node of several GPUs: all on one card (before) vs spread by aqflow.jobs.gpu_pool.

    PYTHONPATH=src python3 benchmarks/gpu_spread.py --work /root/spread --out $OUT/gpu_spread.json

Each job is what a Snakemake `quantize_layer` job runs: a fresh Python process that goes through
`gpu_pool.pin_job_gpus` (as `workflow_glue.run_stage` does) into the quantize-layer
stage at its default (paper) settings, on one SmolLM2-135M-shaped linear of random weights with
the XᵀX of random anisotropic inputs. Jobs are started `--slots-per-card` x cards at a time, as
`--resources gpu=12 x cards` lets Snakemake do. "one card" runs the same jobs with every job
given CUDA_VISIBLE_DEVICES=0 and 12 slots (what profiles/gpu does on any node). nvidia-smi is
sampled every 250 ms throughout; the table gives each card's mean utilisation and the share of
samples in which it was busy, over each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SMOLLM2_LINEARS = [("q_proj", 576, 576), ("k_proj", 192, 576), ("v_proj", 192, 576), ("o_proj", 576, 576),
                   ("gate_proj", 1536, 576), ("up_proj", 1536, 576), ("down_proj", 576, 1536)]
# run_stage takes settings and paths as values; the benchmark passes the stage's command line, so a
# job pins its card as run_stage does, then runs the stage's CLI with its output in the job's log
JOB = """
import contextlib, os, sys
from aqflow.jobs.gpu_pool import pin_job_gpus
pin_job_gpus(1)
from aqflow.stages import quantize_layer
with open(sys.argv[1], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    code = quantize_layer.main(sys.argv[2:])
print(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
sys.exit(code)
"""


def build_inputs(work: Path, blocks: int, device: str, stage_flags: list[str]) -> list[list[str]]:
    """Weight and XᵀX files of `blocks` SmolLM2-shaped blocks; the quantize-layer argv of each linear."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    xtx_files = {}
    for in_features in (576, 1536):
        inputs = torch.randn(4096, in_features, generator=generator) * torch.logspace(0, 1, in_features)
        path = work / f"xtx_{in_features}.safetensors"
        save_file({"xtx": (inputs.T @ inputs / inputs.shape[0]).contiguous()}, str(path))
        xtx_files[in_features] = path
    argvs = []
    for block in range(blocks):
        for name, out_features, in_features in SMOLLM2_LINEARS:
            stem = f"block{block}.{name}"
            weight = work / f"{stem}.safetensors"
            save_file({"weight": 0.02 * torch.randn(out_features, in_features, generator=generator)}, str(weight))
            argvs.append(["--weight", str(weight), "--xtx", str(xtx_files[in_features]), "--output",
                          str(work / "out" / f"{stem}.safetensors"), "--metrics", str(work / "out" / f"{stem}.json"),
                          "--device", device, "--quiet", "--num-codebooks", "2", "--nbits", "8", *stage_flags])
    (work / "out").mkdir(exist_ok=True)
    return argvs


def run_phase(name: str, argvs: list[list[str]], slots: int, env: dict, work: Path) -> dict:
    samples = work / f"{name}.smi.csv"
    try:
        sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                    "--format=csv,noheader,nounits", "-lms", "250"], stdout=open(samples, "w"))
    except OSError:  # no nvidia-smi (a CPU dry run of this script)
        sampler = subprocess.Popen(["sleep", "100000"])
    logs = work / f"logs_{name}"
    logs.mkdir(exist_ok=True)

    def one(index_argv):
        index, argv = index_argv
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", JOB, str(logs / f"{index}.log"), *argv], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"job {index} failed: {done.stderr[-2000:]}\n{(logs / f'{index}.log').read_text()[-2000:]}")
        return done.stdout.strip().splitlines()[-1], time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        results = list(pool.map(one, enumerate(argvs)))
    wall = time.perf_counter() - started
    sampler.terminate()
    sampler.wait()
    per_card: dict[str, list[float]] = {}
    for line in samples.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            per_card.setdefault(parts[0], []).append(float(parts[1]))
    return {
        "jobs": len(argvs), "concurrent_jobs": slots, "wall_seconds": wall,
        "job_seconds_median": sorted(seconds for _, seconds in results)[len(results) // 2],
        "jobs_per_card": dict(Counter(card for card, _ in results)),
        "card_mean_utilisation_percent": {card: sum(v) / len(v) for card, v in per_card.items()},
        "card_busy_sample_fraction": {card: sum(u > 0 for u in v) / len(v) for card, v in per_card.items()},
        "samples_per_card": {card: len(v) for card, v in per_card.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=12, help="SmolLM2 blocks (7 linears each)")
    parser.add_argument("--slots-per-card", type=int, default=12)
    parser.add_argument("--phases", nargs="+", default=["one_card", "spread"], choices=["one_card", "spread"])
    parser.add_argument("--device", default="cuda", help="cpu only to dry-run this script")
    parser.add_argument("--cards", type=int, default=None, help="pretend this many cards (dry runs)")
    parser.add_argument("--stage-flags", type=str.split, default=[], help="extra quantize-layer flags, one string")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cards = args.cards or torch.cuda.device_count()
    argvs = build_inputs(args.work, args.blocks, args.device, args.stage_flags)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "cards": cards, "phases": {}}
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    base["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])
    for phase in args.phases:
        if phase == "one_card":
            env, slots = dict(base, CUDA_VISIBLE_DEVICES="0"), args.slots_per_card
        else:
            env, slots = dict(base, AQFLOW_GPU_POOL_DIR=str(args.work / "pool")), args.slots_per_card * cards
            if args.cards:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(card) for card in range(cards))
        report["phases"][phase] = run_phase(phase, argvs, slots, env, args.work)
        args.out.write_text(json.dumps(report, indent=2))
    print(f"{report['device']} x{cards}: {len(argvs)} quantize-layer jobs")
    for phase, row in report["phases"].items():
        util = "  ".join(f"card {c}: {u:4.0f}% ({row['card_busy_sample_fraction'][c]:.0%} busy, "
                         f"{row['jobs_per_card'].get(c, 0)} jobs)" for c, u in sorted(row["card_mean_utilisation_percent"].items()))
        print(f"{phase:9s} {row['concurrent_jobs']:3d} at a time, {row['wall_seconds']:6.1f} s (median job "
              f"{row['job_seconds_median']:.1f} s)  {util}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
