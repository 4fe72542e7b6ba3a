#!/usr/bin/env bash
# After the codebooks first (session 31, results/build_phase_h200/): what is left of a CTA's wait before its
# tables, in one device call (benchmarks/variant_speeds.sh). In the step a CTA's codebooks take ~1.3-1.5 us
# from request to arrival where x takes ~0.5, likely from device memory; x is asked for after two steps of
# codes and, a warp's loads returning in order, arrives behind them. Neither alone paid (x first: the tables
# then wait for the codebooks; evict-last on the codebooks: +0.7-1.5 %, results/codebooks_first_h200/).
# Together they might: the codebooks kept in L2, and x ahead of the codes. Variants of main:
#   m      as committed;
#   keep   the codebook loads with an L2 evict-last policy (createpolicy + ld.global.nc.L2::cache_hint);
#   x      after the PDL wait, x's first unit before the code requests (the codebooks still first of all);
#   xkeep  both;
#   a64    the one-token attention over 64 cache positions a program instead of 32 (half the programs and
#          half the partial outputs to combine; both models' attention, the 2-bit decode timed here);
#   a128   128 positions a program.
# TIMELINE (default: keep xkeep) names those also run with the CTA timeline. Run from the repository root:
#   bash benchmarks/codebook_latency_check.sh OUT_DIR [VARIANT ...]
# and tar OUT_DIR to bring its files back from the device in one.
set -euo pipefail
names=${*:2}
names=${names:-m keep x xkeep a64 a128}
timelines=${TIMELINE-keep xkeep}
kernel=aqflow/inference/csrc/lut_gemv.cu common=aqflow/inference/csrc/lut_gemv_common.cuh
requests="#pragma unroll
  for (int a = 0; a < kAhead; ++a) request_step(p, codes[a], next, row_end, chunks, g_begin, g_end);  // during the build
"
wait_line="  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one
"
make_variant() {  # name base dest
  local name=$1 base=$2 dest=$3
  case $name in
    m) mkdir -p "$dest" && cp -r "$base/src" "$dest/src" ;;
    keep) codebooks_evict_last "$base" "$dest" ;;
    x) edit "$base" "$dest" "$kernel" \
         "int g_begin, int g_end, int units," "int g_begin, int g_end, int units, const InputFragments& first," \
         "      const InputFragments a = input_fragments<Scalar, kHalfEntries>(p, t, g0, g_end);" \
         "      const InputFragments a = u == 0 && t == 0 ? first : input_fragments<Scalar, kHalfEntries>(p, t, g0, g_end);" \
         "g_begin, g_end, units, smem" "g_begin, g_end, units, first_inputs, smem" \
         "$requests" "" \
         "$wait_line" "$wait_line  // a warp's loads return in order: x before the codes, so that the tables need not wait for them
  const InputFragments first_inputs = input_fragments<Scalar, kHalfEntries>(p, 0, g_begin, g_end);
$requests" ;;
    xkeep) make_variant keep "$base" "$dest.0" && make_variant x "$dest.0" "$dest" && rm -rf "$dest.0" ;;
    a64|a128) edit "$base" "$dest" aqflow/inference/decode_attention.py \
                "BLOCK_L = 32  #" "BLOCK_L = ${name#a}  #" ;;
    *) echo "unknown variant $name" >&2; exit 2 ;;
  esac
}
source benchmarks/variant_speeds.sh "${1:?OUT_DIR}"
