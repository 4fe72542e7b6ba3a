#!/usr/bin/env bash
# PV-tuning's early stop (pvtune.plateau_evaluations) on real models, one card. Each model's 2 bpp
# OA-EM b8 cell (seed 42) is quantized once; from that one start it is PV-tuned twice with the same
# settings, over the whole budget and with the plateau stop, and each result is evaluated
# (WikiText-2 and C4 stand-in perplexity). The budget is twice the offline default (EPOCHS=10) and
# the held-out KL is scored every EVERY=2 steps, so that the rule has a curve to act on: at the
# default's 20-25 steps and an evaluation every 10 the KL still falls >1 % at every evaluation
# (benchmarks/plateau_replay.py) and the stop never fires.
# On the device, after gpu_pipeline.sh install, the text in resources/data and the GGUF parts:
#   bash benchmarks/gpu_pipeline.sh script benchmarks/plateau_gpu.sh   # MODELS="smollm2 gemma3-270m"
# It writes $STAGE/out/plateau_runs.tar.gz (per model and run: eval.json, pvtune.json,
# train_log.parquet), refreshed after every run, and $STAGE/out/plateau_gpu.log; then, here:
#   python benchmarks/plateau_runs.py --runs DIR --out results/published/plateau/plateau_runs.json
set -uo pipefail
MODELS=${MODELS:-"smollm2 gemma3-270m"}
EPOCHS=${EPOCHS:-10} MICRO=${MICRO:-16} EVERY=${EVERY:-2} PATIENCE=${PATIENCE:-2} MIN_IMPROVEMENT=${MIN_IMPROVEMENT:-0.01}
out=$STAGE/out runs=$STAGE/plateau_runs  # runs/ is packed: $OUT brings back 8 files, 2 folders down
mkdir -p "$out" "$runs"
exec > >(tee -a "$out/plateau_gpu.log") 2>&1

# The two runs differ in the plateau keys alone; perplexity on the two stand-ins only (the
# profile's 15 Brown genres and the zero-shot tasks would triple the evaluations).
common="pvtune: {epochs: $EPOCHS, eval_every_steps: $EVERY, plateau_min_improvement: $MIN_IMPROVEMENT, micro_batch_size: $MICRO}
evaluation: {tasks: []}
text: {offline: {evaluation: [wikitext2-standin, c4-standin]}}
speed: {enabled: false}"
echo "$common" > "$STAGE/plateau_full.yaml"
sed "s/^pvtune: {/pvtune: {plateau_evaluations: $PATIENCE, /" "$STAGE/plateau_full.yaml" > "$STAGE/plateau_stop.yaml"
cat "$STAGE/plateau_full.yaml" "$STAGE/plateau_stop.yaml"

# Each model in its own copy of the checkout (Snakemake locks its directory), all at once on the one
# card: the layer jobs, loading and evaluation of one fill the gaps of another's PV-tuning, and a
# model's two PV-tuning runs go side by side from its one quantized start. A fixed micro-batch keeps
# them on the same arithmetic whatever else holds the card.
smk=(python3 -m snakemake --profile profiles/gpu --cores 8 --resources gpu=8 --scheduler greedy --keep-going)
cell() { echo "results/$1/2bpp/oaem/b8"; }

keep() {  # keep MODEL RUN STARTED: this run's files beside the others, then the whole set packed again
  local folder="$runs/$1/$2"
  mkdir -p "$folder"
  cp "$(cell "$1")/eval.json" "$(cell "$1")/pv/pvtune.json" "$(cell "$1")/pv/train_log.parquet" "$folder/" || return 1
  echo "$(( $(date +%s) - $3 ))" > "$folder/wall_seconds"
  nvidia-smi --query-gpu=name --format=csv,noheader > "$folder/card"
  (flock 9; tar -czf "$out/plateau_runs.tar.gz.tmp" -C "$runs" . && mv "$out/plateau_runs.tar.gz.tmp" "$out/plateau_runs.tar.gz") \
    9> "$STAGE/plateau_pack.lock"
  echo "=== kept $1 $2 ($(cat "$folder/wall_seconds") s)"
}

run() {  # run MODEL full|stop: one Snakemake run of the model's cell, then its files kept
  local started
  started=$(date +%s)
  echo "=== $1 $2: $(date -u +%T)"
  "${smk[@]}" "$(cell "$1")/eval.json" --config overrides="$STAGE/plateau_$2.yaml" < /dev/null && keep "$1" "$2" "$started"
}

model_pair() {  # the cell to its pre-PV evaluation once, then both PV-tuning runs at once from it
  local model=$1 gguf
  gguf="$STAGE/cache/$model/$(python3 -c "import sys; from aqflow.models.presets import get_preset; print(get_preset(sys.argv[1]).gguf_name)" "$model")"
  for _ in $(seq 120); do  # its GGUF parts may still be travelling: gpu_pipeline.sh join puts it there
    bash benchmarks/gpu_pipeline.sh join > /dev/null; [ -f "$gguf" ] && break; sleep 10
  done
  [ -f "$gguf" ] || { echo "=== $model: no GGUF after 20 min"; return 1; }
  mkdir -p "$STAGE/w-$model"
  tar --exclude=./results --exclude=./.snakemake --exclude=./logs -cf - . | tar -C "$STAGE/w-$model" -xf -
  cd "$STAGE/w-$model" && export PYTHONPATH="$STAGE/site:$PWD/src" || return 1
  echo "=== $model start: $(date -u +%T)"
  "${smk[@]}" "$(cell "$model")/eval_pre_pv.json" --config overrides="$STAGE/plateau_full.yaml" < /dev/null || return 1
  # the stopped run in a copy of this checkout, Snakemake's records included: the same start
  cp -a . "$STAGE/w-$model-stop"
  run "$model" full > "$out/plateau_$model-full.log" 2>&1 &
  (cd "$STAGE/w-$model-stop" && export PYTHONPATH="$STAGE/site:$PWD/src" && run "$model" stop) > "$out/plateau_$model-stop.log" 2>&1 &
  wait
}

for model in $MODELS; do model_pair "$model" > "$out/plateau_$model.log" 2>&1 & done
wait
tail -n 3 "$out"/plateau_*.log
echo "=== done $(date -u +%T)"
