#!/usr/bin/env bash
# What the 3B decode step costs without the table GEMVs' work (issue 27), in one device call: the
# split-K kernel as committed (e0), returning after the PDL wait with zeros written (e1: no tables, no
# look-ups), and returning after the table build (e3: no look-ups), all in their default configurations
# (--skip-kernels: no tuning, every table GEMV on the split-K kernel). e1 and e3 decode wrong tokens by
# design; only their step times count. Run from the repository root: bash benchmarks/gemv_floor.sh OUT_DIR
# (results/gemv_floor_h200/ measured the code of 37cb524, before open sums).
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
kernel=aqflow/inference/csrc/lut_gemv.cu
early_return='  if (blockIdx.y == 0) {  // the floor experiment: no look-ups, zeros out
    for (int row = row_begin + threadIdx.x; row < row_end; row += kThreads)
      for (int t = 0; t < p.tokens; ++t) store_output<Scalar>(p, t, row, 0.0f);
  }
  allow_next_kernel();
  return;
'
wait_line='  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one
'
build_lines='  build_tables<Scalar, kHalfEntries, kTokens>(p, b, g_begin, g_end, units, smem);
  __syncthreads();
'
python3 benchmarks/source_variant.py src "$variants/e1" "$kernel" "$wait_line" "$wait_line$early_return"
python3 benchmarks/source_variant.py src "$variants/e3" "$kernel" "$build_lines" "$build_lines$early_return"
ARGS=--skip-kernels bash benchmarks/decode_ab.sh "$out" e0=src e1="$variants/e1" e3="$variants/e3"
