"""Where a 2x8 lookup-table GEMV's time goes at batch 1 (issue 27): every CUDA candidate of the
Llama-3.2-3B decode shapes timed the way a decode step runs them, and (under Nsight Compute) the
chosen ones' counters.

The tuner's do_bench times one launch at a time with L2 flushed, host launch included; a decode step
replays a CUDA graph of back-to-back launches over 28 layers' different weights. Here, per shape:
`--copies` random weight sets (as many layers), each candidate checked against the float64 dense
reference on the first, then a CUDA graph of one launch per copy replayed `--replays` times: microseconds
per launch in a graph, beside do_bench's.

    python benchmarks/lut_kernel_profile.py --out $OUT/lut_kernel_profile.json
    ncu --clock-control none -k regex:lut_gemv --section SpeedOfLight --section WarpStateStats \
        python benchmarks/lut_kernel_profile.py --launch-only cuda_lut16:o256g32s12w8 ...   # one launch each

Prints a table per shape (fastest in a graph first) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_gpu import SHAPES, linear_shapes, random_quantized  # noqa: E402

from aqflow.inference import cuda_kernels  # noqa: E402
from aqflow.inference import gpu_kernels as gk  # noqa: E402
from aqflow.inference.packed import VARIANTS, KernelConfig, in_tiles  # noqa: E402

DECODE_LINEARS = ("qkv (fused)", "o_proj", "gate+up (fused)", "down_proj")


def parse_label(label: str) -> KernelConfig:
    """'cuda_lut16:o256g32s12w8' -> KernelConfig."""
    variant, rest = label.split(":")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    rows, rest = rest[1:].split("g")
    groups, rest = rest.split("s")
    split, warps = rest.split("w")
    return KernelConfig(variant, int(rows), int(groups), int(split), int(warps))


def packed_copies(outs: list[int], in_features: int, copies: int, generator) -> list[gk.PackedWeights]:
    dtype = torch.bfloat16
    return [in_tiles(gk.pack_weights([random_quantized(o, in_features, "cuda", dtype, generator) for o in outs]))
            for _ in range(copies)]


def profile_shape(name: str, args, generator) -> dict:
    outs, in_features = linear_shapes(SHAPES[args.shape])[name]
    packs = packed_copies(outs, in_features, args.copies, generator)
    x = torch.randn(1, in_features, device="cuda", generator=generator).to(torch.bfloat16)
    reference = x.double() @ gk.packed_dense_weight(packs[0]).double().T
    weights = [torch.randn(sum(outs), in_features, device="cuda", dtype=x.dtype) * 0.02 for _ in range(args.copies)]

    def dense_all() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)

    row = {"out": sum(outs), "in": in_features, "code_bytes": packs[0].code_bytes(),
           "bf16_graph_us": gk.graph_replay_seconds(dense_all, args.copies, x.device, args.replays) * 1e6,
           "candidates": []}
    candidates = [c for c in cuda_kernels.candidate_configs(packs[0], 1, torch.cuda.get_device_properties(0).multi_processor_count)]
    for config in candidates:
        entry = {"config": config.label()}
        try:
            out = torch.full((1, packs[0].rows), float("nan"), dtype=x.dtype, device=x.device)
            gk._launch(x, packs[0], config, out)
            entry["rel_error"] = gk.relative_error(out, reference)
            if not entry["rel_error"] <= 1e-2:
                entry["note"] = "wrong"
            else:
                entry["graph_us"] = gk.graph_seconds(x, packs, config, args.replays) * 1e6
                entry["do_bench_us"] = gk.time_config(x, packs[0], config) * 1e6
        except Exception as failure:  # noqa: BLE001 - one failing candidate is reported, not fatal
            entry["note"] = f"{type(failure).__name__}: {str(failure)[:160]}"
        row["candidates"].append(entry)
    timed = sorted((c for c in row["candidates"] if "graph_us" in c), key=lambda c: c["graph_us"])
    print(f"== {args.shape} {name} [{row['out']} x {in_features}], {row['code_bytes'] / 1e6:.1f} MB codes; "
          f"bf16 in a graph {row['bf16_graph_us']:.1f} us")
    print(f"{'config':32s} {'graph us':>9s} {'GB/s':>6s} {'do_bench us':>11s}")
    for c in timed[: args.show]:
        print(f"{c['config']:32s} {c['graph_us']:9.2f} {row['code_bytes'] / c['graph_us'] / 1e3:6.0f} "
              f"{c['do_bench_us']:11.2f}")
    failed = [c for c in row["candidates"] if "graph_us" not in c]
    if failed:
        print(f"  {len(failed)} failed or wrong, e.g. {failed[0]['config']}: {failed[0].get('note')}")
    return row


def launch_only(labels: list[str], args, generator) -> None:
    """One launch of each named configuration on its decode shape (for ncu), after one unprofiled-looking
    warm-up is impossible under ncu's kernel filter: each launch is profiled."""
    for label in labels:
        shape_name, config_label = label.split("=")
        outs, in_features = linear_shapes(SHAPES[args.shape])[shape_name]
        packed = packed_copies(outs, in_features, 1, generator)[0]
        x = torch.randn(1, in_features, device="cuda", generator=generator).to(torch.bfloat16)
        out = torch.empty(1, packed.rows, dtype=x.dtype, device=x.device)
        gk._launch(x, packed, parse_label(config_label), out)
        torch.cuda.synchronize()
        print(f"launched {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="3b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--linears", nargs="+", default=list(DECODE_LINEARS))
    parser.add_argument("--copies", type=int, default=28, help="weight sets in the graph (layers)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--show", type=int, default=8, help="rows printed per shape")
    parser.add_argument("--launch-only", nargs="+", metavar="LINEAR=CONFIG",
                        help="one launch of each (for ncu), e.g. 'o_proj=cuda_lut16:o256g32s12w8'")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lut_kernel_profile.json"))
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    cuda_kernels.load_extension()
    if args.launch_only:
        launch_only(args.launch_only, args, generator)
        return
    started = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(0), "shape": args.shape, "copies": args.copies,
              "linears": {}}
    for name in args.linears:
        result["linears"][name] = profile_shape(name, args, generator)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"total {time.perf_counter() - started:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
