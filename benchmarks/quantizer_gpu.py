"""Quantizer benchmark on real SmolLM2-135M layers: time and output error, greedy vs OA-EM.

Input: the layer bundles of `benchmarks/prepare_layers.py` (fp16 weights and each input site's XᵀX
from real text). For each linear, bit rate and init it runs the full quantizer and records seconds
for init and per epoch and the relative output MSE after init and at the end, beside the FLOP floors
of one beam-search pass (2·M·b·out·in²) and one Adam step (2·out·in²). It first checks on one layer
that the CUDA-graph replay of a beam pass gives the eager pass's codes and never raises the
objective. With --reference-src DIR (a module `src.beam_search_xtx` holding AQLM's public
`beam_search_optimal_codes`) it also times one reference pass from the same state and compares errors.

Prints a table last and writes everything as JSON (--out, default $OUT/quantizer_gpu.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from aqflow.quant.beam_search import BeamSearcher
from aqflow.quant.codebook_update import CodebookAdam
from aqflow.quant.objective import relative_output_mse
from aqflow.quant.quantize import QuantizerSettings, quantize_layer, release_cuda_graphs
from aqflow.quant.representation import dequantize_weight, layer_rho


def unpack_upper_triangle(packed: torch.Tensor, size: int) -> torch.Tensor:
    """Symmetric [size, size] matrix from its upper triangle in torch.triu_indices order."""
    rows, cols = torch.triu_indices(size, size)
    full = torch.zeros(size, size, dtype=packed.dtype)
    full[rows, cols] = packed
    full[cols, rows] = packed
    return full


def load_bundle(path: Path) -> list[dict]:
    """One block's linears: [{name, weight [out, in] float32, xtx [in, in] float32}]."""
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
        keys = list(handle.keys())
        tensors = {k: handle.get_tensor(k) for k in keys}
    site_of = json.loads(meta["linear_to_site"])
    sizes = json.loads(meta.get("site_sizes", "{}"))
    layers = []
    for linear, site in site_of.items():
        weight = tensors[f"{linear}.weight"].float()
        if f"{site}.xtx" in tensors:
            xtx = tensors[f"{site}.xtx"].float()
        else:
            xtx = unpack_upper_triangle(tensors[f"{site}.xtx_triu"].float(), int(sizes.get(site, weight.shape[1])))
        layers.append({"name": f"{path.stem}.{linear}", "model": meta.get("model", "smollm2"), "weight": weight, "xtx": xtx})
    return layers


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a dry run of the script itself


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_time(fn):
    """(result, seconds) with device synchronisation around the call."""
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return result, time.perf_counter() - start


def starting_state(weight, xtx, settings):
    """A realistic mid-run state: greedy init + one Adam phase (no beam pass yet)."""
    quick = dataclasses.replace(settings, max_epochs=0)
    layer, _ = quantize_layer(weight, xtx, quick, device=DEVICE, progress=False)
    codes = layer.codes.to(DEVICE)
    codebooks = layer.codebooks[:, :, 0, :].to(DEVICE)
    scales = layer.scales.flatten().to(DEVICE)
    w, h = weight.to(DEVICE), xtx.to(DEVICE)
    adam = CodebookAdam(w, h, codebooks, scales, settings.lr)
    adam.run(codes, settings.steps_per_epoch)
    return w, h, codes, adam.codebooks, adam.scales


def check_graph_replay(weight, xtx, settings) -> dict:
    w, h, codes, codebooks, scales = starting_state(weight, xtx, settings)
    eager = BeamSearcher(h, settings.beam_size, settings.memory_budget_bytes, use_graphs=False)(w, codebooks, scales, codes)
    graphed = BeamSearcher(h, settings.beam_size, settings.memory_budget_bytes, use_graphs=True)
    first = graphed(w, codebooks, scales, codes)
    second = graphed(w, codebooks, scales, codes)  # a replay, not the capture
    before = float(relative_output_mse(w, dequantize_weight(codes, codebooks, scales), h))
    after = float(relative_output_mse(w, dequantize_weight(eager, codebooks, scales), h))
    return {"graph_equals_eager": bool(torch.equal(first, eager) and torch.equal(second, eager)),
            "relative_mse_before_pass": before, "relative_mse_after_pass": after,
            "pass_never_worse": after <= before * (1 + 1e-6)}


def compare_with_reference(layer, settings, reference_search) -> dict:
    """One pass of ours (graph replay, after a warm-up capture) and one of the reference, same start."""
    w, h, codes, codebooks, scales = starting_state(layer["weight"], layer["xtx"], settings)
    searcher = BeamSearcher(h, settings.beam_size, settings.memory_budget_bytes, settings.use_cuda_graphs)
    searcher(w, codebooks, scales, codes)  # capture
    ours, ours_seconds = cuda_time(lambda: searcher(w, codebooks, scales, codes))
    theirs, theirs_seconds = cuda_time(lambda: reference_search(
        XTX=h, reference_weight=w, codebooks=codebooks[:, :, None, :], prev_codes=codes.to(torch.int32),
        scales=scales.reshape(-1, 1, 1, 1), beam_size=settings.beam_size, verbose=False))
    rel = lambda c: float(relative_output_mse(w, dequantize_weight(c.long(), codebooks, scales), h))
    return {"layer": layer["name"], "start_relative_mse": rel(codes), "ours_relative_mse": rel(ours),
            "reference_relative_mse": rel(theirs), "ours_pass_seconds": ours_seconds,
            "reference_pass_seconds": theirs_seconds, "speedup": theirs_seconds / ours_seconds}


def run_reference_layer(layer, settings, engine_class) -> dict:
    """AQLM's public per-layer loop (AQEngine.quantize) with the same settings; greedy init only."""
    from argparse import Namespace

    weight, xtx = layer["weight"].to(DEVICE), layer["xtx"].to(DEVICE)
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=DEVICE)
    linear.weight.data.copy_(weight)
    engine = engine_class(linear)
    engine.XTX.copy_(xtx.double())  # its default float64 accumulator
    args = Namespace(
        devices=[weight.device], out_group_size=1, in_group_size=settings.group_size,
        num_codebooks=settings.num_codebooks, nbits_per_codebook=settings.nbits, codebook_value_nbits=16,
        codebook_value_num_groups=1, scale_nbits=0, init_max_iter=settings.kmeans_max_iter,
        init_max_points_per_centroid=None, lr=settings.lr, max_epochs=settings.max_epochs,
        steps_per_epoch=settings.steps_per_epoch, relative_mse_tolerance=settings.relative_tolerance,
        print_frequency=10**9, beam_size=settings.beam_size,
    )
    torch.manual_seed(settings.seed)
    quantized, seconds = cuda_time(lambda: engine.quantize(args=args, verbose=False))
    with torch.no_grad():
        rel = float(relative_output_mse(weight, quantized().float(), xtx))
    return {"layer": layer["name"], "bpp": settings.num_codebooks, "reference_seconds": seconds, "reference_final_relative_mse": rel}


def run_layer(layer, settings) -> dict:
    weight, xtx = layer["weight"], layer["xtx"]
    out_features, in_features = weight.shape
    synchronize()
    quantized, report = quantize_layer(weight, xtx, settings, device=DEVICE, progress=False, name=layer["name"])
    epochs = report.epochs
    beam = [e["beam_seconds"] for e in epochs]
    adam = [e["adam_seconds"] for e in epochs]
    m, b = settings.num_codebooks, settings.beam_size
    return {
        "layer": layer["name"], "model": layer.get("model"), "shape": [out_features, in_features], "bpp": m,
        "init": settings.init, "rho": layer_rho(out_features, in_features, m, settings.nbits),
        "init_seconds": report.init_seconds, "epochs": len(epochs), "stopped_because": report.stopped_because,
        "beam_pass_seconds_median": sorted(beam)[len(beam) // 2] if beam else None,
        "beam_pass_seconds_first": beam[0] if beam else None,
        "adam_phase_seconds_median": sorted(adam)[len(adam) // 2] if adam else None,
        "total_seconds": report.total_seconds, "init_relative_mse": report.init_relative_mse,
        "final_relative_mse": report.final_relative_mse,
        "beam_pass_flop_floor": 2 * m * b * out_features * in_features**2,
        "adam_step_flop_floor": 2 * out_features * in_features**2, "history": epochs,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", type=Path, nargs="+", default=[Path(".device-carry/smollm2-layers")],
                        help="folders of layer bundles (benchmarks/prepare_layers.py), e.g. of several models")
    parser.add_argument("--seeds", type=int, nargs="+", default=[QuantizerSettings.seed],
                        help="quantizer seeds (k-means start, beam order): every layer and init once per seed")
    parser.add_argument("--bpp", type=int, nargs="+", default=[2, 3], help="codebooks of 8 bits: 2 -> 2 bpp, 3 -> 3 bpp")
    parser.add_argument("--inits", nargs="+", default=["greedy", "oaem"])
    parser.add_argument("--beam-size", type=int, default=8)
    parser.add_argument("--max-epochs", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--layers", nargs="*", default=None, help="substrings selecting layers (default: all)")
    parser.add_argument("--reference-src", type=Path, default=None)
    parser.add_argument("--reference-layers", type=int, default=7, help="how many layers to compare pass by pass")
    parser.add_argument("--reference-full", action="store_true", help="also run the reference's whole per-layer loop on every layer")
    parser.add_argument("--budget-seconds", type=float, default=520, help="stop starting new runs after this long")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "quantizer_gpu.json")
    parser.add_argument("--print-only", type=Path, default=None, help="print the tables of an earlier result JSON and exit")
    args = parser.parse_args(argv)
    if args.print_only is not None:
        print_tables(json.loads(args.print_only.read_text()))
        return 0

    started = time.perf_counter()
    torch.manual_seed(0)
    layers = [l for folder in args.bundles for p in sorted(folder.glob("*.safetensors")) for l in load_bundle(p)]
    if args.layers:
        layers = [l for l in layers if any(s in l["name"] for s in args.layers)]
    results = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
        "settings": {"beam_size": args.beam_size, "max_epochs": args.max_epochs, "relative_tolerance": args.tolerance,
                     "seeds": args.seeds},
        "runs": [], "reference_comparison": [], "reference_full": [],
    }

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))

    base = QuantizerSettings(beam_size=args.beam_size, max_epochs=args.max_epochs, relative_tolerance=args.tolerance)
    results["graph_check"] = check_graph_replay(layers[0]["weight"], layers[0]["xtx"], dataclasses.replace(base, init="greedy"))
    print("graph check:", results["graph_check"], flush=True)
    if not results["graph_check"]["graph_equals_eager"]:
        print("CUDA-graph replay differs from eager: timing the eager pass instead", flush=True)
        base = dataclasses.replace(base, use_cuda_graphs=False)

    reference_search = engine_class = None
    if args.reference_src is not None:
        sys.path.insert(0, str(args.reference_src))
        from src.beam_search_xtx import beam_search_optimal_codes as reference_search  # noqa: E402  (AQLM's public code)

        if args.reference_full:
            from aq_engine import AQEngine as engine_class  # noqa: E402  (AQLM's public code)

    def out_of_time() -> bool:
        if time.perf_counter() - started > args.budget_seconds:
            results["stopped_early"] = "budget"
            return True
        return False

    if DEVICE == "cuda":
        # Triton compiles its kernels once per process (then from its disk cache); graphs are
        # captured per shape. Compile outside the timings, then drop the graphs so that every
        # shape's first layer pays its capture, as a fresh per-layer job would.
        warm_start = time.perf_counter()
        for bpp in args.bpp:
            for init in args.inits:
                quantize_layer(layers[0]["weight"], layers[0]["xtx"], dataclasses.replace(base, num_codebooks=bpp, init=init, max_epochs=1),
                               device=DEVICE, progress=False)
        release_cuda_graphs()
        results["warmup_seconds"] = time.perf_counter() - warm_start
        print(f"warm-up (Triton compilation) {results['warmup_seconds']:.1f} s", flush=True)

    for bpp in args.bpp:  # everything for one bit rate before the next, so a cut budget loses whole rates
        greedy = dataclasses.replace(base, num_codebooks=bpp, init="greedy")
        if reference_search is not None:
            for layer in layers[: args.reference_layers]:
                row = compare_with_reference(layer, greedy, reference_search)
                row["bpp"] = bpp
                results["reference_comparison"].append(row)
                print(json.dumps(row), flush=True)
                save()
        for seed, init, layer in ((s, i, l) for s in args.seeds for i in args.inits for l in layers):
            if out_of_time():
                break
            row = run_layer(layer, dataclasses.replace(base, num_codebooks=bpp, init=init, seed=seed))
            row["seed"] = seed
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "history"}), flush=True)
            save()
        if engine_class is not None:
            for layer in layers:
                if out_of_time():
                    break
                row = run_reference_layer(layer, greedy, engine_class)
                results["reference_full"].append(row)
                print(json.dumps(row), flush=True)
                save()
    save()
    print_tables(results)
    return 0


def print_tables(results) -> None:
    print(f"\ndevice: {results['device']}  torch {results['torch']}  graph check: {results['graph_check']}")
    if results["reference_comparison"]:
        print("\none beam-search pass from the same state (b=8): ours vs AQLM reference")
        print(f"{'layer':34s} {'bpp':>3s} {'ours s':>8s} {'ref s':>8s} {'speedup':>8s} {'relMSE start':>12s} {'ours':>9s} {'ref':>9s}")
        for r in results["reference_comparison"]:
            print(f"{r['layer']:34s} {r['bpp']:3d} {r['ours_pass_seconds']:8.4f} {r['reference_pass_seconds']:8.4f} {r['speedup']:8.1f} "
                  f"{r['start_relative_mse']:12.5f} {r['ours_relative_mse']:9.5f} {r['reference_relative_mse']:9.5f}")
    print("\nbeam s: median seconds of a pass; floor GF: its 2·M·b·out·in² GFLOP. adam ms: one Adam step; floor GF: its 2·out·in²")
    print(f"{'layer':34s} {'bpp':>3s} {'init':>6s} {'rho':>6s} {'init s':>7s} {'ep':>3s} {'beam s':>7s} {'floor GF':>8s} "
          f"{'adam ms':>8s} {'floor GF':>8s} {'relMSE init':>11s} {'final':>8s} {'total s':>7s}")
    for r in results["runs"]:
        adam_step_ms = (r["adam_phase_seconds_median"] or 0) / results.get("steps_per_epoch", 100) * 1e3
        print(f"{r['layer']:34s} {r['bpp']:3d} {r['init']:>6s} {r['rho']:6.2f} {r['init_seconds']:7.2f} {r['epochs']:3d} "
              f"{(r['beam_pass_seconds_median'] or 0):7.4f} {r['beam_pass_flop_floor'] / 1e9:8.1f} {adam_step_ms:8.3f} "
              f"{r['adam_step_flop_floor'] / 1e9:8.2f} {r['init_relative_mse']:11.5f} {r['final_relative_mse']:8.5f} {r['total_seconds']:7.2f}")
    reference = {(r["bpp"], r["layer"]): r for r in results["reference_full"]}
    if reference:
        print("\nwhole per-layer loop, same settings: ours vs AQLM reference (greedy init both; oaem ours)")
        print(f"{'layer':34s} {'bpp':>3s} {'ref s':>7s} {'greedy s':>8s} {'oaem s':>7s} {'x greedy':>8s} {'x oaem':>7s} {'ref relMSE':>10s} {'greedy':>8s} {'oaem':>8s}")
        ours = {(r["bpp"], r["init"], r["layer"]): r for r in results["runs"]}
        for (bpp, name), ref in reference.items():
            g, o = ours.get((bpp, "greedy", name)), ours.get((bpp, "oaem", name))
            if g is None or o is None:
                continue
            print(f"{name:34s} {bpp:3d} {ref['reference_seconds']:7.2f} {g['total_seconds']:8.2f} {o['total_seconds']:7.2f} "
                  f"{ref['reference_seconds'] / g['total_seconds']:8.1f} {ref['reference_seconds'] / o['total_seconds']:7.1f} "
                  f"{ref['reference_final_relative_mse']:10.5f} {g['final_relative_mse']:8.5f} {o['final_relative_mse']:8.5f}")
        for bpp in sorted({b for b, _ in reference}):
            rows = [r for (b, _), r in reference.items() if b == bpp]
            print(f"reference {bpp} bpp: {len(rows)} layers, {sum(r['reference_seconds'] for r in rows):.1f} s, "
                  f"mean final relMSE {sum(r['reference_final_relative_mse'] for r in rows) / len(rows):.5f}")
    print(f"\n{'bpp':>3s} {'init':>6s} {'layers':>6s} {'total s':>8s} {'mean relMSE init':>16s} {'mean relMSE final':>17s}")
    keys = sorted({(r["bpp"], r["init"]) for r in results["runs"]})
    for bpp, init in keys:
        rows = [r for r in results["runs"] if r["bpp"] == bpp and r["init"] == init]
        print(f"{bpp:3d} {init:>6s} {len(rows):6d} {sum(r['total_seconds'] for r in rows):8.1f} "
              f"{sum(r['init_relative_mse'] for r in rows) / len(rows):16.5f} {sum(r['final_relative_mse'] for r in rows) / len(rows):17.5f}")


if __name__ == "__main__":
    sys.exit(main())
