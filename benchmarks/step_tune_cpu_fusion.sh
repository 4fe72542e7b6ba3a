#!/usr/bin/env bash
# Two of issue 27's leads measured in one device call (session 25):
# 1. GPU: the 3B decode with each fused shape's fastest candidates (as timed alone) tried in the whole
#    compile+graph decode (benchmarks/inference_gpu.py --step-tune), the starting and the chosen
#    configurations then decoded twice each, in turn.
# 2. CPU, every core of the GPU host: q/k/v and gate/up fused into one product each (greedy_decode's
#    default now) against unfused, for dense bf16 (numba GEMV) and 2x8, ROUNDS rounds in turn.
# Run from the repository root: bash benchmarks/step_tune_cpu_fusion.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba_cache}
nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
timeout 360 python3 benchmarks/inference_gpu.py --models 3b --budget-seconds 320 --step-tune "${STEP_TUNE:-3}" \
  --out "$out/gpu" > "$out/gpu.log" 2>&1
grep -E "decode compile\+graph|speed-up|step tuning" "$out/gpu.log"
timeout 330 python3 benchmarks/inference_cpu.py --threads "$(nproc)" --no-kernels --no-aqlm-kernel --new-tokens 16 \
  --repeats 1 --rounds "${ROUNDS:-2}" --variants "dense bf16 (numba GEMV, unfused)" "2x8 fast (bf16 rest, unfused)" \
  "dense bf16 (numba GEMV)" "2x8 fast (bf16 rest)" --out "$out/inference_cpu.json" > "$out/inference_cpu.txt" 2>&1
tail -9 "$out/inference_cpu.txt"
