#!/usr/bin/env bash
# Codebooks kept in L2 across decode steps (issue 27), in one device call; written in session 30 when no
# device time was left, not yet run. In the step's timeline (results/code_loads_h200/) a CTA spends 1.2-1.9
# us building its tables, longer than its first batch of look-ups, and the build waits for the codebooks
# (8 KB a matrix). Whether they are still in L2 when a step comes back to a layer is not known: all of an
# 8B model's fit (1.8 MB), but ~1.8 GB of codes stream through between (loaded evict-first). The copy `cb`
# loads them with an L2 evict-last policy (createpolicy + ld.global.nc.L2::cache_hint): its GPU tests, then
# both models decoded against the code as committed (a), each tuned as it runs. If it gains nothing, the
# build's time is elsewhere (every CTA of a launch reads the same codebooks and x at once). Run from the
# repository root: bash benchmarks/codebook_l2_check.sh OUT_DIR
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
python3 benchmarks/source_variant.py src "$variants/cb" aqflow/inference/csrc/lut_gemv_common.cuh \
  "  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);" \
  "  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);
  uint64_t keep;  // the codebooks stay in L2 from one decode step to the next
  asm volatile(\"createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\" : \"=l\"(keep));" \
  "    b[q] = __ldg(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2);" \
  "    asm volatile(\"ld.global.nc.L2::cache_hint.b32 %0, [%1], %2;\" : \"=r\"(b[q])
                 : \"l\"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2), \"l\"(keep));"
TESTS=cb MODELS=3b,8b BUDGET=200 bash benchmarks/decode_ab.sh "$out" cb="$variants/cb" a=src
