// The 2x8 lookup-table GEMV for one token with its split-K inside a thread-block cluster: no global
// workspace, no counters, one trip to device memory.
//
// y[row] = scales[row] * sum_j sum_m lut[j, m, codes[row, j, m]] + bias[row],
// lut[j, m, k] = <codebooks[m, k, :], x[8j:8j+8]>.
//
// Why a second kernel: at batch 1 the split-K kernel (lut_gemv.cu) is bound by its chain of dependent
// trips to memory, not by bytes: codes of the next chunk, the atomic sums, a fence, the arrival counter,
// the re-read of the sums. Here:
// - grid (cluster, row blocks), one cluster per row block; rank r of a cluster takes input groups
//   [r * 16 * chunks_per_cta, ...) of the block's kSlots * 32 rows;
// - every code of the CTA (kMaxChunks x kSlots words a thread), the codebooks, the inputs and the
//   scales and bias of the rows it will finish are requested at once, before any table exists;
// - the tables are built one unit at a time into two alternating slots (one barrier per unit), so
//   shared memory does not grow with the chunks;
// - each rank leaves its rows' partial sums in its own shared memory; after a cluster barrier, rank r
//   adds all ranks' sums of rows [r * kRows / cluster, ...) through distributed shared memory (in rank
//   order: the sum does not depend on timing), applies scales and bias and writes the output.
// Table layout and build: lut_gemv_common.cuh.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lut_gemv.h"
#include "lut_gemv_common.cuh"

namespace aqflow {
namespace {

using namespace lut_detail;
namespace cg = cooperative_groups;

template <typename Scalar, bool kHalfEntries, int kSlots, int kMaxChunks>
__global__ void __launch_bounds__(kThreads, 2) lut_gemv_2x8_cluster_kernel(const __grid_constant__ LutGemvParams p) {
  constexpr int kRows = kSlots * kWarps * 4;  // 4 rows per warp per slot
  constexpr int kUnitChunks = kHalfEntries ? 2 : 1;
  constexpr int kMaxUnits = kMaxChunks / kUnitChunks;
  extern __shared__ __align__(16) unsigned char tables[];  // one unit pair: slots 0 and 1, used in turn
  __shared__ float partial[kRows];

  const int rank = blockIdx.x, ranks = gridDim.x;
  int matrix = 0;
  while (matrix + 1 < p.num_matrices && static_cast<int>(blockIdx.y) >= p.block_start[matrix + 1]) ++matrix;
  const int row_begin = p.row_start[matrix] + (blockIdx.y - p.block_start[matrix]) * kRows;
  const int row_end = min(p.row_start[matrix + 1], row_begin + kRows);
  const int g_begin = rank * kGroupsPerChunk * p.chunks_per_cta;
  const int g_end = min(p.groups, g_begin + kGroupsPerChunk * p.chunks_per_cta);
  const int chunks = (g_end - g_begin + kGroupsPerChunk - 1) / kGroupsPerChunk;
  const int units = (chunks + kUnitChunks - 1) / kUnitChunks;
  const Scalar* codebooks = static_cast<const Scalar*>(p.codebooks) + matrix * 2 * kCodewords * 8;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_in_warp = lane >> 3, i = lane & 7;

  // 1. every request at once: the codebooks (the build's first need, lut_gemv_common.cuh), codes (streamed past
  // the caches), then what the end needs
  uint32_t b[8];
  load_codebook_fragments(codebooks, b);
  uint32_t codes[kMaxChunks][kSlots];
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    const int g = g_begin + kGroupsPerChunk * c + 2 * i;
#pragma unroll
    for (int n = 0; n < kSlots; ++n) {
      const int row = row_begin + (n * kWarps + warp) * 4 + row_in_warp;
      codes[c][n] = 0u;
      if (c < chunks && row < row_end && g < g_end)
        codes[c][n] = __ldcs(reinterpret_cast<const unsigned int*>(p.codes) + code_word_index(p, row, g));
    }
  }
  // the row this thread finishes: one of its own slots when the cluster is one CTA, else a slice of the block
  const int slice = (kRows + ranks - 1) / ranks;
  const int my_row_local = ranks == 1 ? ((i % kSlots) * kWarps + warp) * 4 + row_in_warp : rank * slice + threadIdx.x;
  const bool finishes = ranks == 1 ? i < kSlots && row_begin + my_row_local < row_end
                                   : static_cast<int>(threadIdx.x) < slice && my_row_local < kRows &&
                                         row_begin + my_row_local < row_end;
  float scale = 0.0f, bias = 0.0f;
  if (finishes) {
    scale = ScalarOps<Scalar>::to_float(static_cast<const Scalar*>(p.scales)[row_begin + my_row_local]);
    if (p.bias != nullptr) bias = ScalarOps<Scalar>::to_float(static_cast<const Scalar*>(p.bias)[row_begin + my_row_local]);
  }
  wait_for_prior_kernel();  // x may come from the kernel before this one; the weights above may not
  InputFragments a[kMaxUnits];
#pragma unroll
  for (int u = 0; u < kMaxUnits; ++u) {
    a[u] = InputFragments{};
    if (u < units) a[u] = input_fragments<Scalar, kHalfEntries>(p, 0, g_begin + kUnitChunks * kGroupsPerChunk * u, g_end);
  }

  const LookupSteps steps = lookup_steps(row_in_warp, i);

  // 2. per unit: build its table (the other buffer may still be read by slower warps), barrier, look up
  float sums[kSlots];
#pragma unroll
  for (int n = 0; n < kSlots; ++n) sums[n] = 0.0f;
#pragma unroll
  for (int u = 0; u < kMaxUnits; ++u) {
    if (u < units) {  // the same for the whole CTA: the barrier below is reached by all or none
      store_table_unit<Scalar, kHalfEntries>(b, a[u], tables + unit_slot_offset(u & 1));
      __syncthreads();
#pragma unroll
      for (int h = 0; h < kUnitChunks; ++h) {
        const int c = u * kUnitChunks + h;
        if (c < chunks) {
          const LookupOffsets offsets = lookup_offsets(steps, u & 1, 2 * h);
#pragma unroll
          for (int n = 0; n < kSlots; ++n) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              sums[n] += table_entry<kHalfEntries>(tables + lookup_address(codes[c][n], steps, offsets, s));
            }
          }
        }
      }
    }
  }

  allow_next_kernel();
  // 3. whole rows: across the 8 lanes of a row group, then across the cluster's ranks
  reduce_row_group<kSlots>(sums, i);
  if (ranks == 1) {
    if (finishes) {
      static_cast<Scalar*>(p.out)[row_begin + my_row_local] = ScalarOps<Scalar>::from_float(sums[0] * scale + bias);
    }
    return;
  }
  if (i < kSlots) partial[(i * kWarps + warp) * 4 + row_in_warp] = sums[0];
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every rank's partial sums are written and visible
  if (finishes) {
    float total = 0.0f;
    for (int r = 0; r < ranks; ++r) total += cluster.map_shared_rank(partial, r)[my_row_local];
    static_cast<Scalar*>(p.out)[row_begin + my_row_local] = ScalarOps<Scalar>::from_float(total * scale + bias);
  }
  cluster.sync();  // no CTA leaves (and frees its shared memory) while another may still read it
}

template <typename Scalar, bool kHalfEntries, int kSlots, int kMaxChunks>
cudaError_t launch(const LutGemvParams& params, int ranks, bool dependent_launch, cudaStream_t stream) {
  auto kernel = lut_gemv_2x8_cluster_kernel<Scalar, kHalfEntries, kSlots, kMaxChunks>;
  const int bytes = lut_gemv_2x8_cluster_shared_bytes(kHalfEntries ? 16 : 32, params.chunks_per_cta);
  // attributes set once per device and instantiation, in the warm-up before a CUDA graph capture
  constexpr int kDevices = 64;
  static bool configured[kDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (device >= kDevices || !configured[device]) {
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPairBytes);
    if (status == cudaSuccess) status = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (status != cudaSuccess) return status;
    if (device < kDevices) configured[device] = true;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ranks, params.block_start[params.num_matrices], 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = ranks;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  attribute[1] = dependent_launch_attribute();
  config.attrs = attribute;
  config.numAttrs = dependent_launch ? 2 : 1;
  status = cudaLaunchKernelEx(&config, kernel, params);
  if (status != cudaSuccess) return status;
  return cudaGetLastError();
}

template <typename Scalar, bool kHalfEntries>
cudaError_t launch_slots(const LutGemvParams& params, int ranks, bool dependent_launch, cudaStream_t stream) {
  if (params.rows_per_cta == 256) return launch<Scalar, kHalfEntries, 8, 4>(params, ranks, dependent_launch, stream);
  return launch<Scalar, kHalfEntries, 4, 8>(params, ranks, dependent_launch, stream);
}

}  // namespace

int lut_gemv_2x8_cluster_max_chunks(int rows_per_cta) {
  if (rows_per_cta == 256) return 4;
  if (rows_per_cta == 128) return 8;
  return 0;
}

int lut_gemv_2x8_cluster_shared_bytes(int entry_bits, int chunks_per_cta) {
  const int units = entry_bits == 16 ? (chunks_per_cta + 1) / 2 : chunks_per_cta;
  return lut_detail::unit_slots_bytes(units < 2 ? units : 2);  // slots 0 and 1 in turn: one unit pair
}

int lut_gemv_2x8_cluster_launch(const LutGemvParams& params, int scalar_kind, int entry_bits, int ranks,
                                bool dependent_launch, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int max_chunks = lut_gemv_2x8_cluster_max_chunks(params.rows_per_cta);
  if (max_chunks == 0 || params.chunks_per_cta < 1 || params.chunks_per_cta > max_chunks || ranks < 1 ||
      ranks > kLutMaxClusterRanks || params.num_matrices < 1 || params.num_matrices > kLutMaxMatrices ||
      params.groups % 2 != 0 || params.tokens != 1 || (entry_bits != 16 && entry_bits != 32) ||
      (ranks - 1) * kLutGroupsPerChunk * params.chunks_per_cta >= params.groups)
    return static_cast<int>(cudaErrorInvalidValue);
  const bool half_entries = entry_bits == 16;
  cudaError_t status = cudaErrorInvalidValue;
  if (scalar_kind == 0) {
    status = half_entries ? launch_slots<__nv_bfloat16, true>(params, ranks, dependent_launch, stream)
                          : launch_slots<__nv_bfloat16, false>(params, ranks, dependent_launch, stream);
  } else if (scalar_kind == 1) {
    status = half_entries ? launch_slots<__half, true>(params, ranks, dependent_launch, stream)
                          : launch_slots<__half, false>(params, ranks, dependent_launch, stream);
  }
  return static_cast<int>(status);
}

}  // namespace aqflow
