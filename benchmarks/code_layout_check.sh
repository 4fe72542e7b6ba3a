#!/usr/bin/env bash
# Does the split-K GEMV wait on how its codes lie in memory (issue 27)? In one device call, the decode step
# timed with the kernel's phases (gemv_timeline_check.sh) twice: the kernel as committed, whose warps read
# each code row's 32-byte slice of a chunk (four rows, four cache lines per load), and a copy that reads
# each (256-row batch, 16-group chunk) step as one contiguous 8 KB tile (one 128-byte line per load). The
# codes are random and the copy reads them in the tiled order without re-laying them out: its sums are
# wrong, its work (loads, look-ups, additions) is the same. It measured the kernel of commit be76f3a
# (results/code_layout_h200/); since then the codes lie in tiles for real (packed.in_tiles), its edit no longer
# applies and the script stops naming the missing text (run it from a checkout of be76f3a). Run from the
# repository root:
#   bash benchmarks/code_layout_check.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
python3 benchmarks/source_variant.py src "$variants/tiled" aqflow/inference/csrc/lut_gemv.cu \
  "  const unsigned int first = first_row * row_words + g / 2;
  const unsigned int slot_words = kWarps * 4 * row_words;" \
  "  constexpr unsigned int kTileWords = kRowsPerBatch * kGroupsPerChunk / 2;  // a (batch, chunk) tile
  const unsigned int tile = static_cast<unsigned int>(batch_row / kRowsPerBatch) * (row_words * 2 / kGroupsPerChunk) +
                            g / kGroupsPerChunk;
  const unsigned int first = tile * kTileWords + (first_row - batch_row) * (kGroupsPerChunk / 2) + i;
  const unsigned int slot_words = kWarps * 4 * (kGroupsPerChunk / 2);"
bash benchmarks/gemv_timeline_check.sh "$out/row_major"
SRC="$variants/tiled" bash benchmarks/gemv_timeline_check.sh "$out/tiled"
