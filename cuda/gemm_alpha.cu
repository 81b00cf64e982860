/* gemm_alpha.cu: the GEMM scalars on the device, so NVFP4's alpha (formats.h
 * tq_nvfp4_gemm_alpha of the two directions' amaxes, NUMERICS.md 2) never needs a host sync:
 * one thread writes alpha (1 without amaxes) and, when asked, beta. The caller (gemm.c) has made
 * the operands' device current. Reference: csrc/ref/gemm_alpha_ref.c. Tests: tests/test_gemm.py.
 */
#include <cuda_runtime.h>

#include "internal_gemm.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

__global__ void alpha_kernel(const float *amax_a, const float *amax_b, float beta,
                             float *alpha_beta, int n_out) {
    alpha_beta[0] = amax_a != nullptr ? tq_nvfp4_gemm_alpha(*amax_a, *amax_b) : 1.0f;
    if (n_out > 1) alpha_beta[1] = beta;
}

}  // namespace

extern "C" tq_status tq_gemm_alpha_cuda(const float *amax_a, const float *amax_b, float beta,
                                        float *alpha_beta, int n_out, struct CUstream_st *stream) {
    alpha_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(amax_a, amax_b, beta,
                                                                      alpha_beta, n_out);
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return tq_cuda::cuda_failed("GEMM alpha kernel launch", err);
    return TQ_SUCCESS;
}
