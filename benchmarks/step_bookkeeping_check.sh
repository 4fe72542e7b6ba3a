#!/usr/bin/env bash
# The decode step's bookkeeping compiled with it (issue 27, session 34; not merged: not yet timed against main),
# prepared from main: a copy of src/, tests/ and benchmarks/ with benchmarks/patches/step_bookkeeping.patch applied.
# In it greedy_decode compiles one function for the whole step (`advance`: the forward, the two-stage argmax, the
# chosen token written into the step's token and into the generated tokens, the position moved on), so that the
# graphed step ends in no eager kernels of its own (main runs four after the compiled forward: a subtraction,
# index_copy, copy, add), for the bf16 and the 2-bit model alike. Its decode GPU tests passed on an H100 in
# session 34 (results/one_pass_rows_h100/call2_tests.log, with one-pass rows beside it). In one device call: the
# copy's GPU tests, then both models decoded and tuned through main (`main`), the copy (`book`) and main again,
# with decode_ab.sh (~430 s); main's generated step code is kept (code_main.tgz: what the eight rotary kernels of a
# step are, round 13 of the GPU notes). Main's two runs are also a further machine's figures for main. Run from
# the repository root:
#   bash benchmarks/step_bookkeeping_check.sh OUT_DIR
set -euo pipefail
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
main_src=$(pwd)/src
source benchmarks/kernel_edits.sh
cd "$(patched_copy step_bookkeeping.patch)"
CODE=main TESTS=book MODELS=3b,8b BUDGET=${BUDGET:-130} bash benchmarks/decode_ab.sh "$out" main="$main_src" book=src \
  main_again="$main_src"
