"""One decode step's kernels with their launch grids and blocks, for bf16 and 2 bpp (issue 27).

Written to ask why torch.compile's small kernels seemed slower in the 2 bpp step than in bf16's
(silu(gate) * up 3.5-4.3 us against ~1.1). The answer (benchmarks/inference_gpu_notes.md, round 4):
under programmatic dependent launch a kernel's profiled time includes its wait for the kernel before
it, and the CUDA GEMVs let the next kernel launch before they end. Runs both models (3B shape, random
weights, the 2-bit one on default kernel configurations, no tuning) through greedy_decode with
compile+graph, records one step's kernels (torch.profiler's trace), saves the Triton sources inductor
generated for silu and rotary kernels, and prints, per model, the non-GEMV kernels with grid, block
and microseconds.

    PYTHONPATH=src:. python3 benchmarks/step_kernel_detail.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_gpu import build_llama, quantize_randomly  # noqa: E402

from aqflow.inference import decode  # noqa: E402
from aqflow.inference.decode import fuse_projections, greedy_decode  # noqa: E402

TRACES: dict[str, list[dict]] = {}


def traced_profile(label: str):
    """A stand-in for decode.profile_kernels that also keeps every kernel's grid and block."""

    def profile_kernels(fn, device):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            path = handle.name
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
        os.unlink(path)
        kernels = [e for e in events if e.get("cat") == "kernel"]
        TRACES[label] = [{"name": e["name"], "us": e["dur"], "grid": e["args"].get("grid"),
                          "block": e["args"].get("block"), "registers": e["args"].get("registers per thread"),
                          "shared": e["args"].get("shared memory")} for e in kernels]
        return [(k["name"], k["us"]) for k in TRACES[label]]

    return profile_kernels


def summary(label: str) -> list[str]:
    grouped: dict[tuple, list[float]] = defaultdict(list)
    for k in TRACES.get(label, []):
        if any(s in k["name"] for s in ("nvjet", "lut_gemv", "splitKreduce", "gemv")):
            continue
        grouped[(k["name"][:70], str(k["grid"]), str(k["block"]), k["registers"])].append(k["us"])
    lines = [f"== {label}: kernels other than the GEMVs (name, grid, block, registers: count x mean us)"]
    for (name, grid, block, registers), times in sorted(grouped.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{name:70s} {grid:14s} {block:14s} {registers!s:4s} {len(times):3d} x {sum(times) / len(times):5.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/step_kernel_detail"))
    parser.add_argument("--shape", default="3b")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    prompt = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(7))
    model = build_llama(args.shape, device, dtype)
    fuse_projections(model)
    decode.profile_kernels = traced_profile("bf16")
    _, bf16 = greedy_decode(model, prompt, 32, compile=True, fuse=False, profile=True)
    quantize_randomly(model, "ours")
    fuse_projections(model)
    torch._dynamo.reset()
    decode.profile_kernels = traced_profile("ours")
    _, ours = greedy_decode(model, prompt, 32, compile=True, fuse=False, profile=True)
    lines = [f"bf16 {bf16.decode_tokens_per_second:.1f} tok/s ({bf16.mode}), 2-bit {ours.decode_tokens_per_second:.1f} "
             f"tok/s ({ours.mode})"]
    lines += summary("bf16") + summary("ours")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    sources = []  # the Triton sources of both steps' silu * up and rotary kernels, from inductor's cache
    for path in sorted(Path(cache_dir()).rglob("*.py")):
        text = path.read_text(errors="replace")
        if "@triton.jit" in text and ("silu" in text or "sin" in text) and "def triton_poi" in text:
            name = text[text.find("def triton_poi") + 4:].split("(")[0]
            sources.append(f"# ---- {name} ({path.name})\n{text}")
    (out / "inductor_kernels.py").write_text("\n\n".join(sources))
    lines.append(f"{len(sources)} inductor kernel sources saved (silu or rotary)")
    (out / "step_kernel_detail.json").write_text(json.dumps(TRACES, separators=(",", ":")) + "\n")
    (out / "step_kernel_detail.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
