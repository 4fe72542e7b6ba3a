"""Decode speed on one GPU box: `benchmarks/results/inference_<card>.json` with the keys
`gpu_decode_speedup_3b`, `gpu_decode_speedup_8b` (2 bpp over the best bf16 decode on the card) and
`cpu_decode_speedup_3b` (over the best dense decode on the box's CPU cores), each source named.

    python3 benchmarks/inference_summary.py --gpu benchmarks/results/decode_h200/gpu_argmax.json \\
        --cpu benchmarks/results/decode_h200/cpu_call1.json benchmarks/results/decode_h200/cpu_call2.json \\
        benchmarks/results/decode_h200/cpu_call3.json --out benchmarks/results/inference_h200.json

These machines' speeds move between machines and rounds (CPU up to ±20 %, H200 bf16 3B 413-421
tokens/s), so each key is the median over the machines given (`..._lowest` the lowest, each
machine's own in `..._by_machine`); further machines' files follow the first. GPU files: one card.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from aqflow.io.artifacts import atomic_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_gpu import best_rate  # noqa: E402  (the GPU benchmark's own rule for a model's best decode)

TARGETS = {"gpu_decode_speedup_3b": 2.0, "gpu_decode_speedup_8b": 2.5, "cpu_decode_speedup_3b": 2.0}


def cpu_machine(path: Path) -> dict:
    """One CPU decode file's figures: its speed-up and the best dense and 2x8 tokens/s behind it."""
    record = json.loads(path.read_text())
    best = {row["variant"]: row["decode_tokens_per_second"] for row in record["decode_3b"]}
    dense = max(value for name, value in best.items() if name.startswith("dense"))
    return {"source": str(path), "cpu_decode_speedup_3b": record["cpu_decode_speedup_3b"],
            "best_dense_tokens_per_second": dense, "quantized_tokens_per_second": best.get("2x8 fast (bf16 rest)"),
            "cpu": record["machine"]["cpu"], "cores": record["machine"]["cores"]}


def gpu_machine(path: Path) -> dict:
    """One GPU decode file's figures: both speed-ups and, per model, the best bf16 and 2 bpp tokens/s."""
    record = json.loads(path.read_text())
    machine = {"source": str(path), "device": record["device"]}
    for name in ("3b", "8b"):
        model = record["models"].get(name)
        if model is None or record.get(f"gpu_decode_speedup_{name}") is None:
            raise SystemExit(f"{path}: no {name} decode speed-up in it (run inference_gpu.py --models 3b,8b)")
        machine[f"gpu_decode_speedup_{name}"] = record[f"gpu_decode_speedup_{name}"]
        machine[f"bf16_{name}_tokens_per_second"] = best_rate(model["bf16"])
        machine[f"quantized_{name}_tokens_per_second"] = best_rate(model["ours"])
    return machine


def median_and_lowest(key: str, machines: list[dict]) -> dict:
    values = [machine[key] for machine in machines]
    return {key: statistics.median(values), f"{key}_lowest": min(values)}


def summary(gpu_paths: list[Path], cpu_paths: list[Path]) -> dict:
    gpus = [gpu_machine(path) for path in gpu_paths]
    cards = {machine["device"] for machine in gpus}
    if len(cards) > 1:
        raise SystemExit(f"GPU files from several cards ({', '.join(sorted(cards))}): one summary is one card's")
    machines = [cpu_machine(path) for path in cpu_paths]
    record = {"card": gpus[0]["device"]}
    for key in ("gpu_decode_speedup_3b", "gpu_decode_speedup_8b"):
        record.update(median_and_lowest(key, gpus))
    record["gpu_decode_by_machine"] = gpus
    record.update(median_and_lowest("cpu_decode_speedup_3b", machines))
    record["cpu_decode_speedup_3b_by_machine"] = machines
    record.update({"targets": TARGETS,
                   "sources": {"gpu": [str(path) for path in gpu_paths], "cpu": [str(path) for path in cpu_paths]}})
    record["met"] = {key: record[key] >= target for key, target in TARGETS.items()}
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", type=Path, nargs="+", required=True, help="inference_gpu.py JSONs, one a machine")
    parser.add_argument("--cpu", type=Path, nargs="+", required=True, help="inference_cpu.py JSONs, one a machine")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    record = summary(args.gpu, args.cpu)
    with atomic_path(args.out, checksum=False) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    for key, target in TARGETS.items():
        print(f"{key:24s} {record[key]:5.2f}  (target {target}: {'met' if record['met'][key] else 'not met'})")
        print(f"{'  lowest machine':24s} {record[key + '_lowest']:5.2f}")
    for machine in record["gpu_decode_by_machine"]:
        print(f"  {machine['source']}: 3B {machine['gpu_decode_speedup_3b']:.2f}x "
              f"(bf16 {machine['bf16_3b_tokens_per_second']:.1f}, 2 bpp {machine['quantized_3b_tokens_per_second']:.1f}), "
              f"8B {machine['gpu_decode_speedup_8b']:.2f}x (bf16 {machine['bf16_8b_tokens_per_second']:.1f}, "
              f"2 bpp {machine['quantized_8b_tokens_per_second']:.1f} tok/s)")
    for machine in record["cpu_decode_speedup_3b_by_machine"]:
        print(f"  {machine['source']}: {machine['cpu_decode_speedup_3b']:.2f}x "
              f"(dense {machine['best_dense_tokens_per_second']:.2f}, "
              f"2x8 {machine['quantized_tokens_per_second']:.2f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
