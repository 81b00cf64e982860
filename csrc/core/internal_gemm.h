/* internal_gemm.h: one cuBLASLt matmul as gemm.c describes it to gemm_cublaslt.c, which owns the
 * handles, the plan cache and the launch. Not part of the public API.
 *
 * Column-major cuBLAS terms: D[m, n] = alpha * op(A)[m, k] . B[k, n] + beta * D, with A stored
 * [k, m] (TRANSA = T) and B stored [k, n] (TRANSB = N): tequant's row-major out[M, N] =
 * A_tq[M, K] . B_tq[N, K]^T is this with cuBLAS A = B_tq (m = N) and cuBLAS B = A_tq (n = M).
 * Tests: tests/test_gemm.py (plan-cache counters, every pair on the GPU machine).
 */
#ifndef TEQUANT_CORE_INTERNAL_GEMM_H_
#define TEQUANT_CORE_INTERNAL_GEMM_H_

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tq_lt_call {
    int device;
    int a_type, b_type, d_type; /* cudaDataType_t values */
    int bias_type;              /* cudaDataType_t of bias, or -1 for no bias epilogue */
    int a_scale_mode, b_scale_mode; /* cublasLtMatmulMatrixScale_t, or -1: no scale pointer */
    const void *a, *b, *a_scale, *b_scale, *bias;
    void *d;
    int64_t m, n, k, lda, ldb, ldd;
    int fast_accum;
    int device_scalars; /* alpha and beta point to device floats (else host floats) */
    const float *alpha, *beta;
    void *workspace;
    size_t workspace_bytes;
    struct CUstream_st *stream;
    const tq_quant_config *what_a, *what_b; /* tq_gemm's pair, named in error messages */
} tq_lt_call;

/* "<a> x <b>" of a call's pair ("FP8 per-tensor (E4M3) x FP8 per-tensor (E4M3)") in buf: formatted
 * for error messages only (eagerly, the names cost ~2 us of host time a GEMM). */
const char *tq_lt_call_name(const tq_lt_call *call, char *buf, size_t size);

/* Runs the call through a cached plan (heuristic on the first call of its kind). */
tq_status tq_lt_matmul(const tq_lt_call *call);

/* gemm_alpha: alpha_beta[0] = tq_nvfp4_gemm_alpha(*amax_a, *amax_b), or 1 when amax_a is NULL;
 * alpha_beta[1] = beta when n_out is 2. Device floats on CUDA (on `stream`), host floats on CPU. */
tq_status tq_gemm_alpha_ref(const float *amax_a, const float *amax_b, float beta,
                            float *alpha_beta, int n_out, struct CUstream_st *stream);
tq_status tq_gemm_alpha_cuda(const float *amax_a, const float *amax_b, float beta,
                             float *alpha_beta, int n_out, struct CUstream_st *stream);

/* An emulated GEMM's prologue in ONE launch. MXFP8 (cuda/quantize_mxfp8.cu): both operand
 * directions dequantized exactly into bf16 values_a / values_b (each as tq_dequantize writes
 * it). NVFP4 (cuda/quantize_nvfp4_dequant.cu): each direction's GEMM values e2m1 * s_b (what
 * tq_dequantize writes for a direction whose amax data is NULL; data / scale: its packed codes
 * and E4M3 scales) and tq_gemm_alpha_cuda's alpha_beta[0..1] from amax_a, amax_b and beta.
 * CUDA only: the CPU GEMM multiplies dequantized values (csrc/ext/gemm.c). */
tq_status tq_gemm_values_mxfp8_cuda(const tq_quant_config *config_a, const tq_tensor *data_a,
                                    const tq_tensor *scale_a, tq_tensor *values_a,
                                    const tq_quant_config *config_b, const tq_tensor *data_b,
                                    const tq_tensor *scale_b, tq_tensor *values_b,
                                    struct CUstream_st *stream);
tq_status tq_gemm_values_nvfp4_cuda(const tq_tensor *data_a, const tq_tensor *scale_a,
                                    tq_tensor *values_a, const tq_tensor *data_b,
                                    const tq_tensor *scale_b, tq_tensor *values_b,
                                    const float *amax_a, const float *amax_b, float beta,
                                    float *alpha_beta, struct CUstream_st *stream);

/* A Float8BlockScaling GEMM for cuda/gemm_fp8_block.cu (Hopper, no cuBLASLt): row-major
 * out[M, N] = A[M, K] . B[N, K]^T, E4M3 / E5M2 codes (K-major, ld in bytes) with per-side scales:
 * per_row (1x128) scale_inv[kb * scale_ld + row], scale_ld = pad4(rows); else (128x128)
 * scale_inv[(row / 128) * scale_ld + kb]. out BF16 / FP16 / FP32 (ld ldo elements), plus out's
 * old values when accumulate, plus a bias of N elements (bias_dtype) when bias is not NULL. */
typedef struct tq_block_gemm_side {
    const void *data;
    int64_t rows, ld;
    const float *scale_inv;
    int64_t scale_ld;
    int per_row;
    int e5m2; /* codes are E5M2 (else E4M3) */
} tq_block_gemm_side;

typedef struct tq_block_gemm {
    int device;
    tq_block_gemm_side a, b;
    int64_t k;
    void *out;
    int64_t ldo;
    int out_dtype;
    const void *bias;
    int bias_dtype;
    int accumulate;
} tq_block_gemm;

/* 1 where the kernel runs this GEMM (an sm_90 device, aligned operands), else 0: cuBLASLt. */
int tq_gemm_fp8_block_runs(const tq_block_gemm *g);
tq_status tq_gemm_fp8_block_cuda(const tq_block_gemm *g, struct CUstream_st *stream);
/* The same on host memory (csrc/ref/gemm_fp8_block_ref.c), in the kernel's order. */
tq_status tq_gemm_fp8_block_ref(const tq_block_gemm *g, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* TEQUANT_CORE_INTERNAL_GEMM_H_ */
