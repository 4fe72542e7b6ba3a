#!/usr/bin/env bash
# The MLP's activation inside the down GEMV (issue 27, session 32; not merged: the decode was slower), reproducible
# from main: a copy of src/, tests/ and benchmarks/ with benchmarks/patches/gated_mlp.patch applied. In it, inside
# open_sums_enabled, every Llama-style MLP whose fused gate/up product and down projection both take open sums
# runs one token as two kernels: the gate/up GEMV, then the down GEMV forming silu(gate) * up from the gate/up
# sums (finished with their scales and bias, rounded as the model's MLP rounds) as it reads its input; the
# inductor kernel that did so between them is gone. In one device call: the GPU tests of that copy, then both
# models decoded and tuned through it (`gated`) and through it with no MLP recognized (`apart`: the kernels
# the same, the decode step as on main) with decode_ab.sh (results/gated_mlp_h200/). Run from the repository root:
#   bash benchmarks/gated_mlp_check.sh OUT_DIR
set -euo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
source benchmarks/kernel_edits.sh
copy=$(patched_copy gated_mlp.patch)
cd "$copy"
edit . "$copy/apart" aqflow/inference/open_sums.py \
  'GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})' 'GATED_MLPS = frozenset()'
TESTS=gated MODELS=3b,8b BUDGET=${BUDGET:-170} bash benchmarks/decode_ab.sh "$out" gated=src apart="$copy/apart/src"
