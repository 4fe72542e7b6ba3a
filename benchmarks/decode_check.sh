#!/usr/bin/env bash
# Issue 27's figures on one GPU machine, in one device call: the CUDA kernels' GPU tests, the GPU decode
# benchmark (3B and 8B shapes, bf16 against 2 bpp, compile + graph for both), then the CPU decode of the
# 3B shape on all the machine's cores (dense bf16 through the numba GEMV against 2x8 through the table
# kernels), the two variants measured in turn ROUNDS times (default 3) so that a change in the
# machine's load shows in both. Run from the repository root:
#   bash benchmarks/decode_check.sh OUT_DIR [GPU_BUDGET_SECONDS]
# Writes OUT_DIR/{tests.log, inference_gpu.json, inference_gpu.log, inference_cpu.json, inference_cpu.txt}.
set -uo pipefail
out=${1:?OUT_DIR}
budget=${2:-420}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba_cache}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|Thread"
TRITON_INTERPRET=0 timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_cuda_kernels.py \
  tests/inference/test_dependent_launch.py tests/inference/test_open_sums.py tests/inference/test_cuda_layers.py > "$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log")"
timeout $((budget + 60)) "$PY" benchmarks/inference_gpu.py --budget-seconds "$budget" --out "$out" > "$out/inference_gpu.log" 2>&1
grep -E "decode compile\+graph|speed-up|logits vs" "$out/inference_gpu.log"
timeout 300 "$PY" benchmarks/inference_cpu.py --threads "$(nproc)" --no-kernels --no-aqlm-kernel --new-tokens 16 \
  --repeats 1 --rounds "${ROUNDS:-3}" --variants "dense bf16 (numba GEMV)" "2x8 fast (bf16 rest)" \
  --out "$out/inference_cpu.json" > "$out/inference_cpu.txt" 2>&1
tail -8 "$out/inference_cpu.txt"
