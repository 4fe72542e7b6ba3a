#!/usr/bin/env bash
# Tuning for open sums (issue 27), on one GPU machine: the GPU decode benchmark twice, each 2-bit model
# decoded with open sums; first with the kernel configurations chosen by timing the split-K candidates
# with their finishing pass (--closed-sums-tuning, as before open sums), then timed as open sums run
# them (the default). Run from the repository root, detached if the call may not hold it:
#   bash benchmarks/open_tuning_ab.sh OUT_DIR [BUDGET_SECONDS_EACH]
# Writes OUT_DIR/{closed_tuning,open_tuning}/{inference_gpu.json,inference_gpu.log} and OUT_DIR/done.
set -uo pipefail
out=${1:?OUT_DIR}
budget=${2:-200}
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
for run in closed_tuning open_tuning; do
  mkdir -p "$out/$run"
  flag=$([ "$run" = closed_tuning ] && echo --closed-sums-tuning)
  timeout $((budget + 60)) "$PY" benchmarks/inference_gpu.py --models "${MODELS:-3b,8b}" $flag \
    --budget-seconds "$budget" --out "$out/$run" > "$out/$run/inference_gpu.log" 2>&1
  echo "== $run"; grep -E "decode compile\+graph|speed-up|  ours " "$out/$run/inference_gpu.log"
done
touch "$out/done"
