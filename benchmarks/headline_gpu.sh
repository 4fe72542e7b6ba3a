#!/usr/bin/env bash
# The headline at its own scale: a Llama-3.2-3B- or Llama-3.1-8B-shaped model from the kit's hub cache
# (benchmarks/headline_kit.py) through the unchanged pipeline at the paper's settings, measured rule by
# rule (benchmarks/headline_results.py), on a lent GPU machine (no network there) through
# benchmarks/gpu_pipeline.sh (its staging folder, wheel install and detached Snakemake run).
# Here, with the package registries, from the repository root:
#   bash benchmarks/gpu_pipeline.sh wheels; bash benchmarks/headline_gpu.sh carry   # what travels
#   bash benchmarks/headline_gpu.sh rehearse [CARRY]   # the whole run on a CPU, tiny shape (minutes)
# There:
#   WHEELS=.whl bash benchmarks/gpu_pipeline.sh install  # then WHEELS=".whl2 .whl3" (or a packed site)
#   bash benchmarks/headline_gpu.sh kit SHAPE [CARRY]   # write the hub cache (carry CARRY, default
#                                                       # .device-carry/headline, once; kept in $STAGE)
#   bash benchmarks/headline_gpu.sh start SHAPE [MODE]  # detached, from an empty results/ (profiles/gpu):
#       MODE all (default): both inits' eval_pre_pv.json and the fp baseline, then the first PV-tuning
#                 steps (benchmarks/headline_pv.yaml) alone on the card once every other job is done
#       MODE prepv: the pre-PV targets only;  MODE oaem: OA-EM's eval_pre_pv.json and the fp baseline
#                 (an 8B's two inits need ~60 GB of the machine's 64 GB disk);  MODE j1: the pre-PV
#                 targets with `snakemake -j1` (a user's own command line: no profile, one job at a time);
#                 MODE j1oaem: the same for OA-EM's eval_pre_pv.json alone
#   bash benchmarks/headline_gpu.sh pv SHAPE            # detached: the PV-tuning steps alone, after `prepv`
#   bash benchmarks/headline_gpu.sh wait SECONDS        # watch; once Snakemake is done, collect into $OUT
#   bash benchmarks/headline_gpu.sh collect             # collect now, done or not (a lease about to end)
# SHAPE: llama3b | llama8b | tiny (the CPU rehearsal). What `wait` leaves in $OUT:
# headline_<shape>_<card>[_j1|_pv].json, results.tar.gz (every JSON and Parquet of results/ but
# models), logs.tar.gz (job logs and benchmarks, GPU/disk samples, Snakemake's output), and prints the
# per-rule table last. HEADLINE_CARD: the card's index when two runs share a machine (each with its
# own STAGE and CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER=PCI_BUS_ID): only that card is sampled.
# GPU_SLOTS: concurrent GPU jobs (default 12; 6 suits a 3B). HEADLINE_ARGS: more Snakemake arguments.
set -euo pipefail
STAGE=${STAGE:-/root/stage}
PY=${PYTHON:-python3}
export PYTHONPATH="$STAGE/site:$PWD/src:$PWD" AQFLOW_CACHE="$STAGE/cache" PYTHONUNBUFFERED=1
export HF_HOME="$STAGE/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
case "${1:-}" in kit|start|pv|wait|collect) mkdir -p "$STAGE" ;; esac  # not for --help

targets() {  # the pre-PV targets of a shape: both inits' eval_pre_pv.json and the fp baseline
  local model=$1
  [ "$model" = tiny ] && model=llama3b  # the tiny shape sits under llama3b's hub id
  echo "results/$model/2bpp/greedy/b8/eval_pre_pv.json results/$model/2bpp/oaem/b8/eval_pre_pv.json results/$model/fp/eval.json"
}

model_of() { if [ "$1" = tiny ]; then echo llama3b; else echo "$1"; fi; }

card_name() {  # h100, h200, ... (cpu without a card), for file names
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
  name=$(echo "$name" | grep -oiE '[A-Z][0-9]{2,3}' | head -1 | tr 'A-Z' 'a-z')
  echo "${name:-cpu}"
}

case "${1:-}" in
carry)
  # the kit's inputs (tokenizer, registry text, the zero-shot tasks), fetched here by the pipeline's own fetchers
  PYTHONPATH="$PWD/src:$PWD" "$PY" -m benchmarks.headline_kit carry --out .device-carry/headline
  du -sh .device-carry/headline
  ;;
rehearse)
  # the GPU call's steps on a CPU, end to end: kit, pre-PV targets then PV-tuning alone, collected
  export STAGE=${STAGE_REHEARSAL:-/tmp/headline-rehearsal}; export OUT=${OUT:-$STAGE/out} GPU_SLOTS=${GPU_SLOTS:-2}
  export HEADLINE_ARGS="--cores ${CORES:-2}"
  rm -rf "$STAGE"; mkdir -p "$OUT"
  bash "$0" kit tiny "${2:-.device-carry/headline}"
  bash "$0" start tiny all
  bash "$0" wait 1500
  [ "$(cat "$STAGE/snakemake.rc")" = 0 ] || { tail -60 "$STAGE/snakemake.out"; exit 1; }
  ;;
kit)
  shape=$2 carry=${3:-.device-carry/headline}
  if [ -d "$carry" ]; then rm -rf "$STAGE/carry"; cp -r "$carry" "$STAGE/carry"; fi
  parts=model
  # the corpora and task data are the same for every shape but tiny (whose corpus is small)
  if [ "$shape" = tiny ] || ! grep -q '"corpora"' "$STAGE/hf/kit.json" 2>/dev/null \
      || grep -q '"shape": "tiny"' "$STAGE/hf/kit.json"; then parts=model,corpora,tasks; fi
  "$PY" -m benchmarks.headline_kit build --carry "$STAGE/carry" --hf-home "$HF_HOME" --aqflow-cache "$AQFLOW_CACHE" \
      --shape "$shape" --parts "$parts" | tail -40
  du -sh "$HF_HOME/hub"/* ; df -h "$STAGE" | tail -1
  ;;
start|pv)
  mode=$1 shape=$2 variant=${3:-all}
  model=$(model_of "$shape")
  work="$STAGE/work"
  pv_target="results/$model/2bpp/oaem/b8/pv/pvtune.json"
  overrides=()
  [ "$shape" = tiny ] && overrides+=(benchmarks/headline_tiny.yaml)
  extra=()
  if [ "$mode" = start ]; then
    # an empty results/ (and no earlier models, corpora, logs or Snakemake state)
    rm -rf "$work/results" "$work/resources" "$work/logs" "$work/.snakemake"
    prepv=$(targets "$shape")
    [ "$variant" = oaem ] && prepv="results/$model/2bpp/oaem/b8/eval_pre_pv.json results/$model/fp/eval.json"
    [ "$variant" = j1oaem ] && prepv="results/$model/2bpp/oaem/b8/eval_pre_pv.json"
    slots=${GPU_SLOTS:-12}
    # card shares (a resource of this run): PV-tuning takes every share, so it runs alone on the card
    # once the other GPU jobs are done (it fills the card); every other GPU job takes one, but
    # calibration all but one (beside it only the fp evaluation, which it does not wait for: both
    # run first, prioritized). At 8B calibration takes every share: it sizes its XᵀX sums to the
    # memory it finds free, which an evaluation starting beside it would take away.
    calibrate_shares=$(( slots - 1 )); prioritized=$prepv
    if [ "$model" = llama8b ]; then calibrate_shares=$slots; prioritized=$(echo "$prepv" | tr ' ' '\n' | grep eval_pre_pv); fi
    shares=(--resources "gpu=$slots" "card_share=$slots" --set-resources "calibrate:card_share=$(( calibrate_shares > 0 ? calibrate_shares : 1 ))"
            "pvtune:card_share=$slots" "quantize_layer:card_share=1" "stitch:card_share=1"
            "evaluate_quantized:card_share=1" "evaluate_fp:card_share=1" --prioritize $prioritized)
    case "$variant" in
      all) suffix=""; run_targets="$prepv $pv_target"; overrides+=(benchmarks/headline_pv.yaml); extra+=("${shares[@]}") ;;
      prepv|oaem) suffix=""; run_targets=$prepv; extra+=("${shares[@]}") ;;
      j1|j1oaem) suffix=_j1; run_targets=$prepv ;;
      *) echo "unknown mode $variant (all, prepv, oaem, j1, j1oaem)" >&2; exit 2 ;;
    esac
  else
    prepv=""; run_targets=$pv_target; suffix=_pv
    overrides+=(benchmarks/headline_pv.yaml)
  fi
  if [ ${#overrides[@]} -gt 0 ]; then extra+=(--config "overrides=$(IFS=,; echo "${overrides[*]}")"); fi
  printf '%s\n' "$shape" "$suffix" "$prepv" "$run_targets" "$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    "$(IFS=,; echo "${overrides[*]}")" > "$STAGE/headline_run"
  rm -f "$STAGE/samples.stop" "$STAGE/samples.csv"
  setsid nohup "$PY" -m benchmarks.headline_results sample --out "$STAGE/samples.csv" --disk "$STAGE" \
      --stop-file "$STAGE/samples.stop" ${HEADLINE_CARD:+--card "$HEADLINE_CARD"} > "$STAGE/samples.log" 2>&1 < /dev/null &
  if [ "$suffix" = _j1 ]; then  # the user's own command line: one job at a time, no profile
    PROFILE=none bash benchmarks/gpu_pipeline.sh start -j1 $run_targets "${extra[@]}" ${HEADLINE_ARGS:-}
  else
    bash benchmarks/gpu_pipeline.sh start $run_targets "${extra[@]}" ${HEADLINE_ARGS:-}
  fi
  ;;
wait)
  if [ ! -f "$STAGE/started_at" ]; then  # a fresh machine: the lease that ran `start` has ended
    echo "no run started on this machine ($STAGE/started_at missing): the machine that ran 'start' is gone" >&2; exit 3
  fi
  deadline=$(( $(date +%s) + $2 ))
  while [ ! -f "$STAGE/snakemake.rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do
    sleep 15
    echo "$(( $(date +%s) - $(cat "$STAGE/started_at") )) s: $(grep -E '^[0-9]+ of [0-9]+ steps' "$STAGE/snakemake.out" | tail -1)"
  done
  grep -E "^Error in rule|^WorkflowError|Exiting because|MissingOutput|out of memory" "$STAGE/snakemake.out" | head -20 || true
  if [ ! -f "$STAGE/snakemake.rc" ]; then
    echo "snakemake still running"; tail -5 "$STAGE/snakemake.out"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true
    df -h "$STAGE" | tail -1
    exit 0
  fi
  touch "$STAGE/samples.stop"
  echo "snakemake exit status $(cat "$STAGE/snakemake.rc")"
  bash "$0" collect
  ;;
collect)
  # what the run has made so far into $OUT (also while it runs: a lease about to end; the DAG's
  # planning is then not timed)
  { read -r shape; read -r suffix; read -r prepv; read -r run_targets; read -r commit; read -r overrides; } < "$STAGE/headline_run"
  cd "$STAGE/work"
  smk=(--profile profiles/gpu); [ "$suffix" = _j1 ] && smk=(-j1)
  [ -n "$overrides" ] && smk+=(--config "overrides=$overrides")
  pv=()
  pv_dir="$(dirname "$(echo "$run_targets" | tr ' ' '\n' | grep pvtune.json || echo none/x)")"
  [ -d "$pv_dir" ] && pv=(--pv "$pv_dir")
  [ "$suffix" = _pv ] && pv+=(--merge "$STAGE/headline_${shape}.json")
  plan=()
  if [ -f "$STAGE/snakemake.rc" ]; then
    # the DAG's own planning on the finished run, as a user's next `snakemake -n` pays it
    plan_start=$("$PY" -c "import time; print(time.time())")
    "$PY" -m snakemake "${smk[@]}" -n $run_targets > "$STAGE/plan.out" 2>&1 || true
    plan=(--plan-seconds "$("$PY" -c "import time; print(round(time.time() - $plan_start, 2))")")
    echo "snakemake -n: ${plan[1]} s"; tail -3 "$STAGE/plan.out"
  fi
  card=$(card_name)
  "$PY" -m benchmarks.headline_results --work . --shape "$shape" --card "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo cpu)" \
      --started-at "$(cat "$STAGE/started_at")" --targets $prepv --samples "$STAGE/samples.csv" \
      --hf-home "$HF_HOME" "${plan[@]}" "${pv[@]}" \
      --out "$OUT/headline_${shape}_${card}${suffix}.json" || true
  # the pre-PV record, kept: the PV-tuning run's collection adds to it (headline_<shape>_<card>_pv.json)
  [ -z "$suffix" ] && cp "$OUT/headline_${shape}_${card}.json" "$STAGE/headline_${shape}.json" 2>/dev/null || true
  mkdir -p results
  find results -name '*.json' -o -name '*.parquet' | grep -v '/model/' | tar -czf "$OUT/results.tar.gz" -T - || true
  tar -czf "$OUT/logs.tar.gz" logs "$STAGE/snakemake.out" "$STAGE/samples.csv" "$STAGE/plan.out" "$STAGE/hf/kit.json" \
      "$STAGE"/gpu_utilisation.csv 2>/dev/null || true
  echo "commit $commit"; ls -la "$OUT"
  ;;
*)
  echo "usage: $0 carry | rehearse [CARRY] | kit SHAPE [CARRY] | start SHAPE [all|prepv|oaem|j1|j1oaem] | pv SHAPE | wait SECONDS | collect" >&2; exit 2
  ;;
esac
