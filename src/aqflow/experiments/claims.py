"""The paper's claims, tested on our runs: one effect per seed, its spread, and a verdict.

Every claim compares greedy with OA-EM initialisation at the same cell and seed (the same
calibration, the same beam and epoch budget), through the log perplexity ratio

    gap = log(ppl_greedy) - log(ppl_oaem)        (> 0: OA-EM is better; 0.69 means 2x)

so that effects are comparable across models and domains whose perplexities differ by orders of
magnitude. A claim's effect is one number per seed (a gap, or a difference or slope of gaps); the
verdict is a two-sided 95 % Student-t test of its mean against zero over the seeds: "holds" (mean
> 0, significant), "does not hold" (mean < 0, significant) or "inconclusive" (not significant, or
fewer than `MIN_SEEDS` seeds).

Claims are measured per model, never pooled: two architectures' gaps are different quantities
(their perplexities, tokenizers and domain distances differ), so `claims_table` gives one row per
claim and model with runs, and the measures refuse a frame of several models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from .runs import at_bit_rate_geometry

MIN_SEEDS = 3
NO_RUNS = "inconclusive (no runs)"
BASELINE, CANDIDATE = "greedy", "oaem"
CELL = ("model", "bpp", "beam", "max_epochs")
# Two-sided 95 % quantiles of Student's t by degrees of freedom (1-30); beyond 30 the normal 1.96
# is within 2 % of the exact value.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t_critical(degrees_of_freedom: int) -> float:
    """The two-sided 95 % critical value of Student's t."""
    if degrees_of_freedom < 1:
        raise ValueError(f"need at least 1 degree of freedom, got {degrees_of_freedom}")
    return _T975[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T975) else 1.96


@dataclass(frozen=True)
class Effect:
    """A claim's per-seed effects summarised: mean, sample sd, seeds, t statistic and verdict."""

    mean: float
    sd: float
    seeds: int
    t: float
    verdict: str


def summarise_effect(per_seed: Sequence[float]) -> Effect:
    """per_seed: one effect per seed (NaNs dropped) -> Effect with the t-test verdict."""
    values = np.asarray([v for v in per_seed if v is not None and not math.isnan(v)], dtype=float)
    n = len(values)
    if n == 0:
        return Effect(math.nan, math.nan, 0, math.nan, NO_RUNS)
    mean = float(values.mean())
    sd = float(values.std(ddof=1)) if n > 1 else math.nan
    if n < MIN_SEEDS:
        return Effect(mean, sd, n, math.nan, f"inconclusive (fewer than {MIN_SEEDS} seeds)")
    t = mean / (sd / math.sqrt(n)) if sd > 0 else math.copysign(math.inf, mean) if mean else 0.0
    if abs(t) <= t_critical(n - 1):
        verdict = "inconclusive"
    else:
        verdict = "holds" if mean > 0 else "does not hold"
    return Effect(mean, sd, n, t, verdict)


def paired_gaps(frame: pd.DataFrame, metric: str, cell: Sequence[str] = CELL, baseline: str = BASELINE,
                candidate: str = CANDIDATE) -> pd.DataFrame:
    """log(ppl of `baseline`) - log(ppl of `candidate`) per cell and seed (greedy vs OA-EM by default).

    frame: one row per evaluated variant and seed, with the `cell` columns, `init`, `seed` and
    `metric` (a perplexity column), and `geometry` if it has one. Returns the cell columns (and
    geometry), seed and gap; cells or seeds where either init is missing are left out.
    """
    # greedy and OA-EM are paired at one geometry, never across a rho sweep's geometries
    keys = [*cell, *(["geometry"] if "geometry" in frame and "geometry" not in cell else []), "seed"]
    subset = frame[frame["init"].isin([baseline, candidate])].dropna(subset=[metric])
    wide = subset.pivot_table(index=keys, columns="init", values=metric, aggfunc="mean")
    if baseline not in wide or candidate not in wide:
        return pd.DataFrame(columns=[*keys, "gap"])
    gaps = (np.log(wide[baseline]) - np.log(wide[candidate])).dropna().rename("gap")
    return gaps.reset_index()


def _select(frame: pd.DataFrame, **where) -> pd.DataFrame:
    mask = pd.Series(True, index=frame.index)
    for column, value in where.items():
        mask &= frame[column] == value
    return frame[mask]


def _one_model(gaps: pd.DataFrame) -> pd.DataFrame:
    """`gaps` unchanged when it holds at most one model; a frame of several raises (no pooling)."""
    models = gaps["model"].dropna().unique() if "model" in gaps else []
    if len(models) > 1:
        raise ValueError(f"gaps of several models {sorted(map(str, models))}: claims are measured per model "
                         "(claims_table splits the runs by model)")
    return gaps


def _per_seed(gaps: pd.DataFrame) -> pd.Series:
    """Gap per seed (mean over the cells of one model that remain after selection: normally exactly one)."""
    return _one_model(gaps).groupby("seed")["gap"].mean()


def gap_at(frame: pd.DataFrame, metric: str, baseline: str = BASELINE, candidate: str = CANDIDATE, **cell) -> pd.Series:
    """The per-seed gap of `metric` at one cell (e.g. bpp=2, beam=8, max_epochs=100)."""
    return _per_seed(_select(paired_gaps(frame, metric, baseline=baseline, candidate=candidate), **cell))


def difference_of_gaps(frame: pd.DataFrame, metric: str, first: dict, second: dict) -> pd.Series:
    """Per seed: gap at cell `first` minus gap at cell `second` (seeds present in both)."""
    return (gap_at(frame, metric, **first) - gap_at(frame, metric, **second)).dropna()


def beam_benefit_difference(frame: pd.DataFrame, metric: str, narrow: int, wide: int, **cell) -> pd.Series:
    """Per seed: how much more widening the beam from `narrow` to `wide` lowers greedy's log
    perplexity than OA-EM's. Equal to gap(narrow) - gap(wide); > 0 when beam width helps greedy more."""
    return difference_of_gaps(frame, metric, {**cell, "beam": narrow}, {**cell, "beam": wide})


def slope_per_seed(points: pd.DataFrame, x: str) -> pd.Series:
    """Per seed: the least-squares slope of gap against column `x` (seeds with fewer than two
    distinct x values are left out)."""
    slopes = {}
    for seed, group in points.dropna(subset=[x, "gap"]).groupby("seed"):
        if group[x].nunique() >= 2:
            slopes[seed] = float(np.polyfit(group[x].astype(float), group["gap"].astype(float), 1)[0])
    return pd.Series(slopes, dtype=float)


def gap_against_rho(frame: pd.DataFrame, metric: str, bits_per_weight: float = 2.0, **cell) -> pd.Series:
    """Per seed: slope of the gap against log10 ρ over the bit-rate geometries of `frame` that
    store `bits_per_weight` code bits per weight (its `geometry`, `rho` and `nominal_bits` columns:
    one ρ per model and geometry, e.g. the median over layers), so that ρ varies at a fixed rate."""
    if "nominal_bits" in frame:
        frame = frame[np.isclose(frame["nominal_bits"].astype(float), bits_per_weight)]
    gaps = _one_model(_select(paired_gaps(frame, metric, cell=(*CELL, "geometry")), **cell))
    rho = frame.groupby(["model", "geometry"])["rho"].first().rename("rho").reset_index()
    points = gaps.merge(rho, on=["model", "geometry"])
    points["log10_rho"] = np.log10(points["rho"].astype(float))
    return slope_per_seed(points, "log10_rho")


def gap_against_domain_distance(frame: pd.DataFrame, domains_near_to_far: Sequence[str],
                                metric_of: Callable[[str], str], distances: Mapping[str, float] | None = None,
                                **cell) -> pd.Series:
    """Per seed: slope of the gap against each domain's distance from the calibration text:
    `distances[domain]` where measured (e.g. the Jensen-Shannon divergence of domains.json), else
    the domain's rank in `domains_near_to_far` (0 = the calibration domain). `metric_of(domain)`
    names the perplexity column."""
    if distances is not None:
        unmeasured = [domain for domain in domains_near_to_far if domain not in distances]
        if unmeasured:
            raise KeyError(f"no measured distance for domains {unmeasured}")
    parts = []
    for rank, domain in enumerate(domains_near_to_far):
        if metric_of(domain) not in frame:
            continue
        per_seed = gap_at(frame, metric_of(domain), **cell)
        x = float(distances[domain]) if distances is not None else rank
        parts.append(pd.DataFrame({"seed": per_seed.index, "gap": per_seed.values, "distance": x}))
    if not parts:
        return pd.Series(dtype=float)
    return slope_per_seed(pd.concat(parts, ignore_index=True), "distance")


@dataclass(frozen=True)
class Claim:
    """One claim of the paper, how its effect is measured, and the paper's own figure for it."""

    name: str
    statement: str
    effect: str
    measure: Callable[[pd.DataFrame], pd.Series]
    paper_effect: float | None
    # why these runs cannot test the claim at all, or None: e.g. a PV-tuning that kept its start
    unmeasurable: Callable[[pd.DataFrame], str | None] = lambda runs: None


def heldout_kl_reduction(frame: pd.DataFrame, inits: Sequence[str] = (BASELINE, CANDIDATE), **cell) -> pd.Series:
    """Per seed: the smallest log(held-out KL before / after PV-tuning) over the runs of `inits` at
    `cell` (columns pvtune_heldout_kl_before / _after), so a seed's effect is > 0 only if
    PV-tuning lowered the KL in each of its runs. A seed counts with the inits it has PV-tuned runs
    of (a grid may PV-tune one init per seed, as Qwen2.5-Coder-1.5B's does): the claim is about
    every run, not a comparison of inits; seeds without any PV-tuned run are left out."""
    if "pvtune_heldout_kl_before" not in frame:
        return pd.Series(dtype=float)
    runs = _one_model(_select(frame[frame["init"].isin(inits)], **cell))
    runs = runs.dropna(subset=["pvtune_heldout_kl_before", "pvtune_heldout_kl_after"])
    reduction = np.log(runs["pvtune_heldout_kl_before"].astype(float) / runs["pvtune_heldout_kl_after"].astype(float))
    per_run = runs.assign(reduction=reduction).groupby(["seed", "init"])["reduction"].mean().unstack("init")
    return per_run.reindex(columns=list(inits)).min(axis=1, skipna=True).dropna()


def untuned_reason(runs: pd.DataFrame, inits: Sequence[str], **cell) -> str | None:
    """Why post-PV perplexities of `inits` at `cell` say nothing about PV-tuning: every such run's
    PV-tuning kept its start (selected step 0, the held-out KL never went below it), so its
    "after PV" numbers are its "before PV" ones. None where any run was tuned, or nothing is known."""
    if "pvtune_selected_step" not in runs:
        return None
    selected = _select(runs[runs["init"].isin(inits)], **cell)["pvtune_selected_step"].dropna()
    if len(selected) and (selected == 0).all():
        return "PV-tuning kept its start in every run: nothing was tuned"
    return None


def paper_claims(domains_near_to_far: Sequence[str] = ("c4", "wikitext2"), headline: str = "wikitext2",
                 bpp: int = 2, beams: tuple[int, int] = (4, 16),
                 domain_distances: Mapping[str, float] | None = None) -> list[Claim]:
    """The six claims the paper makes (and PV-tuning's premise, that it lowers the held-out KL),
    each measured on the default cell (b8, e100) unless it
    varies something, on the perplexity of evaluation domain `headline` (the paper's WikiText-2;
    offline, the `wikitext2-standin`). The paper's effects are computed from its Llama-3.2-3B tables.

    The domain claim's x is `domain_distances[domain]` (measured, e.g. the JS divergence of
    domains.json) when given, else the rank in `domains_near_to_far`; the paper's own effect is a
    slope per rank of its three domains, so it is shown only beside a slope per rank."""
    cell = {"bpp": bpp, "beam": 8, "max_epochs": 100}
    pre, post = f"pre_pv_{headline}_ppl", f"{headline}_ppl"
    own = at_bit_rate_geometry  # every claim but rho's is about the bit rate's own geometry
    log = math.log
    if domain_distances is not None:
        domain_effect = (f"slope of the pre-PV gap against the measured distance of the evaluation text from the "
                         f"calibration text (JS divergence, nats; {len(domains_near_to_far)} domains), b8 e100")
        paper_domain_effect = None
    else:
        domain_effect = f"slope of the pre-PV gap against domain rank ({' < '.join(domains_near_to_far)}), b8 e100"
        paper_domain_effect = (log(3.49) - log(1.04)) / 2
    return [
        Claim("pre_pv_gap", f"OA-EM gives lower {headline} perplexity than greedy before PV-tuning at {bpp} bpp",
              "log(greedy/OA-EM) pre-PV, b8 e100", lambda f: gap_at(own(f), pre, **cell), log(60.61 / 17.39)),
        Claim("post_pv_gap", "the gap persists after PV-tuning", "log(greedy/OA-EM) post-PV, b8 e100",
              lambda f: gap_at(own(f), post, **cell), log(11.76 / 11.53),
              lambda f: untuned_reason(own(f), (BASELINE, CANDIDATE), **cell)),
        Claim("pv_lowers_heldout_kl", "PV-tuning lowers the held-out KL to the source model, in every run",
              "log(held-out KL before / after PV), the smaller of greedy's and OA-EM's, b8 e100",
              lambda f: heldout_kl_reduction(own(f), **cell), None,
              lambda f: untuned_reason(own(f), (BASELINE, CANDIDATE), **cell)),
        Claim("beam_helps_greedy_more", f"widening the beam (b{beams[0]} -> b{beams[1]}) helps greedy more than OA-EM",
              f"gap(b{beams[0]}) - gap(b{beams[1]}) pre-PV, e100",
              lambda f: beam_benefit_difference(own(f), pre, beams[0], beams[1], bpp=bpp, max_epochs=100),
              log(352.39 / 16.82) - log(46.01 / 16.53)),
        Claim("gap_smaller_at_3bpp", "the gap is smaller at 3 bpp than at 2 bpp", "gap(2 bpp) - gap(3 bpp) pre-PV, b8 e100",
              lambda f: difference_of_gaps(own(f), pre, {**cell, "bpp": 2}, {**cell, "bpp": 3}),
              log(60.61 / 17.39) - log(9.52 / 8.87)),
        Claim("gap_grows_with_rho", "the gap grows with the representational ratio ρ",
              f"slope of the pre-PV gap against log10 ρ over {bpp}-bit geometries, b8 e100",
              lambda f: gap_against_rho(f, pre, bpp, beam=8, max_epochs=100), None),
        Claim("gap_grows_with_domain_distance", "the gap grows with the distance of the evaluation text from the calibration text",
              domain_effect,
              lambda f: gap_against_domain_distance(own(f), domains_near_to_far, lambda d: f"pre_pv_{d}_ppl",
                                                    domain_distances, **cell),
              paper_domain_effect),
        # beyond the paper: OA-EM's start with a stop rule that waits for three slow epochs
        Claim("patient_stop_beats_oaem_before_pv", "beyond the paper: oaem-patient gives lower perplexity than OA-EM before PV-tuning",
              "log(OA-EM/oaem-patient) pre-PV, b8 e100",
              lambda f: gap_at(own(f), pre, baseline=CANDIDATE, candidate="oaem-patient", **cell), None),
        Claim("patient_stop_beats_oaem_after_pv", "beyond the paper: oaem-patient gives lower perplexity than OA-EM after PV-tuning",
              "log(OA-EM/oaem-patient) post-PV, b8 e100",
              lambda f: gap_at(own(f), post, baseline=CANDIDATE, candidate="oaem-patient", **cell), None,
              lambda f: untuned_reason(own(f), (CANDIDATE, "oaem-patient"), **cell)),
    ]


def claims_table(frame: pd.DataFrame, claims: Sequence[Claim] | Callable[[str], Sequence[Claim]]) -> pd.DataFrame:
    """One row per claim and model: the model, the effect's mean, sd, number of seeds, t, verdict
    and the paper's effect, measured on that model's runs alone.

    frame: one row per run with a `model` column (models in order of appearance). claims: the same
    claims for every model, or `claims(model)` for claims that depend on the model (e.g. on its own
    domain distances; claims("") describes them for a frame without runs); every model's list names
    the same claims in the same order. Rows are grouped by claim, models in order within it; a
    model without runs for a claim has no row for it, and a claim without runs for any model has
    one row with an empty model, NO_RUNS (described as the first model's)."""
    claims_of = claims if callable(claims) else (lambda model: claims)
    models = list(frame["model"].dropna().unique()) if len(frame) else []
    per_model = {model: list(claims_of(model)) for model in models}
    reference = per_model[models[0]] if models else list(claims_of(""))
    names = [claim.name for claim in reference]
    measured = {name: [] for name in names}
    for model, model_claims in per_model.items():
        if [claim.name for claim in model_claims] != names:
            raise ValueError(f"the claims of model {model!r} are not those of the others")
        runs = frame[frame["model"] == model]
        for claim in model_claims:
            effect = summarise_effect(list(claim.measure(runs).values))
            reason = claim.unmeasurable(runs)
            if reason and effect.seeds:
                effect = replace(effect, t=math.nan, verdict=f"inconclusive ({reason})")
            if effect.seeds:
                measured[claim.name].append(_claim_row(claim, model, effect))
    rows = []
    for claim in reference:
        rows += measured[claim.name] or [_claim_row(claim, "", summarise_effect([]))]
    return pd.DataFrame(rows)


def _claim_row(claim: Claim, model: str, effect: Effect) -> dict:
    return {"claim": claim.name, "model": model, "statement": claim.statement, "effect": claim.effect,
            "mean": effect.mean, "sd": effect.sd, "seeds": effect.seeds, "t": effect.t,
            "verdict": effect.verdict, "paper": claim.paper_effect}


def gap_against_model_rho(claims: pd.DataFrame, runs: pd.DataFrame, bpp: int = 2) -> pd.DataFrame:
    """Claim (e) across models: one row per model with its ρ at `bpp`'s own geometry (the largest
    layer's and the parameter-weighted mean, `rho_largest` / `rho_weighted`), its pre-PV gap
    (`pre_pv_gap`: mean, sd, seeds, verdict) and, beside it, the within-model slope of the gap
    against log10 ρ over geometries (`gap_grows_with_rho`). A model without the pre-PV gap claim
    has no row. Models are not pooled into one test: their gaps are different quantities (module
    doc), so this is a table to read, sorted by the weighted ρ.

    claims: claims_table's frame. runs: one row per run with model, bpp, init and the ρ columns
    (runs_table)."""
    columns = ["model", "rho_largest", "rho_weighted", "gap_mean", "gap_sd", "gap_seeds", "gap_verdict",
               "slope_mean", "slope_sd", "slope_verdict"]
    if not len(claims) or not len(runs) or "rho_weighted" not in runs:
        return pd.DataFrame(columns=columns)
    own = at_bit_rate_geometry(runs)
    own = own[(own["bpp"] == bpp) & own["rho_weighted"].notna()]
    rows = []
    for _, gap in claims[claims["claim"] == "pre_pv_gap"].iterrows():
        model_runs = own[own["model"] == gap["model"]]
        if not len(model_runs):
            continue
        slope = claims[(claims["claim"] == "gap_grows_with_rho") & (claims["model"] == gap["model"])]
        slope = slope.iloc[0] if len(slope) else None
        rows.append({"model": gap["model"], "rho_largest": float(model_runs["rho_largest"].max()),
                     "rho_weighted": float(model_runs["rho_weighted"].median()),
                     "gap_mean": gap["mean"], "gap_sd": gap["sd"], "gap_seeds": gap["seeds"], "gap_verdict": gap["verdict"],
                     "slope_mean": math.nan if slope is None else slope["mean"],
                     "slope_sd": math.nan if slope is None else slope["sd"],
                     "slope_verdict": NO_RUNS if slope is None else slope["verdict"]})
    return pd.DataFrame(rows, columns=columns).sort_values("rho_weighted", kind="stable").reset_index(drop=True)
