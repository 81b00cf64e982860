// probe_check.cuh: what the stand-alone cuBLASLt probes (gemm_algo_probe.cu, gemm_block_probe.cu)
// share: a CUDA or cuBLASLt call that fails prints itself and its error and ends the program,
// and the workspace both give cuBLASLt. Not part of the library.
#ifndef TEQUANT_BENCHMARKS_PROBE_CHECK_CUH_
#define TEQUANT_BENCHMARKS_PROBE_CHECK_CUH_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

constexpr size_t kWorkspace = 32u << 20;

#define CHECK_CUDA(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    std::printf("%s: %s\n", #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)
#define CHECK_LT(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { \
    std::printf("%s: status %d\n", #x, (int)s_); std::exit(1); } } while (0)

#endif  // TEQUANT_BENCHMARKS_PROBE_CHECK_CUH_
