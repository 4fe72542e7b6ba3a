#!/usr/bin/env bash
# The codebooks requested first (main since session 31, lut_gemv_common.cuh) against the same with an L2
# evict-last policy on their loads (createpolicy + ld.global.nc.L2::cache_hint), in one device call: the
# GPU tests of main's source, then both models decoded and tuned through each (decode_ab.sh). The codebooks
# come from device memory in a decode step (results/build_phase_h200/: ~1.3-1.5 us from request to arrival,
# where x takes ~0.5 us from L2); evict-last may keep all of them (1.8 MB at 8B) in L2 from step to step
# while ~1.8 GB of codes and the bf16 head stream past. An earlier form of this check (session 30, loads
# after the code requests) gained ~1 % in build_phase_check.sh. Run from the repository root:
#   bash benchmarks/codebook_l2_check.sh OUT_DIR
# (Session 31 ran it with the edit written here, results/codebooks_first_h200/; the same edit now comes
# from kernel_edits.sh.)
# Written for main at 4aeb79e. Since b75f358 main loads its codebooks with evict-last itself, so the keep edit no
# longer finds its text here: rerun from that commit's tree (git worktree add /tmp/at-4aeb79e 4aeb79e).
set -euo pipefail
out=${1:?OUT_DIR}
variants=$(mktemp -d)
source benchmarks/kernel_edits.sh
codebooks_evict_last . "$variants/keep"
TESTS=first MODELS=3b,8b BUDGET=${BUDGET:-200} bash benchmarks/decode_ab.sh "$out" first=src keep="$variants/keep/src"
