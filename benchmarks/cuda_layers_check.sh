#!/usr/bin/env bash
# The GPU decode figures of a change on one GPU machine (issue 27), in one device call: the GPU tests of
# the decode kernels (CUDA GEMVs, PDL, open sums, the fused attention), stopping if any fails; then the
# GPU decode benchmark at the 3B and 8B shapes with ARGS. The default ARGS, --stock-layers-too 3b,8b,
# decode both models with the rotary embedding and cache write inside the attention kernels (the default)
# and again with the modules' own layers, so the two compare on one machine (cuda_layers_h200/);
# benchmarks/open_sums_check.sh runs it with --closed-sums-too. Run from the repository root, detached if
# the call may not hold it:
#   bash benchmarks/cuda_layers_check.sh OUT_DIR [GPU_BUDGET_SECONDS]
# Writes OUT_DIR/{tests.log, inference_gpu.json, inference_gpu.log, done}.
set -uo pipefail
out=${1:?OUT_DIR}
budget=${2:-420}
mkdir -p "$out"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
TRITON_INTERPRET=0 timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/inference/test_cuda_kernels.py \
  tests/inference/test_dependent_launch.py tests/inference/test_open_sums.py tests/inference/test_cuda_layers.py \
  > "$out/tests.log" 2>&1
echo "tests: $(tail -1 "$out/tests.log")"
if ! grep -qE "[0-9]+ passed" "$out/tests.log" || grep -qE "[0-9]+ (failed|error)" "$out/tests.log"; then
  grep -E "^(FAILED|ERROR)" "$out/tests.log" | head; touch "$out/done"; exit 1
fi
timeout $((budget + 60)) "$PY" benchmarks/inference_gpu.py --models "${MODELS:-3b,8b}" ${ARGS:---stock-layers-too 3b,8b} \
  --budget-seconds "$budget" --out "$out" > "$out/inference_gpu.log" 2>&1
grep -E "decode compile\+graph|speed-up|logits vs" "$out/inference_gpu.log"
touch "$out/done"
