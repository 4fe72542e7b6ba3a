#!/usr/bin/env bash
# What the 3B decode step costs without the table GEMVs' work (issue 27), in one device call: the
# split-K kernel as committed (e0), returning after the PDL wait with zeros written (e1: no tables, no
# look-ups), and returning after the table build (e3: no look-ups), all in their default configurations
# (--skip-kernels: no tuning, every table GEMV on the split-K kernel). e1 and e3 decode wrong tokens by
# design; only their step times count. Run from the repository root: bash benchmarks/gemv_floor.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
for name in e1 e3; do
  cp -r src "$variants/$name"
  python3 - "$variants/$name/aqflow/inference/csrc/lut_gemv.cu" "$name" <<'PY'
import sys
from pathlib import Path
path, name = Path(sys.argv[1]), sys.argv[2]
anchor = {"e1": "  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one\n",
          "e3": "  build_tables<Scalar, kHalfEntries, kTokens>(p, b, g_begin, g_end, units, smem);\n  __syncthreads();\n"}[name]
text = path.read_text()
assert text.count(anchor) == 1, name
early_return = """  if (blockIdx.y == 0) {  // the floor experiment: no look-ups, zeros out
    for (int row = row_begin + threadIdx.x; row < row_end; row += kThreads)
      for (int t = 0; t < p.tokens; ++t) store_output<Scalar>(p, t, row, 0.0f);
  }
  allow_next_kernel();
  return;
"""
path.write_text(text.replace(anchor, anchor + early_return))
PY
done
ARGS=--skip-kernels bash benchmarks/decode_ab.sh "$out" e0=src e1="$variants/e1" e3="$variants/e3"
