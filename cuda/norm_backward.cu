/* norm_backward.cu: tq_norm_backward on CUDA: dx, dgamma and dbeta of LayerNorm / RMSNorm from
 * the forward's mean and rstd.
 *
 * Rule (tequant.h): every step is an internal_norm.h helper (one RN operation, no FMA); the two
 * row sums (of RN(dyg * xhat) and of dyg) follow tequant's order S, scheduled by norm_rows.cuh;
 * the column sums follow the fixed chunk order: rows in chunks of R(M, K) rows
 * (tq_norm_partial_rows), each chunk's per-column partial adding its rows in order, written to
 * the workspace; then column_sums.cuh's column_sum_kernel sums each column's partials in
 * groups of 32 chunks and the group sums in order. So every output equals
 * csrc/ref/norm_backward_ref.c bit for bit.
 * Layout: one CTA per row chunk, kT threads on one row at a time (K <= 256: 32 and K <= 512: 64,
 * one chunk each; else the least of 64, 128, 256 with K <= 16 * kT, else 256); thread t owns
 * the chunks c = t mod kT and keeps them (at most 4, of x, dy and gamma) in registers, and
 * their columns' partials in shared memory (no sync: nobody else touches them). Rows longer
 * than 8192 elements: the CTA (kT = 256) reads the row again for dx and leaves the partials to
 * column_partial_kernel (a thread per chunk of 8 columns and row chunk, reading x and dy once
 * more), since 2 * K FP32 partials in shared memory would leave one CTA per SM. A CTA loads
 * its next row into registers during the current one; at K 1025..2048 (16-bit, aligned rows)
 * the row after that is copied into shared memory as well (kStaged).
 * No sync, no allocation: the caller's workspace holds the partials.
 * Tests: tests/test_norm_kernels.py (GPU cases: bit-exact against the CPU reference).
 */
#include <cuda_runtime.h>

#include "internal_kernels.h"
#include "launch.cuh"
#include "column_sums.cuh"
#include "norm_rows.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_norm::Bf16;
using tq_norm::Chunk;
using tq_norm::Half;
using tq_norm::chunk_len;
using tq_norm::kChunk;
using tq_norm::kLanes;

constexpr int kCached = 4; /* chunks per thread held in registers across the two passes */

struct BwdParams {
    const void *dy, *x;
    int64_t rows, cols, ld_dy, ld_x, nchunks;
    const void *gamma;
    int w_dtype, zero_centered, rms;
    const float *mean, *rstd;
    void *dx;
    int64_t ld_dx;
    float *partials; /* [plane][p_count][cols]: dgamma's, then dbeta's (LayerNorm) */
    int64_t r_chunk, p_count;
    int planes;      /* partials accumulated: 1 (dgamma) or 2 (and dbeta) */
    int dy_vec, x_vec, dx_vec, w_vec;
};

/* The fused kernel's column partials in shared memory, [plane][e][chunk] (a warp's threads hold
 * consecutive chunks: no bank conflicts), kStride chunks per (plane, e) row: the instance's
 * most chunks (kJ * kT), a compile-time stride, so a thread's addresses are its chunk's base
 * plus constants (with the row's chunk count as the stride, the 64-bit index math of every
 * access made the kernel issue-bound: ncu, H200, 8192 x 4096 bf16, 70% of SM issue, 1.6 TB/s). */
template <int kStride>
struct ColAcc {
    float *base;
    __device__ __forceinline__ float &at(int plane, int c, int e) const {
        return base[(plane * kChunk + e) * kStride + c];
    }
};

/* One chunk's pass 1: the row sums' terms into acc (its lane slot) and, kCols, the column
 * partials. */
template <int kSlots, bool kCols, typename Col>
__device__ __forceinline__ void pass1_chunk(const BwdParams &p, const Col &col,
                                            float (&acc)[2][kSlots], int slot, int64_t c, int n,
                                            const float (&xv)[kChunk], const float (&dyv)[kChunk],
                                            const float (&g)[kChunk], float mean, float rstd) {
#pragma unroll
    for (int e = 0; e < kChunk; e++) {
        if (e >= n) continue;
        const float xhat = tq_norm_xhat(xv[e], mean, rstd, p.rms);
        const float dyg = tq_nmul(dyv[e], g[e]);
        acc[0][slot] = tq_nadd(acc[0][slot], tq_nmul(dyg, xhat));
        acc[1][slot] = tq_nadd(acc[1][slot], dyg);
        if constexpr (kCols) {
            float &pg = col.at(0, (int)c, e);
            pg = tq_nadd(pg, tq_nmul(dyv[e], xhat));
            if (p.planes == 2) {
                float &pb = col.at(1, (int)c, e);
                pb = tq_nadd(pb, dyv[e]);
            }
        }
    }
}

/* One chunk's pass 2: dx. */
template <typename T>
__device__ __forceinline__ void dx_chunk(const BwdParams &p, int64_t row, int64_t c, int n,
                                         const float (&xv)[kChunk], const float (&dyv)[kChunk],
                                         const float (&g)[kChunk], float mean, float rstd,
                                         float c1, float c2) {
    float dx[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; e++) {
        const float xhat = tq_norm_xhat(xv[e], mean, rstd, p.rms);
        dx[e] = tq_norm_canon(tq_norm_dx(tq_nmul(dyv[e], g[e]), xhat, c1, c2, rstd, p.rms));
    }
    tq_norm::store_chunk(static_cast<T *>(p.dx) + row * p.ld_dx, c, dx, n, p.dx_vec);
}

template <typename T>
__device__ __forceinline__ void widen_chunk(const Chunk<T> &ch, float (&v)[kChunk]) {
#pragma unroll
    for (int e = 0; e < kChunk; e++) v[e] = tq_norm::widen(ch.t[e]);
}

template <typename T>
__device__ __forceinline__ void load_row_chunk(const BwdParams &p, int64_t row, int64_t c, int n,
                                               float (&xv)[kChunk], float (&dyv)[kChunk]) {
    Chunk<T> cx, cdy;
    tq_norm::load_chunk(cx, static_cast<const T *>(p.x) + row * p.ld_x, c, n, p.x_vec);
    tq_norm::load_chunk(cdy, static_cast<const T *>(p.dy) + row * p.ld_dy, c, n, p.dy_vec);
    widen_chunk(cx, xv);
    widen_chunk(cdy, dyv);
}

__device__ __forceinline__ void gamma_chunk(const BwdParams &p, int64_t c, int n,
                                            float (&g)[kChunk]) {
    tq_norm::load_w(g, p.gamma, p.w_dtype, c, n, p.w_vec);
#pragma unroll
    for (int e = 0; e < kChunk; e++) g[e] = tq_norm_gamma(g[e], p.zero_centered);
}

/* A row's chunks t + j * kT (j < kJ) of x and dy as loaded (T, not widened: half the registers
 * of FP32 for 16-bit x); chunks past the row are left alone. */
template <typename T, int kJ, int kT>
__device__ __forceinline__ void load_rows(const BwdParams &p, int64_t row, int t,
                                          Chunk<T> (&cx)[kJ], Chunk<T> (&cdy)[kJ]) {
#pragma unroll
    for (int j = 0; j < kJ; j++) {
        const int64_t c = t + (int64_t)j * kT;
        const int n = chunk_len(c, p.cols);
        if (n == 0) continue;
        tq_norm::load_chunk(cx[j], static_cast<const T *>(p.x) + row * p.ld_x, c, n, p.x_vec);
        tq_norm::load_chunk(cdy[j], static_cast<const T *>(p.dy) + row * p.ld_dy, c, n,
                            p.dy_vec);
    }
}

/* kJ > 0 (K <= 8192): the row's kJ chunks a thread in registers and the column partials in
 * shared memory; kJ == 0 (kT = 256): the row read again for dx, and no partials
 * (column_partial_kernel's). */
/* Four CTAs per SM for 256 threads with two chunks each (K 2049..4096): 73 registers fitted
 * three, so 8192 rows (512 row chunks) ran as a full wave and a third of one (H200: 129-139 us
 * at 8192 x 4096, 100 us in one wave at 64 registers with 16 bytes of spills). Two with four
 * chunks each (K 4097..8192): at 142-147 registers one fitted (H200, bf16 8192 x 8192: RMSNorm
 * 320 -> 211 us, LayerNorm 340 -> 233 at 126 registers, no spills). Sixteen and eight for the
 * 32- and 64-thread instances (K <= 512, 513..1024; row chunks of 4 rows, 2048 CTAs for 8192
 * rows): at 135-137 registers they fitted 15 and 7, a second and a third wave (bf16 8192 rows,
 * H200: RMSNorm K = 1024 49.4 -> 33.2 us, K = 768 46.9 -> 30.7, K = 512 28.2 -> 27.1 at 92
 * and 114 registers, no spills). */
template <typename T, int kT, int kJ, bool kStaged>
__global__ void __launch_bounds__(kT, kT == 32 ? 16 : kT == 64 ? 8 : kT == 128 ? 1
                                      : kJ == 2 ? 4 : kJ == 4 ? 2 : 1)
    norm_backward_kernel(const BwdParams p) {
    /* A CTA walks its rows one after another, and a row's loads would wait on the previous
     * row's fold and dx: load latency, not bytes, bounded the kernel (H200: 8192x512 LayerNorm
     * 53.6 us against torch's 38; 8192x4096 170 us against torch's 119). So the next row's x
     * and dy are loaded, as 16-bit codes where x is 16-bit, before this row's fold and dx. */
    constexpr bool kCache = kJ > 0;
    constexpr bool kPrefetch = kCache && (sizeof(T) == 2 || kJ <= 2);
    constexpr int kSlots = kLanes / kT, kR = kCache ? kJ : 1;
    static_assert(!kStaged || (kPrefetch && sizeof(T) == 2), "staged: 16-byte chunks, prefetched");
    extern __shared__ float acc_shared[];
    __shared__ float red[2][2 * kT]; /* fold scratch, alternate buffers */
    const int t = threadIdx.x;
    const int64_t chunk_p = blockIdx.x;
    const int64_t r_begin = chunk_p * p.r_chunk;
    const int64_t r_end = r_begin + p.r_chunk < p.rows ? r_begin + p.r_chunk : p.rows;
    constexpr int kStride = kCache ? kJ * kT : 1;
    const ColAcc<kStride> col = {acc_shared};
    float g[kR][kChunk];
    if constexpr (kCache) {
#pragma unroll
        for (int j = 0; j < kJ; j++) {
            const int64_t c = t + (int64_t)j * kT;
            const int n = chunk_len(c, p.cols);
            if (n == 0) continue;
            gamma_chunk(p, c, n, g[j]);
            for (int plane = 0; plane < p.planes; plane++)
                for (int e = 0; e < n; e++) col.at(plane, (int)c, e) = 0.0f;
        }
    }
    /* The 32- and 64-thread instances (K <= 1024): row r + 2's x and dy into L2 as row r
     * starts (one bulk request each, by two threads), so the loads of row r + 1 that follow
     * this row's first pass find them there (H200, bf16, 8192 rows: K = 512 27.5 -> 26.4 us,
     * K = 1024 33.7 -> 32.8; bits unchanged). The wider instances lost 2-7% with it (K = 4096
     * 101.6 -> 104.2 us, K = 16384 328 -> 354: NOTES.md), so they do not ask. */
    const auto ask = [&](int64_t r) {
        if (kT > 64 || r >= r_end || !p.x_vec || !p.dy_vec) return;
        const int64_t bytes = p.cols * (int64_t)sizeof(T);
        if (t == 0) tq_chunk::l2_prefetch(static_cast<const T *>(p.x) + r * p.ld_x, bytes);
        if (t == kT - 1) tq_chunk::l2_prefetch(static_cast<const T *>(p.dy) + r * p.ld_dy, bytes);
    };
    ask(r_begin + 1);
    /* kStaged (the 128-thread instance, K 1025..2048, on 16-bit rows whose chunks are all whole
     * and 16-byte aligned): row r + 2's chunks are copied into this thread's slots of shared
     * memory (past the partials) once row r + 1's have been read out of them, after row r's
     * first pass; so a row's loads have a whole row's work to arrive in, where the registers'
     * prefetch alone gave them this row's fold and dx (H200, bf16, 8192 x 2048: RMSNorm 60.5 ->
     * 56.0 us, LayerNorm 65.8 -> 60.8; bits unchanged). The 256-thread instances lost 1.5-6%
     * with it (K = 4096 RMSNorm 101.4 -> 107.2 us: NOTES.md), so they keep the registers'
     * prefetch alone. */
    uint4 *const stage = reinterpret_cast<uint4 *>(acc_shared + p.planes * kChunk * kStride);
    const auto stage_row = [&](int64_t r) {
#pragma unroll
        for (int j = 0; j < kR; j++) {
            const int64_t c = t + (int64_t)j * kT;
            if (c >= p.nchunks) continue;
            tq_chunk::copy16_async(stage + j * kT + t, static_cast<const T *>(p.x) + r * p.ld_x + kChunk * c);
            tq_chunk::copy16_async(stage + (kR + j) * kT + t,
                                   static_cast<const T *>(p.dy) + r * p.ld_dy + kChunk * c);
        }
        tq_chunk::copies_commit();
    };
    int buf = 0;
    Chunk<T> cx[kR], cdy[kR];                                  /* this row's chunks */
    Chunk<T> nx[kPrefetch ? kR : 1], ndy[kPrefetch ? kR : 1];  /* the next row's */
    if constexpr (kPrefetch) {
        if (r_begin < r_end) load_rows<T, kR, kT>(p, r_begin, t, nx, ndy);
    }
    if constexpr (kStaged) {
        if (r_begin + 1 < r_end) stage_row(r_begin + 1);
    }
    for (int64_t row = r_begin; row < r_end; row++) {
        ask(row + 2);
        const float mean = p.rms ? 0.0f : p.mean[row], rstd = p.rstd[row];
        float acc[2][kSlots];
#pragma unroll
        for (int k = 0; k < kSlots; k++) acc[0][k] = acc[1][k] = 0.0f;
        if constexpr (kPrefetch) {
#pragma unroll
            for (int j = 0; j < kR; j++) cx[j] = nx[j], cdy[j] = ndy[j];
        } else if constexpr (kCache) {
            load_rows<T, kR, kT>(p, row, t, cx, cdy);
        }
        if constexpr (kCache) {
#pragma unroll
            for (int j = 0; j < kJ; j++) {
                const int64_t c = t + (int64_t)j * kT;
                const int n = chunk_len(c, p.cols);
                if (n == 0) continue;
                float xv[kChunk], dyv[kChunk];
                widen_chunk(cx[j], xv);
                widen_chunk(cdy[j], dyv);
                pass1_chunk<kSlots, true>(p, col, acc, j % kSlots, c, n, xv, dyv, g[j], mean,
                                          rstd);
            }
            if constexpr (kStaged) {
                if (row + 1 < r_end) {
                    tq_chunk::copies_wait();
#pragma unroll
                    for (int j = 0; j < kR; j++) {
                        if (t + (int64_t)j * kT >= p.nchunks) continue;
                        nx[j].u[0] = stage[j * kT + t];
                        ndy[j].u[0] = stage[(kR + j) * kT + t];
                    }
                    if (row + 2 < r_end) stage_row(row + 2);
                }
            } else if constexpr (kPrefetch) {
                if (row + 1 < r_end) load_rows<T, kR, kT>(p, row + 1, t, nx, ndy);
            }
        } else { /* kT == 256: one lane per thread */
            for (int64_t c = t; c < p.nchunks; c += kT) {
                const int n = chunk_len(c, p.cols);
                float xv[kChunk], dyv[kChunk];
                gamma_chunk(p, c, n, g[0]);
                load_row_chunk<T>(p, row, c, n, xv, dyv);
                pass1_chunk<kSlots, false>(p, col, acc, 0, c, n, xv, dyv, g[0], mean, rstd);
            }
        }
        float sums[2];
        tq_norm::fold<kT, 2>(acc, red[buf], t, sums);
        buf ^= 1;
        const float c1 = tq_norm_mean(sums[0], p.cols);
        const float c2 = p.rms ? 0.0f : tq_norm_mean(sums[1], p.cols);
        if constexpr (kCache) {
#pragma unroll
            for (int j = 0; j < kJ; j++) {
                const int64_t c = t + (int64_t)j * kT;
                const int n = chunk_len(c, p.cols);
                if (n == 0) continue;
                float xv[kChunk], dyv[kChunk];
                widen_chunk(cx[j], xv);
                widen_chunk(cdy[j], dyv);
                dx_chunk<T>(p, row, c, n, xv, dyv, g[j], mean, rstd, c1, c2);
            }
        } else {
            for (int64_t c = t; c < p.nchunks; c += kT) {
                const int n = chunk_len(c, p.cols);
                float xv[kChunk], dyv[kChunk];
                gamma_chunk(p, c, n, g[0]);
                load_row_chunk<T>(p, row, c, n, xv, dyv);
                dx_chunk<T>(p, row, c, n, xv, dyv, g[0], mean, rstd, c1, c2);
            }
        }
    }
    if constexpr (kCache) { /* this thread's columns only: no sync needed */
#pragma unroll
        for (int j = 0; j < kJ; j++) {
            const int64_t c = t + (int64_t)j * kT;
            const int n = chunk_len(c, p.cols);
            for (int plane = 0; plane < p.planes; plane++)
                for (int e = 0; e < n; e++)
                    p.partials[(plane * p.p_count + chunk_p) * p.cols + kChunk * c + e] =
                        col.at(plane, (int)c, e);
        }
    }
}

/* The partials of long rows (K > 8192), in the fused kernel's order: thread = one chunk of 8
 * columns of one row chunk (blockIdx.y), adding the chunk's rows in order. */
template <typename T>
__global__ void __launch_bounds__(256) column_partial_kernel(const BwdParams p) {
    const int64_t c = (int64_t)blockIdx.x * 256 + threadIdx.x;
    const int64_t chunk_p = blockIdx.y;
    const int n = chunk_len(c, p.cols);
    if (n == 0) return;
    const int64_t r_begin = chunk_p * p.r_chunk;
    const int64_t r_end = r_begin + p.r_chunk < p.rows ? r_begin + p.r_chunk : p.rows;
    float pg[kChunk], pb[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; e++) pg[e] = pb[e] = 0.0f;
#pragma unroll 4
    for (int64_t row = r_begin; row < r_end; row++) {
        const float mean = p.rms ? 0.0f : p.mean[row], rstd = p.rstd[row];
        float xv[kChunk], dyv[kChunk];
        load_row_chunk<T>(p, row, c, n, xv, dyv);
#pragma unroll
        for (int e = 0; e < kChunk; e++) {
            pg[e] = tq_nadd(pg[e], tq_nmul(dyv[e], tq_norm_xhat(xv[e], mean, rstd, p.rms)));
            pb[e] = tq_nadd(pb[e], dyv[e]);
        }
    }
    float *out = p.partials + chunk_p * p.cols + kChunk * c;
    for (int e = 0; e < n; e++) out[e] = pg[e];
    if (p.planes == 2)
        for (int e = 0; e < n; e++) out[p.p_count * p.cols + e] = pb[e];
}

template <typename T, int kT, int kJ, bool kStaged = false>
cudaError_t launch_as(const BwdParams &p, cudaStream_t s) {
    constexpr bool kCache = kJ > 0;
    /* the partials in shared memory: at most 2 * 8192 floats (64 KiB), then kStaged's slots
     * (x and dy: 2 * kJ * kT * 16 bytes); with the static fold scratch (4 * kT floats) past 48
     * KiB the kernel must opt in to more dynamic memory */
    const size_t smem = (kCache ? (size_t)p.planes * kChunk * kJ * kT * sizeof(float) : 0)
                        + (kStaged ? 2 * (size_t)kJ * kT * sizeof(uint4) : 0);
    if (smem + 4 * kT * sizeof(float) > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(norm_backward_kernel<T, kT, kJ, kStaged>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     (int)smem);
        if (err != cudaSuccess) return err;
    }
    norm_backward_kernel<T, kT, kJ, kStaged><<<(unsigned)p.p_count, kT, smem, s>>>(p);
    cudaError_t err = cudaGetLastError(); /* cleared: a failure must not poison later calls */
    if (err == cudaSuccess && !kCache) {
        const dim3 grid((unsigned)((p.nchunks + 255) / 256), (unsigned)p.p_count);
        column_partial_kernel<T><<<grid, 256, 0, s>>>(p);
        err = cudaGetLastError();
    }
    return err;
}

/* Two chunks per thread where 256 threads allow it (K <= 4096), else up to kCached: a CTA walks
 * its rows one after another, so the threads in flight, not the bytes, bound the kernel; with
 * four chunks per thread at K = 4096 (128 threads) it ran at 0.84 TB/s on an H100 (8192 rows),
 * 1.47x torch's backward. Rows of up to 512 elements take one chunk per thread (32 or 64
 * threads): H200, bf16, 8192 rows, us per call against two chunks on 32 threads: LayerNorm
 * K = 512 21.0 -> 15.5, RMSNorm 19.0 -> 13.7, K = 256 13.3 -> 11.9; 16384 x 512 36.8 -> 27.7
 * (at K = 1024 one chunk on 128 threads lost: 26.2 -> 32.4, so two on 64 stay). A thread keeps
 * exactly the chunks it owns (kJ), so no registers sit idle. The thread count does not change
 * the bits: chunk c is lane c mod 256 of the order S whatever thread holds it. */
template <typename T>
cudaError_t launch(const BwdParams &p, cudaStream_t s) {
    const bool staged = sizeof(T) == 2 && p.x_vec && p.dy_vec && p.cols % kChunk == 0;
    if (p.nchunks <= 32) return launch_as<T, 32, 1>(p, s);
    if (p.nchunks <= 64) return launch_as<T, 64, 1>(p, s);
    if (p.nchunks <= 2 * 64) return launch_as<T, 64, 2>(p, s);
    if constexpr (sizeof(T) == 2) {
        if (staged && p.nchunks <= 2 * 128) return launch_as<T, 128, 2, true>(p, s);
    }
    if (p.nchunks <= 2 * 128) return launch_as<T, 128, 2>(p, s);
    if (p.nchunks <= 2 * 256) return launch_as<T, 256, 2>(p, s);
    if (p.nchunks <= kCached * 256) return launch_as<T, 256, kCached>(p, s);
    return launch_as<T, 256, 0>(p, s);
}

}  // namespace

extern "C" tq_status tq_norm_backward_cuda(const tq_tensor *dy, const tq_tensor *x,
                                           const tq_norm_backward_args *a,
                                           struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess)
        return cuda_failed("norm backward: making x's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const size_t elem = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    BwdParams p = {};
    p.dy = dy->data;
    p.x = x->data;
    p.rows = x->rows;
    p.cols = x->cols;
    p.ld_dy = dy->ld;
    p.ld_x = x->ld;
    p.nchunks = (x->cols + kChunk - 1) / kChunk;
    p.gamma = a->gamma.data;
    p.w_dtype = (int)a->gamma.dtype;
    p.zero_centered = (a->flags & TQ_NORM_ZERO_CENTERED_GAMMA) != 0;
    p.rms = a->norm == TQ_NORM_RMSNORM;
    p.mean = static_cast<const float *>(a->mean.data);
    p.rstd = static_cast<const float *>(a->rstd.data);
    p.dx = a->dx.data;
    p.ld_dx = a->dx.ld;
    p.partials = static_cast<float *>(a->workspace.data);
    p.r_chunk = tq_norm_partial_rows(x->rows, x->cols);
    p.p_count = x->rows == 0 ? 0 : (x->rows + p.r_chunk - 1) / p.r_chunk;
    p.planes = a->dbeta.data != nullptr ? 2 : 1;
    p.dy_vec = tq_norm::rows_aligned16(dy->data, dy->ld, elem);
    p.x_vec = tq_norm::rows_aligned16(x->data, x->ld, elem);
    p.dx_vec = tq_norm::rows_aligned16(p.dx, p.ld_dx, elem);
    p.w_vec = tq_norm::aligned(p.gamma, 16);
    if (p.p_count > 0) {
        cudaError_t err;
        switch (x->dtype) {
            case TQ_DTYPE_FLOAT32: err = launch<float>(p, s); break;
            case TQ_DTYPE_BFLOAT16: err = launch<Bf16>(p, s); break;
            default: err = launch<Half>(p, s); break;
        }
        if (err != cudaSuccess) return cuda_failed("norm backward kernel launch", err);
    }
    tq_colsum::launch(p.partials, p.p_count, p.cols, a->dgamma.data, a->dbeta.data,
                      a->dgamma.dtype, s);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_failed("norm backward column-sum kernel launch", err);
    return TQ_SUCCESS;
}
