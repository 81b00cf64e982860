/* gemm_alpha_ref.c: CPU reference of the GEMM scalars (NUMERICS.md 2 "NVFP4": the GEMM alpha
 * RN(RN(amax_A * amax_B) * RN(1/7225344)), formats.h tq_nvfp4_gemm_alpha; 1 for other pairs).
 * The CUDA twin is cuda/gemm_alpha.cu. Tests: tests/test_gemm.py (NVFP4 products on CPU and CUDA).
 */
#include "internal_gemm.h"
#include "tequant/formats.h"

tq_status tq_gemm_alpha_ref(const float *amax_a, const float *amax_b, float beta,
                            float *alpha_beta, int n_out, struct CUstream_st *stream) {
    (void)stream;
    alpha_beta[0] = amax_a != NULL ? tq_nvfp4_gemm_alpha(*amax_a, *amax_b) : 1.0f;
    if (n_out > 1) alpha_beta[1] = beta;
    return TQ_SUCCESS;
}
