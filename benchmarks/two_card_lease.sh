#!/usr/bin/env bash
# One lease of a 2-GPU box (no network) for issues 24 and 27 at once: card 0 runs the 3B headline
# (benchmarks/headline_gpu.sh), card 1 the GPU decode benchmark (benchmarks/inference_gpu.py) and
# then the 8B headline; the CPU decode benchmark (benchmarks/inference_cpu.py) runs on cores 16-31
# while the pipelines and the GPU benchmark are pinned to cores 0-15 (so "all cores" of that
# benchmark are the 16 it has). Each headline run has its own staging folder and samples its own card.
#   bash benchmarks/two_card_lease.sh setup   # carry .whl and .device-carry/headline: wheels, the 3B
#                                             # kit on card 0; card 1's chain and the CPU benchmark start
#   bash benchmarks/two_card_lease.sh start3b # carry .whl2 .whl4: transformers 5.23, huggingface_hub 2.4
#                                             # (1.x, the box's, fails offline with allow_patterns); the 3B run starts
#   bash benchmarks/two_card_lease.sh wait S  # watch for S seconds; what exists so far goes to $OUT
set -euo pipefail
export CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BENCH=/root/bench
mkdir -p "$BENCH"
# pinning to cores where taskset exists (util-linux); without it everything shares all cores
command -v taskset > /dev/null || taskset() { shift 2; "$@"; }
export -f taskset 2>/dev/null || true
case "$1" in
setup)
  nvidia-smi -L; nproc
  STAGE=/root/stage taskset -c 0-15 bash benchmarks/gpu_pipeline.sh install | tail -3
  mkdir -p /root/stage8 && ln -sfn /root/stage/site /root/stage8/site
  cp -r "$PWD" "$BENCH/repo"  # the chains below run from a copy: the next call replaces this checkout
  cd "$BENCH/repo"
  # card 1: the GPU decode benchmark, then the 8B kit, then (once start3b has installed .whl2) the 8B run
  setsid nohup bash -c '
    PYTHONPATH=src CUDA_VISIBLE_DEVICES=1 taskset -c 0-15 timeout 300 '"$PY"' benchmarks/inference_gpu.py --out '"$BENCH"' > '"$BENCH"'/inference_gpu.log 2>&1
    echo $? > '"$BENCH"'/inference_gpu.rc
    export STAGE=/root/stage8 HEADLINE_CARD=1 CUDA_VISIBLE_DEVICES=1 GPU_SLOTS=4
    taskset -c 0-15 bash benchmarks/headline_gpu.sh kit llama8b > '"$BENCH"'/kit8b.log 2>&1
    while [ ! -f /root/stage/whl2.done ]; do sleep 5; done
    taskset -c 0-15 bash benchmarks/headline_gpu.sh start llama8b oaem > '"$BENCH"'/start8b.log 2>&1' \
    > "$BENCH/chain1.log" 2>&1 < /dev/null &
  # cores 16-31: the CPU decode benchmark (numba and torch on 16 threads)
  setsid nohup bash -c 'PYTHONPATH=src NUMBA_NUM_THREADS=16 taskset -c 16-31 timeout 900 '"$PY"' benchmarks/inference_cpu.py --threads 16 --out '"$BENCH"'/inference_cpu.json > '"$BENCH"'/inference_cpu.log 2>&1; echo $? > '"$BENCH"'/inference_cpu.rc' \
    > /dev/null 2>&1 < /dev/null &
  cd - > /dev/null
  CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash benchmarks/headline_gpu.sh kit llama3b | tail -8
  ;;
start3b)
  STAGE=/root/stage WHEELS=".whl2 .whl4" bash benchmarks/gpu_pipeline.sh install | tail -2 && touch /root/stage/whl2.done
  STAGE=/root/stage HEADLINE_CARD=0 CUDA_VISIBLE_DEVICES=0 GPU_SLOTS=6 taskset -c 0-15 bash benchmarks/headline_gpu.sh start llama3b all
  ;;
wait)
  deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$deadline" ] && ! { [ -f /root/stage/snakemake.rc ] && [ -f /root/stage8/snakemake.rc ]; }; do sleep 20; done
  for run in /root/stage /root/stage8; do
    echo "== $run: $(grep -E '^[0-9]+ of [0-9]+ steps' "$run/snakemake.out" 2>/dev/null | tail -1)"
    grep -E "^Error in rule|out of memory|Exiting because" "$run/snakemake.out" 2>/dev/null | head -5 || true
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader; df -h /root | tail -1
  mkdir -p "$OUT/3b" "$OUT/8b"
  STAGE=/root/stage OUT="$OUT/3b" bash benchmarks/headline_gpu.sh collect > "$BENCH/collect3b.log" 2>&1 || true
  STAGE=/root/stage8 OUT="$OUT/8b" bash benchmarks/headline_gpu.sh collect > "$BENCH/collect8b.log" 2>&1 || true
  tail -3 "$BENCH"/inference_gpu.log "$BENCH"/inference_cpu.log 2>/dev/null || true
  tar -czf "$OUT/bench.tar.gz" -C "$BENCH" --exclude=repo . 2>/dev/null || true
  ls -la "$OUT" "$OUT/3b" "$OUT/8b"
  ;;
esac
