#!/usr/bin/env bash
# What a kernel boundary costs against a grid-wide barrier in one persistent kernel (issue 27), on the GPU
# machine: builds benchmarks/boundary_cost.cu with that machine's nvcc and runs it. Run from the repository
# root: bash benchmarks/boundary_cost.sh OUT_DIR   (writes OUT_DIR/boundary_cost.{json,txt})
set -euo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/boundary_cost.cu -o "$out/boundary_cost.bin"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/boundary_cost.txt"
"$out/boundary_cost.bin" "$out/boundary_cost.json" | tee -a "$out/boundary_cost.txt"
rm -f "$out/boundary_cost.bin"
