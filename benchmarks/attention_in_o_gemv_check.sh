#!/usr/bin/env bash
# The attention's combine inside the o GEMV (issue 27, session 33; not merged: the decode was not faster at 3B and
# slower at 8B), reproducible from main: a copy of src/, tests/ and benchmarks/ with
# benchmarks/patches/attention_in_o_gemv.patch applied. In it, a Llama-style attention module whose o projection
# takes open sums runs its one-token attention as the split kernel only (`rope_cache_attention_splits`), and the o
# projection's split-K CTAs form their inputs in shared memory from the splits' maxima, sums and partial outputs
# (csrc/attention_inputs.cuh) and move the cache's length on: one kernel a layer fewer (273 -> 245 at 3B). The split
# kernel lets the o GEMV launch as soon as its programs have started (`early`). In one device call: the GPU tests of
# that copy, then both models decoded and tuned through it (`early`), through it with the split kernel's usual
# launch point (`late`), and through main's tree (`main`) with decode_ab.sh (results/attention_in_o_gemv_h200/).
# Run from the repository root:
#   bash benchmarks/attention_in_o_gemv_check.sh OUT_DIR
set -euo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
main_src=$(pwd)/src
source benchmarks/kernel_edits.sh
copy=$(patched_copy attention_in_o_gemv.patch)
cd "$copy"
edit . "$copy/late" aqflow/inference/decode_attention.py \
  '    return _split_attention(query, keys, values, valid, scale, rope, finish, early_dependents=True)' \
  '    return _split_attention(query, keys, values, valid, scale, rope, finish, early_dependents=False)'
TESTS=early MODELS=3b,8b BUDGET=${BUDGET:-150} bash benchmarks/decode_ab.sh "$out" early=src late="$copy/late/src" \
  main="$main_src"
