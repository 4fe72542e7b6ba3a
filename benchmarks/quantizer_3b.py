"""The quantizer on one Llama-shaped transformer block: seconds per phase, error, memory, projection.

Each of a Llama-3.2-3B block's seven linears (Llama-3.1-8B's with --models 8b) is quantized by
`quantize_layer` at the paper's settings (2 bpp 2x8 g8, beam 8, <= 100 epochs of 100 Adam steps, 1 %
tolerance, OA-EM init) as its layer job runs it, recording each layer's peak GPU memory. Inputs are
synthetic unless --bundles (benchmarks/prepare_layers.py): heavy-tailed weights with row scales and
XᵀX = D Q Λ Qᵀ D with a decaying spectrum and a few outlier channels in D, as real activations have,
seeded and cached in --data-dir so before and after see the same layers. The implementation is
whatever `aqflow` is importable:

    PYTHONPATH=old/src:. python3 benchmarks/quantizer_3b.py --label before --json $OUT/before.json
    PYTHONPATH=src:. python3 benchmarks/quantizer_3b.py --label after --json $OUT/after.json
    python3 benchmarks/quantizer_3b.py --combine $OUT/before.json $OUT/after.json --out $OUT/quantizer_3b_h100.json

Whole-model hours = block seconds x blocks (a 3B block scaled per layer where no block of the shape
was measured: init by group count, Adam and beam by out·in², epochs as measured).
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

MODELS = {
    # name: (blocks, hidden, kv width, intermediate)
    "3b": (28, 3072, 1024, 8192),
    "8b": (32, 4096, 1024, 14336),
}
# FP32 (non-tensor-core) peak of the cards we run on, for the beam pass's distance to its floor.
FP32_PEAK_FLOPS = {"H100": 67e12, "H200": 67e12}


def block_layers(model: str) -> list[tuple[str, int, int, str]]:
    """(name, out, in, input site) of the seven linears of one block."""
    _, hidden, kv, inter = MODELS[model]
    return [("q_proj", hidden, hidden, "attn_in"), ("k_proj", kv, hidden, "attn_in"), ("v_proj", kv, hidden, "attn_in"),
            ("o_proj", hidden, hidden, "o_in"), ("gate_proj", inter, hidden, "mlp_in"),
            ("up_proj", inter, hidden, "mlp_in"), ("down_proj", hidden, inter, "down_in")]


def synthetic_xtx(size: int, generator: torch.Generator, device: str) -> torch.Tensor:
    """D Q Λ Qᵀ D: random orthogonal Q, λ_i = i^-1.2 + 1e-3 (normalised), 1 % outlier channels. -> [size, size]"""
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, device=device))
    spectrum = torch.arange(1, size + 1, device=device, dtype=torch.float32) ** -1.2 + 1e-3
    spectrum = spectrum / spectrum.mean()
    channel = torch.ones(size, device=device)
    outliers = torch.randperm(size, generator=generator, device=device)[: max(1, size // 100)]
    channel[outliers] = 8 + 22 * torch.rand(outliers.numel(), generator=generator, device=device)
    xtx = (q * spectrum) @ q.T
    xtx = channel[:, None] * xtx * channel[None, :]
    return ((xtx + xtx.T) / 2).cpu()


def synthetic_weight(out_features: int, in_features: int, generator: torch.Generator, device: str) -> torch.Tensor:
    """Student-t-like entries (a Gaussian over a random scale) with log-normal row scales. -> [out, in]"""
    gauss = torch.randn(out_features, in_features, generator=generator, device=device)
    tails = torch.rand(out_features, in_features, generator=generator, device=device).clamp_min(0.05) ** -0.25
    rows = torch.exp(0.3 * torch.randn(out_features, 1, generator=generator, device=device))
    return (gauss * tails * rows / in_features**0.5).cpu()


def synthetic_block(model: str, data_dir: Path, device: str, seed: int = 0) -> list[dict]:
    """The block's layers [{name, weight, xtx}], cached on disk so a second run sees the same ones."""
    from safetensors.torch import load_file, save_file

    path = data_dir / f"synthetic_{model}_seed{seed}.safetensors"
    if path.exists():
        tensors = load_file(str(path))
    else:
        generator = torch.Generator(device=device).manual_seed(seed)
        tensors = {}
        for name, out_features, in_features, site in block_layers(model):
            if f"{site}.xtx" not in tensors:
                tensors[f"{site}.xtx"] = synthetic_xtx(in_features, generator, device)
            tensors[f"{name}.weight"] = synthetic_weight(out_features, in_features, generator, device)
        data_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path.with_suffix(".tmp")))
        os.replace(path.with_suffix(".tmp"), path)
    return [{"name": name, "weight": tensors[f"{name}.weight"], "xtx": tensors[f"{site}.xtx"]} for name, _, _, site in block_layers(model)]


def run_layer(layer: dict, settings, device: str) -> dict:
    from aqflow.quant.quantize import quantize_layer, release_cuda_graphs

    release_cuda_graphs()  # as in a fresh layer job: this layer pays its own captures
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    _, report = quantize_layer(layer["weight"], layer["xtx"], settings, device=device, progress=False, name=layer["name"])
    out_features, in_features = layer["weight"].shape
    epochs = report.epochs
    floor = 2 * settings.num_codebooks * settings.beam_size * out_features * in_features**2
    beam = [e["beam_seconds"] for e in epochs]
    return {
        "layer": layer["name"], "shape": [out_features, in_features], "init_seconds": report.init_seconds,
        "adam_seconds": sum(e["adam_seconds"] for e in epochs), "beam_seconds": sum(beam),
        "beam_pass_seconds_median": sorted(beam)[len(beam) // 2] if beam else None,
        "beam_pass_flop_floor": floor, "epochs": len(epochs), "stopped_because": report.stopped_because,
        "total_seconds": report.total_seconds, "init_relative_mse": report.init_relative_mse,
        "final_relative_mse": report.final_relative_mse,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "history": epochs,
    }


def warm_up(layers: list[dict], settings, device: str) -> float:
    """Compile the Triton kernels for every input width (then cached on disk), outside the timings."""
    from aqflow.quant.quantize import quantize_layer

    started = time.perf_counter()
    seen = set()
    for layer in layers:
        width = layer["weight"].shape[1]
        if width in seen:
            continue
        seen.add(width)
        quantize_layer(layer["weight"][:512], layer["xtx"], dataclasses.replace(settings, max_epochs=1), device=device, progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(args) -> dict:
    import aqflow.quant
    from aqflow.quant.quantize import QuantizerSettings

    device = "cuda"
    settings = QuantizerSettings(beam_size=args.beam_size, max_epochs=args.max_epochs, relative_tolerance=args.tolerance)
    result = {"label": args.label, "aqflow_src": os.path.relpath(Path(aqflow.quant.__file__).parent),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "settings": dataclasses.asdict(settings), "blocks": {}}
    for model in args.models:
        if args.bundles is not None:
            from benchmarks.quantizer_gpu import load_bundle

            layers = [l for p in sorted(args.bundles.glob("*.safetensors")) for l in load_bundle(p)]
            model_key = f"bundles:{args.bundles.name}"
        else:
            started = time.perf_counter()
            layers = synthetic_block(model, args.data_dir, device)
            print(f"[{args.label}] {model} data ready in {time.perf_counter() - started:.1f} s", flush=True)
            model_key = model
        warm = warm_up(layers, settings, device)
        print(f"[{args.label}] {model_key} warm-up {warm:.1f} s", flush=True)
        rows = []
        for layer in layers:
            row = run_layer(layer, settings, device)
            rows.append(row)
            print(f"[{args.label}] " + json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items() if k != "history"}), flush=True)
        result["blocks"][model_key] = {"warmup_seconds": warm, "layers": rows, "block_seconds": sum(r["total_seconds"] for r in rows)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        if args.bundles is not None:
            break
    return result


def fp32_peak(device_name: str) -> float | None:
    return next((v for k, v in FP32_PEAK_FLOPS.items() if k in device_name), None)


def project_hours(block: dict, model: str, source_model: str) -> float:
    """Whole-model hours from a block of `source_model` shapes, scaled per layer to `model`'s."""
    blocks = MODELS[model][0]
    if model == source_model:
        return block["block_seconds"] * blocks / 3600
    target = {name: (o, i) for name, o, i, _ in block_layers(model)}
    seconds = 0.0
    for row in block["layers"]:
        out_features, in_features = row["shape"]
        to_out, to_in = target[row["layer"]]
        group_ratio = (to_out * to_in) / (out_features * in_features)
        gemm_ratio = (to_out * to_in**2) / (out_features * in_features**2)
        other = row["total_seconds"] - row["init_seconds"] - row["adam_seconds"] - row["beam_seconds"]
        seconds += (row["init_seconds"] + other) * group_ratio + (row["adam_seconds"] + row["beam_seconds"]) * gemm_ratio
    return seconds * blocks / 3600


def summarise(run: dict) -> dict:
    """Per block: totals, mean relative MSE, worst peak memory, beam pass vs its FP32 floor; projections."""
    peak = fp32_peak(run["device"])
    summary = {}
    for key, block in run["blocks"].items():
        layers = block["layers"]
        entry = {
            "block_seconds": block["block_seconds"],
            "init_seconds": sum(r["init_seconds"] for r in layers),
            "adam_seconds": sum(r["adam_seconds"] for r in layers),
            "beam_seconds": sum(r["beam_seconds"] for r in layers),
            "epochs": [r["epochs"] for r in layers],
            "mean_final_relative_mse": sum(r["final_relative_mse"] for r in layers) / len(layers),
            "max_peak_memory_gib": max(r["peak_memory_gib"] for r in layers),
        }
        if peak is not None:
            entry["beam_pass_x_fp32_floor"] = {
                r["layer"]: r["beam_pass_seconds_median"] / (r["beam_pass_flop_floor"] / peak) for r in layers if r["beam_pass_seconds_median"]
            }
        if key in MODELS:
            entry["projected_hours"] = {m: project_hours(block, m, key) for m in MODELS}
            entry["projection_basis"] = {m: ("measured block" if m == key else f"scaled from the {key} block") for m in MODELS}
        summary[key] = entry
    # a measured block of a model beats a scaled one
    for key in summary:
        if key in MODELS and "projected_hours" in summary[key]:
            for m in MODELS:
                if m != key and m in summary:
                    summary[key]["projected_hours"][m] = summary[m]["projected_hours"][m]
                    summary[key]["projection_basis"][m] = "measured block"
    return summary


def combine(paths: list[Path], out: Path) -> dict:
    runs = [json.loads(p.read_text()) for p in paths]
    combined = {"device": runs[0]["device"], "fp32_peak_flops_assumed": fp32_peak(runs[0]["device"]), "runs": runs}
    combined["summary"] = {run["label"]: summarise(run) for run in runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(combined, indent=1))
    print_table(combined)
    return combined


def print_table(combined: dict) -> None:
    print(f"\ndevice: {combined['device']}  (FP32 peak assumed {combined['fp32_peak_flops_assumed']})")
    header = f"{'run':8s} {'block':10s} {'total s':>8s} {'init s':>7s} {'adam s':>7s} {'beam s':>7s} {'epochs':>22s} {'mean relMSE':>11s} {'peak GiB':>8s} {'3B h':>6s} {'8B h':>6s}"
    print(header)
    for label, blocks in combined["summary"].items():
        for key, s in blocks.items():
            hours = s.get("projected_hours", {})
            print(f"{label:8s} {key:10s} {s['block_seconds']:8.1f} {s['init_seconds']:7.1f} {s['adam_seconds']:7.1f} {s['beam_seconds']:7.1f} "
                  f"{str(s['epochs']):>22s} {s['mean_final_relative_mse']:11.5f} {s['max_peak_memory_gib']:8.2f} "
                  f"{hours.get('3b', float('nan')):6.2f} {hours.get('8b', float('nan')):6.2f}")
    for run in combined["runs"]:
        for key, block in run["blocks"].items():
            print(f"\n{run['label']} {key}: per layer (init / adam / beam s, epochs, beam pass s, x FP32 floor, relMSE, peak GiB)")
            floors = combined["summary"][run["label"]][key].get("beam_pass_x_fp32_floor", {})
            for r in block["layers"]:
                print(f"  {r['layer']:10s} {r['init_seconds']:6.2f} {r['adam_seconds']:6.2f} {r['beam_seconds']:6.2f} {r['epochs']:3d} "
                      f"{(r['beam_pass_seconds_median'] or 0):7.3f} {floors.get(r['layer'], float('nan')):6.1f} {r['final_relative_mse']:.5f} {r['peak_memory_gib']:5.2f}")


def top_kernels(fn, label: str, rows: int = 12) -> None:
    """Print the CUDA kernels of one call of `fn` (after one untimed call), costliest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n== {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


def profile_phases(data_dir: Path, layer_name: str) -> None:
    """Top CUDA kernels of 10 eager Adam steps, one eager beam pass and 50 Lloyd iterations on one 3B layer."""
    from aqflow.quant.beam_search import beam_search_rows
    from aqflow.quant.codebook_update import CodebookAdam
    from aqflow.quant.kmeans import fit_kmeans
    from aqflow.quant.quantize import QuantizerSettings, quantize_layer

    layer = next(l for l in synthetic_block("3b", data_dir, "cuda") if l["name"] == layer_name)
    quantized, _ = quantize_layer(layer["weight"], layer["xtx"], QuantizerSettings(init="greedy", max_epochs=0, kmeans_max_iter=20), device="cuda", progress=False)
    w, h = layer["weight"].cuda(), layer["xtx"].cuda()
    codes, codebooks, scales = quantized.codes.cuda(), quantized.codebooks[:, :, 0].cuda(), quantized.scales.flatten().cuda()
    adam = CodebookAdam(w, h, codebooks, scales, 1e-4)
    top_kernels(lambda: adam.run(codes, 10), f"{layer_name}: 10 Adam steps (eager)")
    top_kernels(lambda: beam_search_rows(w[:1024], h, codebooks, scales[:1024], codes[:1024], 8), f"{layer_name}: one beam pass over 1024 rows (eager)")
    points = (w / w.norm(dim=1, keepdim=True)).reshape(-1, 8)
    top_kernels(lambda: fit_kmeans(points, 256, 50, torch.Generator().manual_seed(0)), f"{layer_name}: k-means, 50 iterations")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run")
    parser.add_argument("--models", nargs="+", default=["3b"], choices=sorted(MODELS))
    parser.add_argument("--bundles", type=Path, default=None, help="real layer bundles instead of the synthetic block")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/quantizer_3b_data"))
    parser.add_argument("--beam-size", type=int, default=8)
    parser.add_argument("--max-epochs", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "quantizer_3b_run.json")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, help="run JSONs to put side by side")
    parser.add_argument("--out", type=Path, default=None, help="with --combine: the combined JSON")
    parser.add_argument("--profile", default=None, metavar="LAYER", help="print the top kernels of each phase on this 3B layer and exit")
    args = parser.parse_args(argv)
    if args.combine:
        combine(args.combine, args.out or args.combine[0].with_name("quantizer_3b.json"))
        return 0
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device")
    if args.profile:
        profile_phases(args.data_dir, args.profile)
        return 0
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
