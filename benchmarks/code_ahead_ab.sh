#!/usr/bin/env bash
# Three steps of codes in flight instead of two in the one-token split-K GEMV (issue 27), in one device
# call: the kernel as committed (a) against a copy whose lut_gemv.cu requests the codes of the next three
# (batch, chunk) steps while one is looked up (k3; still 80 registers, three CTAs a multiprocessor, no
# spills with nvcc 13.0 for sm_90a), both models, each tuned as it runs. Run from the repository root:
#   bash benchmarks/code_ahead_ab.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
python3 benchmarks/source_variant.py src "$variants/k3/src" aqflow/inference/csrc/lut_gemv.cu \
  "constexpr int kAhead = kTokens == 1 ? 2 : 1;" "constexpr int kAhead = kTokens == 1 ? 3 : 1;"
MODELS=3b,8b BUDGET=200 bash benchmarks/decode_ab.sh "$out" a=src k3="$variants/k3/src"
