/* column_sums.cuh: the second launch of the fused backward kernels that produce column sums
 * (norm_backward.cu's dgamma / dbeta, act_backward.cu's dbias; finish_columns: the same work
 * inside quantize_fp8.cu's cooperative cast after its grid barrier), internal to cuda/: each column's
 * FP32 partials (one per chunk of R(M, K) rows, written to the workspace by the first launch) in
 * tequant.h's fixed column order: groups of 32 consecutive partials, each in order onto +0, then
 * the group sums in order onto +0; canonical NaN; stored as FP32, or (dbias) rounded once to
 * BF16 / FP16 (fp_cast.cuh's narrow). The C references' side of the same order is
 * internal_norm.h's tq_norm_column_sum_ref.
 * Tests: tests/test_norm_kernels.py, tests/test_act_kernels.py, tests/test_linear_dbias.py (GPU
 * cases, bit for bit).
 */
#ifndef TEQUANT_CUDA_COLUMN_SUMS_CUH_
#define TEQUANT_CUDA_COLUMN_SUMS_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp_cast.cuh"
#include "internal_norm.h"

namespace tq_colsum {

/* out0[j] (and out1[j]: the second plane of partials, [2][p_count][cols]): column j's p_count
 * partials, in groups of 32 chunks (thread row ty sums group ty in order), then the group sums in
 * order (thread row 0). p_count <= 1024 (TQ_NORM_MAX_PARTIALS): one thread row per group. */
template <typename TOut>
static __global__ void __launch_bounds__(1024) column_sum_kernel(const float *__restrict__ partials,
                                                                 int64_t p_count, int64_t cols,
                                                                 TOut *out0, TOut *out1) {
    __shared__ float group_sum[TQ_NORM_GROUP][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t j = (int64_t)blockIdx.x * 32 + tx;
    for (int plane = 0; plane < 2; plane++) {
        TOut *out = plane == 0 ? out0 : out1;
        if (out == nullptr) continue; /* uniform */
        const float *part = partials + plane * p_count * cols;
        float s = 0.0f;
        const int64_t p_begin = (int64_t)ty * TQ_NORM_GROUP;
        const int64_t p_end = p_begin + TQ_NORM_GROUP < p_count ? p_begin + TQ_NORM_GROUP : p_count;
        if (j < cols) {
#pragma unroll 8
            for (int64_t q = p_begin; q < p_end; q++) s = tq_nadd(s, part[q * cols + j]);
        }
        group_sum[ty][tx] = s;
        __syncthreads();
        if (ty == 0 && j < cols) {
            float total = 0.0f;
            for (int64_t grp = 0; grp * TQ_NORM_GROUP < p_count; grp++)
                total = tq_nadd(total, group_sum[grp][tx]);
            tq_fp::narrow(tq_norm_canon(total), out + j);
        }
        __syncthreads();
    }
}

/* One column's total stored in out's dtype: canonical NaN, rounded once (dbias: BF16 / FP16). */
__device__ __forceinline__ void store_total(float total, void *out, tq_dtype dtype, int64_t j) {
    if (dtype == TQ_DTYPE_BFLOAT16) tq_fp::narrow(tq_norm_canon(total), static_cast<tq_fp::Bf16 *>(out) + j);
    else if (dtype == TQ_DTYPE_FLOAT16) tq_fp::narrow(tq_norm_canon(total), static_cast<tq_fp::Half *>(out) + j);
    else static_cast<float *>(out)[j] = tq_norm_canon(total);
}

/* column_sum_kernel's work inside a kernel that wrote the partials itself and has passed a grid
 * barrier since (quantize_fp8.cu's cooperative cast with dbias): a CTA of kCtaThreads threads
 * finishes the kCols columns of chunks first, first + stride, ... Thread (ty, tx) =
 * (threadIdx.x / kCols, % kCols) sums group ty of column tx's partials as column_sum_kernel's
 * thread (tx, ty) does (its 32 loads issued at once), the group sums then in order by thread row
 * 0: the same bits. group_sum: kCtaThreads / kCols x (kCols + 1) floats of shared memory (free
 * when called; the call ends with a barrier of the CTA). */
template <int kCtaThreads, int kCols>
__device__ __forceinline__ void finish_columns(const float *partials, int64_t p_count, int64_t cols,
                                               void *out, tq_dtype dtype, float *group_sum,
                                               int64_t first, int64_t stride) {
    static_assert(kCtaThreads / kCols == TQ_NORM_GROUP, "one thread row per group of partials");
    const int tx = threadIdx.x % kCols, ty = threadIdx.x / kCols;
    const int64_t p_begin = (int64_t)ty * TQ_NORM_GROUP;
    const int n = p_count - p_begin < TQ_NORM_GROUP ? (int)(p_count - p_begin) : TQ_NORM_GROUP;
    for (int64_t j0 = first * kCols; j0 < cols; j0 += stride * kCols) {
        const int64_t j = j0 + tx;
        float v[TQ_NORM_GROUP];
#pragma unroll
        for (int q = 0; q < TQ_NORM_GROUP; q++)
            v[q] = j < cols && q < n ? __ldcg(partials + (p_begin + q) * cols + j) : 0.0f;
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < TQ_NORM_GROUP; q++)
            if (q < n) s = tq_nadd(s, v[q]);
        group_sum[ty * (kCols + 1) + tx] = s;
        __syncthreads();
        if (ty == 0 && j < cols) {
            float total = 0.0f;
            for (int64_t grp = 0; grp * TQ_NORM_GROUP < p_count; grp++)
                total = tq_nadd(total, group_sum[grp * (kCols + 1) + tx]);
            store_total(total, out, dtype, j);
        }
        __syncthreads();
    }
}

/* Queues column_sum_kernel on s (out1 may be NULL); the caller checks cudaGetLastError. */
template <typename TOut>
static inline void launch(const float *partials, int64_t p_count, int64_t cols, TOut *out0,
                          TOut *out1, cudaStream_t s) {
    const dim3 block(32, TQ_NORM_GROUP);
    column_sum_kernel<TOut><<<(unsigned)((cols + 31) / 32), block, 0, s>>>(partials, p_count, cols,
                                                                           out0, out1);
}

/* One or two planes into out0 (and out1 unless NULL), FLOAT32, BFLOAT16 or FLOAT16 vectors of
 * `dtype`. */
static inline void launch(const float *partials, int64_t p_count, int64_t cols, void *out0,
                          void *out1, tq_dtype dtype, cudaStream_t s) {
    if (dtype == TQ_DTYPE_BFLOAT16)
        launch<tq_fp::Bf16>(partials, p_count, cols, static_cast<tq_fp::Bf16 *>(out0),
                            static_cast<tq_fp::Bf16 *>(out1), s);
    else if (dtype == TQ_DTYPE_FLOAT16)
        launch<tq_fp::Half>(partials, p_count, cols, static_cast<tq_fp::Half *>(out0),
                            static_cast<tq_fp::Half *>(out1), s);
    else launch<float>(partials, p_count, cols, static_cast<float *>(out0),
                       static_cast<float *>(out1), s);
}

}  // namespace tq_colsum

#endif  // TEQUANT_CUDA_COLUMN_SUMS_CUH_
