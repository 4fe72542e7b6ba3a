// torch binding of the 2x8 lookup-table GEMV (lut_gemv.cu): checks the tensors, fills the parameters and
// launches on the stream the caller passes (its current CUDA stream, so a CUDA graph capture records it).
// Only torch's CPU-side headers are included, so the binding compiles wherever torch is installed.
#include <torch/extension.h>

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "lut_gemv.h"

namespace {

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", x on ", device);
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.dim() == dim, name, " has ", t.dim(), " dimensions, expected ", dim);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Checks the tensors both kernels take and fills their parameters (out, workspace and counters left null).
// x [T, in]; codes [rows, in / 8, 2] uint8, or tiled [rows / 256, in / 128, 32, 8, 8, 2, 2] (packed.py);
// codebooks [n, 2, 256, 8]; scales [rows]; bias [rows] or None; out_sizes: the rows of each packed matrix (1..4,
// summing to rows).
aqflow::LutGemvParams checked_params(const char* name, const at::Tensor& x, const at::Tensor& codes,
                                     const at::Tensor& codebooks, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& bias,
                                     const std::vector<int64_t>& out_sizes, int64_t rows_per_cta,
                                     int64_t chunks_per_cta, int64_t entry_bits, int64_t max_tokens) {
  TORCH_CHECK(x.is_cuda(), name, ": x must be a CUDA tensor");
  const at::Device device = x.device();
  const at::ScalarType scalar = x.scalar_type();
  TORCH_CHECK(scalar == at::kBFloat16 || scalar == at::kHalf, name, ": x must be bfloat16 or float16, got ", scalar);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 2 == 0, name, ": x must be [T, in] with unit, even strides");
  const bool tiled = codes.dim() == 7;
  check_tensor(codes, "codes", at::kByte, tiled ? 7 : 3, device);
  check_tensor(codebooks, "codebooks", scalar, 4, device);
  check_tensor(scales, "scales", scalar, 1, device);
  const int64_t rows = tiled ? codes.size(0) * aqflow::kLutTileRows : codes.size(0);
  const int64_t groups = tiled ? codes.size(1) * aqflow::kLutGroupsPerChunk : codes.size(1);
  TORCH_CHECK(codes.size(-1) == 2, "codes: 2 codebooks expected, got ", codes.size(-1));
  TORCH_CHECK(!tiled || (codes.size(2) == 32 && codes.size(3) == 8 && codes.size(4) == 8 && codes.size(5) == 2),
              "tiled codes must be [rows / 256, groups / 16, 32, 8, 8, 2, 2], got ", codes.sizes());
  TORCH_CHECK(codebooks.size(1) == 2 && codebooks.size(2) == 256 && codebooks.size(3) == 8,
              "codebooks must be [n, 2, 256, 8], got ", codebooks.sizes());
  TORCH_CHECK(x.size(1) == groups * 8, "x has ", x.size(1), " features, the codes take ", groups * 8);
  TORCH_CHECK(groups % 2 == 0, name, " needs an even number of input groups, got ", groups);
  TORCH_CHECK(scales.size(0) == rows, "scales has ", scales.size(0), " rows, codes ", rows);
  if (bias.has_value()) {
    check_tensor(*bias, "bias", scalar, 1, device);
    TORCH_CHECK(bias->size(0) == rows, "bias has ", bias->size(0), " rows, codes ", rows);
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 && reinterpret_cast<uintptr_t>(codes.data_ptr()) % 4 == 0,
              name, ": x and codes must be 4-byte aligned (the kernel reads input pairs and 4 code bytes)");
  const int64_t tokens = x.size(0);
  TORCH_CHECK(tokens >= 1 && tokens <= max_tokens, name, ": ", tokens, " tokens, this variant takes 1..", max_tokens);
  const int64_t matrices = static_cast<int64_t>(out_sizes.size());
  TORCH_CHECK(matrices >= 1 && matrices <= aqflow::kLutMaxMatrices, "1..", aqflow::kLutMaxMatrices,
              " packed matrices, got ", matrices);
  TORCH_CHECK(codebooks.size(0) == matrices, "codebooks for ", codebooks.size(0), " matrices, out_sizes for ", matrices);
  TORCH_CHECK(rows_per_cta > 0, "rows_per_cta must be positive");
  TORCH_CHECK(chunks_per_cta >= 1, "chunks_per_cta must be >= 1");
  TORCH_CHECK(entry_bits == 16 || entry_bits == 32, "entry_bits must be 16 or 32");

  aqflow::LutGemvParams params{};
  params.x = x.data_ptr();
  params.codes = codes.data_ptr<uint8_t>();
  params.codebooks = codebooks.data_ptr();
  params.scales = scales.data_ptr();
  params.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  params.tokens = static_cast<int>(tokens);
  params.rows = static_cast<int>(rows);
  params.groups = static_cast<int>(groups);
  params.x_stride = static_cast<int>(x.stride(0));
  params.rows_per_cta = static_cast<int>(rows_per_cta);
  params.chunks_per_cta = static_cast<int>(chunks_per_cta);
  params.num_matrices = static_cast<int>(matrices);
  params.tiled = tiled ? 1 : 0;
  int64_t row = 0, block = 0;
  for (int64_t i = 0; i < matrices; ++i) {
    TORCH_CHECK(out_sizes[i] > 0, "out_sizes must be positive");
    TORCH_CHECK(!tiled || out_sizes[i] % aqflow::kLutTileRows == 0, name, ": tiled codes need every matrix's rows ",
                "whole tiles of ", aqflow::kLutTileRows, ", got ", out_sizes[i]);
    params.row_start[i] = static_cast<int>(row);
    params.block_start[i] = static_cast<int>(block);
    row += out_sizes[i];
    block += (out_sizes[i] + rows_per_cta - 1) / rows_per_cta;
  }
  TORCH_CHECK(row == rows, "out_sizes sum to ", row, ", codes have ", rows, " rows");
  params.row_start[matrices] = static_cast<int>(row);
  params.block_start[matrices] = static_cast<int>(block);
  return params;
}

// out [T, rows] of x's dtype, unit column stride: where the kernels write y.
void set_output(aqflow::LutGemvParams& params, const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(out.device() == x.device() && out.scalar_type() == x.scalar_type() && out.dim() == 2 &&
                  out.size(0) == params.tokens && out.size(1) == params.rows && out.stride(1) == 1,
              "out must be [", params.tokens, ", ", params.rows, "] of x's dtype with unit column stride");
  params.out = out.data_ptr();
  params.out_stride = static_cast<int>(out.stride(0));
}

// fp32, contiguous, at least T * rows elements: the split-K sums.
void set_workspace(aqflow::LutGemvParams& params, const at::Tensor& x, const at::Tensor& workspace, const char* what) {
  TORCH_CHECK(workspace.device() == x.device() && workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                  workspace.numel() >= static_cast<int64_t>(params.tokens) * params.rows,
              what, " must be fp32 with at least tokens * rows elements");
  params.workspace = workspace.data_ptr<float>();
}

int64_t splits_of(int64_t groups, int64_t chunks_per_cta) {
  const int64_t groups_per_cta = aqflow::kLutGroupsPerChunk * chunks_per_cta;
  return (groups + groups_per_cta - 1) / groups_per_cta;
}

void launch_split_k(const aqflow::LutGemvParams& params, const at::Tensor& x, int64_t chunks_per_cta,
                    int64_t entry_bits, int64_t max_tokens, bool dependent_launch, int64_t stream) {
  const int splits = static_cast<int>(splits_of(params.groups, chunks_per_cta));
  const int status = aqflow::lut_gemv_2x8_launch(params, x.scalar_type() == at::kBFloat16 ? 0 : 1,
                                                 static_cast<int>(entry_bits), static_cast<int>(max_tokens), splits,
                                                 dependent_launch, reinterpret_cast<void*>(stream));
  TORCH_CHECK(status == 0, "lut_gemv_2x8 launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(status)));
}

}  // namespace

// The split-K kernel (lut_gemv.cu), up to 4 tokens. workspace: fp32, >= T * rows elements, zero;
// counters: int32, >= row blocks, zero (both left zero); dependent_launch: programmatic dependent launch
// (sm_90+); stream: a cudaStream_t as an integer; the caller makes x's device current.
void lut_gemv_2x8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& codebooks, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias, const at::Tensor& out, const at::Tensor& workspace,
                  const at::Tensor& counters,
                  const std::vector<int64_t>& out_sizes, int64_t rows_per_cta, int64_t chunks_per_cta,
                  int64_t entry_bits, int64_t max_tokens, bool dependent_launch, int64_t stream) {
  aqflow::LutGemvParams params = checked_params("lut_gemv_2x8", x, codes, codebooks, scales, bias, out_sizes,
                                                rows_per_cta, chunks_per_cta, entry_bits, max_tokens);
  TORCH_CHECK(rows_per_cta % 256 == 0, "rows_per_cta must be a positive multiple of 256");
  set_output(params, x, out);
  set_workspace(params, x, workspace, "workspace");
  TORCH_CHECK(counters.device() == x.device() && counters.scalar_type() == at::kInt && counters.is_contiguous(),
              "counters must be int32");
  const int64_t blocks = params.block_start[params.num_matrices];
  TORCH_CHECK(counters.numel() >= blocks, "counters: ", counters.numel(), " slots for ", blocks, " row blocks");
  params.counters = counters.data_ptr<int>();
  launch_split_k(params, x, chunks_per_cta, entry_bits, max_tokens, dependent_launch, stream);
}

// The split-K kernel with open sums: sums [T, rows] fp32, zero before the call, gains the unscaled sums
// sum_j sum_m lut[j, m, code] of each row (no scales, no bias, no output written); the caller finishes them
// and zeroes sums before the next call.
void lut_gemv_2x8_open(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& codebooks,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& bias, const at::Tensor& sums,
                       const std::vector<int64_t>& out_sizes, int64_t rows_per_cta, int64_t chunks_per_cta,
                       int64_t entry_bits, int64_t max_tokens, bool dependent_launch, int64_t stream) {
  aqflow::LutGemvParams params = checked_params("lut_gemv_2x8_open", x, codes, codebooks, scales, bias, out_sizes,
                                                rows_per_cta, chunks_per_cta, entry_bits, max_tokens);
  TORCH_CHECK(rows_per_cta % 256 == 0, "rows_per_cta must be a positive multiple of 256");
  set_workspace(params, x, sums, "sums");
  launch_split_k(params, x, chunks_per_cta, entry_bits, max_tokens, dependent_launch, stream);
}

// The cluster kernel (lut_gemv_cluster.cu), one token: rows_per_cta 256 (chunks_per_cta <= 4) or 128 (<= 8),
// one cluster of ceil(groups / (16 chunks_per_cta)) <= 16 CTAs per row block.
void lut_gemv_2x8_cluster(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& codebooks,
                          const at::Tensor& scales, const c10::optional<at::Tensor>& bias, const at::Tensor& out,
                          const std::vector<int64_t>& out_sizes, int64_t rows_per_cta, int64_t chunks_per_cta,
                          int64_t entry_bits, bool dependent_launch, int64_t stream) {
  aqflow::LutGemvParams params = checked_params("lut_gemv_2x8_cluster", x, codes, codebooks, scales, bias,
                                                out_sizes, rows_per_cta, chunks_per_cta, entry_bits, 1);
  set_output(params, x, out);
  const int max_chunks = aqflow::lut_gemv_2x8_cluster_max_chunks(static_cast<int>(rows_per_cta));
  TORCH_CHECK(max_chunks > 0, "lut_gemv_2x8_cluster: rows_per_cta must be 128 or 256, got ", rows_per_cta);
  TORCH_CHECK(chunks_per_cta <= max_chunks, "lut_gemv_2x8_cluster: at most ", max_chunks, " chunks per CTA of ",
              rows_per_cta, " rows, got ", chunks_per_cta);
  const int64_t ranks = splits_of(params.groups, chunks_per_cta);
  TORCH_CHECK(ranks <= aqflow::kLutMaxClusterRanks, "lut_gemv_2x8_cluster: ", params.groups, " groups in chunks of ",
              chunks_per_cta, " need ", ranks, " CTAs per cluster, at most ", aqflow::kLutMaxClusterRanks);
  const int status = aqflow::lut_gemv_2x8_cluster_launch(params, x.scalar_type() == at::kBFloat16 ? 0 : 1,
                                                         static_cast<int>(entry_bits), static_cast<int>(ranks),
                                                         dependent_launch, reinterpret_cast<void*>(stream));
  TORCH_CHECK(status == 0, "lut_gemv_2x8_cluster launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(status)));
}

int64_t lut_gemv_2x8_shared_bytes(int64_t entry_bits, int64_t max_tokens, int64_t chunks_per_cta) {
  return aqflow::lut_gemv_2x8_shared_bytes(static_cast<int>(entry_bits), static_cast<int>(max_tokens),
                                           static_cast<int>(chunks_per_cta));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut_gemv_2x8", &lut_gemv_2x8, "2x8 AQLM lookup-table GEMV (a few tokens)");
  m.def("lut_gemv_2x8_open", &lut_gemv_2x8_open, "the same, its unscaled sums added into a zeroed fp32 buffer");
  m.def("lut_gemv_2x8_cluster", &lut_gemv_2x8_cluster, "2x8 AQLM lookup-table GEMV, one token, split-K in a cluster");
  m.def("shared_bytes", &lut_gemv_2x8_shared_bytes, "dynamic shared memory of one CTA, bytes");
}
