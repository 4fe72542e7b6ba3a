#!/usr/bin/env bash
# Where the 2-bit GEMVs' time goes inside a decode step (issue 27), in one device call: a copy of src/ with
# benchmarks/patches/gemv_timeline.patch applied (every split-K CTA stamps its phases into a ring buffer),
# then benchmarks/gemv_timeline.py decodes both models (SHAPES) on the configurations of CONFIGS and prints,
# per linear, the exposed time and the CTA phases, into OUT_DIR/t_m/ (benchmarks/variant_speeds.sh, with
# the code as it is as its one timeline variant). SRC (default src) names the source folder to patch (a
# variant made by source_variant.py). Run from the repository root:
#   bash benchmarks/gemv_timeline_check.sh OUT_DIR
# (Session 30's results/gemv_timeline_h200/ and code_*_h200/ came from its first form, which wrote into
# OUT_DIR itself and defaulted to results/qkv_finish_h200/c's configurations.)
set -euo pipefail
names="" timelines=m
make_variant() { mkdir -p "$3" && cp -r "$2/src" "$3/src"; }  # the source as it is
source benchmarks/variant_speeds.sh "${1:?OUT_DIR}"
