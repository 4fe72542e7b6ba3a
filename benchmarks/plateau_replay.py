"""The plateau stop (`pvtune.plateau_evaluations`) replayed on published PV-tuning curves.

The rule looks only at the held-out evaluations, and a run is the same up to the step where it
stops, so a finished run's train_log.parquet says exactly where each setting would have stopped
it, which state it would have kept (the best held-out one up to there) and what that state's
held-out KL and perplexity were. Per model and setting: runs stopped early, steps saved, and the
kept state's held-out numbers against the full budget's.

    python benchmarks/plateau_replay.py --logs 'results/published/*/2bpp/*/b8*/pv/train_log.parquet' \
        --out benchmarks/results/plateau_replay.json
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from aqflow.pvtune.train import plateau_reached  # noqa: E402

SETTINGS = [(2, 0.01), (3, 0.01), (2, 0.005), (1, 0.01)]  # (plateau_evaluations, plateau_min_improvement)


def heldout_curve(log_path: str | Path) -> pd.DataFrame:
    """The held-out rows [step, kl, perplexity] of a train_log.parquet, in step order."""
    log = pd.read_parquet(log_path)
    return log[log["split"] == "heldout"].sort_values("step").reset_index(drop=True)


def replay(heldout: pd.DataFrame, evaluations: int, min_improvement: float, metric: str = "kl") -> dict:
    """Where the rule stops a run whose held-out rows [step, kl, perplexity] (in step order) are
    given, and the best state it keeps there, against the whole run's best."""
    values = heldout[metric].tolist()
    stop = next((i for i in range(len(values)) if plateau_reached(values[:i + 1], evaluations, min_improvement)),
                len(values) - 1)
    kept = heldout.iloc[:stop + 1][metric].idxmin()
    best = heldout[metric].idxmin()
    last_step = int(heldout["step"].iloc[-1])
    return {"stopped_early": stop < len(values) - 1, "stop_step": int(heldout["step"].iloc[stop]),
            "budget_steps": last_step, "steps_saved": last_step - int(heldout["step"].iloc[stop]),
            "kept_kl": float(heldout.loc[kept, "kl"]), "best_kl": float(heldout.loc[best, "kl"]),
            "kept_perplexity": float(heldout.loc[kept, "perplexity"]),
            "best_perplexity": float(heldout.loc[best, "perplexity"])}


def model_of(path: str) -> str:
    """The published folder a log belongs to, up to its bit budget (smollm2/pv-weight-rms/2bpp)."""
    parts = Path(path).parts
    start = parts.index("published") + 1 if "published" in parts else 0
    end = next((i for i, part in enumerate(parts) if part.endswith("bpp")), len(parts) - 1)
    return "/".join(parts[start:end + 1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", required=True, help="glob of train_log.parquet files")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    paths = sorted(glob.glob(args.logs, recursive=True))
    if not paths:
        raise SystemExit(f"no train logs match {args.logs!r}")
    runs = []
    for path in paths:
        heldout = heldout_curve(path)
        for evaluations, min_improvement in SETTINGS:
            runs.append({"log": path, "model": model_of(path), "evaluations_held_out": len(heldout),
                         "plateau_evaluations": evaluations, "plateau_min_improvement": min_improvement,
                         **replay(heldout, evaluations, min_improvement)})
    table = pd.DataFrame(runs)
    table["kl_rise"] = table["kept_kl"] / table["best_kl"] - 1
    table["perplexity_rise"] = table["kept_perplexity"] / table["best_perplexity"] - 1
    summary = table.groupby(["model", "plateau_evaluations", "plateau_min_improvement"]).agg(
        runs=("log", "size"), stopped=("stopped_early", "sum"), evaluations=("evaluations_held_out", "median"),
        steps_saved_mean=("steps_saved", "mean"), budget_steps=("budget_steps", "median"),
        kl_rise_max=("kl_rise", "max"), perplexity_rise_max=("perplexity_rise", "max")).reset_index()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    provenance = {"card": "none (CPU, reads logs)", "date": datetime.date.today().isoformat(), "commit": commit,
                  "command": "python " + " ".join(sys.argv)}
    args.out.write_text(json.dumps({"provenance": provenance, "summary": summary.to_dict("records"), "runs": runs},
                                   indent=1))
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
