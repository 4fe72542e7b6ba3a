// What one dependent step costs on this GPU (issue 27): a kernel boundary in a CUDA graph (as the decode
// step's ~270 kernels meet, with and without programmatic dependent launch) against a grid-wide barrier
// inside one persistent kernel (what a decode step written as one kernel would pay instead).
//
// Every step ("phase") reads, in each CTA, a slice of the vector the previous phase wrote (as a GEMV reads
// its input groups after the kernel before it) and writes its own part of the next one; "empty" phases only
// meet. Prints one line per case and writes them as JSON:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/boundary_cost.cu -o boundary_cost
//   ./boundary_cost OUT.json
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int kThreads = 256;
constexpr int kVector = 3072;  // a Llama-3.2-3B hidden state
constexpr int kSlice = 256;    // what one CTA reads of it
constexpr int kPhases = 2000;
constexpr int kReplays = 5;

#define CHECK(call)                                                                       \
  do {                                                                                    \
    cudaError_t status_ = (call);                                                         \
    if (status_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(status_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// One phase's work: this CTA's slice of the previous vector in, its own elements of the next one out.
__device__ __forceinline__ void phase_work(const float* in, float* out) {
  const int slice = (blockIdx.x % (kVector / kSlice)) * kSlice;
  const float v = __ldcg(in + slice + threadIdx.x);  // from L2: another CTA wrote it
  __stcg(out + (blockIdx.x * kThreads + threadIdx.x) % kVector, v + 1.0f);
}

__global__ void chain_kernel(float* buffers, int phase, bool work, bool dependent) {
  if (dependent) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (work) phase_work(buffers + (phase & 1) * kVector, buffers + ((phase + 1) & 1) * kVector);
  if (dependent) asm volatile("griddepcontrol.launch_dependents;");
}

// All CTAs arrive (a monotonic counter: no reset between phases) and leave once `target` have arrived.
__device__ __forceinline__ void grid_barrier(unsigned int* count, unsigned int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this CTA's writes before its arrival
    atomicAdd(count, 1u);
    unsigned int seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

__global__ void persistent_kernel(float* buffers, unsigned int* count, int phases, bool work) {
  for (int phase = 0; phase < phases; ++phase) {
    if (work) phase_work(buffers + (phase & 1) * kVector, buffers + ((phase + 1) & 1) * kVector);
    grid_barrier(count, static_cast<unsigned int>(phase + 1) * gridDim.x);
  }
}

// Microseconds per phase of a CUDA graph of kPhases chain kernels, replayed kReplays times.
float chain_microseconds(float* buffers, int ctas, bool work, bool dependent, cudaStream_t stream) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int phase = 0; phase < kPhases; ++phase) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(ctas);
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    cudaLaunchAttribute attribute[1] = {};
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = dependent ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&config, chain_kernel, buffers, phase, work, dependent));
  }
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphLaunch(exec, stream));  // warm-up
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < kReplays; ++r) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(end, stream));
  CHECK(cudaEventSynchronize(end));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, start, end));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return ms * 1e3f / (kReplays * kPhases);
}

// Microseconds per phase of one cooperative (all CTAs resident) kernel of kPhases phases.
float persistent_microseconds(float* buffers, unsigned int* count, int ctas, bool work, cudaStream_t stream) {
  float best = 1e30f;
  for (int r = 0; r < kReplays + 1; ++r) {  // the first is a warm-up
    CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned int), stream));
    int phases = kPhases;
    bool w = work;
    void* args[] = {&buffers, &count, &phases, &w};
    cudaEvent_t start, end;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&end));
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(ctas), dim3(kThreads), args, 0,
                                      stream));
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    if (r > 0 && ms < best) best = ms;
  }
  return best * 1e3f / kPhases;
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = argc > 1 ? argv[1] : "boundary_cost.json";
  cudaDeviceProp props;
  CHECK(cudaGetDeviceProperties(&props, 0));
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, persistent_kernel, kThreads, 0));
  float* buffers = nullptr;
  unsigned int* count = nullptr;
  CHECK(cudaMalloc(&buffers, 2 * kVector * sizeof(float)));
  CHECK(cudaMemset(buffers, 0, 2 * kVector * sizeof(float)));
  CHECK(cudaMalloc(&count, sizeof(unsigned int)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Row {
    std::string how;
    int ctas;
    bool work;
    float us;
  };
  std::vector<Row> rows;
  for (int per_sm : {1, 3}) {
    const int ctas = props.multiProcessorCount * per_sm;
    if (per_sm > resident) continue;
    for (bool work : {false, true}) {
      rows.push_back({"graph of kernels", ctas, work, chain_microseconds(buffers, ctas, work, false, stream)});
      rows.push_back({"graph of kernels, PDL", ctas, work, chain_microseconds(buffers, ctas, work, true, stream)});
      rows.push_back({"one kernel, grid barriers", ctas, work,
                      persistent_microseconds(buffers, count, ctas, work, stream)});
    }
  }
  std::FILE* json = std::fopen(out_path, "w");
  std::fprintf(json, "{\"device\": \"%s\", \"multiprocessors\": %d, \"phases\": %d, \"rows\": [\n", props.name,
               props.multiProcessorCount, kPhases);
  std::printf("%-28s %6s %6s %14s\n", "how", "CTAs", "work", "us per phase");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%-28s %6d %6s %14.2f\n", r.how.c_str(), r.ctas, r.work ? "slice" : "none", r.us);
    std::fprintf(json, "  {\"how\": \"%s\", \"ctas\": %d, \"work\": %s, \"us_per_phase\": %.3f}%s\n", r.how.c_str(),
                 r.ctas, r.work ? "true" : "false", r.us, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(json, "]}\n");
  std::fclose(json);
  return 0;
}
