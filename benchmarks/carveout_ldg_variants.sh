#!/usr/bin/env bash
# One device call (issue 27): inductor's small kernels seemed 2-3 us longer after the CUDA GEMVs than
# after cuBLAS or the Triton GEMVs (benchmarks/results/step_kernel_detail_h200/). Two guesses, each tried
# on a patched copy of src with benchmarks/step_kernel_detail.py: the GEMVs asking for the largest
# shared-memory carveout, and the GEMVs reading codes with __ldg instead of __ldcs (evict-first). Neither
# changed it: it is the wait of programmatic dependent launch counted in the kernel's time (notes, round 4).
# Run from the repository root with OUT set.
set -uo pipefail
export PYTHONUNBUFFERED=1
for v in carveout ldg; do
  d=$(mktemp -d); cp -r src $d/src
  python3 - $d/src/aqflow/inference/csrc $v <<'PY'
import sys
from pathlib import Path
csrc, v = Path(sys.argv[1]), sys.argv[2]
if v == "ldg":
    for name in ("lut_gemv.cu", "lut_gemv_cluster.cu"):
        p = csrc / name; t = p.read_text(); assert "__ldcs(" in t; p.write_text(t.replace("__ldcs(", "__ldg("))
else:
    p = csrc / "lut_gemv.cu"; t = p.read_text()
    old = "  cudaLaunchConfig_t config = {};"
    assert t.count(old) == 1
    t = t.replace(old, "  static bool carved = false;\n  if (!carved) { cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared); carved = true; }\n" + old)
    p.write_text(t)
    p = csrc / "lut_gemv_cluster.cu"; t = p.read_text()
    old = "    if (status == cudaSuccess) status = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);"
    assert t.count(old) == 1
    t = t.replace(old, old + "\n    if (status == cudaSuccess) status = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);")
    p.write_text(t)
PY
  echo "== $v"
  TORCH_EXTENSIONS_DIR=$d/ext PYTHONPATH=$d/src:. timeout 170 python3 benchmarks/step_kernel_detail.py --out $OUT/$v 2>&1 | grep -E "tok/s|silu|rsqrt_1[0-3] |cos_index" | head -12
  rm -f $OUT/$v/inductor_kernels.py
done
