/* norm_rows.cuh: what the normalization kernels (norm_forward.cu, norm_backward.cu) share, internal
 * to cuda/: gamma / beta loads, and tequant's row sum S (tequant.h) scheduled over a group
 * of kT threads without changing its order.
 *
 * A row is cut into chunks of 8 elements; chunk c belongs to lane c mod 256. A group of kT threads
 * (kT in 32, 64, 128, 256) works on one row: thread t owns the lanes t + k*kT (k < 256/kT), hence
 * the chunks c with c mod kT == t, which it visits in increasing c, so each lane still adds its
 * elements in index order (one accumulator per owned lane, acc[k]). The halving fold of the 256
 * lanes (for s = 128 ... 1: lane[l] += lane[l + s], l < s) then runs as: strides s >= kT inside
 * each thread (lanes t + k*kT and t + (k + s/kT)*kT are both its own); strides 32 <= s < kT
 * through shared memory, where every warp reads the group's kT values and folds them itself;
 * strides 16 ... 1 as an XOR butterfly, after which every thread of the group holds the sum
 * (lanes l and l ^ s hold the same value after each step, and lane l < s holds lane[l] +
 * lane[l + s] exactly as the fold defines it; IEEE addition is commutative).
 * The reference is tq_norm_sum_ref (csrc/core/internal_norm.h). Tests: tests/test_norm_kernels.py.
 */
#ifndef TEQUANT_CUDA_NORM_ROWS_CUH_
#define TEQUANT_CUDA_NORM_ROWS_CUH_

#include <cuda_runtime.h>

#include "chunks.cuh"
#include "fp_cast.cuh"
#include "internal_norm.h"

namespace tq_norm {

constexpr int kChunk = TQ_NORM_CHUNK;
static_assert(kChunk == tq_chunk::kChunk, "the row sums' chunks are chunks.cuh's");
constexpr int kLanes = TQ_NORM_LANES;

using tq_chunk::Chunk;
using tq_chunk::aligned;
using tq_chunk::chunk_len;
using tq_chunk::load_chunk;
using tq_chunk::rows_aligned16;
using tq_chunk::store_chunk;
using tq_fp::Bf16;
using tq_fp::Half;
using tq_fp::cvt8x8;
using tq_fp::narrow;
using tq_fp::narrow2;
using tq_fp::widen;

/* gamma (or beta), whose dtype is a run-time value (any float dtype, not tied to x's): the chunk's
 * values widened to FP32 (0 past n). vec: the vector's base is 16-byte aligned. */
template <typename W>
__device__ __forceinline__ void load_w_as(float (&out)[kChunk], const void *w, int64_t c, int n,
                                          bool vec) {
    Chunk<W> ch;
    load_chunk(ch, static_cast<const W *>(w), c, n, vec);
#pragma unroll
    for (int e = 0; e < kChunk; e++) out[e] = widen(ch.t[e]);
}

__device__ __forceinline__ void load_w(float (&out)[kChunk], const void *w, int dtype, int64_t c,
                                       int n, bool vec) {
    if (dtype == TQ_DTYPE_FLOAT32) load_w_as<float>(out, w, c, n, vec);
    else if (dtype == TQ_DTYPE_BFLOAT16) load_w_as<Bf16>(out, w, c, n, vec);
    else load_w_as<Half>(out, w, c, n, vec);
}

/* The fold of kN sums at once (the backward folds two). acc[i][k] is thread t's lane t + k*kT of
 * sum i; red is this group's shared scratch of kN * kT floats, used alternately by consecutive
 * calls (the caller passes buffer 0, 1, 0, ...; the __syncthreads inside each call orders the
 * previous call's reads before the next writes), and every thread of the CTA must make the same
 * calls. Returns with out[i] = S of sum i in every thread of the group. t: the thread's index in
 * its group, lane: its index in its warp. */
template <int kT, int kN>
__device__ __forceinline__ void fold(float (&acc)[kN][kLanes / kT], float *red, int t,
                                     float (&out)[kN]) {
#pragma unroll
    for (int s = kLanes / 2; s >= kT; s /= 2) {
#pragma unroll
        for (int k = 0; k < s / kT; k++)
#pragma unroll
            for (int i = 0; i < kN; i++) acc[i][k] = tq_nadd(acc[i][k], acc[i][k + s / kT]);
    }
    float v[kN];
#pragma unroll
    for (int i = 0; i < kN; i++) v[i] = acc[i][0]; /* lane t after the in-thread strides */
    if constexpr (kT > 32) {
#pragma unroll
        for (int i = 0; i < kN; i++) red[i * kT + t] = v[i];
        __syncthreads();
        const int l = t & 31;
        float w[kN][kT / 32]; /* lanes l + 32q of the group */
#pragma unroll
        for (int q = 0; q < kT / 32; q++)
#pragma unroll
            for (int i = 0; i < kN; i++) w[i][q] = red[i * kT + l + 32 * q];
#pragma unroll
        for (int s = kT / 2; s >= 32; s /= 2) {
#pragma unroll
            for (int q = 0; q < s / 32; q++)
#pragma unroll
                for (int i = 0; i < kN; i++) w[i][q] = tq_nadd(w[i][q], w[i][q + s / 32]);
        }
#pragma unroll
        for (int i = 0; i < kN; i++) v[i] = w[i][0];
    }
#pragma unroll
    for (int s = (kT < 32 ? kT : 32) / 2; s >= 1; s /= 2)
#pragma unroll
        for (int i = 0; i < kN; i++) v[i] = tq_nadd(v[i], __shfl_xor_sync(0xffffffffu, v[i], s));
#pragma unroll
    for (int i = 0; i < kN; i++) out[i] = v[i];
}

}  // namespace tq_norm

#endif  // TEQUANT_CUDA_NORM_ROWS_CUH_
