/* chunks.cuh: chunks of 8 consecutive elements of a row, the unit the row-wise kernels of cuda/
 * (norm_forward.cu, norm_backward.cu, act_forward.cu, act_backward.cu) load, convert and store,
 * internal to cuda/: 16-byte vector accesses where the row allows them, element accesses for a
 * misaligned row or a row's last, partial chunk. Stores round with fp_cast.cuh's narrowing.
 * Also the cp.async copies into shared memory that norm_backward.cu and quantize_nvfp4.cu issue.
 * Tests: tests/test_norm_kernels.py, tests/test_act_kernels.py (GPU cases, every layout).
 */
#ifndef TEQUANT_CUDA_CHUNKS_CUH_
#define TEQUANT_CUDA_CHUNKS_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp_cast.cuh"

namespace tq_chunk {

constexpr int kChunk = 8;

using tq_fp::narrow;
using tq_fp::narrow2;

/* One chunk of 8 elements in registers: 16 bytes of bf16 / fp16, 32 bytes of fp32. */
template <typename T>
union Chunk {
    uint4 u[sizeof(T) / 2];
    T t[kChunk];
};

/* The n <= 8 valid elements of chunk c of `row` (the rest zero): 16-byte loads when vec (the
 * row's base 16-byte aligned) and the chunk is whole, else element loads. */
template <typename T>
__device__ __forceinline__ void load_chunk(Chunk<T> &ch, const T *__restrict__ row, int64_t c,
                                           int n, bool vec) {
    const T *p = row + (int64_t)kChunk * c;
    if (vec && n == kChunk) {
#pragma unroll
        for (int i = 0; i < (int)(sizeof(T) / 2); i++)
            ch.u[i] = __ldg(reinterpret_cast<const uint4 *>(p) + i);
    } else {
#pragma unroll
        for (int e = 0; e < kChunk; e++) ch.t[e] = e < n ? p[e] : T{0};
    }
}

/* The 8 values of chunk c rounded to T (element e < n only). */
template <typename T>
__device__ __forceinline__ void store_chunk(T *__restrict__ row, int64_t c,
                                            const float (&v)[kChunk], int n, bool vec) {
    Chunk<T> ch;
    if constexpr (sizeof(T) == 2) { /* RNE by cvt.rn (fp_cast.cuh: formats.h's rule) */
        const T *tag = nullptr;
        ch.u[0] = make_uint4(narrow2(v[0], v[1], tag), narrow2(v[2], v[3], tag),
                             narrow2(v[4], v[5], tag), narrow2(v[6], v[7], tag));
    } else {
#pragma unroll
        for (int e = 0; e < kChunk; e++) narrow(v[e], &ch.t[e]);
    }
    T *p = row + (int64_t)kChunk * c;
    if (vec && n == kChunk) {
#pragma unroll
        for (int i = 0; i < (int)(sizeof(T) / 2); i++) reinterpret_cast<uint4 *>(p)[i] = ch.u[i];
    } else {
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            if (e < n) p[e] = ch.t[e];
    }
}

/* Valid elements of chunk c of a row of k elements (0 when c is past the row). */
__device__ __forceinline__ int chunk_len(int64_t c, int64_t k) {
    const int64_t left = k - (int64_t)kChunk * c;
    return left <= 0 ? 0 : (left >= kChunk ? kChunk : (int)left);
}

/* Grid-striding over rows x nchunks items as (row, chunk) pairs, item i = row * nchunks + chunk,
 * without a 64-bit division per step (one at the start): `for (Walk w(i0, stride, nchunks);
 * w.row < rows; w.next())`. nchunks > 0. */
struct Walk {
    int64_t row, chunk, d_row, d_chunk, nchunks;
    __device__ __forceinline__ Walk(int64_t start, int64_t stride, int64_t n)
        : row(start / n), chunk(start % n), d_row(stride / n), d_chunk(stride % n), nchunks(n) {}
    __device__ __forceinline__ void next() {
        row += d_row;
        chunk += d_chunk;
        if (chunk >= nchunks) {
            chunk -= nchunks;
            row++;
        }
    }
};

inline bool aligned(const void *p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (uintptr_t)(bytes - 1)) == 0;
}

/* A matrix's rows all start 16-byte aligned. */
inline bool rows_aligned16(const void *p, int64_t ld, size_t elem) {
    return aligned(p, 16) && ((uint64_t)ld * elem) % 16 == 0;
}

/* Asynchronous copies of 16 bytes from global to shared memory (cp.async.cg: L2 only), for a
 * thread that later reads back what it copied itself: commit its copies as a group, then wait
 * for every group before reading (no barrier: no other thread reads them). Both addresses
 * 16-byte aligned. */
__device__ __forceinline__ void copy16_async(void *smem_dst, const void *src) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
/* The same copy where the source may lie outside the tensor: valid false writes 16 zero bytes
 * and reads nothing (src_size 0; src must still be a valid address form). */
__device__ __forceinline__ void copy16_async_or_zeros(void *smem_dst, const void *src, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

/* A hint, no effect on any value: bytes [src, src + bytes) of global memory into L2 as one bulk
 * request (sm_90's cp.async.bulk.prefetch; src 16-byte aligned, bytes rounded down to 16), for
 * loops whose next step's loads would otherwise wait on DRAM (norm_backward.cu). */
__device__ __forceinline__ void l2_prefetch(const void *src, int64_t bytes) {
    const uint32_t n = (uint32_t)(bytes & ~(int64_t)15);
    if (n > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(n) : "memory");
}

}  // namespace tq_chunk

#endif  // TEQUANT_CUDA_CHUNKS_CUH_
