"""The report: one row per evaluated variant, a quality-vs-time Pareto plot and per-layer plots,
and with speed measured (speed.json beside eval.json) speed and memory columns and a plot of
quality against decode speed and memory.

Inputs are `eval.json` files (see `aqflow.stages.evaluate`); each carries its metrics, the
settings that produced it (with per-layer quantization summaries) and timings.

Perplexity columns are named after the evaluation domain, i.e. the corpus the text came from:
`wikitext2_ppl` / `c4_ppl` are the hub's WikiText-2 and C4 (comparable with published numbers),
`wikitext2-standin_ppl` / `c4-standin_ppl` the offline stand-ins, `<name>_ppl` a user corpus; the
`eval_text` column says where each domain's text came from and `calibration_corpus` what the
variant was calibrated on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from aqflow.io.artifacts import read_json, read_parquet  # noqa: E402


def _get(mapping, *keys, default=None):
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return default
        mapping = mapping[key]
    return mapping


def summary_row(path: str | Path) -> dict:
    """One eval.json -> one flat row (missing metrics are None)."""
    record = read_json(path, required=False)
    settings = pipeline_settings(record)
    quantizer = settings.get("quantizer") or {}
    calibration = settings.get("calibration") or {}
    metrics = record.get("metrics") or {}
    row = {
        "variant": record.get("label") or str(Path(path).parent),
        "model": settings.get("model"),
        "bpp": settings.get("bpp"),
        "init": quantizer.get("init", "fp" if not quantizer else None),
        "beam": quantizer.get("beam_size"),
        "max_epochs": quantizer.get("max_epochs"),
        # which propagation mode calibrated the variant (fp baselines have none)
        "propagation": calibration.get("propagation", "fp") if calibration else None,
        "block_finetune": bool(_get(calibration, "block_finetune", "enabled", default=False)) if calibration else None,
        "bits_per_parameter": record.get("bits_per_parameter"),
        "calibration_corpus": calibration.get("corpus") if calibration else None,
        **{f"{domain}_ppl": value for domain, value in domain_perplexities(record).items()},
        "eval_text": eval_text(record),
        "avg_acc": metrics.get("avg_acc"),
        "quantization_seconds": settings.get("quantization_seconds"),
        "calibration_seconds": settings.get("calibration_seconds"),
        "mean_layer_relative_mse": _mean(layer["final_relative_mse"] for layer in settings.get("layers", [])),
        **pv_columns(record),
        "eval_json": str(path),
    }
    for task, values in (metrics.get("tasks") or {}).items():
        for metric, value in values.items():
            if isinstance(value, (int, float)):
                row[f"{task}/{metric}"] = value
    return row


# Before evaluation domains were named after their corpus, eval.json called the stand-ins' numbers
# "wikitext2" and "c4" and marked them {"source": "offline"} in `data`.
LEGACY_STANDIN_DOMAINS = {"wikitext2": "wikitext2-standin", "c4": "c4-standin"}


def perplexity_domains(record: dict) -> list[str]:
    """The perplexity keys of an eval.json's metrics in the order they were asked for (its
    settings' `domain` list; eval.json itself is written with sorted keys)."""
    metrics = record.get("metrics") or {}
    names = [key for key, value in metrics.items() if isinstance(value, dict) and "perplexity" in value]
    asked = [entry[0] for entry in (_get(record, "settings", "domain") or []) if entry and entry[0] in names]
    return asked + [name for name in names if name not in asked]


def domain_perplexities(record: dict) -> dict[str, float]:
    """{evaluation domain: perplexity} of one eval.json, in its order (legacy stand-in keys renamed)."""
    data = record.get("data") or {}
    metrics = record.get("metrics") or {}
    out = {}
    for key in perplexity_domains(record):
        value = metrics[key]
        legacy = _get(data, key, "source") == "offline" and key in LEGACY_STANDIN_DOMAINS
        out[LEGACY_STANDIN_DOMAINS[key] if legacy else key] = value["perplexity"]
    return out


def eval_text(record: dict) -> str | None:
    """"wikitext2=hub Salesforce/wikitext@b08601e; c4=standin; notes=user notes.jsonl": where the text
    of every perplexity came from (the corpus's split record, copied into eval.json's `data`)."""
    data = record.get("data") or {}
    parts = []
    for domain in perplexity_domains(record):
        origin = _get(data, domain, "text")
        if not isinstance(origin, dict):
            if _get(data, domain, "source") == "offline":  # legacy eval.json: the stand-ins
                parts.append(f"{LEGACY_STANDIN_DOMAINS.get(domain, domain)}=standin")
            continue
        kind = origin.get("kind")
        if kind == "hub":
            where = ",".join(sorted({f"{f['repo_id']}@{(f.get('revision') or '?')[:7]}" for f in origin.get("files", [])}))
        elif kind == "user":
            where = Path(origin.get("path", "?")).name
        else:
            where = origin.get("package", "")
        parts.append(f"{domain}={kind} {where}".strip())
    return "; ".join(parts) or None


def pv_columns(record: dict) -> dict:
    """Before/after PV-tuning columns of one eval.json: the metrics of the embedded pre-PV
    evaluation and what the PV-tuning cost. A quantized model that was never PV-tuned (an
    eval_pre_pv.json, or a run with PV-tuning off) is its own pre-PV evaluation; an fp baseline
    has no pre-PV columns."""
    settings = pipeline_settings(record)
    pvtune = settings.get("pvtune") or {}
    never_tuned = bool(settings.get("quantizer")) and not pvtune
    pre = record if never_tuned else record.get("pre_pv") or {}
    pre_metrics = pre.get("metrics") or {}
    return {
        "pv_tuned": bool(pvtune),
        **{f"pre_pv_{domain}_ppl": value for domain, value in domain_perplexities(pre).items()},
        "pre_pv_avg_acc": pre_metrics.get("avg_acc"),
        "pvtune_seconds": _get(pvtune, "timings", "total_seconds"),
        "pvtune_steps": pvtune.get("steps"),
        "pvtune_selected_step": pvtune.get("best_step"),
        "pvtune_heldout_kl_before": pvtune.get("initial_heldout_kl"),
        "pvtune_heldout_kl_after": pvtune.get("best_heldout_kl"),
    }


def pipeline_settings(record: dict) -> dict:
    """The pipeline's own settings (model, bpp, quantizer, calibration, layers) embedded in an eval.json."""
    settings = record.get("settings") or {}
    return settings.get("upstream") or settings


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


# report column (before its device suffix) -> (speed.json path, key of that path's measurements); see
# aqflow.stages.speed
SPEED_METRICS = ("decode_tokens_per_second", "prefill_tokens_per_second", "resident_weight_bytes", "peak_memory_bytes")
SPEED_PATH_COLUMNS = {metric + suffix: (path, metric)
                      for metric in SPEED_METRICS for path, suffix in (("fast", ""), ("plain", "_plain"))}
SPEED_DEVICE_KINDS = ("gpu", "cpu")
SPEED_COLUMNS = (*(f"{column}_{kind}" for kind in SPEED_DEVICE_KINDS for column in (*SPEED_PATH_COLUMNS, "speed_device")),
                 "disk_weight_bytes")


def speed_sections(record: dict) -> dict[str, dict]:
    """A speed.json's device sections by kind (`gpu`, `cpu`; the first section of each kind where a
    list names several GPUs). A speed.json of the one-device layout (no `devices`) is its one section."""
    sections = record.get("devices")
    if sections is None:
        device = record.get("device") or "cpu"
        sections = {device: {"device": device, "name": record.get("device_name"), "paths": record.get("paths")}}
    found: dict[str, dict] = {}
    for device, section in sections.items():
        found.setdefault(section.get("kind") or ("cpu" if device == "cpu" else "gpu"), section)
    return found


def speed_columns(record: dict) -> dict:
    """The report's columns of one speed.json, per device kind (suffix `_gpu`, `_cpu`): batch-1 decode
    and prefill tokens/s, resident weight bytes and peak memory through the fastest path (`fast`) and
    through plain transformers + aqlm (`..._plain`), and the device's name (`speed_device`); None for
    a device or path not measured. Also the weight bytes on disk."""
    sections = speed_sections(record)
    columns = {}
    for kind in SPEED_DEVICE_KINDS:
        section = sections.get(kind) or {}
        paths = section.get("paths") or {}
        columns.update({f"{column}_{kind}": _get(paths, path, key) for column, (path, key) in SPEED_PATH_COLUMNS.items()})
        columns[f"speed_device_{kind}"] = section.get("name")
    return {**columns, "disk_weight_bytes": record.get("disk_weight_bytes")}


def speed_by_folder(speeds: Iterable[str | Path]) -> dict[Path, Path]:
    """speed.json files by their folder (the folder of the eval.json they belong to)."""
    return {Path(path).parent: Path(path) for path in speeds}


def summary_table(paths: Iterable[str | Path], speeds: Iterable[str | Path] = ()) -> pd.DataFrame:
    """One row per eval.json; given speed.json files, every row gets the SPEED_COLUMNS of the one in
    its eval.json's folder (None where there is none). Without any, no speed columns."""
    found = speed_by_folder(speeds)
    rows = []
    for path in paths:
        row = summary_row(path)
        if found:
            speed = found.get(Path(path).parent)
            row.update(speed_columns(read_json(speed)) if speed else dict.fromkeys(SPEED_COLUMNS))
        rows.append(row)
    return pd.DataFrame(rows)


def pareto_front(frame: pd.DataFrame, cost: str, quality: str) -> pd.DataFrame:
    """Rows not dominated in (lower cost, lower quality value), sorted by cost."""
    rows = frame.dropna(subset=[cost, quality]).sort_values([cost, quality])
    best = float("inf")
    keep = []
    for index, row in rows.iterrows():
        if row[quality] < best:
            keep.append(index)
            best = row[quality]
    return rows.loc[keep]


def _beam_label(beam) -> str:
    """'b8' for a beam read back as 8.0 (the table's beam column is float: fp rows hold NaN)."""
    return f"b{int(beam)}" if pd.notna(beam) else ""


def headline_domain(frame: pd.DataFrame) -> str | None:
    """The evaluation domain the Pareto plot shows: hub WikiText-2 if the table has it, else the
    WikiText-2 stand-in, else the first perplexity column with a value (None if there is none)."""
    columns = [c[:-len("_ppl")] for c in frame.columns
               if c.endswith("_ppl") and not c.startswith("pre_pv_") and frame[c].notna().any()]
    for preferred in ("wikitext2", "wikitext2-standin"):
        if preferred in columns:
            return preferred
    return columns[0] if columns else None


def plot_pareto(frame: pd.DataFrame, out: str | Path) -> None:
    """Perplexity (`headline_domain`) against quantization time, frontier drawn, fp baselines as lines.

    A PV-tuned variant is drawn at its post-PV perplexity, with a hollow marker at its pre-PV
    perplexity and an arrow between them (same quantization time: PV-tuning is not counted)."""
    domain = headline_domain(frame) or "wikitext2"
    ppl, pre_ppl = f"{domain}_ppl", f"pre_pv_{domain}_ppl"
    frame = frame.copy()
    for column in (ppl, pre_ppl, "pv_tuned"):
        if column not in frame:
            frame[column] = None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    quantized = frame[frame["init"].notna() & (frame["init"] != "fp")]
    for (init, bpp), group in quantized.groupby(["init", "bpp"], dropna=False):
        marker = {"greedy": "s", "oaem": "o"}.get(init, "^")
        points = ax.scatter(group["quantization_seconds"], group[ppl], label=f"{init} {bpp:g} bpp",
                            marker=marker)
        for _, row in group.iterrows():
            ax.annotate(_beam_label(row["beam"]), (row["quantization_seconds"], row[ppl]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        pre = group[group["pv_tuned"].fillna(False).astype(bool)] if "pv_tuned" in group else group.iloc[:0]
        if len(pre):
            ax.scatter(pre["quantization_seconds"], pre[pre_ppl], marker=marker, facecolors="none",
                       edgecolors=points.get_facecolor()[0], label=f"{init} {bpp:g} bpp before PV-tuning")
            for _, row in pre.iterrows():
                ax.annotate("", xy=(row["quantization_seconds"], row[ppl]),
                            xytext=(row["quantization_seconds"], row[pre_ppl]),
                            arrowprops={"arrowstyle": "->", "color": "grey", "linewidth": 0.8})
    front = pareto_front(quantized, "quantization_seconds", ppl)
    if len(front) > 1:
        ax.plot(front["quantization_seconds"], front[ppl], "k--", linewidth=0.8, label="Pareto front")
    for _, row in frame[frame["init"] == "fp"].iterrows():
        if pd.notna(row[ppl]):
            ax.axhline(row[ppl], color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"{row['model']} source model", (ax.get_xlim()[0], row[ppl]), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("quantization time, s (sum over layer jobs)")
    ax.set_ylabel(f"{domain} perplexity (log scale)")
    ax.set_title("quality vs quantization time")
    if len(quantized):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def short_label(row: pd.Series) -> str:
    """A point's label: the variant's label less its model ("2bpp/oaem/b8+pv"), "fp" for a baseline."""
    if row["init"] == "fp":
        return "fp"
    label = str(row["variant"])
    return label.split("/", 1)[1] if "/" in label else label


def bytes_unit(values: pd.Series) -> tuple[float, str]:
    """(divisor, name) of the binary unit that keeps the largest value between 1 and 1024."""
    largest = values.max() if values.notna().any() else 0
    for power, name in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024**power:
            return 1024.0**power, name
    return 1.0, "bytes"


def speed_plot_kind(frame: pd.DataFrame) -> str:
    """The device kind the speed figure shows: `gpu` where any row has a GPU figure, else `cpu`."""
    gpu = ["decode_tokens_per_second_gpu", "resident_weight_bytes_gpu"]
    return "gpu" if any(column in frame and frame[column].notna().any() for column in gpu) else "cpu"


def speed_points(frame: pd.DataFrame, kind: str | None = None) -> tuple[str, pd.DataFrame]:
    """(headline domain, one point per summary row with a perplexity and a speed figure on `kind`'s
    device (default `speed_plot_kind`)): its model, init, label (`short_label`), perplexity, and decode
    tokens/s and resident weight bytes through the fastest path (`decode`, `resident`) and plain
    transformers + aqlm (`*_plain`, NaN if not measured)."""
    kind = kind or speed_plot_kind(frame)
    domain = headline_domain(frame) or "wikitext2"
    columns = {"perplexity": f"{domain}_ppl", "decode": f"decode_tokens_per_second_{kind}",
               "decode_plain": f"decode_tokens_per_second_plain_{kind}", "resident": f"resident_weight_bytes_{kind}",
               "resident_plain": f"resident_weight_bytes_plain_{kind}"}
    points = pd.DataFrame({"model": frame["model"], "init": frame["init"],
                           "label": [short_label(row) for _, row in frame.iterrows()]}, index=frame.index)
    for name, column in columns.items():
        points[name] = pd.to_numeric(frame[column], errors="coerce") if column in frame else float("nan")
    has_speed = points["decode"].notna() | points["resident"].notna()
    return domain, points[points["perplexity"].notna() & has_speed].reset_index(drop=True)


def plot_speed(frame: pd.DataFrame, out: str | Path) -> None:
    """Perplexity (`headline_domain`) against batch-1 decode tokens/s (left) and resident weight
    memory (right) on the GPU where one was measured, else on the CPU (`speed_plot_kind`), every
    `speed_points` point: filled markers the fastest path, hollow ones plain transformers + aqlm
    joined to them by a thin line; one colour per model, one marker per init (a star for the source
    model)."""
    kind = speed_plot_kind(frame)
    domain, points = speed_points(frame, kind)
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    divisor, unit = bytes_unit(pd.concat([points["resident"], points["resident_plain"]]))
    colours = {model: f"C{index}" for index, model in enumerate(dict.fromkeys(points["model"]))}
    for (model, init), group in points.groupby(["model", "init"], dropna=False, sort=False):
        marker = {"fp": "*", "greedy": "s", "oaem": "o"}.get(init, "^")
        colour, size = colours[model], 110 if init == "fp" else 40
        label = f"{model} {'source model' if init == 'fp' else init}"
        for ax, fast, plain, scale in ((ax_speed, "decode", "decode_plain", 1.0),
                                       (ax_memory, "resident", "resident_plain", divisor)):
            rows = group.dropna(subset=[fast])
            ax.scatter(rows[fast] / scale, rows["perplexity"], marker=marker, color=colour, s=size, label=label,
                       zorder=3)
            for _, row in rows.iterrows():
                ax.annotate(row["label"], (row[fast] / scale, row["perplexity"]), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")
                if pd.notna(row[plain]):
                    ax.scatter(row[plain] / scale, row["perplexity"], marker=marker, facecolors="none",
                               edgecolors=colour, s=size)
                    ax.plot([row[plain] / scale, row[fast] / scale], [row["perplexity"]] * 2, color=colour,
                            linewidth=0.6)
    if points.empty:
        ax_speed.text(0.5, 0.5, "no speed measured (config speed.enabled)", ha="center", va="center",
                      transform=ax_speed.transAxes)
    else:
        ax_speed.set_yscale("log")
        ax_speed.legend(fontsize=7)
    ax_speed.set_xlabel(f"batch-1 decode on the {kind.upper()}, tokens/s (hollow: plain transformers + aqlm)")
    ax_speed.set_ylabel(f"{domain} perplexity (log scale)")
    ax_speed.set_title("quality vs decode speed")
    ax_memory.set_xlabel(f"resident weights on the {kind.upper()}, {unit} (hollow: plain transformers + aqlm)")
    ax_memory.set_title("quality vs weight memory")
    devices = sorted(set(frame[f"speed_device_{kind}"].dropna())) if f"speed_device_{kind}" in frame else []
    if devices:
        fig.suptitle(f"measured on {', '.join(devices)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def plot_layers(paths: Iterable[str | Path], out: str | Path) -> None:
    """Per-layer relative output MSE after init and at the end, and ρ, for every variant."""
    fig, (ax_mse, ax_rho) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for path in paths:
        record = read_json(path, required=False)
        layers = pipeline_settings(record).get("layers") or []
        if not layers:
            continue
        label = record.get("label") or str(path)
        x = range(len(layers))
        line = ax_mse.plot(x, [layer["final_relative_mse"] for layer in layers], label=f"{label} final")[0]
        ax_mse.plot(x, [layer["init_relative_mse"] for layer in layers], linestyle=":", color=line.get_color(), label=f"{label} init")
        ax_rho.plot(x, [layer["rho"] for layer in layers], color=line.get_color(), label=label)
    ax_mse.set_yscale("log")
    ax_mse.set_ylabel("relative output MSE")
    ax_rho.set_ylabel("ρ = N / K^M")
    ax_rho.set_yscale("log")
    ax_rho.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax_rho.set_xlabel("layer (block order)")
    ax_mse.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)


def pv_log_label(path: str | Path) -> str:
    """results/<model>/<bpp>bpp/<init>/<variant>/pv/train_log.parquet -> "<model>/<bpp>bpp/<init>/<variant>"."""
    parts = Path(path).parts
    return "/".join(parts[-6:-2]) if len(parts) >= 6 else str(path)


def plot_pv_curves(log_paths: Iterable[str | Path], out: str | Path) -> None:
    """PV-tuning curves per variant: training KL per step (thin) and held-out KL (thick, the
    selected step starred) above, held-out perplexity below."""
    fig, (ax_kl, ax_ppl) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    paths = list(log_paths)
    for path in paths:
        log = read_parquet(path, required=False)
        label = pv_log_label(path)
        train, heldout = log[log["split"] == "train"], log[log["split"] == "heldout"]
        line = ax_kl.plot(heldout["step"], heldout["kl"], marker="o", markersize=3, label=f"{label} held-out")[0]
        ax_kl.plot(train["step"], train["kl"], color=line.get_color(), linewidth=0.7, alpha=0.5, label=f"{label} train")
        ax_ppl.plot(heldout["step"], heldout["perplexity"], marker="o", markersize=3, color=line.get_color(), label=label)
        chosen = heldout[heldout["selected"]] if "selected" in heldout else heldout.iloc[0:0]
        ax_kl.scatter(chosen["step"], chosen["kl"], marker="*", s=120, color=line.get_color(), zorder=3)
    if not paths:
        ax_kl.text(0.5, 0.5, "PV-tuning is disabled in this configuration", ha="center", va="center",
                   transform=ax_kl.transAxes)
    ax_kl.set_ylabel("token KL(teacher || student), nats")
    ax_ppl.set_ylabel("held-out perplexity")
    if paths:  # variants differ by orders of magnitude, and early steps dwarf later gains
        ax_kl.set_yscale("log")
        ax_ppl.set_yscale("log")
    ax_ppl.set_xlabel("optimiser step")
    ax_kl.set_title("PV-tuning (star: the selected held-out state)")
    if paths:
        ax_kl.legend(fontsize=6, ncol=2)
        ax_ppl.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
