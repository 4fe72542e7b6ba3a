#!/usr/bin/env bash
# Where the 2-bit GEMVs' time goes inside a decode step (issue 27), in one device call: a copy of src/ and
# benchmarks/ with benchmarks/patches/gemv_timeline.patch applied (every split-K CTA stamps its phases
# into a ring buffer), then benchmarks/gemv_timeline.py decodes both models on the configurations of
# CONFIGS (default: the committed H200 decode's) and prints, per linear, the exposed time and the CTA
# phases. SRC (default src) names the source folder to patch (a variant made by source_variant.py). Run
# from the repository root:
#   bash benchmarks/gemv_timeline_check.sh OUT_DIR
set -euo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
configs=$(pwd)/${CONFIGS:-benchmarks/results/qkv_finish_h200/c/inference_gpu.json}
copy=$(mktemp -d)
cp -r "${SRC:-src}" "$copy/src" && cp -r benchmarks "$copy/"
cd "$copy"
git apply benchmarks/patches/gemv_timeline.patch
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
TORCH_EXTENSIONS_DIR="$copy/ext" PYTHONPATH="src:benchmarks" PYTHONUNBUFFERED=1 \
  python3 benchmarks/gemv_timeline.py --shapes "${SHAPES:-3b,8b}" --configs "$configs" --out "$out" 2>&1 |
  grep -v "Warning\|warn(" | tee "$out/gemv_timeline.txt"
