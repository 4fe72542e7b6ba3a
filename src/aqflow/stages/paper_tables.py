"""`python -m aqflow paper-tables`: the paper's tables and claims regenerated from eval.json files.

Writes into --out-dir: runs.csv (one row per run), cells.md/.csv (mean ± sd over seeds per grid
cell, the paper's Llama-3.2-3B numbers beside the matching rows), domains.md/.csv (greedy / OA-EM
perplexity ratio per model and evaluation domain, with its measured distance from the calibration
text where --domain-distances gives one), claims.md/.csv (one row per claim and model: effect per
seed, its spread, a verdict computed from the data), four plots (one panel per model), and
README.md tying them together with the list of expected cells that have no run yet.

Models are never pooled: each model's claims are measured on its runs alone, and each model's
domains on its own distances (`--domain-distances MODEL=PATH` per model: every tokenizer measures
its own). A model's domains: --domains in the order given, else those of its domains.json from
the nearest to the farthest, else c4 and wikitext2. Its domain-distance claim is the slope of the
gap against the measured distance when every domain has one, else against the rank in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from aqflow.io import artifacts
from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import read_json, verify_inputs
from aqflow.experiments.claims import claims_table, gap_against_model_rho, paper_claims
from aqflow.experiments.paper_numbers import PAPER_DOMAIN_RATIOS, paper_cells
from aqflow.experiments.plots import plot_against_beam, plot_against_domain, plot_against_rho, plot_pre_to_post_pv
from aqflow.experiments.runs import after_pv_where_tuned, at_bit_rate_geometry, grid_evals, missing_cells, runs_table
from aqflow.experiments.tables import GROUP, PAPER_KEYS, frame_markdown, markdown_table, seed_statistics, with_paper
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "paper-tables"
DEFAULT_DOMAINS = ("c4", "wikitext2")
INPUT_ERRORS = EXPECTED_ERRORS
QUANTIZED_INITS = ("greedy", "oaem", "oaem-patient")
PLOTS = ("beam.png", "rho.png", "domains.png", "pv.png")
# The CSV tables' floats, in significant digits: more than the measurements carry (a perplexity's
# spread over seeds is a few percent), and few enough that a redraw on another CPU writes the same
# bytes. The slopes' least squares (np.polyfit) run in OpenBLAS, whose kernels are chosen by CPU: in
# full, one claim's t was 4.3766124619091205 with this machine's kernels and 4.376612461909124 with
# Haswell's (OPENBLAS_CORETYPE=Haswell), 8e-16 relative, which moves the 7th significant digit with a
# probability of about 1e-8. At 7 digits the redraws with the Haswell, Zen and Sandy Bridge kernels
# are byte-identical.
CSV_FLOAT_FORMAT = "%.7g"


def paper_domain(domain: str) -> str | None:
    """Which of the paper's texts an evaluation domain stands for ("wikitext2-standin" -> "wikitext2")."""
    for name in ("wikitext2", "c4", "lambada"):
        if domain == name or domain.startswith(f"{name}-"):
            return name
    return None


def cell_metrics(domains: list[str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(metric columns of the cells table, their labels, {paper column: our column}): perplexity
    of every domain before and after PV-tuning, average accuracy and quantization time."""
    metrics, labels, to_ours = [], {"avg_acc": "avg acc", "quantization_seconds": "quant. s"}, {}
    for domain in domains:
        for prefix, stage in (("pre_pv_", " pre-PV"), ("", "")):
            column = f"{prefix}{domain}_ppl"
            metrics.append(column)
            labels[column] = f"{domain}{stage}"
            if paper_domain(domain):
                to_ours[f"{prefix}{paper_domain(domain)}_ppl"] = column
    return metrics + ["avg_acc", "quantization_seconds"], labels, to_ours


def markdown_metrics(metrics: list[str], to_ours: dict[str, str]) -> list[str]:
    """The columns of cells.md: perplexity only on the domains the paper reports (its WikiText-2 and
    C4, or our stand-ins), when there are any, so that 17 domains do not make the table unreadable;
    cells.csv keeps every domain and domains.md compares them all."""
    paper_columns = set(to_ours.values())
    if not paper_columns:
        return metrics
    return [metric for metric in metrics if metric in paper_columns or not metric.endswith("_ppl")]


def headline_domain(domains: list[str]) -> str:
    """The domain the paper's headline claims use: its WikiText-2 (or our stand-in), else the farthest."""
    return next((domain for domain in domains if paper_domain(domain) == "wikitext2"), domains[-1])


@dataclass(frozen=True)
class PaperTablesSettings:
    domains: tuple[str, ...] = field(default=(), metadata=option(
        "evaluation domains (corpus names as in eval.json) ordered from the calibration text's own to the farthest "
        f"(default: each model's of its --domain-distances, nearest first; without them {' '.join(DEFAULT_DOMAINS)})"))


@dataclass(frozen=True)
class PaperTablesPaths:
    out_dir: Path
    evals: tuple[Path, ...] = field(default=(), metadata=option("eval.json files of the grid's runs", positional=True))
    expected_cells: Path | None = field(default=None, metadata=option(
        "JSON list of the grid's cells, each with its eval_json path (results/paper/grid.json): the ones that "
        "exist are read, the others listed as missing"))
    domain_distances: tuple[str, ...] = field(default=(), metadata=option(
        "domains.json of domain-distances per model, as MODEL=PATH (each model's distances of its domains from its "
        "calibration text, under its own tokenizer); one bare PATH serves runs of a single model"))


def distance_frame(record: dict) -> pd.DataFrame:
    """domains.json of domain-distances -> one row per domain (index), columns distance, distance_sd."""
    rows = record.get("domains") if isinstance(record, dict) else None
    if not isinstance(rows, list) or not all(isinstance(row, dict) and {"domain", "distance"} <= set(row) for row in rows):
        raise StageInputError("the domain distances file has no list `domains` of {domain, distance, ...} entries")
    frame = pd.DataFrame(rows).set_index("domain")
    return frame.reindex(columns=["distance", "distance_sd"])


def distance_files(entries: Sequence[str]) -> dict[str | None, Path]:
    """--domain-distances entries -> {model: domains.json}: MODEL=PATH each, or one bare PATH (key
    None: the domains.json of whichever single model the runs are of)."""
    files: dict[str | None, Path] = {}
    for entry in entries:
        model, separator, path = entry.partition("=")
        key = model if separator else None
        if key in files or (key is None and len(entries) > 1):
            raise StageInputError(f"--domain-distances {list(entries)}: give MODEL=PATH once per model "
                                  "(a bare PATH only alone)")
        files[key] = Path(path if separator else entry)
    return files


def distances_by_model(files: Mapping[str | None, Path], models: Sequence[str]) -> dict[str, pd.DataFrame]:
    """{model: distance_frame} of the files of distance_files for the runs' `models`; a bare file is
    the single model's, and runs of several models need theirs named."""
    frames = {model: distance_frame(read_json(path, required=False)) for model, path in files.items()}
    if None in frames:
        if len(models) > 1:
            raise StageInputError(f"one --domain-distances file for runs of {len(models)} models {list(models)}: "
                                  "give each model's as MODEL=PATH (their tokenizers measure different distances)")
        frames = {(models[0] if models else ""): frames[None]}
    return frames


def domain_order(given: list[str], distances: pd.DataFrame | None) -> list[str]:
    """The domains of the tables: `given` as ordered, else the measured ones nearest first, else the defaults."""
    if given:
        return given
    if distances is not None:
        return list(distances.sort_values("distance", kind="stable").index)
    return list(DEFAULT_DOMAINS)


def measured_distances(domains: list[str], distances: pd.DataFrame | None) -> dict[str, float] | None:
    """{domain: distance} when every domain of the tables has a measured one (the claim's x), else None (ranks)."""
    if distances is None or not set(domains) <= set(distances.index):
        return None
    return {domain: float(distances.loc[domain, "distance"]) for domain in domains}


def domain_table(runs: pd.DataFrame, domains: list[str], bpp: int = 2, beam: int = 8, max_epochs: int = 100,
                 distances: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per domain: its measured distance from the calibration text (where `distances` has it), mean
    pre-PV perplexity of greedy and OA-EM over seeds, their ratio, and the paper's ratio where it
    has that domain."""
    cell = runs[(runs["bpp"] == bpp) & (runs["beam"] == beam) & (runs["max_epochs"] == max_epochs)]
    rows = []
    for rank, domain in enumerate(domains):
        metric = f"pre_pv_{domain}_ppl"
        if metric not in cell:
            continue
        means = cell.groupby("init")[metric].mean()
        seeds = int(cell[cell["init"] == "oaem"]["seed"].nunique()) if "seed" in cell else 0
        greedy, oaem = means.get("greedy"), means.get("oaem")
        paper = PAPER_DOMAIN_RATIOS.set_index("domain")["ratio"].get(paper_domain(domain))
        measured = {}
        if distances is not None:
            known = domain in distances.index
            measured = {"distance": distances.loc[domain, "distance"] if known else None,
                        "distance_sd": distances.loc[domain, "distance_sd"] if known else None}
        rows.append({"domain": domain, "distance_rank": rank, **measured, "greedy_ppl": greedy, "oaem_ppl": oaem,
                     "ratio": greedy / oaem if greedy and oaem else None, "paper_ratio": paper, "seeds": seeds})
    return pd.DataFrame(rows)


def _write_table(out_dir: Path, name: str, frame: pd.DataFrame, markdown: str) -> None:
    with artifacts.atomic_path(out_dir / f"{name}.csv") as tmp:
        frame.to_csv(tmp, index=False, float_format=CSV_FLOAT_FORMAT)
    with artifacts.atomic_path(out_dir / f"{name}.md") as tmp:
        tmp.write_text(markdown)


def claims_markdown(claims: pd.DataFrame) -> str:
    lines = ["| claim | model | effect measured | mean | sd | seeds | paper | verdict |", "|---" * 8 + "|"]
    for _, row in claims.iterrows():
        number = lambda value: "" if pd.isna(value) else f"{value:.3f}"  # noqa: E731
        model = "" if pd.isna(row["model"]) else row["model"]
        lines.append(f"| {row['statement']} | {model} | {row['effect']} | {number(row['mean'])} | {number(row['sd'])} | "
                     f"{row['seeds']} | {number(row['paper'])} | **{row['verdict']}** |")
    return "\n".join(lines) + "\n"


def model_rho_markdown(table: pd.DataFrame) -> str:
    """gap_against_model_rho's frame as the claims' second table (claim (e) across models)."""
    lines = ["| model | ρ, largest layer | ρ, parameter-weighted | pre-PV gap (mean ± sd, seeds) | verdict | "
             "slope over its geometries (per decade of ρ) | verdict |", "|---" * 7 + "|"]
    number = lambda value, digits=3: "" if pd.isna(value) else f"{value:.{digits}f}"  # noqa: E731
    spread = lambda mean, sd: ("" if pd.isna(mean) else number(mean) if pd.isna(sd)  # noqa: E731
                               else f"{number(mean)} ± {number(sd)}")
    for _, row in table.iterrows():
        lines.append(f"| {row['model']} | {number(row['rho_largest'], 2)} | {number(row['rho_weighted'], 2)} | "
                     f"{spread(row['gap_mean'], row['gap_sd'])} ({row['gap_seeds']}) | {row['gap_verdict']} | "
                     f"{spread(row['slope_mean'], row['slope_sd'])} | {row['slope_verdict']} |")
    return "\n".join(lines) + "\n"


# The layer-level study of claim (e) (benchmarks/layer_rho.py writes it beside the tables): each
# layer's error from greedy and OA-EM against its ρ, at ρ that no model with whole runs reaches.
LAYER_STUDY = "layers_rho.md"


def claims_tables_markdown(claims: pd.DataFrame, model_rho: pd.DataFrame, layer_study: bool = False) -> str:
    """claims.md: the claims table, then (where a model has the pre-PV gap) the gap against each
    model's ρ, pointing at the layer-level study where the folder holds one (layer_study)."""
    text = claims_markdown(claims)
    if len(model_rho):
        text += ("\n### The pre-PV gap against each model's ρ (claim (e) across models)\n\n"
                 "ρ = N / K^M of the model's layers at 2 bpp's own geometry; each model's gap is measured on its "
                 "own runs (not pooled: a table to read, not a test). Beside it, the within-model test of the "
                 "same claim over the geometries of one bit rate.\n\n" + model_rho_markdown(model_rho))
        if layer_study:
            text += (f"\nThe same claim layer by layer, up to larger ρ than these models': [{LAYER_STUDY}]({LAYER_STUDY}) "
                     "(each layer's error after greedy and OA-EM initialisation against its ρ).\n")
    return text


def quantized_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The quantized runs of `runs` (the full-precision baselines left out)."""
    return runs[runs["init"].isin(QUANTIZED_INITS)] if len(runs) else runs


def run_models(runs: pd.DataFrame) -> list[str]:
    """The models of `runs` in order of first appearance."""
    return list(runs["model"].dropna().unique()) if len(runs) and "model" in runs else []


def domain_tables(runs: pd.DataFrame, domains_of: Mapping[str, list[str]],
                  distances: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Every model's domain_table, on its own runs, domains and distances, with a `model` column first."""
    frames = []
    for model, domains in domains_of.items():
        frame = domain_table(runs[runs["model"] == model], domains, distances=distances.get(model))
        if len(frame):
            frames.append(frame.assign(model=model)[["model", *frame.columns]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def write_tables(runs: pd.DataFrame, out_dir: Path, given_domains: list[str], expected: list[dict],
                 distances: Mapping[str, pd.DataFrame] | None = None) -> dict:
    """Every table, plot and the README into `out_dir`; returns what was written and what is missing.
    `given_domains`: every model's domains in this order ([]: each model's from its distances, nearest
    first); `distances`: per model, each domain's measured distance from that model's calibration
    text (index domain, columns distance, distance_sd), shown in its domain table rows and plot
    panel and used by its domain claim."""
    out_dir.mkdir(parents=True, exist_ok=True)
    distances = dict(distances or {})
    quantized = quantized_runs(runs)
    with artifacts.atomic_path(out_dir / "runs.csv") as tmp:
        runs.to_csv(tmp, index=False, float_format=CSV_FLOAT_FORMAT)
    models = run_models(quantized)
    domains_of = {model: domain_order(given_domains, distances.get(model)) for model in models}
    # the cells table's columns: every model's domains, the first model's order first
    domains = (list(dict.fromkeys(domain for model in models for domain in domains_of[model]))
               or domain_order(given_domains, next(iter(distances.values()), None)))
    measured_of = {model: measured_distances(domains_of[model], distances.get(model)) for model in models}
    all_metrics, labels, to_ours = cell_metrics(domains)
    metrics = [metric for metric in all_metrics if metric in quantized]
    # the paper's numbers are its bit rates' own geometries: none beside a rho sweep's rows
    paper = paper_cells().rename(columns=to_ours).assign(bit_rate_geometry=True)
    cells = (with_paper(seed_statistics(quantized, metrics, group=(*GROUP, "bit_rate_geometry")), paper, metrics,
                        on=(*PAPER_KEYS, "bit_rate_geometry")).drop(columns="bit_rate_geometry")
             if len(quantized) else pd.DataFrame())
    _write_table(out_dir, "cells", cells,
                 markdown_table(cells, markdown_metrics(metrics, to_ours), labels) if len(cells) else "no runs yet\n")
    own = at_bit_rate_geometry(quantized)  # what every table and plot but rho's compares
    domains_frame = domain_tables(own, domains_of, distances)
    _write_table(out_dir, "domains", domains_frame, frame_markdown(domains_frame) if len(domains_frame) else "no runs yet\n")
    headline = headline_domain(domains)
    claims = (claims_table(quantized, lambda model: paper_claims(domains_of.get(model, domains), headline,
                                                                 domain_distances=measured_of.get(model)))
              if len(quantized) else pd.DataFrame())
    claims_text = (claims_tables_markdown(claims, gap_against_model_rho(claims, quantized),
                                          layer_study=(out_dir / LAYER_STUDY).exists()) if len(claims)
                   else "no runs yet\n")
    _write_table(out_dir, "claims", claims, claims_text)
    draws = (lambda p: plot_against_beam(own, p, headline),
             lambda p: plot_against_rho(quantized, p, f"pre_pv_{headline}_ppl"),
             lambda p: plot_against_domain(own, domains_of, p, distances_of=measured_of),
             lambda p: plot_pre_to_post_pv(quantized, p, headline))
    for name, draw in zip(PLOTS, draws):
        with artifacts.atomic_path(out_dir / name) as tmp:
            draw(tmp)
    missing = missing_cells(expected)
    notes = [(f"{model}: " if len(models) > 1 else "")
             + domain_note(domains_of[model], distances.get(model), measured_of[model]) for model in models]
    seeds = quantized["seed"].nunique() if "seed" in quantized and len(quantized) else 0
    readme = ["# The paper's experiments on our models", "",
              f"{len(quantized)} quantized runs ({seeds} seeds{'; models ' + ', '.join(models) if len(models) > 1 else ''}); "
              "tables: cells.md, domains.md, claims.md; plots: " + ", ".join(PLOTS) + ".", "",
              *(notes or [domain_note(domains, None, None)]), "",
              "## Claims", "",
              "One row per claim and model with runs, measured on that model's runs alone (a claim no model has "
              "runs for: one row without a model).", "",
              claims_text, "",
              f"## Missing cells ({len(missing)})", ""]
    if expected:
        readme += [f"- `{cell['eval_json']}`" for cell in missing] or ["none"]
    else:
        readme += ["unknown: no grid was given (`--expected-cells results/paper/grid.json`, written by "
                   "`snakemake results/paper/grid.json`)"]
    with artifacts.atomic_path(out_dir / "README.md") as tmp:
        tmp.write_text("\n".join(readme) + "\n")
    return {"runs": len(runs), "missing": missing}


def domain_note(domains: list[str], distances: pd.DataFrame | None, measured: dict | None) -> str:
    """One README line: how the domains are ordered and what the domain-distance claim is measured against."""
    if measured is not None:
        return (f"Domains ({len(domains)}): distance from the calibration text measured as the Jensen-Shannon "
                "divergence of token unigrams (domains.json); the domain claim is the slope of the gap against it.")
    if distances is not None:
        unmeasured = sorted(set(domains) - set(distances.index))
        return (f"Domains ({len(domains)}) in the order given; no measured distance for {unmeasured}, so the "
                "domain claim is the slope of the gap against the rank in that order.")
    return (f"Domains ({len(domains)}) in the order given (no measured distances); the domain claim is the slope "
            "of the gap against the rank in that order.")


def run(settings: PaperTablesSettings, paths: PaperTablesPaths) -> dict:
    """Every table, plot and the README into paths.out_dir; what was written and what is missing."""
    absent = [str(path) for path in paths.evals if not path.is_file()]
    if absent:
        raise FileNotFoundError(f"eval.json files not found: {absent}")
    files = distance_files(paths.domain_distances)
    verify_inputs(*paths.evals, paths.expected_cells, *files.values())
    expected = read_json(paths.expected_cells, required=False) if paths.expected_cells else []
    runs = after_pv_where_tuned(runs_table(grid_evals(list(paths.evals), expected)))
    quantized = quantized_runs(runs)
    distances = distances_by_model(files, run_models(quantized))
    result = write_tables(runs, paths.out_dir, list(settings.domains), expected, distances)
    return result | {"out_dir": str(paths.out_dir)}


def summary(result: dict) -> str:
    return (f"paper tables from {result['runs']} runs -> {result['out_dir']} "
            f"({len(result['missing'])} expected cells missing)")


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)
