/* column_sums.cuh: the second launch of the fused backward kernels that produce column sums
 * (norm_backward.cu's dgamma / dbeta, act_backward.cu's dbias), internal to cuda/: each column's
 * FP32 partials (one per chunk of R(M, K) rows, written to the workspace by the first launch) in
 * tequant.h's fixed column order: groups of 32 consecutive partials, each in order onto +0, then
 * the group sums in order onto +0; canonical NaN. The C references' side of the same order is
 * internal_norm.h's tq_norm_column_sums_ref.
 * Tests: tests/test_norm_kernels.py, tests/test_act_kernels.py (GPU cases, bit for bit).
 */
#ifndef TEQUANT_CUDA_COLUMN_SUMS_CUH_
#define TEQUANT_CUDA_COLUMN_SUMS_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "internal_norm.h"

namespace tq_colsum {

/* out0[j] (and out1[j]: the second plane of partials, [2][p_count][cols]): column j's p_count
 * partials, in groups of 32 chunks (thread row ty sums group ty in order), then the group sums in
 * order (thread row 0). p_count <= 1024 (TQ_NORM_MAX_PARTIALS): one thread row per group. */
static __global__ void __launch_bounds__(1024) column_sum_kernel(const float *__restrict__ partials,
                                                                 int64_t p_count, int64_t cols,
                                                                 float *out0, float *out1) {
    __shared__ float group_sum[TQ_NORM_GROUP][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t j = (int64_t)blockIdx.x * 32 + tx;
    for (int plane = 0; plane < 2; plane++) {
        float *out = plane == 0 ? out0 : out1;
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
            out[j] = tq_norm_canon(total);
        }
        __syncthreads();
    }
}

/* Queues column_sum_kernel on s (out1 may be NULL); the caller checks cudaGetLastError. */
static inline void launch(const float *partials, int64_t p_count, int64_t cols, float *out0,
                          float *out1, cudaStream_t s) {
    const dim3 block(32, TQ_NORM_GROUP);
    column_sum_kernel<<<(unsigned)((cols + 31) / 32), block, 0, s>>>(partials, p_count, cols, out0,
                                                                     out1);
}

}  // namespace tq_colsum

#endif  // TEQUANT_CUDA_COLUMN_SUMS_CUH_
