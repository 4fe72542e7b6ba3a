#!/usr/bin/env bash
# How the split-K GEMV loads its tiled codes (issue 27), 8B decode step with the kernel's phases
# (gemv_timeline_check.sh, the configurations of CONFIGS), in one device call:
#   tiled  the kernel as committed: two (batch, chunk) steps of codes in flight, one 4-byte load a row slot
#          (a warp's load: one 128-byte line);
#   k3     three steps in flight;
#   v4     each thread's 8 words as two 16-byte loads (a warp's load: four lines); the words a thread gets
#          are not its rows' (the tile is not laid out for it), so its sums are wrong, its work is the same.
# It measured the kernel of commit 6b89d1a (results/code_loads_h200/). Main has since taken v4's loads with
# the tiles laid out for them, so the v4 edit no longer applies and the script stops naming the missing text
# (run it from a checkout of 6b89d1a). Run from the repository root: bash benchmarks/code_loads_check.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
export CONFIGS=${CONFIGS:-benchmarks/results/tiled_codes_h200/b/inference_gpu.json} SHAPES=${SHAPES:-8b}
variants=$(mktemp -d)
python3 benchmarks/source_variant.py src "$variants/k3" aqflow/inference/csrc/lut_gemv.cu \
  "constexpr int kAhead = kTokens == 1 ? 2 : 1;" "constexpr int kAhead = kTokens == 1 ? 3 : 1;"
python3 benchmarks/source_variant.py src "$variants/v4" aqflow/inference/csrc/lut_gemv.cu \
  "    for (int n = 0; n < kRowSlots; ++n) words[n] = __ldcs(code_words + first + n * slot_words);  // read once
    return;" \
  "    const unsigned int base = first - ((first_row - batch_row) * (kGroupsPerChunk / 2) + i);
    const uint4* lines = reinterpret_cast<const uint4*>(code_words + base + 8 * (first - base));
    const uint4 low = __ldcs(lines), high = __ldcs(lines + 1);
    words[0] = low.x, words[1] = low.y, words[2] = low.z, words[3] = low.w;
    words[4] = high.x, words[5] = high.y, words[6] = high.z, words[7] = high.w;
    return;"
bash benchmarks/gemv_timeline_check.sh "$out/tiled"
SRC="$variants/k3" bash benchmarks/gemv_timeline_check.sh "$out/k3"
SRC="$variants/v4" bash benchmarks/gemv_timeline_check.sh "$out/v4"
