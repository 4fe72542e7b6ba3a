# Sourced, not run: edits of the CUDA GEMV's source that kernel-variant checks share (variant_speeds.sh and the
# *_check.sh scripts that use it, codebook_l2_check.sh). Each edit function writes DEST/src, a copy of BASE/src
# with its edits, through benchmarks/source_variant.py, which stops naming any text it does not find exactly once.
# patched_copy makes the copy a check of a patch (benchmarks/patches/) starts from.

patched_copy() {  # patch: prints the path of a new copy of src/, tests/, benchmarks/ with benchmarks/patches/PATCH in
  local copy
  copy=$(mktemp -d)
  cp -r src tests benchmarks "$copy/"
  (cd "$copy" && git apply "benchmarks/patches/$1")
  echo "$copy"
}

edit() {  # base dest file old new [old new ...]: a copy of base/src as dest/src with the edits
  local base=$1 dest=$2 file=$3
  shift 3
  python3 benchmarks/source_variant.py "$base/src" "$dest/src" "$file" "$@"
}

# The codebook loads with an L2 evict-last policy (createpolicy + ld.global.nc.L2::cache_hint), so that the
# codebooks may stay in L2 from one decode step to the next (main since b75f358; this edit is for older trees).
# LOAD: the load as the source has it (default: main's from session 31 to b75f358, a volatile ld.global.nc).
codebooks_evict_last() {  # base dest [load]
  local load=${3:-'    asm volatile("ld.global.nc.b32 %0, [%1];"
                 : "=r"(b[q]) : "l"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2));'}
  edit "$1" "$2" aqflow/inference/csrc/lut_gemv_common.cuh \
    "  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);" \
    "  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);
  uint64_t keep;  // the codebooks stay in L2 from one decode step to the next
  asm volatile(\"createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\" : \"=l\"(keep));" \
    "$load" \
    "    asm volatile(\"ld.global.nc.L2::cache_hint.b32 %0, [%1], %2;\" : \"=r\"(b[q])
                 : \"l\"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2), \"l\"(keep));"
}
