"""One beam-search pass at Llama-3B layer shapes: seconds, distance to the FP32 FLOP floor, and
where the time goes (CUDA kernels by name, from the profiler).

The pass runs as `quantize_layer` runs it (BeamSearcher, 2 GiB budget, CUDA graphs replayed,
2 bpp: M=2, K=256, g=8, beam 8) on synthetic inputs (benchmarks/quantizer_3b.py's weights and
XᵀX; random codebooks and codes). Which implementation runs is whatever `aqflow` is importable,
so a before/after comparison is two runs with different PYTHONPATH in one call:

    PYTHONPATH=old/src:. python3 benchmarks/beam_pass.py --label before --json $OUT/before.json
    PYTHONPATH=src:. python3 benchmarks/beam_pass.py --label after --sweep --json $OUT/after.json

--sweep also times each shape's pass at every stage-kernel warp count (where the implementation
has the setting) and reports the pass at the fastest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.quantizer_3b import FP32_PEAK_FLOPS, synthetic_weight, synthetic_xtx

SHAPES = {"gate_proj": (8192, 3072), "q_proj": (3072, 3072), "k_proj": (1024, 3072), "down_proj": (3072, 8192)}
NUM_CODEBOOKS, NUM_CODEWORDS, GROUP_SIZE, BEAM = 2, 256, 8, 8


def pass_inputs(out_features: int, in_features: int, seed: int = 0) -> dict:
    """weight [out, in], xtx [in, in], codebooks [M, K, g], scales [out], codes [out, G, M] on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = synthetic_weight(out_features, in_features, generator, "cuda").cuda()
    xtx = synthetic_xtx(in_features, generator, "cuda").cuda()
    scales = weight.norm(dim=1) / in_features**0.5
    codebooks = torch.randn(NUM_CODEBOOKS, NUM_CODEWORDS, GROUP_SIZE, generator=generator, device="cuda") * 0.7
    codes = torch.randint(0, NUM_CODEWORDS, (out_features, in_features // GROUP_SIZE, NUM_CODEBOOKS), generator=generator, device="cuda")
    return {"weight": weight, "xtx": xtx, "codebooks": codebooks, "scales": scales, "codes": codes}


def time_passes(inputs: dict, repeats: int) -> list[float]:
    """Seconds of `repeats` passes after one that captures the graphs."""
    from aqflow.quant.beam_search import _GRAPH_CACHE, BeamSearcher

    _GRAPH_CACHE.clear()
    searcher = BeamSearcher(inputs["xtx"], BEAM, 2 << 30)
    args = (inputs["weight"], inputs["codebooks"], inputs["scales"], inputs["codes"])
    searcher(*args)
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        searcher(*args)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def kernel_breakdown(inputs: dict, top: int = 8) -> list[dict]:
    """CUDA time per kernel name over one pass (graph replay included), largest first."""
    from torch.profiler import ProfilerActivity, profile

    from aqflow.quant.beam_search import BeamSearcher

    searcher = BeamSearcher(inputs["xtx"], BEAM, 2 << 30)
    args = (inputs["weight"], inputs["codebooks"], inputs["scales"], inputs["codes"])
    searcher(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        searcher(*args)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            entry[1] += 1
    rows = sorted(({"kernel": k, "ms": v[0] / 1e3, "calls": v[1]} for k, v in totals.items()), key=lambda r: -r["ms"])
    return rows[:top]


def settings_grid() -> list[dict]:
    import aqflow.quant.beam_kernels as kernels

    if not hasattr(kernels, "STAGE_NUM_WARPS"):
        return []
    return [{"num_warps": w} for w in (1, 2, 4, 8)]


def apply_settings(settings: dict) -> None:
    import aqflow.quant.beam_kernels as kernels

    kernels.STAGE_NUM_WARPS = settings["num_warps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--profile", action="store_true", help="kernel breakdown of each shape's pass")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    card = torch.cuda.get_device_name()
    peak = next((v for k, v in FP32_PEAK_FLOPS.items() if k in card), 67e12)
    result = {"label": args.label, "device": card, "fp32_peak_flops": peak, "sweep": [], "shapes": []}
    for name in args.shapes:
        out_features, in_features = SHAPES[name]
        inputs = pass_inputs(out_features, in_features)
        chosen = None
        for settings in settings_grid() if args.sweep else []:
            apply_settings(settings)
            median = statistics.median(time_passes(inputs, args.repeats))
            result["sweep"].append({**settings, "layer": name, "seconds_median": median})
            print(f"sweep {name} {settings}: {median:.4f} s", flush=True)
            if chosen is None or median < chosen[1]:
                chosen = (settings, median)
        if chosen is not None:
            apply_settings(chosen[0])
        seconds = time_passes(inputs, args.repeats)
        floor = 2 * NUM_CODEBOOKS * BEAM * out_features * in_features**2
        median = statistics.median(seconds)
        row = {"layer": name, "shape": [out_features, in_features], "seconds": seconds, "seconds_median": median,
               "flop_floor": floor, "x_fp32_floor": median / (floor / peak), "settings": chosen[0] if chosen else None}
        if args.profile:
            try:
                row["kernels"] = kernel_breakdown(inputs)
            except Exception as error:  # the timing stands without the breakdown
                print(f"no kernel breakdown: {error!r}")
        result["shapes"].append(row)
        print(f"{args.label} {name} {out_features}x{in_features}: {median:.4f} s  ({row['x_fp32_floor']:.2f}x FP32 floor)", flush=True)
        for kernel in row.get("kernels", []):
            print(f"    {kernel['ms']:8.2f} ms {kernel['calls']:6d}  {kernel['kernel']}")
        del inputs
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
