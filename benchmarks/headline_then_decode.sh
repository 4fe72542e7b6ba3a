#!/usr/bin/env bash
# One lease of one GPU box for issues 24 and 27: the 3B headline's pre-PV run (benchmarks/headline_gpu.sh,
# profiles/gpu) alone on the machine, and once it has finished, the GPU decode benchmark
# (benchmarks/inference_gpu.py, host cores 0-1) beside the CPU decode benchmark
# (benchmarks/inference_cpu.py, cores 2-15, the machine's other 14 cores), so neither timing shares
# the machine with the pipeline.
#   bash benchmarks/gpu_pipeline.sh install; bash benchmarks/headline_gpu.sh kit llama3b   # carry .whl, .device-carry/headline
#   WHEELS=".whl2 .whl4" bash benchmarks/gpu_pipeline.sh install                          # carry .whl2, .whl4
#   bash benchmarks/headline_then_decode.sh start      # detached: the run, then both benchmarks
#   bash benchmarks/headline_then_decode.sh wait S     # watch for S seconds; what exists goes to $OUT
set -euo pipefail
PY=${PYTHON:-python3}
BENCH=/root/bench
command -v taskset > /dev/null || taskset() { shift 2; "$@"; }
export -f taskset 2>/dev/null || true
case "$1" in
start)
  mkdir -p "$BENCH" && rm -rf "$BENCH/repo" && cp -r "$PWD" "$BENCH/repo"  # the next call replaces this checkout
  GPU_SLOTS=${GPU_SLOTS:-6} bash benchmarks/headline_gpu.sh start llama3b prepv | tail -2
  cd "$BENCH/repo"
  setsid nohup bash -c '
    while [ ! -f /root/stage/snakemake.rc ]; do sleep 5; done
    OUT='"$BENCH"'/headline bash benchmarks/headline_gpu.sh wait 1 > '"$BENCH"'/collect.log 2>&1
    export PYTHONPATH=/root/stage/site:$PWD/src PYTHONUNBUFFERED=1
    taskset -c 0-1 timeout 420 '"$PY"' benchmarks/inference_gpu.py --out '"$BENCH"' > '"$BENCH"'/inference_gpu.log 2>&1 &
    NUMBA_NUM_THREADS=14 taskset -c 2-15 timeout 420 '"$PY"' benchmarks/inference_cpu.py --threads 14 \
        --out '"$BENCH"'/inference_cpu.json ${CPU_ARGS:-} > '"$BENCH"'/inference_cpu.log 2>&1
    wait; touch '"$BENCH"'/done' > "$BENCH/chain.log" 2>&1 < /dev/null &
  ;;
wait)
  mkdir -p "$BENCH/headline"
  deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$deadline" ] && [ ! -f "$BENCH/done" ]; do
    sleep 20
    echo "$(( $(date +%s) - $(cat /root/stage/started_at) )) s: $(grep -E '^[0-9]+ of [0-9]+ steps' /root/stage/snakemake.out | tail -1)"
  done
  grep -E "^Error in rule|out of memory|going on with|Exiting because" /root/stage/snakemake.out /root/stage/work/logs/evaluate/*/*/*/*.log 2>/dev/null | head -8 || true
  tail -4 "$BENCH"/collect.log "$BENCH"/inference_gpu.log "$BENCH"/inference_cpu.log 2>/dev/null || true
  cp "$BENCH"/headline/* "$BENCH"/inference_*.json "$BENCH"/inference_*.log "$OUT"/ 2>/dev/null || true
  ls -la "$OUT"
  ;;
esac
