#!/usr/bin/env bash
# The codebooks requested first (main since session 31, lut_gemv_common.cuh) against the same with an L2
# evict-last policy on their loads (createpolicy + ld.global.nc.L2::cache_hint), in one device call: the
# GPU tests of main's source, then both models decoded and tuned through each (decode_ab.sh). The codebooks
# come from device memory in a decode step (results/build_phase_h200/: ~1.3-1.5 us from request to arrival,
# where x takes ~0.5 us from L2); evict-last may keep all of them (1.8 MB at 8B) in L2 from step to step
# while ~1.8 GB of codes and the bf16 head stream past. An earlier form of this check (session 30, loads
# after the code requests) gained ~1 % in build_phase_check.sh. Run from the repository root:
#   bash benchmarks/codebook_l2_check.sh OUT_DIR
# (Session 31 ran it with the load on one line, results/codebooks_first_h200/; the text is now wrapped.)
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
load='    asm volatile("ld.global.nc.b32 %0, [%1];"
                 : "=r"(b[q]) : "l"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2));'
python3 benchmarks/source_variant.py src "$variants/keep" aqflow/inference/csrc/lut_gemv_common.cuh \
  "  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);" \
  "  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);
  uint64_t keep;  // the codebooks stay in L2 from one decode step to the next
  asm volatile(\"createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\" : \"=l\"(keep));" \
  "$load" \
  "    asm volatile(\"ld.global.nc.L2::cache_hint.b32 %0, [%1], %2;\" : \"=r\"(b[q])
                 : \"l\"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2), \"l\"(keep));"
TESTS=first MODELS=3b,8b BUDGET=${BUDGET:-200} bash benchmarks/decode_ab.sh "$out" first=src keep="$variants/keep"
