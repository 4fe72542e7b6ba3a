#!/usr/bin/env bash
# What holds up the split-K GEMV's table build (issue 27), in one device call. Each variant below is made
# twice: from src/ as it is (decode speed) and from a copy with benchmarks/patches/gemv_timeline.patch
# applied (the step's CTA timeline, 8 stamps: the build split into waiting for the first codebook word and
# the tables' own work). All extensions build in parallel first; then every plain variant decodes both
# shapes (benchmarks/gemv_timeline.py, the GEMVs on the configurations of CONFIGS, 256 new tokens), `m`
# again last to show the spread between runs, then the patched variants of TIMELINE (default: m f).
# In session 30's timelines the codes in tiles cut a CTA's request phase by ~1.2 us and its build grew by
# ~0.8: request + build stayed ~3 us, as if the build waited on something issued at the start. The SASS
# (cuobjdump, sm_90a) shows ptxas issuing the codebook loads (LDG.E.CONSTANT) only after the PDL wait
# (ACQBULK), not with the code requests as written. Variants:
#   m    as committed;
#   f    codebook loads as volatile ld.global.nc, issued before the code requests (so before the wait);
#   g    the same with coherent ld.global (not the read-only path);
#   cb   volatile ld.global.nc with an L2 evict-last policy, after the code requests (codebook_l2_check.sh);
#   x    codebooks before the PDL wait (as f), then x's first unit, then the code requests: a warp's loads
#        return in order, so x no longer waits behind two steps of codes from DRAM;
#   k    f, with 8 copies of every matrix's codebooks (cuda_kernels.py makes them at the first launch), a CTA
#        reading copy (blockIdx.x + blockIdx.y) % 8: whether the codebooks come late because every CTA of
#        a launch reads the same 8 KB from the same few L2 lines at once;
#   kx   x, with the 8 copies;
#   r    row_begin from blockIdx alone (no matrix search, a chain of indexed constant loads, before the
#        first code request): right only where every matrix's rows are whole row blocks, as in the tuned
#        3B/8B configurations; the search stays, for the codebooks, after the requests.
# The stamps move loads (the patched m issues its codebook loads before the wait): timelines show phases,
# the plain variants' speeds are what counts. It measured commit 202cfe7 (results/build_phase_h200/: calls
# 1-3 ran variants "m f g cb r", "m f x" and "m f k kx" with TIMELINE "m f", "x", "kx"). Main has since
# taken f (the codebooks requested first), so the edits of f, g, x, k and kx no longer apply and the script
# stops naming the missing text (run it from a checkout of 202cfe7); m and r still apply. Run from the
# repository root:
#   bash benchmarks/build_phase_check.sh OUT_DIR [VARIANT ...]
set -euo pipefail
names=${*:2}
names=${names:-m f g cb r}
timelines=${TIMELINE-m f}
kernel=aqflow/inference/csrc/lut_gemv.cu common=aqflow/inference/csrc/lut_gemv_common.cuh
requests="#pragma unroll
  for (int a = 0; a < kAhead; ++a) request_step(p, codes[a], next, row_end, chunks, g_begin, g_end);  // during the build
  uint32_t b[8];
  load_codebook_fragments(codebooks, b);"
codebooks_first="  uint32_t b[8];
  load_codebook_fragments(codebooks, b);
#pragma unroll
  for (int a = 0; a < kAhead; ++a) request_step(p, codes[a], next, row_end, chunks, g_begin, g_end);  // during the build"
ldg="    b[q] = __ldg(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2);"
volatile_load() {  # $1: the PTX load
  echo "    asm volatile(\"$1 %0, [%1];\" : \"=r\"(b[q]) : \"l\"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2));"
}
replicate() {  # base dest: 8 copies of every codebook in memory, a CTA reading copy (x + y) % 8 of its block
  edit "$1" "$1.r1" "$kernel" \
    "  const Scalar* codebooks = static_cast<const Scalar*>(p.codebooks) + matrix * 2 * kCodewords * 8;" \
    "  const Scalar* codebooks = static_cast<const Scalar*>(p.codebooks) +
                           (((blockIdx.x + blockIdx.y) % 8) * p.num_matrices + matrix) * 2 * kCodewords * 8;"
  edit "$1.r1" "$1.r2" aqflow/inference/csrc/lut_gemv_binding.cpp \
    "TORCH_CHECK(codebooks.size(0) == matrices," "TORCH_CHECK(codebooks.size(0) % matrices == 0,"
  edit "$1.r2" "$2" aqflow/inference/cuda_kernels.py \
    "def launch(x: torch.Tensor," "_REPLICAS = {}


def _replicated(codebooks: torch.Tensor) -> torch.Tensor:
    key = (codebooks.data_ptr(), tuple(codebooks.shape))
    if key not in _REPLICAS:
        _REPLICAS[key] = codebooks.repeat(8, 1, 1, 1).contiguous()
    return _REPLICAS[key]


def launch(x: torch.Tensor," \
    "    common = (x, packed.codes, packed.codebooks," "    common = (x, packed.codes, _replicated(packed.codebooks)," \
    "    args = (x, packed.codes, packed.codebooks," "    args = (x, packed.codes, _replicated(packed.codebooks),"
  rm -rf "$1.r1" "$1.r2"
}
make_variant() {  # name base dest
  local name=$1 base=$2 dest=$3
  case $name in
    m) mkdir -p "$dest" && cp -r "$base/src" "$dest/src" ;;
    f|g) local load=ld.global.nc.b32
       [ "$name" = g ] && load=ld.global.b32
       edit "$base" "$dest.1" "$common" "$ldg" "$(volatile_load $load)"
       edit "$dest.1" "$dest" "$kernel" "$requests" "$codebooks_first" && rm -rf "$dest.1" ;;
    x) edit "$base" "$dest.1" "$common" "$ldg" "$(volatile_load ld.global.nc.b32)"
       edit "$dest.1" "$dest" "$kernel" \
         "int g_begin, int g_end, int units," "int g_begin, int g_end, int units, const InputFragments& first," \
         "      const InputFragments a = input_fragments<Scalar, kHalfEntries>(p, t, g0, g_end);" \
         "      const InputFragments a = u == 0 && t == 0 ? first : input_fragments<Scalar, kHalfEntries>(p, t, g0, g_end);" \
         "g_begin, g_end, units, smem" "g_begin, g_end, units, first_inputs, smem" \
         "$requests" "  uint32_t b[8];
  load_codebook_fragments(codebooks, b);" \
         "  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one
" "  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one
  // a warp's loads return in order: x before the codes, so that the tables need not wait for them
  const InputFragments first_inputs = input_fragments<Scalar, kHalfEntries>(p, 0, g_begin, g_end);
#pragma unroll
  for (int a = 0; a < kAhead; ++a) request_step(p, codes[a], next, row_end, chunks, g_begin, g_end);
" && rm -rf "$dest.1" ;;
    k) make_variant f "$base" "$dest.0" && replicate "$dest.0" "$dest" && rm -rf "$dest.0" ;;
    kx) make_variant x "$base" "$dest.0" && replicate "$dest.0" "$dest" && rm -rf "$dest.0" ;;
    cb) codebooks_evict_last "$base" "$dest" "$ldg" ;;
    r) edit "$base" "$dest" "$kernel" \
         "  const int row_begin = p.row_start[matrix] + (blockIdx.x - p.block_start[matrix]) * p.rows_per_cta;
  const int row_end = min(p.row_start[matrix + 1], row_begin + p.rows_per_cta);" \
         "  const int row_begin = static_cast<int>(blockIdx.x) * p.rows_per_cta;  // every matrix whole row blocks
  const int row_end = min(p.rows, row_begin + p.rows_per_cta);" ;;
    *) echo "unknown variant $name" >&2; exit 2 ;;
  esac
}
source benchmarks/variant_speeds.sh "${1:?OUT_DIR}"
