#!/usr/bin/env bash
# Open sums on one GPU machine (issue 27), in one device call: the CUDA kernels' GPU tests (open sums
# included), then the GPU decode benchmark at the 3B and 8B shapes, each 2-bit model decoded with open sums
# (the default) and again with the GEMVs finishing their own sums (--closed-sums-too), so the two compare
# on one machine. Run from the repository root, detached if the call may not hold it (setsid ... &):
#   bash benchmarks/open_sums_check.sh OUT_DIR [GPU_BUDGET_SECONDS]
# Writes OUT_DIR/{tests.log, inference_gpu.json, inference_gpu.log, done}.
set -uo pipefail
out=${1:?OUT_DIR}
budget=${2:-420}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
TRITON_INTERPRET=0 timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_cuda_kernels.py \
  tests/inference/test_dependent_launch.py tests/inference/test_open_sums.py tests/inference/test_cuda_layers.py > "$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log")"
timeout $((budget + 60)) "$PY" benchmarks/inference_gpu.py --models "${MODELS:-3b,8b}" --closed-sums-too 3b,8b \
  --budget-seconds "$budget" --out "$out" > "$out/inference_gpu.log" 2>&1
grep -E "decode compile\+graph|speed-up|logits vs" "$out/inference_gpu.log"
touch "$out/done"
