#!/usr/bin/env bash
# The headline run rehearsed on a CPU, end to end, through the same scripts the GPU call uses
# (benchmarks/headline_gpu.sh on benchmarks/gpu_pipeline.sh): the kit's `tiny` shape under the
# llama3b preset's hub id, HF_HUB_OFFLINE=1, profiles/gpu (warm workers on), both inits and the fp
# baseline to the pre-PV eval.json, then two PV-tuning steps alone, collected into a headline JSON.
#   bash benchmarks/headline_rehearsal.sh [CARRY]   # CARRY: from `python -m benchmarks.headline_kit carry`
# Env: PYTHON (default: python3 with the pinned packages), STAGE (default /tmp/headline-rehearsal),
# OUT (default $STAGE/out). Prints the per-rule tables last; several minutes on 2 cores.
set -euo pipefail
export STAGE=${STAGE:-/tmp/headline-rehearsal} PYTHON=${PYTHON:-python3}
export OUT=${OUT:-$STAGE/out} GPU_SLOTS=${GPU_SLOTS:-2} HEADLINE_ARGS="--cores ${CORES:-2}"
carry=${1:-.device-carry/headline}
rm -rf "$STAGE"; mkdir -p "$OUT"
bash benchmarks/headline_gpu.sh kit tiny "$carry"
# as the GPU lease runs it: pre-PV targets, then PV-tuning alone, in one Snakemake run
bash benchmarks/headline_gpu.sh start tiny all
bash benchmarks/headline_gpu.sh wait 1500
[ "$(cat "$STAGE/snakemake.rc")" = 0 ] || { tail -60 "$STAGE/snakemake.out"; exit 1; }
ls -la "$OUT"
