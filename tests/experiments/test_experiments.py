"""Claims and tables of the experiment grid, on synthetic results whose truth is known."""

import math

import numpy as np
import pandas as pd
import pytest

from aqflow.experiments.claims import (
    claims_table,
    gap_against_domain_distance,
    gap_against_model_rho,
    gap_against_rho,
    paired_gaps,
    paper_claims,
    summarise_effect,
    t_critical,
)
from aqflow.experiments.paper_numbers import paper_cells
from aqflow.experiments.runs import parameter_weighted_rho
from aqflow.experiments.tables import markdown_table, mean_sd_text, seed_statistics, with_paper


def grid(gap_of, seeds=(0, 1, 2), noise=0.02, rng_seed=0):
    """Synthetic eval rows for 2/3 bpp, beams 4/8/16, two geometries and two domains: greedy's
    perplexity = OA-EM's x exp(gap_of(cell) + noise), OA-EM's = 20; PV-tuning halved every run's
    held-out KL."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    cells = [(2, b, 100, "g8m2k256", 0.6) for b in (4, 8, 16)] + [(2, 8, 5, "g8m2k256", 0.6), (3, 8, 100, "g8m3k256", 0.002),
                                                                  (2, 8, 100, "g4m1k256", 300.0)]
    for bpp, beam, epochs, geometry, rho in cells:
        for seed in seeds:
            cell = {"model": "m", "bpp": bpp, "beam": beam, "max_epochs": epochs, "geometry": geometry, "rho": rho, "seed": seed,
                    "nominal_bits": 3.0 if geometry == "g8m3k256" else 2.0,
                    "pvtune_heldout_kl_before": 1.4, "pvtune_heldout_kl_after": 0.7,
                    "bit_rate_geometry": geometry in ("g8m2k256", "g8m3k256")}
            greedy = {"init": "greedy"}
            for column, domain_gap in (("wikitext2", 1.0), ("c4", 0.0)):
                for stage, stage_gap in (("pre_pv_", 1.0), ("", 0.2)):
                    gap = gap_of(cell) * domain_gap * stage_gap + noise * rng.standard_normal()
                    greedy[f"{stage}{column}_ppl"] = 20.0 * math.exp(gap)
            rows.append({**cell, **greedy})
            rows.append({**cell, "init": "oaem", **{f"{s}{c}_ppl": 20.0 for s in ("pre_pv_", "") for c in ("wikitext2", "c4")}})
    # the geometry sweep shares the bit rate's cells (2 bpp, b8, e100): only bit_rate_geometry tells them apart
    return pd.DataFrame(rows)


def test_t_critical_matches_known_quantiles():
    assert t_critical(2) == pytest.approx(4.303)
    assert t_critical(100) == pytest.approx(1.96)
    with pytest.raises(ValueError):
        t_critical(0)


@pytest.mark.parametrize("values,verdict", [
    ([0.5, 0.52, 0.48], "holds"),
    ([-0.5, -0.52, -0.48], "does not hold"),
    ([0.5, -0.4, 0.1], "inconclusive"),
    ([0.5, 0.5], "inconclusive (fewer than 3 seeds)"),
    ([], "inconclusive (no runs)"),
])
def test_verdicts_follow_the_t_test(values, verdict):
    assert summarise_effect(values).verdict == verdict


def test_effect_statistics():
    effect = summarise_effect([1.0, 2.0, 3.0, float("nan")])
    assert effect.seeds == 3 and effect.mean == pytest.approx(2.0) and effect.sd == pytest.approx(1.0)
    assert effect.t == pytest.approx(2.0 / (1.0 / math.sqrt(3)))


def test_paired_gaps_are_log_ratios_per_cell_and_seed():
    frame = grid(lambda cell: 0.7, noise=0.0)
    gaps = paired_gaps(frame, "pre_pv_wikitext2_ppl")
    assert len(gaps) == 6 * 3
    assert np.allclose(gaps["gap"], 0.7)


def test_claims_hold_when_the_data_say_so():
    # OA-EM better everywhere; more so at narrow beams, at 2 bpp, at high rho; wikitext2 far, c4 near
    def gap_of(cell):
        return {4: 2.0, 8: 1.0, 16: 0.5}[cell["beam"]] * (0.2 if cell["bpp"] == 3 else 1.0) * (3.0 if cell["rho"] > 100 else 1.0)
    table = claims_table(grid(gap_of), paper_claims()).set_index("claim")
    paper_rows = table.drop(index=[name for name in table.index if name.startswith("patient_")])
    assert set(paper_rows["verdict"]) == {"holds"}, table[["mean", "sd", "verdict"]]
    assert table.loc["patient_stop_beats_oaem_before_pv", "verdict"] == "inconclusive (no runs)"
    assert table.loc["pre_pv_gap", "mean"] == pytest.approx(1.0, abs=0.05)
    assert table.loc["post_pv_gap", "mean"] == pytest.approx(0.2, abs=0.05)
    assert table.loc["beam_helps_greedy_more", "mean"] == pytest.approx(1.5, abs=0.05)
    assert (paper_rows["seeds"] == 3).all()


def test_claims_fail_or_stay_open_when_the_data_say_so():
    reversed_table = claims_table(grid(lambda cell: -1.0), paper_claims()).set_index("claim")
    assert reversed_table.loc["pre_pv_gap", "verdict"] == "does not hold"
    assert reversed_table.loc["post_pv_gap", "verdict"] == "does not hold"
    noisy = claims_table(grid(lambda cell: 0.0, noise=0.5, rng_seed=3), paper_claims()).set_index("claim")
    assert noisy.loc["pre_pv_gap", "verdict"] == "inconclusive"
    two_seeds = claims_table(grid(lambda cell: 1.0, seeds=(0, 1)), paper_claims()).set_index("claim")
    assert set(two_seeds["verdict"]) <= {"inconclusive (fewer than 3 seeds)", "inconclusive (no runs)"}


def test_the_patient_variant_is_compared_with_oaem():
    frame = grid(lambda cell: 1.0)
    patient = frame[frame["init"] == "oaem"].copy()
    patient["init"] = "oaem-patient"
    for column in ("pre_pv_wikitext2_ppl", "wikitext2_ppl"):
        patient[column] = patient[column] / math.exp(0.1)  # 10 % lower log perplexity than OA-EM
    table = claims_table(pd.concat([frame, patient]), paper_claims()).set_index("claim")
    assert table.loc["patient_stop_beats_oaem_before_pv", "verdict"] == "holds"
    assert table.loc["patient_stop_beats_oaem_before_pv", "mean"] == pytest.approx(0.1)


def test_claims_of_two_models_are_not_pooled():
    """Model A's gap is +1 and model B's -1 on every seed: two rows per claim, one holding and one
    not, never one inconclusive row at 0; a claim no model has runs for is one row without a model."""
    first, second = grid(lambda cell: 1.0), grid(lambda cell: -1.0)
    first["model"], second["model"] = "a", "b"
    table = claims_table(pd.concat([first, second], ignore_index=True), paper_claims())
    gaps = table[table["claim"] == "pre_pv_gap"].set_index("model")
    assert list(gaps.index) == ["a", "b"]
    assert gaps.loc["a", "verdict"] == "holds" and gaps.loc["a", "mean"] == pytest.approx(1.0, abs=0.05)
    assert gaps.loc["b", "verdict"] == "does not hold" and gaps.loc["b", "mean"] == pytest.approx(-1.0, abs=0.05)
    assert (gaps["seeds"] == 3).all()
    patient = table[table["claim"] == "patient_stop_beats_oaem_before_pv"]
    assert len(patient) == 1 and patient["model"].iloc[0] == "" and patient["verdict"].iloc[0] == "inconclusive (no runs)"
    # claims in their order, models in order within each
    assert list(dict.fromkeys(table["claim"])) == [claim.name for claim in paper_claims()]
    # a model with runs for only some claims has rows for those alone
    b_only_beam8 = second[second["beam"] == 8]
    table = claims_table(pd.concat([first, b_only_beam8], ignore_index=True), paper_claims())
    assert table[table["claim"] == "beam_helps_greedy_more"]["model"].tolist() == ["a"]
    # the measures refuse several models at once rather than average them
    with pytest.raises(ValueError, match="several models"):
        paper_claims()[0].measure(pd.concat([first, second], ignore_index=True))


def test_claims_take_each_models_own_claims():
    """claims(model): each model's domain claim measured against its own distances."""
    first, second = grid(lambda cell: 1.0, noise=0.0), grid(lambda cell: 1.0, noise=0.0)
    first["model"], second["model"] = "a", "b"
    distances = {"a": {"c4": 0.1, "wikitext2": 0.35}, "b": {"c4": 0.1, "wikitext2": 0.6}}
    table = claims_table(pd.concat([first, second], ignore_index=True),
                         lambda model: paper_claims(domain_distances=distances[model]))
    slopes = table[table["claim"] == "gap_grows_with_domain_distance"].set_index("model")["mean"]
    # the same gaps (c4 0, wikitext2 1), 0.25 and 0.5 nats apart
    assert slopes["a"] == pytest.approx(4.0) and slopes["b"] == pytest.approx(2.0)


def test_rho_and_domain_slopes():
    frame = grid(lambda cell: 1.0 + 0.5 * math.log10(cell["rho"]), noise=0.0)
    slopes = gap_against_rho(frame[frame["bpp"] == 2], "pre_pv_wikitext2_ppl", beam=8, max_epochs=100)
    assert np.allclose(slopes, 0.5)
    domain = gap_against_domain_distance(grid(lambda cell: 1.0, noise=0.0), ["c4", "wikitext2"],
                                         lambda d: f"pre_pv_{d}_ppl", bpp=2, beam=8, max_epochs=100)
    assert np.allclose(domain, 1.0)  # c4 gap 0, wikitext2 gap 1: slope 1 per rank
    measured = gap_against_domain_distance(grid(lambda cell: 1.0, noise=0.0), ["c4", "wikitext2"],
                                           lambda d: f"pre_pv_{d}_ppl", {"c4": 0.1, "wikitext2": 0.35},
                                           bpp=2, beam=8, max_epochs=100)
    assert np.allclose(measured, 4.0)  # the same gaps 0.25 nats apart: slope 4 per nat
    with pytest.raises(KeyError, match="wikitext2"):
        gap_against_domain_distance(grid(lambda cell: 1.0), ["c4", "wikitext2"], lambda d: f"pre_pv_{d}_ppl", {"c4": 0.1})


def test_parameter_weighted_rho_weights_each_layer_by_its_parameters():
    # one geometry (g 8, K^M 65536): a layer of rho r holds 8 * 65536 * r parameters
    layers = [0.25, 1.0, 4.0]
    parameters = [8 * 65536 * rho for rho in layers]
    by_parameters = sum(rho * count for rho, count in zip(layers, parameters)) / sum(parameters)
    assert parameter_weighted_rho(layers) == pytest.approx(by_parameters)
    assert parameter_weighted_rho([2.0]) == 2.0 and parameter_weighted_rho([]) is None


def test_gap_against_model_rho_gives_each_model_its_own_gap_and_rho():
    def model_grid(model, gap, rho_largest, rho_weighted):
        frame = grid(lambda cell: gap, noise=0.0).assign(model=model)
        own = frame["bit_rate_geometry"] & (frame["bpp"] == 2)
        return frame.assign(rho_largest=np.where(own, rho_largest, 99.0), rho_weighted=np.where(own, rho_weighted, 99.0))

    runs = pd.concat([model_grid("wide", 1.5, 26.0, 9.0), model_grid("small", 0.5, 1.7, 0.9)], ignore_index=True)
    table = gap_against_model_rho(claims_table(runs, paper_claims()), runs)
    # sorted by weighted rho; each gap from its own model's runs; the rho sweep's geometry not read
    assert table["model"].tolist() == ["small", "wide"]
    assert table["gap_mean"].tolist() == pytest.approx([0.5, 1.5]) and table["gap_seeds"].tolist() == [3, 3]
    assert table["rho_largest"].tolist() == [1.7, 26.0] and table["rho_weighted"].tolist() == [0.9, 9.0]
    assert (table["gap_verdict"] == "holds").all() and table["slope_mean"].tolist() == pytest.approx([0.0, 0.0])
    assert gap_against_model_rho(pd.DataFrame(), runs).empty


def test_seed_statistics_and_markdown_with_paper_numbers():
    frame = grid(lambda cell: 1.0, noise=0.0)
    stats = seed_statistics(frame, ["pre_pv_wikitext2_ppl", "wikitext2_ppl"])
    row = stats[(stats["init"] == "greedy") & (stats["bpp"] == 2) & (stats["beam"] == 8) & (stats["max_epochs"] == 100)].iloc[0]
    assert row["seeds"] == 3 and row["pre_pv_wikitext2_ppl_mean"] == pytest.approx(20 * math.e)
    assert row["pre_pv_wikitext2_ppl_sd"] == pytest.approx(0.0)
    both = with_paper(stats, paper_cells(), ["pre_pv_wikitext2_ppl"])
    matched = both[(both["init"] == "greedy") & (both["bpp"] == 2) & (both["beam"] == 8) & (both["max_epochs"] == 100)]
    assert matched["paper_pre_pv_wikitext2_ppl"].iloc[0] == pytest.approx(60.61)
    text = markdown_table(both, ["pre_pv_wikitext2_ppl"], {"pre_pv_wikitext2_ppl": "WikiText-2 pre-PV"})
    assert "| WikiText-2 pre-PV | paper WikiText-2 pre-PV | seeds |" in text and "54.37 ± 0.00 | 60.61 | 3 |" in text
    assert mean_sd_text(float("nan"), float("nan")) == "missing" and mean_sd_text(3.0, float("nan")) == "3.00"


def write_eval(folder, init, beam, seed, pre_wiki, post_wiki, bpp=2, epochs=100, rho=0.6, model="m", pre_c4=None,
               pv_tuned=True):
    """A minimal eval.json of a PV-tuned run, shaped as the evaluate stage writes it (c4 perplexity
    half of wikitext2's unless `pre_c4` gives the pre-PV one). pv_tuned=False: an eval_pre_pv.json,
    the cell's evaluation before PV-tuning (its metrics are `pre_wiki`'s; `post_wiki` is unused)."""
    import json

    upstream = {"model": model, "bpp": bpp, "quantization_seconds": 10.0,
                "quantizer": {"init": init, "beam_size": beam, "max_epochs": epochs, "seed": seed, "group_size": 8,
                              "num_codebooks": bpp, "nbits": 8},
                "layers": [{"rho": rho, "final_relative_mse": 0.01, "init_relative_mse": 0.02}]}
    if pv_tuned:
        upstream["pvtune"] = {"steps": 3}
    metrics = lambda wiki: {"wikitext2": {"perplexity": wiki}, "c4": {"perplexity": wiki / 2},  # noqa: E731
                            "brown-news": {"perplexity": wiki * 1.5}, "avg_acc": 0.4}
    pre_metrics = metrics(pre_wiki)
    if pre_c4 is not None:
        pre_metrics["c4"] = {"perplexity": pre_c4}
    record = {"label": f"{init}-b{beam}-s{seed}", "metrics": metrics(post_wiki), "settings": {"upstream": upstream},
              "bits_per_parameter": 2.15, "pre_pv": {"metrics": pre_metrics}}
    if not pv_tuned:
        record = {**record, "metrics": pre_metrics, "pre_pv": None}
    path = folder / model / f"{init}-b{beam}-s{seed}-{bpp}" / ("eval.json" if pv_tuned else "eval_pre_pv.json")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    return path


def test_paper_tables_stage_writes_tables_claims_plots_and_missing_cells(tmp_path):
    import json

    from aqflow.stages import paper_tables

    paths = []
    for seed in (42, 43, 44):
        jitter = 1 + 0.01 * (seed - 43)
        paths += [write_eval(tmp_path, "greedy", 8, seed, 200 * jitter, 50 * jitter),
                  write_eval(tmp_path, "oaem", 8, seed, 80 * jitter, 45 * jitter)]
    expected = [{"eval_json": str(path)} for path in paths[2:]] + [{"eval_json": str(tmp_path / f"{init}-s45" / "eval.json")}
                                                                   for init in ("greedy", "oaem")]
    (tmp_path / "grid.json").write_text(json.dumps(expected))
    out = tmp_path / "paper"
    # two runs named on the command line, the rest found through the grid
    assert paper_tables.main([*map(str, paths[:2]), "--out-dir", str(out), "--expected-cells", str(tmp_path / "grid.json")]) == 0
    for name in ("runs.csv", "cells.md", "cells.csv", "domains.md", "claims.md", "claims.csv", "README.md", *paper_tables.PLOTS):
        assert (out / name).stat().st_size > 0, name
    claims = pd.read_csv(out / "claims.csv").set_index("claim")
    assert claims.loc["pre_pv_gap", "verdict"] == "holds" and claims.loc["pre_pv_gap", "seeds"] == 3
    assert claims.loc["pre_pv_gap", "mean"] == pytest.approx(math.log(200 / 80), rel=1e-6)
    assert claims.loc["gap_smaller_at_3bpp", "verdict"].startswith("inconclusive")  # no 3 bpp runs
    cells = (out / "cells.md").read_text()
    assert "200.00 ± 2.00 | 60.61 | " in cells  # greedy b8 pre-PV, beside the paper's 60.61
    readme = (out / "README.md").read_text()
    assert "## Missing cells (2)" in readme and "greedy-s45/eval.json" in readme
    # claim (e) across models: the model's rho beside its gap (one layer of rho 0.6)
    assert "| m | 0.60 | 0.60 | 0.916 ± 0.000 (3) | holds |" in (out / "claims.md").read_text()
    assert paper_tables.LAYER_STUDY not in (out / "claims.md").read_text()  # none in the folder: no link
    # a domain the paper does not report is in cells.csv, not in the Markdown table
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domains", "c4", "brown-news", "wikitext2"]) == 0
    assert "brown-news" not in (out / "cells.md").read_text() and "200.00 ± 2.00 | 60.61 | " in (out / "cells.md").read_text()
    assert any(column.startswith("pre_pv_brown-news_ppl") for column in pd.read_csv(out / "cells.csv").columns)
    # a layer-level study beside the tables: the claims point at it
    (out / paper_tables.LAYER_STUDY).write_text("| layer | rho |\n")
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out)]) == 0
    assert f"]({paper_tables.LAYER_STUDY})" in (out / "claims.md").read_text()
    assert paper_tables.main([str(tmp_path / "nope.json"), "--out-dir", str(out)]) == 2


def test_paper_tables_order_domains_by_measured_distance(tmp_path):
    """Without --domains the domains come from domains.json, nearest first; the distance is a column
    of the domain table and the domain claim's x (here c4 is measured FARTHER than wikitext2, so
    only the file can have put it last)."""
    from aqflow.io.artifacts import write_json
    from aqflow.stages import paper_tables

    paths = []
    for seed in (42, 43, 44):
        jitter = 1 + 0.01 * (seed - 43)
        paths += [write_eval(tmp_path, "greedy", 8, seed, 200 * jitter, 50 * jitter),
                  write_eval(tmp_path, "oaem", 8, seed, 80 * jitter, 45 * jitter)]
    distances = tmp_path / "domains.json"
    write_json(distances, {"domains": [{"domain": "wikitext2", "distance": 0.2, "distance_sd": 0.01},
                                       {"domain": "c4", "distance": 0.3, "distance_sd": 0.02}]})
    out = tmp_path / "paper"
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domain-distances", str(distances)]) == 0
    domains = pd.read_csv(out / "domains.csv")
    assert domains["domain"].tolist() == ["wikitext2", "c4"] and domains["distance"].tolist() == [0.2, 0.3]
    assert domains["distance_sd"].tolist() == [0.01, 0.02]
    claims = pd.read_csv(out / "claims.csv").set_index("claim")
    row = claims.loc["gap_grows_with_domain_distance"]
    # write_eval gives c4 the same greedy/OA-EM ratio as wikitext2: no slope against distance
    assert "measured distance" in row["effect"] and row["mean"] == pytest.approx(0.0, abs=1e-9)
    assert pd.isna(row["paper"])  # the paper's slope is per rank: not comparable
    assert "Jensen-Shannon" in (out / "README.md").read_text()
    # --domains still decides the order; a domain without a distance makes the claim fall back to ranks
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domain-distances", str(distances),
                              "--domains", "c4", "wikitext2", "lambada"]) == 0
    assert pd.read_csv(out / "domains.csv")["domain"].tolist() == ["c4", "wikitext2"]  # no lambada runs
    claims = pd.read_csv(out / "claims.csv").set_index("claim")
    assert "domain rank" in claims.loc["gap_grows_with_domain_distance", "effect"]
    assert "no measured distance for ['lambada']" in (out / "README.md").read_text()
    write_json(distances, {"not": "domains"})
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domain-distances", str(distances)]) == 2


def test_paper_tables_use_each_models_own_domain_distances(tmp_path):
    """Two models, each with its domains.json (MODEL=PATH): each model's domain rows, order and
    claim use its own distances; the claims are per model; one bare file for two models is refused."""
    from aqflow.io.artifacts import write_json
    from aqflow.stages import paper_tables

    paths = []
    for seed in (42, 43, 44):
        jitter = 1 + 0.01 * (seed - 43)
        # both models: wikitext2 ratio 2.5, c4 ratio 1 (greedy and OA-EM equal on c4 before PV)
        for model in ("a", "b"):
            paths += [write_eval(tmp_path, "greedy", 8, seed, 200 * jitter, 50 * jitter, model=model, pre_c4=30.0),
                      write_eval(tmp_path, "oaem", 8, seed, 80 * jitter, 45 * jitter, model=model, pre_c4=30.0)]
    files = {}
    for model, (c4, wiki) in {"a": (0.1, 0.3), "b": (0.4, 0.2)}.items():  # b measures wikitext2 the nearer
        files[model] = tmp_path / f"{model}-domains.json"
        write_json(files[model], {"domains": [{"domain": "c4", "distance": c4, "distance_sd": 0.0},
                                              {"domain": "wikitext2", "distance": wiki, "distance_sd": 0.0}]})
    out = tmp_path / "paper"
    argv = [*map(str, paths), "--out-dir", str(out), "--domain-distances", *(f"{m}={p}" for m, p in files.items())]
    assert paper_tables.main(argv) == 0
    domains = pd.read_csv(out / "domains.csv")
    assert domains[["model", "domain", "distance"]].values.tolist() == [
        ["a", "c4", 0.1], ["a", "wikitext2", 0.3], ["b", "wikitext2", 0.2], ["b", "c4", 0.4]]
    claims = pd.read_csv(out / "claims.csv")
    slope = claims[claims["claim"] == "gap_grows_with_domain_distance"].set_index("model")["mean"]
    gap = math.log(200 / 80)  # c4's gap is 0
    assert slope["a"] == pytest.approx(gap / 0.2) and slope["b"] == pytest.approx(-gap / 0.2)
    pre = claims[claims["claim"] == "pre_pv_gap"].set_index("model")
    assert list(pre.index) == ["a", "b"] and set(pre["verdict"]) == {"holds"}
    assert "| a |" in (out / "claims.md").read_text() and "b: Domains (2)" in (out / "README.md").read_text()
    # one model's file alone: the other's domains fall back to ranks in the default order, and say so
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domain-distances", f"a={files['a']}"]) == 0
    effects = pd.read_csv(out / "claims.csv").query("claim == 'gap_grows_with_domain_distance'").set_index("model")["effect"]
    assert "measured distance" in effects["a"] and "domain rank" in effects["b"]
    # one bare file for runs of two models, or a model named twice: input errors
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domain-distances", str(files["a"])]) == 2
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out), "--domain-distances", f"a={files['a']}",
                              f"a={files['b']}"]) == 2


def test_spread_labels_keeps_order_and_gap_inside_the_axes():
    """Crowded label heights are pushed apart to the gap, in their order, within [0, 1]; heights
    already far enough apart stay where they are."""
    from aqflow.experiments.plots import spread_labels

    rng = np.random.default_rng(0)
    for count in (1, 2, 5, 17, 30):
        heights = np.sort(rng.uniform(0.4, 1.2, size=count))  # crowded, some above the axes
        placed = spread_labels(heights, gap=0.055)
        gap = min(0.055, 1.0 / count)
        assert np.all(np.diff(placed) >= gap - 1e-12)
        assert placed.min() >= 0.0 and placed.max() <= 1.0 + 1e-12
    spaced = np.array([0.1, 0.3, 0.5, 0.9])
    np.testing.assert_array_equal(spread_labels(spaced, gap=0.055), spaced)


def test_runs_at_their_bit_rates_own_geometry_are_those_whose_folder_names_no_other():
    from aqflow.experiments.runs import GEOMETRY_LABEL, at_bit_rate_geometry

    assert GEOMETRY_LABEL.match("g6m2k64-b8s43") and GEOMETRY_LABEL.match("g4m1k256-b8")
    assert not GEOMETRY_LABEL.match("b8s43") and not GEOMETRY_LABEL.match("b8e5")
    frame = pd.DataFrame({"variant": ["b8", "g6m2k64-b8", "fp"], "bit_rate_geometry": [True, False, False]})
    assert at_bit_rate_geometry(frame)["variant"].tolist() == ["b8"]
    assert len(at_bit_rate_geometry(frame.drop(columns="bit_rate_geometry"))) == 3


def test_a_post_pv_claim_on_runs_whose_pv_tuning_kept_its_start_is_not_a_verdict():
    frame = grid(lambda cell: 1.0, noise=0.01)
    frame["pvtune_selected_step"] = 20
    tuned = claims_table(frame, paper_claims()).set_index("claim")
    assert tuned.loc["post_pv_gap", "verdict"] == "holds"
    frame["pvtune_selected_step"] = 0  # every run: the held-out KL never went below the start
    untuned = claims_table(frame, paper_claims()).set_index("claim")
    assert untuned.loc["post_pv_gap", "verdict"] == "inconclusive (PV-tuning kept its start in every run: nothing was tuned)"
    assert untuned.loc["post_pv_gap", "mean"] == pytest.approx(tuned.loc["post_pv_gap", "mean"])  # still shown
    assert untuned.loc["pre_pv_gap", "verdict"] == "holds"


def test_cells_never_pv_tuned_count_before_pv_and_never_after(tmp_path):
    """eval_pre_pv.json files (a model whose cells stopped before PV-tuning) beside a PV-tuned
    model: the pre-PV claim is measured on their own numbers; no after-PV claim or column uses them."""
    from aqflow.stages import paper_tables

    paths = []
    for seed in (42, 43, 44):
        jitter = 1 + 0.01 * (seed - 43)
        paths += [write_eval(tmp_path, "greedy", 8, seed, 200 * jitter, 50 * jitter),
                  write_eval(tmp_path, "oaem", 8, seed, 80 * jitter, 45 * jitter)]
        paths += [write_eval(tmp_path, "greedy", 8, seed, 30 * jitter, 999.0, model="big", rho=26.25, pv_tuned=False),
                  write_eval(tmp_path, "oaem", 8, seed, 20 * jitter, 1.0, model="big", rho=26.25, pv_tuned=False)]
    out = tmp_path / "paper"
    assert paper_tables.main([*map(str, paths), "--out-dir", str(out)]) == 0
    claims = pd.read_csv(out / "claims.csv").set_index(["claim", "model"])
    assert claims.loc[("pre_pv_gap", "big"), "mean"] == pytest.approx(math.log(30 / 20), rel=1e-6)
    assert claims.loc[("pre_pv_gap", "big"), "verdict"] == "holds"
    assert ("post_pv_gap", "big") not in claims.index
    assert claims.loc[("post_pv_gap", "m"), "mean"] == pytest.approx(math.log(50 / 45), rel=1e-6)
    runs = pd.read_csv(out / "runs.csv")
    big = runs[runs["model"] == "big"]
    assert big["wikitext2_ppl"].isna().all() and big["pre_pv_wikitext2_ppl"].notna().all()
    assert "| big | 26.25 | 26.25 | 0.405 ± 0.000 (3) | holds |" in (out / "claims.md").read_text()
    # one seed: its gap without a spread
    assert paper_tables.main([*map(str, paths[2:4]), "--out-dir", str(out)]) == 0
    assert "| big | 26.25 | 26.25 | 0.405 (1) | inconclusive (fewer than 3 seeds) |" in (out / "claims.md").read_text()


def test_pv_tuning_lowers_the_heldout_kl_only_where_every_run_of_a_seed_lowered_it():
    """The claim's per-seed effect is the smaller of the two inits' log KL ratios: one run of a seed
    whose KL rose makes that seed's effect negative, and runs that kept their start say why."""
    from aqflow.experiments.claims import heldout_kl_reduction
    from aqflow.experiments.runs import at_bit_rate_geometry

    frame = grid(lambda cell: 1.0, noise=0.01)
    frame["pvtune_selected_step"] = 20
    frame["pvtune_heldout_kl_before"] = 1.4
    frame["pvtune_heldout_kl_after"] = np.where(frame["init"] == "greedy", 0.6, 0.7)
    frame.loc[(frame["seed"] == 2) & (frame["init"] == "oaem") & (frame["beam"] == 8), "pvtune_heldout_kl_after"] = 1.5
    at_b8 = at_bit_rate_geometry(frame)
    per_seed = heldout_kl_reduction(at_b8, bpp=2, beam=8, max_epochs=100)
    assert per_seed.to_dict() == pytest.approx({0: math.log(1.4 / 0.7), 1: math.log(1.4 / 0.7), 2: math.log(1.4 / 1.5)})
    # a seed PV-tuned for one init only counts with that run
    one_init = at_b8[~((at_b8["seed"] == 1) & (at_b8["init"] == "oaem"))]
    assert heldout_kl_reduction(one_init, bpp=2, beam=8, max_epochs=100)[1] == pytest.approx(math.log(1.4 / 0.6))
    frame.loc[frame["seed"] == 2, "pvtune_heldout_kl_after"] = 0.7  # now every run lowered it
    claims = claims_table(frame, paper_claims()).set_index("claim")
    assert claims.loc["pv_lowers_heldout_kl", "verdict"] == "holds"
    assert claims.loc["pv_lowers_heldout_kl", "mean"] == pytest.approx(math.log(1.4 / 0.7))
    frame["pvtune_selected_step"], frame["pvtune_heldout_kl_after"] = 0, 1.4  # the start kept everywhere
    untuned = claims_table(frame, paper_claims()).set_index("claim")
    assert untuned.loc["pv_lowers_heldout_kl", "verdict"].startswith("inconclusive (PV-tuning kept its start")
