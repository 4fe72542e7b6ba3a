"""Plots of the experiment grid: perplexity against beam width, ρ and domain, and pre -> post PV.

Each takes the per-run frame (one row per variant and seed, columns as in `claims`) and draws
the mean over seeds with error bars of one sample sd; greedy and OA-EM share an axis. Models are
never pooled: each model of the frame gets its own panel, side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

INITS = {"greedy": ("s", "tab:red"), "oaem": ("o", "tab:blue"), "oaem-patient": ("^", "tab:green")}


def _mean_sd(frame: pd.DataFrame, by: str, metric: str) -> pd.DataFrame:
    stats = frame.dropna(subset=[metric]).groupby(by)[metric].agg(["mean", "std", "count"]).reset_index()
    return stats.fillna({"std": 0.0})


def _finish(ax, title: str, empty: bool, model: str | None) -> None:
    if empty:
        ax.text(0.5, 0.5, "no runs of this kind yet", ha="center", va="center", transform=ax.transAxes)
    else:
        # below the axes: inside, it hid points at the panel's edges
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.set_title(f"{model}: {title}" if model else title, fontsize=10)


def spread_labels(heights: Sequence[float], gap: float) -> np.ndarray:
    """Label heights (axes fractions) as near `heights` as possible, each at least `gap` from the
    next, in their order, inside [0, 1]. heights: [n] ascending; returns [n]."""
    placed = np.asarray(heights, dtype=float).copy()
    gap = min(gap, 1.0 / max(len(placed), 1))
    for index in range(len(placed)):  # up from the lowest, then back down from the top
        floor = placed[index - 1] + gap if index else 0.0
        placed[index] = max(placed[index], floor)
    for index in reversed(range(len(placed))):
        ceiling = placed[index + 1] - gap if index + 1 < len(placed) else 1.0
        placed[index] = min(placed[index], ceiling)
    return placed


def _label_column(ax, xs: Sequence[float], ys: Sequence[float], names: Sequence[str]) -> None:
    """Each point's name in a column right of the axes, joined to it by a thin line: names beside
    the points themselves overlapped wherever points crowd."""
    ax.autoscale_view()
    low, high = ax.get_ylim()
    order = np.argsort(ys)
    heights = spread_labels([(ys[index] - low) / (high - low) for index in order], gap=0.055)
    for index, height in zip(order, heights):
        ax.annotate(names[index], (xs[index], ys[index]), xytext=(1.03, height), textcoords="axes fraction",
                    fontsize=6, va="center", annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "color": "grey", "linewidth": 0.4, "shrinkA": 0, "shrinkB": 2})


def _per_model(runs: pd.DataFrame, out: str | Path, size: tuple[float, float],
               draw: Callable[[plt.Axes, pd.DataFrame, str | None], None]) -> None:
    """One panel of `size` inches per model of `runs` (one panel when it has none), each drawn by
    draw(axes, that model's runs, model), saved as one PNG."""
    models = list(runs["model"].dropna().unique()) if "model" in runs and len(runs) else [None]
    fig, axes = plt.subplots(1, len(models), figsize=(size[0] * len(models), size[1]), squeeze=False)
    for model, ax in zip(models, axes[0]):
        draw(ax, runs if model is None else runs[runs["model"] == model], model)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png", bbox_inches="tight")
    plt.close(fig)


def plot_against_beam(runs: pd.DataFrame, out: str | Path, headline: str = "wikitext2", bpp: int = 2,
                      max_epochs: int = 100) -> None:
    """Perplexity of domain `headline` against beam width, greedy vs OA-EM, before (dashed) and after PV."""
    def draw(ax, runs: pd.DataFrame, model: str | None) -> None:
        cell = runs[(runs["bpp"] == bpp) & (runs["max_epochs"] == max_epochs)]
        drawn = False
        for init, (marker, color) in INITS.items():
            for metric, style, stage in ((f"pre_pv_{headline}_ppl", "--", "before PV"),
                                         (f"{headline}_ppl", "-", "after PV")):
                stats = _mean_sd(cell[cell["init"] == init], "beam", metric) if metric in cell else pd.DataFrame()
                if len(stats):
                    ax.errorbar(stats["beam"], stats["mean"], yerr=stats["std"], marker=marker, color=color,
                                linestyle=style, capsize=3, label=f"{init} {stage}")
                    drawn = True
        ax.set_xscale("log", base=2)
        beams = sorted(cell["beam"].dropna().unique())
        if beams:
            ax.set_xticks(beams, [str(int(beam)) for beam in beams])
        ax.set_yscale("log")
        ax.set_xlabel("beam width")
        ax.set_ylabel(f"{headline} perplexity (mean ± sd over seeds)")
        _finish(ax, f"{bpp} bpp, at most {max_epochs} epochs", not drawn, model)

    _per_model(runs, out, (6, 4), draw)


def plot_against_rho(runs: pd.DataFrame, out: str | Path, metric: str = "pre_pv_wikitext2_ppl", bpp: int = 2,
                     beam: int = 8, max_epochs: int = 100) -> None:
    """Perplexity ratio greedy / OA-EM against ρ (one point per geometry of `bpp` bits per weight, at
    one beam and epoch budget), log-log."""
    def draw(ax, runs: pd.DataFrame, model: str | None) -> None:
        drawn = False
        if {"geometry", "rho", metric} <= set(runs.columns):
            runs = runs[(runs["bpp"] == bpp) & (runs["beam"] == beam) & (runs["max_epochs"] == max_epochs)]
            wide = runs.pivot_table(index=["geometry", "seed"], columns="init", values=metric, aggfunc="mean")
            if {"greedy", "oaem"} <= set(wide.columns):
                ratio = (wide["greedy"] / wide["oaem"]).dropna().rename("ratio").reset_index()
                rho = runs.groupby("geometry")["rho"].first()
                stats = ratio.groupby("geometry")["ratio"].agg(["mean", "std"]).fillna(0.0).join(rho).reset_index()
                if len(stats):
                    ax.errorbar(stats["rho"], stats["mean"], yerr=stats["std"], marker="o", linestyle="none", capsize=3,
                                label="greedy / OA-EM")
                    for _, row in stats.iterrows():
                        ax.annotate(row["geometry"], (row["rho"], row["mean"]), fontsize=7, xytext=(4, 4),
                                    textcoords="offset points")
                    drawn = True
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ρ = N / K^M (median over layers)")
        ax.set_ylabel("perplexity ratio greedy / OA-EM")
        _finish(ax, f"the gap against the representational ratio ({bpp} bpp, b{beam})", not drawn, model)

    _per_model(runs, out, (6, 4), draw)


def plot_against_domain(runs: pd.DataFrame, domains_of: Mapping[str, Sequence[str]], out: str | Path, bpp: int = 2,
                        beam: int = 8, max_epochs: int = 100,
                        distances_of: Mapping[str, Mapping[str, float] | None] | None = None) -> None:
    """Pre-PV perplexity ratio greedy / OA-EM per evaluation domain, one panel per model:
    against each domain's measured distance from that model's calibration text
    (`distances_of[model]`, e.g. JS divergence under its tokenizer) where given, else as bars in the
    order of `domains_of[model]`, nearest first."""
    distances_of = distances_of or {}
    measured = any(value is not None for value in distances_of.values())

    def draw(ax, runs: pd.DataFrame, model: str | None) -> None:
        distances = distances_of.get(model)
        cell = runs[(runs["bpp"] == bpp) & (runs["beam"] == beam) & (runs["max_epochs"] == max_epochs)]
        means, sds, names = [], [], []
        for domain in domains_of.get(model, ()):
            metric = f"pre_pv_{domain}_ppl"
            if metric not in cell:
                continue
            wide = cell.pivot_table(index="seed", columns="init", values=metric, aggfunc="mean")
            if {"greedy", "oaem"} <= set(wide.columns):
                ratio = (wide["greedy"] / wide["oaem"]).dropna()
                if len(ratio):
                    names.append(domain)
                    means.append(ratio.mean())
                    sds.append(ratio.std() if len(ratio) > 1 else 0.0)
        title = f"the gap by domain ({bpp} bpp, b{beam}, e{max_epochs}"
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")  # first: it sets the y range the labels follow
        if names and distances is not None:
            x = [float(distances[name]) for name in names]
            ax.errorbar(x, means, yerr=sds, marker="o", linestyle="none", capsize=3, color="tab:purple",
                        label="greedy / OA-EM")
            _label_column(ax, x, means, names)
        elif names:
            ax.bar(np.arange(len(names)), means, yerr=sds, capsize=3, color="tab:purple", label="greedy / OA-EM")
            ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right", fontsize=8)
        if distances is not None:
            ax.set_xlabel("distance from the calibration text (JS divergence of token unigrams, nats)")
            title += ")"
        else:
            title += "; nearest first)"
        ax.set_ylabel("pre-PV perplexity ratio greedy / OA-EM")
        _finish(ax, title, not names, model)

    _per_model(runs, out, (7, 4.5) if measured else (6, 4), draw)


def plot_pre_to_post_pv(runs: pd.DataFrame, out: str | Path, headline: str = "wikitext2") -> None:
    """Perplexity of domain `headline` before vs after PV-tuning, one point per run, greedy vs OA-EM."""
    pre, post = f"pre_pv_{headline}_ppl", f"{headline}_ppl"

    def draw(ax, runs: pd.DataFrame, model: str | None) -> None:
        drawn = False
        if {pre, post} <= set(runs.columns):
            for init, (marker, color) in INITS.items():
                group = runs[runs["init"] == init].dropna(subset=[pre, post])
                if len(group):
                    ax.scatter(group[pre], group[post], marker=marker, color=color, label=init)
                    drawn = True
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"{headline} perplexity before PV-tuning")
        ax.set_ylabel("after PV-tuning")
        _finish(ax, "PV-tuning: where each run starts and ends", not drawn, model)

    _per_model(runs, out, (5, 5), draw)
