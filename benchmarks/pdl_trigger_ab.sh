#!/usr/bin/env bash
# One device call (issue 27): where the CUDA GEMVs let the next kernel launch under programmatic
# dependent launch, A/B on one machine. A: as committed (after the look-ups); B: at the kernel's first
# instruction, so the kernel after it (inductor's, or the attention's) is scheduled while the GEMV runs and
# waits in griddepcontrol.wait. Both decode the 3B shape through benchmarks/decode_ab.sh, each with
# its own extension build. Run from the repository root: bash benchmarks/pdl_trigger_ab.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
variant=$(mktemp -d)
cp -r src "$variant/src"
python3 - "$variant/src/aqflow/inference/csrc" <<'PY'
import sys
from pathlib import Path
csrc = Path(sys.argv[1])
for name, before in (("lut_gemv.cu", "  // codes of the next kAhead"),
                     ("lut_gemv_cluster.cu", "  // 1. every request at once")):
    path = csrc / name
    text = path.read_text()
    assert text.count("  allow_next_kernel();\n") == 1 and text.count(before) == 1, name
    text = text.replace("  allow_next_kernel();\n", "").replace(before, "  allow_next_kernel();\n" + before)
    path.write_text(text)
PY
bash benchmarks/decode_ab.sh "$out" a=src b="$variant/src"
