// Device pieces shared by the two 2x8 lookup-table GEMVs (lut_gemv.cu: split-K through a global
// workspace; lut_gemv_cluster.cu: split-K inside a thread-block cluster): the tensor-core table build
// and its bank-conflict-free layout, the inputs it needs, the sum across a row group's lanes, the output's
// epilogue, and programmatic dependent launch.
//
// A table unit is 256 lines of 32 banks (32 KB). Chunk c's table (16 groups x 2 codebooks x 256
// codewords) puts entry (j, m, k) in line k, bank 2j + m: a warp's 32 look-ups at 32 different (group,
// codebook) pairs hit 32 different banks whatever the codes. fp32 entries: one chunk per unit; fp16
// entries: two chunks per unit (low half: the even chunk, high half: the odd one).
//
// Units lie in pairs (kPairBytes): line k of a pair is 256 bytes, the first 128 of them line k of its even
// unit, the rest line k of its odd one. So an entry's byte offset is pair * 65536 + code * 256 + (unit & 1)
// * 128 + bank * 4 (+ 2 for an odd fp16 chunk): one byte permute forms it from the code byte and an
// offset word holding the rest (lookup_address), and a look-up is three instructions (permute, load, add)
// where a 128-byte line needed a shift-add as a fourth.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lut_gemv.h"

namespace aqflow {
namespace lut_detail {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroupsPerChunk = kLutGroupsPerChunk;
constexpr int kCodewords = 256;
constexpr int kLineBytes = 256;                     // a line of a unit pair
constexpr int kPairBytes = kCodewords * kLineBytes;  // two table units, interleaved line by line

// The byte offset of table unit slot q (q >> 1: its pair; q & 1: which half of each line) from the tables' start.
__host__ __device__ constexpr int unit_slot_offset(int q) { return (q >> 1) * kPairBytes + (q & 1) * (kLineBytes / 2); }

// Shared memory for `slots` table units.
__host__ __device__ constexpr int unit_slots_bytes(int slots) { return (slots + 1) / 2 * kPairBytes; }

template <typename Scalar>
struct ScalarOps;

template <>
struct ScalarOps<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  // d = A(16x8) * B(8x8): a_lo holds row gid, a_hi row gid + 8 (inputs 2tq, 2tq+1); b inputs 2tq, 2tq+1 of column gid
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a_lo, uint32_t a_hi, uint32_t b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a_lo), "r"(a_hi), "r"(b), "f"(0.0f));
  }
};

template <>
struct ScalarOps<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a_lo, uint32_t a_hi, uint32_t b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%7, %7, %7, %7};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a_lo), "r"(a_hi), "r"(b), "f"(0.0f));
  }
};

// The 32-bit word of codes holding groups g, g+1 (g even) of `row`, as an index from p.codes: row-major codes
// [rows, groups, 2], or tiled [rows / 256, groups / 16, 32, 8, 8, 2, 2] (packed.py, tiled_codes): in a tile
// of 256 rows x 16 groups, word (q, i, s) holds row 32s + q, groups 2i, 2i+1. The words a thread of the
// split-K kernel takes in one step (row slots s = 0..7 of its q, its i) are then 32 contiguous bytes.
__device__ __forceinline__ unsigned int code_word_index(const LutGemvParams& p, int row, int g) {
  const unsigned int row_words = static_cast<unsigned int>(p.groups) / 2;
  if (!p.tiled) return static_cast<unsigned int>(row) * row_words + g / 2;
  constexpr unsigned int kTileWords = kLutTileRows * kGroupsPerChunk / 2;
  constexpr unsigned int kSlotsPerTile = kLutTileRows / 32;
  const unsigned int tile =
      static_cast<unsigned int>(row / kLutTileRows) * (p.groups / kGroupsPerChunk) + g / kGroupsPerChunk;
  const unsigned int in_tile = row % kLutTileRows, pair = (g % kGroupsPerChunk) / 2;
  return tile * kTileWords + ((in_tile % 32) * (kGroupsPerChunk / 2) + pair) * kSlotsPerTile + in_tile / 32;
}

// Inputs 2tq, 2tq+1 of group g for token t (zero past the CTA's groups or the tokens given).
template <typename Scalar>
__device__ __forceinline__ uint32_t input_pair(const LutGemvParams& p, int t, int g, int tq, int g_end) {
  if (t >= p.tokens || g >= g_end) return 0u;
  const Scalar* x = static_cast<const Scalar*>(p.x) + static_cast<size_t>(t) * p.x_stride + g * 8 + 2 * tq;
  return *reinterpret_cast<const uint32_t*>(x);
}

// The A fragments of one table unit's products: rows gid and gid + 8 of the m16n8k8 A tile are groups
// 2gid and 2gid + 1 of a chunk, so that a lane's four results (groups 2gid, 2gid+1 x codebooks 0, 1 of
// one codeword) are four consecutive words of a line. second_*: the unit's odd chunk (fp16 entries).
struct InputFragments {
  uint32_t first_lo, first_hi, second_lo, second_hi;
};

template <typename Scalar, bool kHalfEntries>
__device__ __forceinline__ InputFragments input_fragments(const LutGemvParams& p, int t, int g0, int g_end) {
  const int lane = threadIdx.x & 31;
  const int gid = lane >> 2, tq = lane & 3;
  InputFragments a{};
  a.first_lo = input_pair<Scalar>(p, t, g0 + 2 * gid, tq, g_end);
  a.first_hi = input_pair<Scalar>(p, t, g0 + 2 * gid + 1, tq, g_end);
  if (kHalfEntries) {
    a.second_lo = input_pair<Scalar>(p, t, g0 + kGroupsPerChunk + 2 * gid, tq, g_end);
    a.second_hi = input_pair<Scalar>(p, t, g0 + kGroupsPerChunk + 2 * gid + 1, tq, g_end);
  }
  return a;
}

// The B fragments: columns n = gid are codebook n & 1, codeword k0 + (n >> 1); warp w owns the 8 quads
// of codewords 4 (w + 8q) .. +3, q < 8. codebooks: [2, 256, 8] of one matrix.
//
// Volatile loads (read-only path), so that they are issued where the kernel asks for them: the first thing a
// CTA requests. As plain __ldg, ptxas issued them after the PDL wait (presumably to hold fewer registers
// across it). In a decode step they take ~1.3-1.5 us from request to arrival where x takes ~0.5. Eight copies
// of them, read by different CTAs, gained under 1 % and left them as late: not an L2 hot spot, likely device
// memory, as the step's other weights stream through L2 between two uses. Requested first, the 3B decode
// gains 2.6-2.8 % and the 8B 1.8-1.9 % (H200, three machines, results/build_phase_h200/). With an L2
// evict-last policy, so that they may stay in L2 from one decode step to the next while the step's codes stream
// past (1.8 MB of codebooks at 8B): +1.0-1.5 % (3B), +0.5-0.9 % (8B) more on two machines
// (results/codebooks_first_h200/, results/codebook_latency_h200/).
template <typename Scalar>
__device__ __forceinline__ void load_codebook_fragments(const Scalar* codebooks, uint32_t (&b)[8]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tq = lane & 3;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(codebooks);
  uint64_t keep;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int k = 4 * (warp + kWarps * q) + (gid >> 1);
    asm volatile("ld.global.nc.L2::cache_hint.b32 %0, [%1], %2;"
                 : "=r"(b[q]) : "l"(words + (((gid & 1) * kCodewords + k) * 8 + 2 * tq) / 2), "l"(keep));
  }
}

__device__ __forceinline__ uint32_t pack_halves(float low, float high) {
  __half2 h = __floats2half2_rn(low, high);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Writes one table unit (its lines kLineBytes apart from `unit`, a unit_slot_offset) from the token's A
// fragments and the codebooks' B fragments.
template <typename Scalar, bool kHalfEntries>
__device__ __forceinline__ void store_table_unit(const uint32_t (&b)[8], const InputFragments& a, unsigned char* unit) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int line = 4 * (warp + kWarps * q) + tq;
    float d0[4];
    ScalarOps<Scalar>::mma(d0, a.first_lo, a.first_hi, b[q]);
    uint32_t word[4];
    if (kHalfEntries) {
      float d1[4];
      ScalarOps<Scalar>::mma(d1, a.second_lo, a.second_hi, b[q]);
#pragma unroll
      for (int e = 0; e < 4; ++e) word[e] = pack_halves(d0[e], d1[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) word[e] = __float_as_uint(d0[e]);
    }
    // The four words go to banks 4gid..4gid+3 of line k0 + tq: stored as one 16-byte vector, the 4 lanes
    // of a gid (4 lines, same banks) would conflict 4-way; as 4 word stores with the lane's words
    // rotated by tq, each store covers the 32 banks once. word[(e + tq) & 3] through two select stages.
    uint32_t rotated[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) rotated[e] = (tq & 1) ? word[(e + 1) & 3] : word[e];
#pragma unroll
    for (int e = 0; e < 4; ++e) word[e] = (tq & 2) ? rotated[(e + 2) & 3] : rotated[e];
    uint32_t* quad = reinterpret_cast<uint32_t*>(unit + line * kLineBytes) + 4 * gid;
#pragma unroll
    for (int e = 0; e < 4; ++e) quad[(e + tq) & 3] = word[e];
  }
}

// A lane's four look-up steps over its 4 code bytes (groups 2i, 2i+1 x codebooks 0, 1 of its row): step s
// reads byte (s + row_in_warp) mod 4, so the 4 rows of a warp hit 4 different banks of each group's
// pair of banks. selector: __byte_perm's selector putting that code byte at bits 8-15 between bytes 0, 2
// and 3 of an offset word (lookup_address); bank_offset: the byte offset of its bank (4i + byte) within a
// unit's line.
struct LookupSteps {
  uint32_t selector[4], bank_offset[4];
};

__device__ __forceinline__ LookupSteps lookup_steps(int row_in_warp, int i) {
  LookupSteps steps;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int byte = (s + row_in_warp) & 3;
    steps.selector[s] = 0x7604u | (byte << 4);
    steps.bank_offset[s] = (4 * i + byte) * 4;
  }
  return steps;
}

// The offset words of one unit slot's look-ups: step s's bank, the slot's pair and line half, and `extra`
// (2 for an odd fp16 chunk). Byte 1 is zero (bank_offset + half + extra < 256): the code byte goes there.
struct LookupOffsets {
  uint32_t word[4];
};

__device__ __forceinline__ LookupOffsets lookup_offsets(const LookupSteps& steps, int slot, int extra) {
  LookupOffsets offsets;
#pragma unroll
  for (int s = 0; s < 4; ++s) offsets.word[s] = unit_slot_offset(slot) + extra + steps.bank_offset[s];
  return offsets;
}

// The byte offset of step s's table entry for the 4 code bytes in `codes`: pair, half and bank from the
// offset word, code * 256 from the code byte, in one permute.
__device__ __forceinline__ uint32_t lookup_address(uint32_t codes, const LookupSteps& steps,
                                                   const LookupOffsets& offsets, int s) {
  return __byte_perm(codes, offsets.word[s], steps.selector[s]);
}

// One transposing step across lanes kWidth apart (kWidth 4, 2, 1): of its first 2 * kWidth slots a lane
// keeps the half its lane bit kWidth selects, plus its partner's copy of that half, in slots [0, kWidth).
template <int kWidth, int kSlots>
__device__ __forceinline__ void transpose_add(float (&sums)[kSlots], int i) {
#pragma unroll
  for (int k = 0; k < kWidth; ++k) {
    const bool upper = i & kWidth;
    const float send = upper ? sums[k] : sums[k + kWidth];
    const float keep = upper ? sums[k + kWidth] : sums[k];
    sums[k] = keep + __shfl_xor_sync(0xffffffffu, send, kWidth);
  }
}

// The lanes i = 0..7 of a row group hold partial sums (over their own groups) of the same kSlots rows.
// Afterwards lane i holds the whole sum of row slot i % kSlots in sums[0].
template <int kSlots>
__device__ __forceinline__ void reduce_row_group(float (&sums)[kSlots], int i) {
  static_assert(kSlots == 8 || kSlots == 4, "8 or 4 row slots");
  if (kSlots == 8) {
    transpose_add<4>(sums, i);
  } else {  // 4 slots over 8 lanes: lanes 4 apart hold the same rows
#pragma unroll
    for (int k = 0; k < 4; ++k) sums[k] += __shfl_xor_sync(0xffffffffu, sums[k], 4);
  }
  transpose_add<2>(sums, i);
  transpose_add<1>(sums, i);
}

// One table entry of a look-up: `entry` points at the word of (code, bank); fp16 units hold the even
// chunk in the low half (offset 0) and the odd one in the high half (the caller adds 2 bytes).
template <bool kHalfEntries>
__device__ __forceinline__ float table_entry(const unsigned char* entry) {
  if (kHalfEntries) return __half2float(*reinterpret_cast<const __half*>(entry));
  return *reinterpret_cast<const float*>(entry);
}

// Programmatic dependent launch (sm_90 and later). A launch with it may start while the kernel before it
// in the stream is finishing: a CTA requests the weights (which no kernel writes), then waits here until
// that kernel has finished and its writes are visible, and only then reads its input or touches the
// split-K workspace. Without such a launch the wait returns at once.
__device__ __forceinline__ void wait_for_prior_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets a kernel launched after this one with programmatic dependent launch be scheduled (it still waits for
// this one to finish before reading anything this one writes).
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// The launch attribute asking for programmatic dependent launch (host side).
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

// y = sum * scale (+ bias), cast to the output's type.
template <typename Scalar>
__device__ __forceinline__ void store_output(const LutGemvParams& p, int t, int row, float sum) {
  float y = sum * ScalarOps<Scalar>::to_float(static_cast<const Scalar*>(p.scales)[row]);
  if (p.bias != nullptr) y += ScalarOps<Scalar>::to_float(static_cast<const Scalar*>(p.bias)[row]);
  static_cast<Scalar*>(p.out)[static_cast<size_t>(t) * p.out_stride + row] = ScalarOps<Scalar>::from_float(y);
}

}  // namespace lut_detail
}  // namespace aqflow
