#!/usr/bin/env bash
# What the split-K GEMV's finishing costs in the 3B decode step (issue 27), in one device call: the
# split-K kernel as committed (e0); without its finishing (e5: the CTAs still add their sums into the
# workspace, but no arrival counter and no last CTA applying scales and writing the output); and with
# plain stores of each split's sums instead of atomic additions, also unfinished (e6). Every table GEMV
# runs the split-K kernel in its default configuration (--skip-kernels). e5 and e6 decode wrong tokens by
# design; only their step times count: the difference to e0 bounds what moving the finishing elsewhere
# can gain. Run from the repository root: bash benchmarks/epilogue_floor.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
for name in e5 e6; do
  cp -r src "$variants/$name"
  python3 - "$variants/$name/aqflow/inference/csrc/lut_gemv.cu" "$name" <<'PY'
import sys
from pathlib import Path
path, name = Path(sys.argv[1]), sys.argv[2]
text = path.read_text()
finishing = "  if (split_k) {\n    __threadfence();"
assert text.count(finishing) == 1
text = text.replace(finishing, "  if (false) {  // the floor experiment: no finishing\n    __threadfence();")
if name == "e6":
    atomic = "atomicAdd(p.workspace + static_cast<size_t>(t) * p.rows + row, acc[0][t]);"
    assert text.count(atomic) == 1
    text = text.replace(atomic, "p.workspace[(static_cast<size_t>(blockIdx.y) * p.tokens + t) * p.rows + row] = acc[0][t];")
path.write_text(text)
PY
done
ARGS=--skip-kernels bash benchmarks/decode_ab.sh "$out" e0=src e5="$variants/e5" e6="$variants/e6"
