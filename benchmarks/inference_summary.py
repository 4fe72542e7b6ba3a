"""The issue's summary of decode speed on one GPU box: `benchmarks/results/inference_<card>.json` with the
top-level keys `gpu_decode_speedup_3b`, `gpu_decode_speedup_8b` (2 bpp over the best bf16 decode of
the same model on the card) and `cpu_decode_speedup_3b` (over the best dense decode on the box's CPU
cores), gathered from the result files that measured them, each named in `sources`.

    python3 benchmarks/inference_summary.py --gpu benchmarks/results/thread_tiles_h200/b/inference_gpu.json \\
        --cpu benchmarks/results/cpu_int16_h200/call1/decode.json benchmarks/results/cpu_int16_h200/call2/decode.json \\
        benchmarks/results/cpu_int16_h200/call3/decode.json --out benchmarks/results/inference_h200.json

Why several CPU files: one lease is one machine of the kind, and these machines' decode speeds move by up
to ±20 % between machines and rounds (dense bf16 alone 7.4-11.4 tokens/s), so `cpu_decode_speedup_3b` is
the median over the machines given (`..._lowest` the lowest), each machine's own best-over-best beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from aqflow.io.artifacts import atomic_path

TARGETS = {"gpu_decode_speedup_3b": 2.0, "gpu_decode_speedup_8b": 2.5, "cpu_decode_speedup_3b": 2.0}


def cpu_machine(path: Path) -> dict:
    """One CPU decode file's figures: its speed-up and the best dense and 2x8 tokens/s behind it."""
    record = json.loads(path.read_text())
    best = {row["variant"]: row["decode_tokens_per_second"] for row in record["decode_3b"]}
    dense = max(value for name, value in best.items() if name.startswith("dense"))
    return {"source": str(path), "cpu_decode_speedup_3b": record["cpu_decode_speedup_3b"],
            "best_dense_tokens_per_second": dense, "quantized_tokens_per_second": best.get("2x8 fast (bf16 rest)"),
            "cpu": record["machine"]["cpu"], "cores": record["machine"]["cores"]}


def summary(gpu_path: Path, cpu_paths: list[Path]) -> dict:
    gpu = json.loads(gpu_path.read_text())
    machines = [cpu_machine(path) for path in cpu_paths]
    record = {"card": gpu["device"],
              "gpu_decode_speedup_3b": gpu["gpu_decode_speedup_3b"],
              "gpu_decode_speedup_8b": gpu["gpu_decode_speedup_8b"],
              "cpu_decode_speedup_3b": statistics.median(m["cpu_decode_speedup_3b"] for m in machines),
              "cpu_decode_speedup_3b_lowest": min(m["cpu_decode_speedup_3b"] for m in machines),
              "cpu_decode_speedup_3b_by_machine": machines,
              "targets": TARGETS,
              "sources": {"gpu": str(gpu_path), "cpu": [str(path) for path in cpu_paths]}}
    record["met"] = {key: record[key] >= target for key, target in TARGETS.items()}
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", type=Path, required=True, help="an inference_gpu.py JSON")
    parser.add_argument("--cpu", type=Path, nargs="+", required=True, help="inference_cpu.py JSONs, one a machine")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = summary(args.gpu, args.cpu)
    with atomic_path(args.out, checksum=False) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    for key, target in TARGETS.items():
        print(f"{key:24s} {record[key]:5.2f}  (target {target}: {'met' if record['met'][key] else 'not met'})")
    print(f"{'  lowest machine':24s} {record['cpu_decode_speedup_3b_lowest']:5.2f}")
    for machine in record["cpu_decode_speedup_3b_by_machine"]:
        print(f"  {machine['source']}: {machine['cpu_decode_speedup_3b']:.2f}x "
              f"(dense {machine['best_dense_tokens_per_second']:.2f}, "
              f"2x8 {machine['quantized_tokens_per_second']:.2f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
