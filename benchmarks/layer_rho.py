"""Layer-level evidence against ρ: greedy vs OA-EM on real layers, from quantizer_gpu.py results.

    python -m benchmarks.layer_rho RESULT.json [...] --out-dir results/published/paper --stem layers_rho
    python -m benchmarks.layer_rho --variant-dirs results/M/2bpp/greedy/b8 results/M/2bpp/oaem/b8 [...] \
        --runs-parquet OUT/layers.parquet --out-dir OUT    # a pipeline run's own layer jobs
    python -m benchmarks.layer_rho --runs-parquet OUT/layers.parquet --out-dir OUT   # again, from that table

For every (model, layer, init) of the runs: ρ = N/K^M of the layer, the relative output error
after the init and at the end (mean and sd over seeds), and epochs. Then per layer the ratio
init/greedy of both errors. Writes <stem>.csv (one row per layer and init), <stem>.md (the ratios
per layer, sorted by ρ, and the least-squares slope of log(ratio) against log10 ρ per init), and
<stem>.png (each init's errors as ratios to greedy's against ρ, log-log).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from aqflow.io.artifacts import atomic_path
from aqflow.stages.paper_tables import LAYER_STUDY


def runs_frame(paths: list[Path]) -> pd.DataFrame:
    """Every run of the result files: model, layer, init, seed, bpp, rho, init/final relative MSE, epochs."""
    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        for run in result["runs"]:
            rows.append({"model": run.get("model") or "smollm2", "layer": run["layer"], "init": run["init"],
                         "seed": run.get("seed", 42), "bpp": run["bpp"], "rho": run["rho"],
                         "init_relative_mse": run["init_relative_mse"], "final_relative_mse": run["final_relative_mse"],
                         "epochs": run["epochs"], "device": result["device"]})
    return pd.DataFrame(rows)


def variant_layer_runs(variant_dir: Path) -> pd.DataFrame:
    """The layer jobs of one pipeline variant (results/<model>/<bpp>bpp/<init>/<variant>/layers/*.json)
    in runs_frame's columns, plus the job's seconds and why its loop stopped: the whole model's
    layers at the run's own calibration, where quantizer_gpu.py runs take a few bundled layers."""
    model, bpp_folder, init = variant_dir.parts[-4:-1]
    rows = []
    for path in sorted((variant_dir / "layers").glob("*.json")):
        job = json.loads(path.read_text())
        rows.append({"model": model, "layer": job["layer"], "init": init, "seed": job["settings"]["seed"],
                     "bpp": int(bpp_folder.removesuffix("bpp")), "rho": job["rho"],
                     "init_relative_mse": job["init_relative_mse"], "final_relative_mse": job["final_relative_mse"],
                     "epochs": len(job["epochs"]), "device": job["device"],
                     "out_features": job["out_features"], "in_features": job["in_features"],
                     "init_seconds": job["init_seconds"], "seconds": job["total_seconds"],
                     "stopped_because": job["stopped_because"]})
    if not rows:
        raise SystemExit(f"{variant_dir}: no layer metrics under layers/ (a variant folder of results/?)")
    return pd.DataFrame(rows)


def per_layer(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and sd over seeds per (model, bpp, layer, init), with the ratios to greedy's means."""
    keys = ["model", "bpp", "layer", "init"]
    stats = runs.groupby(keys).agg(
        rho=("rho", "first"), seeds=("seed", "nunique"), epochs=("epochs", "mean"),
        init_mse=("init_relative_mse", "mean"), init_mse_sd=("init_relative_mse", "std"),
        final_mse=("final_relative_mse", "mean"), final_mse_sd=("final_relative_mse", "std")).reset_index()
    greedy = stats[stats["init"] == "greedy"][["model", "bpp", "layer", "init_mse", "final_mse"]].rename(
        columns={"init_mse": "init_mse_greedy", "final_mse": "final_mse_greedy"})
    joined = stats.merge(greedy, on=["model", "bpp", "layer"], how="left")
    joined["init_ratio"] = joined["init_mse"] / joined["init_mse_greedy"]
    joined["final_ratio"] = joined["final_mse"] / joined["final_mse_greedy"]
    return joined.drop(columns=["init_mse_greedy", "final_mse_greedy"]).sort_values(["bpp", "rho", "model", "layer", "init"])


def slope_against_rho(layers: pd.DataFrame, column: str) -> dict[tuple[int, str], float]:
    """Per (bpp, init other than greedy): least-squares slope of log(`column`) against log10 ρ."""
    slopes = {}
    for (bpp, init), group in layers[layers["init"] != "greedy"].groupby(["bpp", "init"]):
        group = group.dropna(subset=[column])
        if group["rho"].nunique() >= 2:
            slopes[(bpp, init)] = float(np.polyfit(np.log10(group["rho"]), np.log(group[column]), 1)[0])
    return slopes


def markdown(layers: pd.DataFrame, device: str) -> str:
    inits = [i for i in layers["init"].unique() if i != "greedy"]
    lines = [f"# Layer-level error against ρ ({device})", "",
             "Relative output error ‖(W−Ŵ)X‖²/‖WX‖² after the init and at the end of the layer's loop (beam 8, ≤100 epochs,",
             "1 % tolerance), as a ratio to greedy's on the same layer (mean over seeds; < 1: better than greedy).", ""]
    header = "| model | layer | bpp | ρ | seeds | greedy init | greedy final | " + " | ".join(
        f"{i} init ratio | {i} final ratio" for i in inits) + " |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for (model, bpp, layer), group in layers.groupby(["model", "bpp", "layer"], sort=False):
        by_init = group.set_index("init")
        if "greedy" not in by_init.index:
            continue
        greedy = by_init.loc["greedy"]
        cells = [f"{by_init.loc[i, 'init_ratio']:.3f} | {by_init.loc[i, 'final_ratio']:.3f}" if i in by_init.index else "– | –"
                 for i in inits]
        lines.append(f"| {model} | {layer} | {bpp} | {greedy['rho']:.2f} | {int(greedy['seeds'])} | {greedy['init_mse']:.4f} | "
                     f"{greedy['final_mse']:.4f} | " + " | ".join(cells) + " |")
    lines += ["", "Slope of log(ratio) against log10 ρ (negative: the init gains more over greedy as ρ grows):", ""]
    for column in ("init_ratio", "final_ratio"):
        for (bpp, init), slope in slope_against_rho(layers, column).items():
            lines.append(f"- {bpp} bpp, {init}, {column.replace('_', ' ')}: {slope:+.3f}")
    return "\n".join(lines) + "\n"


def plot(layers: pd.DataFrame, path: Path) -> None:
    """Each init's error as a ratio to greedy's on the same layer, against ρ (log-log): after the
    init and at the end; one colour per init, one marker per model and bit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = layers[layers["init"] != "greedy"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    groups = sorted({(m, b) for m, b in zip(others["model"], others["bpp"])})
    markers = dict(zip(groups, "osD^vP*X"))
    for ax, column, title in ((axes[0], "init_ratio", "after the init"), (axes[1], "final_ratio", "at the end")):
        for colour, (init, group) in zip(("tab:orange", "tab:green", "tab:red", "tab:purple"), others.groupby("init")):
            for (model, bpp), points in group.groupby(["model", "bpp"]):
                ax.scatter(points["rho"], points[column], color=colour, marker=markers[(model, bpp)], s=22,
                           label=f"{init}, {model} {bpp} bpp")
        ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ρ = N / K^M (groups per codeword combination)")
        ax.set_title(f"relative output error {title}, / greedy's")
    axes[0].set_ylabel("error / greedy's error (< 1: better)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path, help="quantizer_gpu.py result JSONs")
    parser.add_argument("--variant-dirs", nargs="*", type=Path, default=[],
                        help="pipeline variant folders whose layers/*.json to read")
    parser.add_argument("--runs-parquet", type=Path,
                        help="with --variant-dirs: where to write their runs (one row per layer job); "
                             "alone: the runs to read")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--stem", default=Path(LAYER_STUDY).stem, help="the name paper_tables links the claims to")
    args = parser.parse_args(argv)
    frames = [runs_frame(args.results)] if args.results else []
    if args.variant_dirs:
        variant_runs = pd.concat([variant_layer_runs(d) for d in args.variant_dirs], ignore_index=True)
        if args.runs_parquet:
            with atomic_path(args.runs_parquet) as tmp:
                variant_runs.to_parquet(tmp, index=False)
        frames.append(variant_runs)
    elif args.runs_parquet:
        frames.append(pd.read_parquet(args.runs_parquet))
    if not frames:
        parser.error("give result JSONs, --variant-dirs or --runs-parquet")
    runs = pd.concat(frames, ignore_index=True)
    layers = per_layer(runs)
    device = ", ".join(sorted(runs["device"].unique()))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out_dir / f"{args.stem}.csv") as tmp:
        layers.to_csv(tmp, index=False)
    text = markdown(layers, device)
    with atomic_path(args.out_dir / f"{args.stem}.md") as tmp:
        tmp.write_text(text)
    plot(layers, args.out_dir / f"{args.stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
