"""The real-model plateau summary (benchmarks/plateau_runs.py): from a whole-budget run and a
stopped run of one model it reports the steps saved, the perplexity ratios and where the rule,
replayed on the whole run's held-out curve, says the stop belongs."""

import json

import pandas as pd

from benchmarks.plateau_runs import compare

# held-out KL every 2 steps: falls, then flattens after step 8 (no 1 % gain over 2 evaluations)
STEPS = [0, 2, 4, 6, 8, 10, 12, 14, 16]
KL = [1.0, 0.8, 0.7, 0.65, 0.64, 0.639, 0.638, 0.637, 0.636]


def _run(folder, steps: int, perplexity: float, plateau: int | None) -> None:
    folder.mkdir(parents=True)
    kept = [s for s in STEPS if s <= steps]
    log = pd.DataFrame({"step": kept, "split": "heldout", "kl": KL[:len(kept)], "perplexity": [100.0] * len(kept)})
    log.to_parquet(folder / "train_log.parquet")
    best = min(range(len(kept)), key=lambda i: KL[i])
    (folder / "pvtune.json").write_text(json.dumps({
        "steps": steps, "budget_steps": 16, "stopped_at_plateau": steps < 16, "best_step": kept[best],
        "best_heldout_kl": KL[best], "timings": {"total_seconds": 10.0 * steps},
        "settings": {"plateau_evaluations": plateau, "plateau_min_improvement": 0.01, "eval_every_steps": 2,
                     "epochs": 10}}))
    (folder / "eval.json").write_text(json.dumps({"metrics": {"wikitext2-standin": {"perplexity": perplexity},
                                                              "c4-standin": {"perplexity": 2 * perplexity}}}))
    (folder / "card").write_text("NVIDIA H100 80GB HBM3\n")


def test_the_summary_reports_the_saving_the_cost_and_the_replayed_stop(tmp_path):
    _run(tmp_path / "m" / "full", 16, 40.0, None)
    _run(tmp_path / "m" / "stop", 12, 41.0, 2)
    pair = compare(tmp_path / "m")
    assert pair["steps_saved"] == 4 and abs(pair["steps_saved_fraction"] - 0.25) < 1e-12
    assert abs(pair["wikitext2_perplexity_ratio"] - 41 / 40) < 1e-12
    assert abs(pair["c4_perplexity_ratio"] - 41 / 40) < 1e-12
    # evaluations at steps 10 and 12 gain < 1 % on the best before them (0.64): the rule stops at 12
    assert pair["replay_stop_step"] == 12 == pair["stop"]["steps"]
    assert pair["heldout_kl_ratio"] == KL[6] / KL[8]
