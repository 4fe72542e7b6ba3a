#!/usr/bin/env bash
# Does the unit of the V-step's step decide whether PV-tuning works on a model with small weights?
# Gemma3-270M (weight RMS 0.02-0.04 per linear, SmolLM2's 0.16-0.23) at 2 bpp, quantized cheaply on
# this CPU, then PV-tuned three ways from the same checkpoint and data: code_lr 0.01 in weight units
# (the recipe's default), code_lr 0.05 in units of each layer's weight RMS, and no V-step at all.
# Prints the held-out KL every 2 steps and the groups re-encoded per step; writes OUT/summary.json.
# Run from the repository root: bash benchmarks/pvtune_code_lr_scale.sh [OUT] (about 50 min on 2 cores).
set -euo pipefail
repo=$PWD
out=$(realpath -m "${1:-benchmarks/results/pvtune_code_lr_scale_gemma_cpu}")
work=${WORK:-$(mktemp -d)}
mkdir -p "$out" "$work"
cd "$work"
for entry in Snakefile workflow config.yaml profiles src envs; do ln -sfn "$repo/$entry" "$entry"; done
checkpoint=results/gemma3-270m/2bpp/greedy/b2e2/model
python -m snakemake --cores 2 --configfile config.yaml profiles/demo/demo.yaml \
  --config overrides="$repo/benchmarks/pvtune_code_lr_scale.yaml" -- "$checkpoint" > snakemake.log 2>&1
run() {
  name=$1; shift
  PYTHONPATH="$repo/src" python -m aqflow pvtune --model-dir resources/models/gemma3-270m \
    --checkpoint-dir "$checkpoint" --corpus resources/data/c4-standin.parquet \
    --output-dir "pv-$name/model" --train-log "$out/$name.train_log.parquet" --metrics "$out/$name.pvtune.json" \
    --state-dir "pv-$name/state" --num-samples 24 --window-tokens 256 --heldout-samples 4 --batch-size 4 \
    --micro-batch-size 2 --epochs 1 --eval-every-steps 2 --kl-chunk-tokens 256 --device cpu --quiet "$@" \
    > "pv-$name.log" 2>&1
}
run absolute
run weight_rms --code-lr-scale weight_rms --code-lr 0.05
run no_codes --no-update-codes
PYTHONPATH="$repo/src" python - "$out" <<'PY'
import json, sys
from pathlib import Path
import pandas as pd
out = Path(sys.argv[1])
summary = {}
for name in ("absolute", "weight_rms", "no_codes"):
    log = pd.read_parquet(out / f"{name}.train_log.parquet")
    heldout = log[log["split"] == "heldout"]
    train = log[log["split"] == "train"]
    summary[name] = {"heldout_kl": dict(zip(heldout["step"].astype(int).astype(str), heldout["kl"].round(4))),
                     "codes_changed_per_step": train["codes_changed_fraction"].round(5).tolist(),
                     "selected_step": int(json.loads((out / f"{name}.pvtune.json").read_text())["best_step"])}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"{'V-step':12} {'held-out KL by step':44} {'max groups re-encoded a step':>28} selected")
for name, row in summary.items():
    kl = ", ".join(f"{step}: {value:.3f}" for step, value in row["heldout_kl"].items())
    changed = [value for value in row["codes_changed_per_step"] if value == value]  # no V-step: NaN
    share = f"{100 * max(changed):.2f}%" if changed else "-"
    print(f"{name:12} {kl:44} {share:>28} {row['selected_step']:>8}")
PY
