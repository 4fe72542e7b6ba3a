#!/usr/bin/env bash
# What the split-K GEMV's finishing costs in the 3B decode step (issue 27), in one device call: the
# split-K kernel as committed (e0); without its finishing (e5: the CTAs still add their sums into the
# workspace, but no arrival counter and no last CTA applying scales and writing the output); and with
# plain stores of each split's sums instead of atomic additions, also unfinished (e6). Every table GEMV
# runs the split-K kernel in its default configuration (--skip-kernels). e5 and e6 decode wrong tokens by
# design; only their step times count: the difference to e0 bounds what moving the finishing elsewhere
# can gain. Run from the repository root: bash benchmarks/epilogue_floor.sh OUT_DIR
# It measures the kernel as it was before open sums (results/epilogue_floor_h200/: the code of 32591e1's
# parent); since then a decode step no longer finishes in the kernel, the edit's text is gone and the
# variants refuse to build (source_variant.py names the missing text).
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
kernel=aqflow/inference/csrc/lut_gemv.cu
finishing=$'  if (split_k) {\n    __threadfence();'
unfinished=$'  if (false) {  // the floor experiment: no finishing\n    __threadfence();'
atomic='atomicAdd(p.workspace + static_cast<size_t>(t) * p.rows + row, acc[0][t]);'
stored='p.workspace[(static_cast<size_t>(blockIdx.y) * p.tokens + t) * p.rows + row] = acc[0][t];'
python3 benchmarks/source_variant.py src "$variants/e5" "$kernel" "$finishing" "$unfinished"
python3 benchmarks/source_variant.py src "$variants/e6" "$kernel" "$finishing" "$unfinished" "$atomic" "$stored"
ARGS=--skip-kernels bash benchmarks/decode_ab.sh "$out" e0=src e5="$variants/e5" e6="$variants/e6"
