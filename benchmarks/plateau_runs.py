"""The plateau stop measured on real models: pairs of PV-tuning runs from one start, the whole
budget against `plateau_evaluations` (benchmarks/plateau_gpu.sh made them on one card).

Per model: the steps each run took and the steps the stop saved, PV-tuning's seconds, the written
state's held-out KL and its WikiText-2 / C4 stand-in perplexity (eval.json), and the stopped run's
perplexity relative to the whole budget's. As a check of the run against the rule, the whole-budget
run's held-out curve is replayed (benchmarks/plateau_replay.py): it says where the stop should
have come. A figure of both held-out curves per model goes beside the JSON.

    python benchmarks/plateau_runs.py --runs DIR --out results/published/plateau/plateau_runs.json

DIR holds <model>/{full,stop}/ with eval.json, pvtune.json, train_log.parquet and `card`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.plateau_replay import heldout_curve, replay  # noqa: E402

RUNS = ("full", "stop")


def run_record(folder: Path) -> dict:
    """What one PV-tuning run did and what its written state scores."""
    pv = json.loads((folder / "pvtune.json").read_text())
    evaluation = json.loads((folder / "eval.json").read_text())["metrics"]
    return {"steps": pv["steps"], "budget_steps": pv["budget_steps"], "stopped_at_plateau": pv["stopped_at_plateau"],
            "best_step": pv["best_step"], "best_heldout_kl": pv["best_heldout_kl"],
            "pv_seconds": pv["timings"]["total_seconds"],
            "plateau_evaluations": pv["settings"]["plateau_evaluations"],
            "plateau_min_improvement": pv["settings"]["plateau_min_improvement"],
            "eval_every_steps": pv["settings"]["eval_every_steps"], "epochs": pv["settings"]["epochs"],
            "wikitext2_perplexity": evaluation["wikitext2-standin"]["perplexity"],
            "c4_perplexity": evaluation["c4-standin"]["perplexity"],
            "card": (folder / "card").read_text().strip()}


def compare(model_dir: Path) -> dict:
    """The whole-budget and stopped runs of one model side by side, with the replay's prediction."""
    full, stop = (run_record(model_dir / run) for run in RUNS)
    predicted = replay(heldout_curve(model_dir / "full" / "train_log.parquet"),
                       stop["plateau_evaluations"], stop["plateau_min_improvement"])
    return {"model": model_dir.name, "full": full, "stop": stop,
            "steps_saved": full["steps"] - stop["steps"],
            "steps_saved_fraction": 1 - stop["steps"] / full["steps"],
            "pv_seconds_saved_fraction": 1 - stop["pv_seconds"] / full["pv_seconds"],
            "wikitext2_perplexity_ratio": stop["wikitext2_perplexity"] / full["wikitext2_perplexity"],
            "c4_perplexity_ratio": stop["c4_perplexity"] / full["c4_perplexity"],
            "heldout_kl_ratio": stop["best_heldout_kl"] / full["best_heldout_kl"],
            "replay_stop_step": predicted["stop_step"]}


def plot(runs_dir: Path, pairs: list[dict], path: Path) -> None:
    """Held-out KL against step, both runs of each model (`compare`'s pairs) in one panel; the
    step where the stop ended training marked, where it did."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.4), squeeze=False)
    for axis, pair in zip(axes[0], pairs):
        for run, style, label in zip(RUNS, ("-o", "--s"), ("whole budget", "plateau stop")):
            curve = heldout_curve(runs_dir / pair["model"] / run / "train_log.parquet")
            axis.plot(curve["step"], curve["kl"], style, markersize=3, label=label)
        if pair["stop"]["stopped_at_plateau"]:
            axis.axvline(pair["stop"]["steps"], color="grey", linewidth=0.8, label="stopped")
        axis.set(title=pair["model"], xlabel="PV-tuning step", ylabel="held-out KL to the source model", yscale="log")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="the folder plateau_gpu.sh packed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    models = sorted(p.name for p in args.runs.iterdir() if all((p / run / "eval.json").is_file() for run in RUNS))
    if not models:
        raise SystemExit(f"no model under {args.runs} has both a full and a stop run")
    pairs = [compare(args.runs / model) for model in models]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "pairs": pairs}, indent=1))
    tmp.replace(args.out)
    plot(args.runs, pairs, args.out.with_suffix(".png"))
    rows = [{"model": p["model"], "card": p["full"]["card"], "budget": p["full"]["steps"], "stopped at": p["stop"]["steps"],
             "replay says": p["replay_stop_step"], "saved": f"{p['steps_saved_fraction']:.0%}",
             "PV s full/stop": f"{p['full']['pv_seconds']:.0f}/{p['stop']['pv_seconds']:.0f}",
             "wiki ppl full/stop": f"{p['full']['wikitext2_perplexity']:.2f}/{p['stop']['wikitext2_perplexity']:.2f}",
             "c4 ppl full/stop": f"{p['full']['c4_perplexity']:.2f}/{p['stop']['c4_perplexity']:.2f}"} for p in pairs]
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
