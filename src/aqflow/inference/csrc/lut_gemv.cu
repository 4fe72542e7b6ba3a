// A lookup-table GEMV for AQLM 2x8 linears (2 codebooks of 256 codewords over groups of 8 inputs) at
// decode time: one token (or up to four), weights read only as codes, codebooks and scales.
//
// y[t, row] = scales[row] * sum_j sum_m lut_t[j, m, codes[row, j, m]] + bias[row],
// lut_t[j, m, k] = <codebooks[m, k, :], x[t, 8j:8j+8]>.
//
// Grid (row blocks, splits); a CTA of 8 warps owns rows_per_cta rows of one matrix and
// 16 * chunks_per_cta input groups. It
// 1. builds the tables of its groups in shared memory with tensor-core products (mma m16n8k8: 16 groups x
//    8 inputs times 8 inputs x (4 codewords x 2 codebooks), fp32 accumulation; the bf16/fp16 products
//    are exact in fp32; stored without bank conflicts), then
// 2. sweeps its rows 256 at a time: each thread loads 4 bytes of codes (2 groups x 2 codebooks) of 8
//    rows per chunk, and per code does one shared-memory read and one fp32 add.
//
// Shared-memory layout, chosen so that the look-ups never conflict on a bank: a chunk's table of 16
// groups x 2 codebooks x 256 codewords is 256 lines of 32 words; entry (j, m, k) lies in line k, bank
// 2j + m. In a warp, 8 lanes read the 8 x 4 code bytes of one row's chunk (lane i: groups 2i, 2i+1), four
// rows per warp; at look-up step s, the lane of row p reads byte (s + p) mod 4, so the 32 lanes read 32
// different (group, codebook) pairs: 32 banks, one wavefront per 32 random look-ups. With fp16 entries two
// chunks share a word (low half: even chunk, high half: odd chunk). Two such tables interleave line by line
// in 256-byte lines, so that one byte permute turns a code byte into its entry's address (three
// instructions a look-up: permute, load, add; lut_gemv_common.cuh).
//
// Split-K: CTAs of one row block add their per-row sums into an fp32 workspace (red.global.add); the last
// to arrive (a counter per row block) applies scales and bias, writes the output and zeroes workspace and
// counter, so a CUDA graph can replay the launch. With one split the sums go straight to the output.
// Open sums (no counters given): every CTA only adds its sums into the workspace, which the caller zeroed,
// and the caller finishes them. Finishing in the kernel costs the last CTAs a fence, an atomic and a second
// pass in series (~2.4 us a launch in a 3B decode step, H200); the decode step's next kernel can apply
// scales and bias as it reads its input instead.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lut_gemv.h"

#include "lut_gemv_common.cuh"

namespace aqflow {
namespace {

using namespace lut_detail;

constexpr int kRowSlots = 8;                          // rows per thread per batch
constexpr int kRowsPerBatch = kRowSlots * kWarps * 4;  // 256: 4 rows per warp per slot

// Builds the tables of chunks [0, chunks) of this CTA for every token: unit u of token t in slot
// u * kTokens + t (unit_slot_offset); fp32 entries: unit u = chunk u; fp16: chunks 2u, 2u+1.
// b: the codebooks' B fragments (load_codebook_fragments).
template <typename Scalar, bool kHalfEntries, int kTokens>
__device__ void build_tables(const LutGemvParams& p, const uint32_t (&b)[8], int g_begin, int g_end, int units,
                             unsigned char* smem) {
  static_assert(kTokens == 1 || kTokens % 2 == 0, "a unit's token slots start at an even slot");
  for (int u = 0; u < units; ++u) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      const int g0 = g_begin + (kHalfEntries ? 2 : 1) * kGroupsPerChunk * u;
      const InputFragments a = input_fragments<Scalar, kHalfEntries>(p, t, g0, g_end);
      store_table_unit<Scalar, kHalfEntries>(b, a, smem + unit_slot_offset(u * kTokens + t));
    }
  }
}

// Code bytes of the 8 row slots of a batch for chunk c: 4 bytes (groups 2i, 2i+1 x codebooks 0, 1) per row.
// A whole batch of a whole chunk (the CTA's usual case) loads without bounds checks, its addresses as 32-bit
// word offsets (codes stay far below 16 GB).
__device__ __forceinline__ void load_codes(const LutGemvParams& p, uint32_t (&words)[kRowSlots], int batch_row,
                                           int row_end, int chunk, int g_begin, int g_end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_in_warp = lane >> 3, i = lane & 7;
  const int g = g_begin + kGroupsPerChunk * chunk + 2 * i;
  const int first_row = batch_row + warp * 4 + row_in_warp;
  const unsigned int* code_words = reinterpret_cast<const unsigned int*>(p.codes);
  const unsigned int first = code_word_index(p, first_row, g);
  // slot n's rows lie n * 32 rows on: in tiles, the next word (a batch is one tile of rows, whose 8 row slots
  // of a thread lie together: code_word_index), row-major 32 rows of words on
  static_assert(kRowsPerBatch == kLutTileRows && kRowSlots == 8, "a batch of rows is one tile of rows");
  const unsigned int slot_words = p.tiled ? 1u : kWarps * 4 * (static_cast<unsigned int>(p.groups) / 2);
  if (batch_row + kRowsPerBatch <= row_end && g_begin + kGroupsPerChunk * (chunk + 1) <= g_end) {  // read once:
    if (p.tiled) {  // 32 aligned bytes: two 16-byte loads
      const uint4* slots = reinterpret_cast<const uint4*>(code_words + first);
      const uint4 low = __ldcs(slots), high = __ldcs(slots + 1);
      words[0] = low.x, words[1] = low.y, words[2] = low.z, words[3] = low.w;
      words[4] = high.x, words[5] = high.y, words[6] = high.z, words[7] = high.w;
      return;
    }
#pragma unroll
    for (int n = 0; n < kRowSlots; ++n) words[n] = __ldcs(code_words + first + n * slot_words);
    return;
  }
#pragma unroll
  for (int n = 0; n < kRowSlots; ++n) {
    const int row = first_row + n * kWarps * 4;
    words[n] = row < row_end && g < g_end ? __ldcs(code_words + first + n * slot_words) : 0u;
  }
}

// CTAs a multiprocessor holds by registers: three at one token (80 registers, no spills; the extra warps
// hide look-up latency: +1 % on the 3B decode step, H200), two at four tokens (their sums need more).
constexpr int ctas_per_multiprocessor(int tokens) { return tokens == 1 ? 3 : 2; }

// The next (batch, chunk) step of a CTA to request codes for, in the order the CTA looks them up.
struct StepCursor {
  int row, chunk;
};

// Requests the codes of `next`'s step into `words` (zeros past the CTA's last step) and moves `next` on.
__device__ __forceinline__ void request_step(const LutGemvParams& p, uint32_t (&words)[kRowSlots], StepCursor& next,
                                             int row_end, int chunks, int g_begin, int g_end) {
  if (next.row < row_end) {
    load_codes(p, words, next.row, row_end, next.chunk, g_begin, g_end);
  } else {
#pragma unroll
    for (int n = 0; n < kRowSlots; ++n) words[n] = 0u;
  }
  if (++next.chunk == chunks) next.chunk = 0, next.row += kRowsPerBatch;
}

template <typename Scalar, bool kHalfEntries, int kTokens>
__global__ void __launch_bounds__(kThreads, ctas_per_multiprocessor(kTokens))
    lut_gemv_2x8_kernel(const __grid_constant__ LutGemvParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int last_to_arrive;

  int matrix = 0;
  while (matrix + 1 < p.num_matrices && static_cast<int>(blockIdx.x) >= p.block_start[matrix + 1]) ++matrix;
  const int row_begin = p.row_start[matrix] + (blockIdx.x - p.block_start[matrix]) * p.rows_per_cta;
  const int row_end = min(p.row_start[matrix + 1], row_begin + p.rows_per_cta);
  const int g_begin = blockIdx.y * kGroupsPerChunk * p.chunks_per_cta;
  const int g_end = min(p.groups, g_begin + kGroupsPerChunk * p.chunks_per_cta);
  const int chunks = (g_end - g_begin + kGroupsPerChunk - 1) / kGroupsPerChunk;
  const int units = kHalfEntries ? (chunks + 1) / 2 : chunks;
  const Scalar* codebooks = static_cast<const Scalar*>(p.codebooks) + matrix * 2 * kCodewords * 8;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_in_warp = lane >> 3, i = lane & 7;
  const LookupSteps steps = lookup_steps(row_in_warp, i);

  // codes of the next kAhead (batch, chunk) steps in flight while one is looked up: one step's compute is
  // shorter than a trip to device memory
  constexpr int kAhead = kTokens == 1 ? 2 : 1;
  uint32_t codes[kAhead + 1][kRowSlots];
  StepCursor next{row_begin, 0};
  uint32_t b[8];
  load_codebook_fragments(codebooks, b);  // first: the build needs them before the look-ups need codes
#pragma unroll
  for (int a = 0; a < kAhead; ++a) request_step(p, codes[a], next, row_end, chunks, g_begin, g_end);  // during the build
  wait_for_prior_kernel();  // x and the workspace may come from the kernel before this one
  build_tables<Scalar, kHalfEntries, kTokens>(p, b, g_begin, g_end, units, smem);
  __syncthreads();

  const bool split_k = gridDim.y > 1;
  const bool finish = p.counters != nullptr;  // else open sums: the caller finishes them
  for (int batch_row = row_begin; batch_row < row_end; batch_row += kRowsPerBatch) {
    float acc[kRowSlots][kTokens];
#pragma unroll
    for (int n = 0; n < kRowSlots; ++n)
#pragma unroll
      for (int t = 0; t < kTokens; ++t) acc[n][t] = 0.0f;

    for (int chunk = 0; chunk < chunks; ++chunk) {
      request_step(p, codes[kAhead], next, row_end, chunks, g_begin, g_end);
      const int unit = kHalfEntries ? chunk >> 1 : chunk;
      const LookupOffsets offsets = lookup_offsets(steps, unit * kTokens, kHalfEntries ? 2 * (chunk & 1) : 0);
#pragma unroll
      for (int n = 0; n < kRowSlots; ++n) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const unsigned char* entry = smem + lookup_address(codes[0][n], steps, offsets, s);
#pragma unroll
          for (int t = 0; t < kTokens; ++t) {
            // token t's unit lies unit_slot_offset(t) from token 0's: a unit's token slots start at an even
            // slot (build_tables)
            acc[n][t] += table_entry<kHalfEntries>(entry + unit_slot_offset(t));
          }
        }
      }
#pragma unroll
      for (int a = 0; a < kAhead; ++a)
#pragma unroll
        for (int n = 0; n < kRowSlots; ++n) codes[a][n] = codes[a + 1][n];
    }

    // lane i of a row group ends with the whole sum of row slot i, for each token
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      float sums[kRowSlots];
#pragma unroll
      for (int n = 0; n < kRowSlots; ++n) sums[n] = acc[n][t];
      reduce_row_group<kRowSlots>(sums, i);
      acc[0][t] = sums[0];
    }
    const int row = batch_row + (i * kWarps + warp) * 4 + row_in_warp;
    if (row < row_end) {
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        if (t < p.tokens) {
          if (split_k || !finish) {
            atomicAdd(p.workspace + static_cast<size_t>(t) * p.rows + row, acc[0][t]);
          } else {
            store_output<Scalar>(p, t, row, acc[0][t]);
          }
        }
      }
    }
  }

  allow_next_kernel();
  if (split_k && finish) {
    __threadfence();  // this thread's additions are visible before the block says it is done
    __syncthreads();
    if (threadIdx.x == 0) last_to_arrive = atomicAdd(p.counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
    __syncthreads();
    if (last_to_arrive) {
      __threadfence();
      for (int row = row_begin + threadIdx.x; row < row_end; row += kThreads) {
        for (int t = 0; t < p.tokens; ++t) {
          float* sum = p.workspace + static_cast<size_t>(t) * p.rows + row;
          const float total = __ldcg(sum);
          __stcg(sum, 0.0f);
          store_output<Scalar>(p, t, row, total);
        }
      }
      if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;
    }
  }
}

template <typename Scalar, bool kHalfEntries, int kTokens>
cudaError_t launch(const LutGemvParams& params, int splits, bool dependent_launch, cudaStream_t stream) {
  auto kernel = lut_gemv_2x8_kernel<Scalar, kHalfEntries, kTokens>;
  const int bytes = lut_gemv_2x8_shared_bytes(kHalfEntries ? 16 : 32, kTokens, params.chunks_per_cta);
  // the opt-in shared-memory limit, raised per device and instantiation when a launch first needs more
  // (in the warm-up before a CUDA graph capture, not during it)
  constexpr int kDevices = 64;
  static int bytes_allowed[kDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (bytes > 48 * 1024 && (device >= kDevices || bytes > bytes_allowed[device])) {
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (status != cudaSuccess) return status;
    if (device < kDevices) bytes_allowed[device] = bytes;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(params.block_start[params.num_matrices], splits, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1] = {dependent_launch_attribute()};
  config.attrs = attribute;
  config.numAttrs = dependent_launch ? 1 : 0;
  status = cudaLaunchKernelEx(&config, kernel, params);
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

}  // namespace

int lut_gemv_2x8_shared_bytes(int entry_bits, int max_tokens, int chunks_per_cta) {
  const int units = entry_bits == 16 ? (chunks_per_cta + 1) / 2 : chunks_per_cta;
  return unit_slots_bytes(units * max_tokens);
}

int lut_gemv_2x8_launch(const LutGemvParams& params, int scalar_kind, int entry_bits, int max_tokens, int splits,
                        bool dependent_launch, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  if (params.rows_per_cta % kRowsPerBatch != 0 || params.chunks_per_cta < 1 || params.num_matrices < 1 ||
      params.num_matrices > kLutMaxMatrices || params.groups % 2 != 0 || params.tokens < 1 ||
      params.tokens > max_tokens)
    return static_cast<int>(cudaErrorInvalidValue);
  const bool half_entries = entry_bits == 16;
  if (!half_entries && entry_bits != 32) return static_cast<int>(cudaErrorInvalidValue);
  cudaError_t status = cudaErrorInvalidValue;
  if (scalar_kind == 0) {
    if (max_tokens == 1) {
      status = half_entries ? launch<__nv_bfloat16, true, 1>(params, splits, dependent_launch, stream)
                            : launch<__nv_bfloat16, false, 1>(params, splits, dependent_launch, stream);
    } else if (max_tokens == 4) {
      status = half_entries ? launch<__nv_bfloat16, true, 4>(params, splits, dependent_launch, stream)
                            : launch<__nv_bfloat16, false, 4>(params, splits, dependent_launch, stream);
    }
  } else if (scalar_kind == 1) {
    if (max_tokens == 1) {
      status = half_entries ? launch<__half, true, 1>(params, splits, dependent_launch, stream)
                            : launch<__half, false, 1>(params, splits, dependent_launch, stream);
    } else if (max_tokens == 4) {
      status = half_entries ? launch<__half, true, 4>(params, splits, dependent_launch, stream)
                            : launch<__half, false, 4>(params, splits, dependent_launch, stream);
    }
  }
  return static_cast<int>(status);
}

}  // namespace aqflow
