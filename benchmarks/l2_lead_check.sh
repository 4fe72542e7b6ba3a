#!/usr/bin/env bash
# The L2 lead (issue 27, session 29; not merged: it made the decode slower), reproducible from main: a copy
# of src/, tests/ and benchmarks/ with benchmarks/patches/l2_lead.patch applied, in which each open-sums
# GEMV of a decode step requests the next one's codes into L2 (sm_90 bulk prefetch, a slice a CTA). Runs
# that copy's benchmarks/cuda_layers_check.sh: its GPU tests, then both models decoded with and without
# the requests, and per shape the chosen GEMV streamed, leading and with its codes in L2
# (results/l2_lead_h200/). Run from the repository root: bash benchmarks/l2_lead_check.sh OUT_DIR
set -euo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
copy=$(mktemp -d)
cp -r src tests benchmarks "$copy/"
(cd "$copy" && git apply benchmarks/patches/l2_lead.patch && \
   ARGS="--no-l2-lead-too 3b,8b" bash benchmarks/cuda_layers_check.sh "$out" 420)
