// The parameters of the 2x8 lookup-table GEMV (lut_gemv.cu), shared by the kernel and its torch binding.
#pragma once

#include <cstdint>

namespace aqflow {

constexpr int kLutMaxMatrices = 4;
constexpr int kLutMaxClusterRanks = 16;  // a non-portable cluster size, allowed on Hopper
constexpr int kLutGroupsPerChunk = 16;  // input groups per table chunk
constexpr int kLutTileRows = 256;       // tiled codes: tiles of 256 rows x 16 groups (packed.py, in_tiles)

// y[t, row] = scales[row] * sum_j sum_m lut_t[j, m, codes[row, j, m]] (+ bias[row]) for the rows of up to
// four matrices packed one after another (q/k/v, gate/up), each with its own codebooks.
struct LutGemvParams {
  const void* x;            // [tokens, groups * 8], scalar type, row stride x_stride
  const uint8_t* codes;     // [rows, groups, 2] uint8, or tiled: [rows / 256, groups / 16, 32, 8, 8, 2, 2]
  const void* codebooks;    // [num_matrices, 2, 256, 8], scalar type
  const void* scales;       // [rows], scalar type
  const void* bias;         // [rows] or nullptr
  void* out;                // [tokens, rows], scalar type, row stride out_stride
  float* workspace;         // [tokens, rows] fp32, zero between launches (split-K sums)
  int* counters;            // one per row block, zero between launches; nullptr: open sums (the scaled
                            // outputs are not written: the unscaled sums are added into the workspace,
                            // zero before the launch, and left there)
  int tokens;
  int rows;
  int groups;
  int x_stride;
  int out_stride;
  int rows_per_cta;         // a multiple of kLutRowsPerBatch
  int chunks_per_cta;       // chunks of 16 input groups whose tables a CTA holds
  int num_matrices;
  int tiled;                // codes in tiles (every matrix's rows and the groups whole tiles)
  int row_start[kLutMaxMatrices + 1];    // first row of each matrix; row_start[num_matrices] = rows
  int block_start[kLutMaxMatrices + 1];  // first row block of each matrix
};

// scalar_kind: 0 bfloat16, 1 float16; entry_bits: 32 (fp32 table) or 16 (fp16 table); max_tokens: 1 or 4.
// Grid: (block_start[num_matrices], splits) CTAs of 256 threads. dependent_launch: launched with
// programmatic dependent launch (sm_90+: it may start while the kernel before it finishes; it waits for
// that kernel before reading x). Returns a cudaError_t.
int lut_gemv_2x8_launch(const LutGemvParams& params, int scalar_kind, int entry_bits, int max_tokens, int splits,
                        bool dependent_launch, void* stream);

// Dynamic shared memory a launch needs, in bytes.
int lut_gemv_2x8_shared_bytes(int entry_bits, int max_tokens, int chunks_per_cta);

// The cluster kernel (lut_gemv_cluster.cu): one token; rows_per_cta 256 (chunks_per_cta <= 4) or 128
// (<= 8); grid (ranks, block_start[num_matrices]) with clusters of `ranks` CTAs (<= 16), rank r taking
// input groups [16 * chunks_per_cta * r, ...); workspace and counters unused. Returns a cudaError_t.
int lut_gemv_2x8_cluster_launch(const LutGemvParams& params, int scalar_kind, int entry_bits, int ranks,
                                bool dependent_launch, void* stream);

// The most chunks per CTA the cluster kernel takes at rows_per_cta (0: not a size it takes).
int lut_gemv_2x8_cluster_max_chunks(int rows_per_cta);

// Dynamic shared memory of one CTA of the cluster kernel, in bytes (at most two table units).
int lut_gemv_2x8_cluster_shared_bytes(int entry_bits, int chunks_per_cta);

}  // namespace aqflow
