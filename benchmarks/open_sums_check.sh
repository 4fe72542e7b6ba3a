#!/usr/bin/env bash
# Open sums on one GPU machine (issue 27), in one device call: benchmarks/cuda_layers_check.sh (the GPU
# tests, then the 3B and 8B decode) with each 2-bit model decoded with open sums (the default) and again
# with the GEMVs finishing their own sums (--closed-sums-too), so the two compare on one machine
# (open_sums_h200/, measured before the fused attention existed, when the test list ended at open sums).
# Run from the repository root, detached if the call may not hold it:
#   bash benchmarks/open_sums_check.sh OUT_DIR [GPU_BUDGET_SECONDS]
ARGS="--closed-sums-too 3b,8b" exec bash "$(dirname "$0")/cuda_layers_check.sh" "$@"
