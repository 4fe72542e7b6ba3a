"""The speed stage on a GPU box: both devices, both paths, and the plain path left unfused on CUDA.

    PYTHONPATH=src python benchmarks/speed_devices_check.py --json $OUT/speed_devices.json

Each phase prints a line as it starts and ends (pipe it through `grep --line-buffered` if at all: a
try on an H100 on 2026-11-28 printed nothing in 290 s through a buffering grep and was cut).

Builds a random Llama at SmolLM2-135M's shape (hidden 576, 30 layers, MLP 1536, 9 heads, 3 KV heads;
a tiny BPE vocabulary) in float16 and a random 2x8 AQLM checkpoint of it (groups of 8: the shape the
CUDA table kernel takes), then:

1. on CUDA, the plain path decoded as the stage decodes it (runtime.decode_options) keeps every
   q/k/v and gate/up projection its own module (aqlm's QuantizedLinear / nn.Linear), while the fast
   path fuses them: the check of the plain path being plain transformers + aqlm;
2. `aqflow speed` with `--devices auto` on both folders: auto must resolve to [cuda, cpu] there, and
   speed.json must hold a section per device with both paths (the AQLM folder's plain CPU path on
   cpu_plain_tokens tokens);
3. prints a table per folder, device and path (decode and prefill tokens/s, decode mode, resident
   weights, peak memory, token counts). Random weights: the figures say the harness runs and what
   each path costs at this shape, not the quality of anything. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.inference.aqlm_checkpoints writes the random checkpoint

from aqflow.inference.decode import FusedProjectionMember, greedy_decode  # noqa: E402
from aqflow.inference.runtime import decode_options, load_for_decoding  # noqa: E402
from aqflow.models import build_tiny_llama  # noqa: E402
from aqflow.stages import speed  # noqa: E402
from tests.inference.aqlm_checkpoints import write_random_aqlm_checkpoint  # noqa: E402


def fused_members(model: torch.nn.Module) -> int:
    return sum(isinstance(module, FusedProjectionMember) for module in model.modules())


def fusion_check(folder: Path) -> dict:
    """Fused projection modules after a short decode through each path on CUDA."""
    found = {}
    for path in ("plain", "fast"):
        model = load_for_decoding(folder, "cuda", "auto", path)
        greedy_decode(model, torch.zeros(1, 8, dtype=torch.long), 4, **decode_options(path))
        found[path] = fused_members(model)
        del model
        torch.cuda.empty_cache()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every speed.json and the checks here")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible: this check is for the GPU machine", file=sys.stderr)
        return 1
    failures, record = [], {"card": torch.cuda.get_device_name(0), "folders": {}}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        fp_dir = build_tiny_llama(root / "fp", hidden_size=576, num_layers=30, intermediate_size=1536, num_heads=9,
                                  num_kv_heads=3, dtype="float16")
        aqlm_dir = root / "aqlm"
        write_random_aqlm_checkpoint(fp_dir, aqlm_dir, num_codebooks=2, nbits=8, group_size=8)
        for name, folder in (("fp16", fp_dir), ("aqlm 2x8", aqlm_dir)):
            print(f"{name}: the fusion check on cuda", flush=True)
            fused = fusion_check(folder)
            record.setdefault("fused_members", {})[name] = fused
            if fused["plain"] != 0 or fused["fast"] == 0:
                failures.append(f"{name}: fused members plain {fused['plain']} (want 0), fast {fused['fast']} (want > 0)")
            settings = speed.SpeedSettings(devices=("auto",), paths=("fast", "plain"), repeats=args.repeats)
            started = time.perf_counter()
            payload = speed.run(settings, speed.SpeedPaths(model_dir=folder, output=root / f"{name}.json"))
            payload["stage_seconds"] = time.perf_counter() - started
            print(f"{name}: the speed stage took {payload['stage_seconds']:.0f} s", flush=True)
            record["folders"][name] = payload
            if list(payload["devices"]) != ["cuda", "cpu"]:
                failures.append(f"{name}: devices {list(payload['devices'])}, want ['cuda', 'cpu']")
            for device, section in payload["devices"].items():
                if list(section["paths"]) != ["fast", "plain"]:
                    failures.append(f"{name} on {device}: paths {list(section['paths'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    print(f"\ncard: {record['card']}; fused projection members after a decode: {record['fused_members']}")
    print(f"{'folder':9s} {'device':6s} {'path':5s} {'decode tok/s':>12s} {'mode':>14s} {'prefill tok/s':>13s} "
          f"{'weights MiB':>11s} {'peak MiB':>9s}  tokens (prompt/new/prefill)  threads  stage s")
    for name, payload in record["folders"].items():
        for device, section in payload["devices"].items():
            for path, r in section["paths"].items():
                tokens = r["tokens"]
                print(f"{name:9s} {device:6s} {path:5s} {r['decode_tokens_per_second']:12.1f} {r['decode_mode']:>14s} "
                      f"{r['prefill_tokens_per_second']:13.1f} {r['resident_weight_bytes'] / 2**20:11.1f} "
                      f"{r['peak_memory_bytes'] / 2**20:9.0f}  {tokens['prompt_tokens']}/{tokens['new_tokens']}/"
                      f"{tokens['prefill_tokens']:<20}  {r['threads']:7d}  {payload['stage_seconds']:7.0f}")
    print("checks:", "all passed" if not failures else "FAILED\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
