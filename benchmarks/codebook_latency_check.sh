#!/usr/bin/env bash
# After the codebooks first (session 31): two latency chains of the decode step, in one device call
# (benchmarks/variant_speeds.sh), on one machine.
# 1. A GEMV CTA's wait before its tables. Its codebooks take ~1.3-1.5 us from request to arrival where x
#    takes ~0.5, likely from device memory; x is asked for after two steps of codes and, a warp's loads
#    returning in order, arrives behind them (results/build_phase_h200/). Neither alone paid (x first: the
#    tables then wait for the codebooks; evict-last: +0.7-1.5 %, results/codebooks_first_h200/). Together
#    they might: the codebooks kept in L2, and x ahead of the codes.
# 2. The one-token attention (decode_attention.py): its split kernel waits for the q/k/v GEMV, then loads
#    its cache rows, then a second kernel combines the splits.
# Variants of main:
#   m      as committed;
#   keep   the codebook loads with an L2 evict-last policy (createpolicy + ld.global.nc.L2::cache_hint);
#   x      after the PDL wait, x's first unit before the code requests (the codebooks still first of all);
#   xkeep  both;
#   a64    the attention over 64 cache positions a program instead of 32 (half the programs and half the
#          partial outputs to combine);
#   a128   128 positions a program (not run by default: the attention tests size their case for 32);
#   kv     the attention's cache rows requested before its PDL wait (written in earlier steps; only the query
#          and the new key and value come from the GEMV just before).
# The attention variants change bf16's step as well; the 2-bit decode is what is timed here.
# TIMELINE (default: xkeep) names the variants also run with the CTA timeline. About 450 s on an H200 for
# the default set; from the repository root, keeping the files to one:
#   timeout 560 bash benchmarks/codebook_latency_check.sh /tmp/cl [VARIANT ...]; tar czf $OUT/cl.tgz -C /tmp cl
# Written for main at 4aeb79e. Since b75f358 main loads its codebooks with evict-last itself, so the keep edit no
# longer finds its text here: rerun from that commit's tree (git worktree add /tmp/at-4aeb79e 4aeb79e).
set -euo pipefail
names=${*:2}
names=${names:-m keep x xkeep a64 kv}
timelines=${TIMELINE-xkeep}
kernel=aqflow/inference/csrc/lut_gemv.cu common=aqflow/inference/csrc/lut_gemv_common.cuh
requests="#pragma unroll
  for (int a = 0; a < kAhead; ++a) request_step(p, codes[a], next, row_end, chunks, g_begin, g_end);  // during the build
"
wait_line="  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one
"
kv_loads="    if PDL:  # everything below reads what the kernels before wrote (the query, the cache)
        tl.extra.cuda.gdc_wait()
    k = tl.load(k_ptr + kv_head * stride_kh + pos[:, None] * stride_kl + d[None, :], mask=in_range[:, None],
                other=0.0)
    # requested before the scores need k: both loads in flight at once (a program is one round trip)
    v = tl.load(v_ptr + kv_head * stride_vh + pos[:, None] * stride_vl + d[None, :], mask=in_range[:, None],
                other=0.0)
"
kv_loads_early="    if ROPE:  # the cache rows before position were written steps ago: requested before the wait
        k = tl.load(k_ptr + kv_head * stride_kh + pos[:, None] * stride_kl + d[None, :], mask=in_range[:, None],
                    other=0.0)
        v = tl.load(v_ptr + kv_head * stride_vh + pos[:, None] * stride_vl + d[None, :], mask=in_range[:, None],
                    other=0.0)
    if PDL:  # everything below reads what the kernels before wrote (the query, the cache)
        tl.extra.cuda.gdc_wait()
    if not ROPE:
        k = tl.load(k_ptr + kv_head * stride_kh + pos[:, None] * stride_kl + d[None, :], mask=in_range[:, None],
                    other=0.0)
        v = tl.load(v_ptr + kv_head * stride_vh + pos[:, None] * stride_vl + d[None, :], mask=in_range[:, None],
                    other=0.0)
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
    kv) edit "$base" "$dest" aqflow/inference/decode_attention.py "$kv_loads" "$kv_loads_early" ;;
    *) echo "unknown variant $name" >&2; exit 2 ;;
  esac
}
source benchmarks/variant_speeds.sh "${1:?OUT_DIR}"
