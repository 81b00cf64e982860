/* norm_forward.cu: tq_norm_forward on CUDA: LayerNorm / RMSNorm of x [M, K] with, in the same
 * pass, the per-tensor FP8 codes of y (DELAYED / CURRENT scaling), max |y| and mean / rstd.
 *
 * Rule (tequant.h, NUMERICS.md 2 for the cast): every step is an internal_norm.h helper (one RN
 * operation, no FMA); the two row sums follow tequant's order S, scheduled by norm_rows.cuh;
 * codes are cvt8(tq_mul(y, scale)) by the hardware's cvt.rn.satfinite, as quantize_fp8.cu casts
 * (the rule of formats.h's codec, which the CPU reference uses); y_hp is rounded by cvt.rn too
 * (formats.h's rule); amax is fmaxf(|y|) (NaN ignored) per CTA, then one atomicMax on the slot's signed bits
 * (quantize_fp8.cu's history-slot rule). So every output equals csrc/ref/norm_forward_ref.c bit
 * for bit, whatever the launch shape.
 *
 * Two kernels:
 * - fast_kernel (the common case: M > 0, K % 8 == 0, K <= 16384, x's rows 16-byte aligned, y_hp's
 *   too and y_q's 8-byte aligned when given, and the GPU holds one of its CTAs; else the other
 *   kernel runs). A CTA of kCta threads is kCta / kT independent groups of kT threads
 *   (kT = 32 .. 256), each on its own rows (grid-striding): a group's
 *   barriers are named ones (bar.sync 1 + group, kT), so a group waiting on its fold never holds
 *   up the others, and a warp-wide group (kT = 32) has no barrier at all. A thread loads its
 *   kC (4 or 8) whole chunks of the row once (16-byte loads, a warp reading 512 contiguous
 *   bytes), keeps them packed in registers for both sums and the output, and stores 16 bytes of
 *   y_hp and 8 of codes per chunk. gamma (RN(1 + gamma) when zero-centered) and beta are widened
 *   to FP32 once per CTA into shared memory (two planes of float4, conflict-free), so the output
 *   pass reads 4 floats per load and never converts them. No per-element bounds: K % 8 == 0, so
 *   every chunk of the row is whole.
 *   Why the bits are the reference's: (1) the sums: chunk c is thread c mod kT's slot j = c / kT,
 *   whose lane c mod 256 = t + (j mod 256/kT) * kT is accumulator acc[j mod 256/kT]; a thread
 *   visits its slots in increasing j, hence each lane's chunks in increasing c and each chunk's
 *   elements in index order, from +0; lanes without a chunk stay +0, as in the reference; the
 *   fold is group_fold (norm_rows.cuh's scheme: strides >= kT in the thread, down to 32 through
 *   shared memory, then the XOR butterfly). (2) gamma and beta in shared memory are the very
 *   values the reference computes (tq_norm_gamma of the exactly widened element, the widened
 *   beta). (3) LayerNorm without beta adds -0 instead of skipping the add: RN(y + -0) = y for
 *   every y (x + -0 is exact for x != 0, and -0 + -0 = -0, +0 + -0 = +0 under RN), so y keeps
 *   the reference's bits, signed zeros included. (4) fp16 x is widened by cvt.f32.f16, exact for
 *   every finite and infinite half (subnormals too: no .ftz); a NaN may keep another payload than
 *   formats.h's software widening gives, but no output takes it: every output of a NaN element
 *   goes through at least one FP32 add or multiply first (which returns the canonical NaN on
 *   the GPU), mean / rstd / y_hp are canonicalized, amax skips NaN and cvt8 of any NaN is 0x7F.
 * - norm_forward_kernel (everything else: odd K, misaligned or strided-by-odd rows, K > 16384,
 *   M = 0): a CTA of 256 threads works on 256 / kT rows at a time, kT threads per row (the least
 *   of 32, 64, 128, 256 with K <= 64 * kT), grid-striding over rows. A thread keeps its (at most
 *   8) chunks of the row in registers between the passes (16-byte loads when the rows are
 *   aligned, element loads otherwise and for a row's last, partial chunk); rows longer than
 *   16384 elements are read again from memory for each pass (kT = 256).
 * No sync, no allocation.
 * Tests: tests/test_norm_kernels.py (GPU cases: bit-exact against the CPU reference, both kernels).
 */
#include <cuda_runtime.h>

#include "internal_kernels.h"
#include "launch.cuh"
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

constexpr int kThreads = 256;
constexpr int kCached = 8; /* chunks per thread held in registers across the passes */

struct FwdParams {
    const void *x;
    int64_t rows, cols, ld_x, nchunks;
    const void *gamma, *beta;
    int w_dtype, zero_centered, has_beta, rms;
    float eps;
    void *y_hp;
    int64_t ld_y;
    float *mean, *rstd, *amax;
    uint8_t *y_q;
    int64_t ld_q;
    float *scale_inv;
    const float *scale;   /* DELAYED */
    const float *amax_in; /* CURRENT */
    float fmax, amax_eps;
    int quantize, pow2, e5m2; /* quantize: a config was given (y_q may be empty: M = 0) */
    int x_vec, y_vec, q_vec, w_vec; /* 16-byte rows of x, y_hp, gamma / beta; 8-byte rows of y_q */
};

__device__ __forceinline__ float cast_scale(const FwdParams &p) {
    if (!p.quantize) return 1.0f;
    if (p.scale != nullptr) return *p.scale;
    return tq_scale_from_amax(*p.amax_in, p.fmax, p.amax_eps, p.pow2, TQ_FLT_MAX);
}

/* y of chunk c (n valid elements of raw) into the outputs; amax over the valid ones. */
template <typename T>
__device__ __forceinline__ void write_chunk(const FwdParams &p, const Chunk<T> &raw, int64_t row,
                                            int64_t c, int n, float mean, float rstd, float scale,
                                            float &amax) {
    float g[kChunk], b[kChunk] = {}, y[kChunk];
    tq_norm::load_w(g, p.gamma, p.w_dtype, c, n, p.w_vec);
    if (p.has_beta) tq_norm::load_w(b, p.beta, p.w_dtype, c, n, p.w_vec);
#pragma unroll
    for (int e = 0; e < kChunk; e++) {
        const float xhat = tq_norm_xhat(tq_norm::widen(raw.t[e]), mean, rstd, p.rms);
        y[e] = tq_norm_y(xhat, tq_norm_gamma(g[e], p.zero_centered), b[e], p.has_beta);
        if (e < n) amax = tq_amax_step(amax, y[e]);
    }
    if (p.y_hp != nullptr) {
        float out[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++) out[e] = tq_norm_canon(y[e]);
        tq_norm::store_chunk(static_cast<T *>(p.y_hp) + row * p.ld_y, c, out, n, p.y_vec);
    }
    if (p.quantize) {
        float scaled[kChunk];
        uint32_t w[2];
#pragma unroll
        for (int e = 0; e < kChunk; e++) scaled[e] = tq_mul(y[e], scale);
        tq_norm::cvt8x8(scaled, p.e5m2, w);
        uint8_t *dst = p.y_q + row * p.ld_q + (int64_t)kChunk * c;
        if (p.q_vec && n == kChunk) {
            *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int e = 0; e < kChunk; e++)
                if (e < n) dst[e] = (uint8_t)(w[e / 4] >> (8 * (e % 4)));
        }
    }
}

/* The term a row sum adds for v: v itself, v * v (RMSNorm), or RN(v - mean)^2 (LayerNorm's
 * second sum). */
enum Term { kValue, kSquare, kDeviation };

__device__ __forceinline__ float term(float v, Term what, float mean) {
    if (what == kValue) return v;
    const float d = what == kSquare ? v : tq_nsub(v, mean);
    return tq_nmul(d, d);
}

template <typename T, int kT, bool kCache>
__global__ void __launch_bounds__(kThreads) norm_forward_kernel(const FwdParams p) {
    constexpr int kSlots = kLanes / kT, kRows = kThreads / kT, kJ = kCache ? kCached : 1;
    __shared__ float red[2][kThreads]; /* fold scratch, alternate buffers */
    __shared__ float warp_amax[kThreads / 32];
    const int t = threadIdx.x % kT, group = threadIdx.x / kT;
    const T *x = static_cast<const T *>(p.x);
    const float scale = cast_scale(p);
    if (blockIdx.x == 0 && threadIdx.x == 0 && p.quantize) *p.scale_inv = tq_rcp(scale);
    float amax = 0.0f;
    int buf = 0;
    for (int64_t row0 = (int64_t)blockIdx.x * kRows; row0 < p.rows;
         row0 += (int64_t)gridDim.x * kRows) {
        const int64_t row = row0 + group;
        const bool active = row < p.rows; /* idle groups still join every fold */
        const T *xr = x + (active ? row : 0) * p.ld_x;
        Chunk<T> raw[kJ];
        if constexpr (kCache) {
#pragma unroll
            for (int j = 0; j < kJ; j++) {
                const int64_t c = t + (int64_t)j * kT;
                const int n = active ? chunk_len(c, p.cols) : 0;
                if (n > 0) tq_norm::load_chunk(raw[j], xr, c, n, p.x_vec);
            }
        }
        float mean = 0.0f, sum[1];
        const int n_sums = p.rms ? 1 : 2;
        for (int pass = 0; pass < n_sums; pass++) {
            const Term what = p.rms ? kSquare : (pass == 0 ? kValue : kDeviation);
            float acc[1][kSlots];
#pragma unroll
            for (int k = 0; k < kSlots; k++) acc[0][k] = 0.0f;
            if constexpr (kCache) {
#pragma unroll
                for (int j = 0; j < kJ; j++) {
                    const int n = active ? chunk_len(t + (int64_t)j * kT, p.cols) : 0;
#pragma unroll
                    for (int e = 0; e < kChunk; e++)
                        if (e < n)
                            acc[0][j % kSlots] = tq_nadd(acc[0][j % kSlots],
                                                         term(tq_norm::widen(raw[j].t[e]), what, mean));
                }
            } else { /* kT == 256: one lane per thread */
                for (int64_t c = t; active && c < p.nchunks; c += kT) {
                    const int n = chunk_len(c, p.cols);
                    tq_norm::load_chunk(raw[0], xr, c, n, p.x_vec);
#pragma unroll
                    for (int e = 0; e < kChunk; e++)
                        if (e < n)
                            acc[0][0] = tq_nadd(acc[0][0], term(tq_norm::widen(raw[0].t[e]), what, mean));
                }
            }
            tq_norm::fold<kT, 1>(acc, red[buf] + group * kT, t, sum);
            buf ^= 1;
            if (pass == 0 && !p.rms) mean = tq_norm_mean(sum[0], p.cols);
        }
        const float rstd = tq_norm_rstd(sum[0], p.cols, p.eps);
        if (!active) continue;
        if (t == 0) {
            if (p.mean != nullptr) p.mean[row] = tq_norm_canon(mean);
            if (p.rstd != nullptr) p.rstd[row] = tq_norm_canon(rstd);
        }
        if constexpr (kCache) {
#pragma unroll
            for (int j = 0; j < kJ; j++) {
                const int64_t c = t + (int64_t)j * kT;
                const int n = chunk_len(c, p.cols);
                if (n > 0) write_chunk<T>(p, raw[j], row, c, n, mean, rstd, scale, amax);
            }
        } else {
            for (int64_t c = t; c < p.nchunks; c += kT) {
                const int n = chunk_len(c, p.cols);
                tq_norm::load_chunk(raw[0], xr, c, n, p.x_vec);
                write_chunk<T>(p, raw[0], row, c, n, mean, rstd, scale, amax);
            }
        }
    }
    if (p.amax != nullptr) {
        for (int offset = 16; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < kThreads / 32; w++) amax = fmaxf(amax, warp_amax[w]);
            /* Signed compare of the bits, as the reference's slot rule; issued by every CTA
             * (also one that saw no row) so a zero amax still replaces a negative slot. */
            atomicMax(reinterpret_cast<int *>(p.amax), __float_as_int(amax));
        }
    }
}

/* ---- fast_kernel: whole chunks, aligned rows, K <= 16384 (see the header) ------------------ */

constexpr int kFastMaxChunks = 2048; /* K <= 16384 */

/* 8 elements of x (one chunk, kVecs<T> uint4) widened exactly to FP32. */
template <typename T>
constexpr int kVecs = (int)sizeof(T) / 2;

/* FP32: the bits as they are, through a volatile asm so that each pass reads the loaded registers
 * again (else the compiler keeps RN(v - mean) of the variance pass for the output pass: more
 * live registers than the cap, spills). */
__device__ __forceinline__ void widen8(const uint4 (&u)[2], float (&v)[kChunk], const float *) {
    const uint32_t w[8] = {u[0].x, u[0].y, u[0].z, u[0].w, u[1].x, u[1].y, u[1].z, u[1].w};
#pragma unroll
    for (int e = 0; e < kChunk; e++) asm volatile("mov.b32 %0, %1;" : "=f"(v[e]) : "r"(w[e]));
}
/* bf16 is the top half of an FP32: the low element of a word shifted up, the high one masked
 * (tq_bf16_to_f32 of each). In volatile asm so that the compiler widens again in each pass
 * rather than keeping the 64 widened values of a thread live across the passes (spills). */
__device__ __forceinline__ void widen8(const uint4 (&u)[1], float (&v)[kChunk], const Bf16 *) {
    const uint32_t w[4] = {u[0].x, u[0].y, u[0].z, u[0].w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        asm volatile("{\n\tshl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xFFFF0000;\n\t}"
                     : "=f"(v[2 * i]), "=f"(v[2 * i + 1])
                     : "r"(w[i]));
}
/* cvt.f32.f16: exact for every non-NaN half, subnormals included (see the header for NaNs);
 * volatile as for bf16. */
__device__ __forceinline__ void widen8(const uint4 (&u)[1], float (&v)[kChunk], const Half *) {
    const uint32_t w[4] = {u[0].x, u[0].y, u[0].z, u[0].w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        asm volatile("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\t"
            "cvt.f32.f16 %1, hi;\n\t}"
            : "=f"(v[2 * i]), "=f"(v[2 * i + 1])
            : "r"(w[i]));
}

/* Element i of gamma / beta (run-time dtype) widened exactly, as tq_norm_vec_load does. */
__device__ __forceinline__ float load_w1(const void *w, int dtype, int64_t i) {
    if (dtype == TQ_DTYPE_FLOAT32) return static_cast<const float *>(w)[i];
    if (dtype == TQ_DTYPE_BFLOAT16) return tq_norm::widen(static_cast<const Bf16 *>(w)[i]);
    return tq_norm::widen(static_cast<const Half *>(w)[i]);
}

/* Waits for the kT threads of one group (named barrier `id`; kT a multiple of 32). Orders their
 * shared-memory accesses like __syncthreads does for a CTA. */
__device__ __forceinline__ void group_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* S's fold of the 256 lanes over a group of kT threads, returned to every thread of the group:
 * norm_rows.cuh's fold (the same additions of the same pairs in the same order: strides >= kT in
 * the thread, strides kT/2 .. 32 through the group's kT floats of shared memory `red`, strides
 * 16 .. 1 as the XOR butterfly) with the group's own barrier instead of the CTA's. acc[k] is lane
 * t + k * kT. Consecutive calls must alternate between two scratch buffers (the barrier inside a
 * call orders the reads of the call before it ahead of the next call's writes). */
template <int kT>
__device__ __forceinline__ float group_fold(float (&acc)[kLanes / kT], float *red, int t, int bar) {
#pragma unroll
    for (int s = kLanes / 2; s >= kT; s /= 2) {
#pragma unroll
        for (int k = 0; k < s / kT; k++) acc[k] = tq_nadd(acc[k], acc[k + s / kT]);
    }
    float v = acc[0];
    if constexpr (kT > 32) {
        red[t] = v;
        group_sync(bar, kT);
        const int l = t & 31;
        float w[kT / 32]; /* lanes l + 32q */
#pragma unroll
        for (int q = 0; q < kT / 32; q++) w[q] = red[l + 32 * q];
#pragma unroll
        for (int s = kT / 2; s >= 32; s /= 2) {
#pragma unroll
            for (int q = 0; q < s / 32; q++) w[q] = tq_nadd(w[q], w[q + s / 32]);
        }
        v = w[0];
    }
#pragma unroll
    for (int s = 16; s >= 1; s /= 2) v = tq_nadd(v, __shfl_xor_sync(0xffffffffu, v, s));
    return v;
}

/* What the output pass of fast_kernel writes, chosen once per launch: the fused norm's common
 * calls without a run-time test per chunk (E4M3 codes with the history slot's amax: delayed
 * scaling; E4M3 codes alone: current scaling's cast run; amax alone: its first run), else kAny:
 * whatever p asks for. */
enum WriteMode { kAny, kCodesAmax, kCodes, kAmax };

/* y of one whole chunk (raw: its packed x; c: its index) into the outputs, and amax. g, b: the
 * staged gamma / beta; yrow, qrow: the row of y_hp / y_q (only where given). */
template <typename T, bool kRms, int kMode>
__device__ __forceinline__ void fast_write(const FwdParams &p, const uint4 (&raw)[kVecs<T>],
                                           int c, const float4 *g, const float4 *b, int nch,
                                           float mean, float rstd, float scale, T *yrow,
                                           uint2 *qrow, float &amax) {
    constexpr bool kWantAmax = kMode == kAny || kMode == kCodesAmax || kMode == kAmax;
    constexpr bool kWantCodes = kMode == kCodesAmax || kMode == kCodes;
    float v[kChunk], y[kChunk];
    widen8(raw, v, static_cast<const T *>(nullptr));
    const float4 g0 = g[c], g1 = g[nch + c];
    const float gv[kChunk] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    if constexpr (kRms) {
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            y[e] = tq_norm_y(tq_norm_xhat(v[e], 0.0f, rstd, 1), gv[e], 0.0f, 0);
    } else {
        const float4 b0 = b[c], b1 = b[nch + c];
        const float bv[kChunk] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            y[e] = tq_norm_y(tq_norm_xhat(v[e], mean, rstd, 0), gv[e], bv[e], 1);
    }
    if constexpr (kWantAmax) {
#pragma unroll
        for (int e = 0; e < kChunk; e++) amax = tq_amax_step(amax, y[e]);
    }
    if (kMode == kAny && yrow != nullptr) {
        float o[kChunk]; /* tq_norm_canon: NaN -> 0x7FFFFFFF */
#pragma unroll
        for (int e = 0; e < kChunk; e++) o[e] = isnan(y[e]) ? __uint_as_float(0x7FFFFFFFu) : y[e];
        uint4 *dst = reinterpret_cast<uint4 *>(yrow) + kVecs<T> * c;
        if constexpr (kVecs<T> == 1) {
            const T *tag = nullptr;
            dst[0] = make_uint4(
                tq_norm::narrow2(o[0], o[1], tag), tq_norm::narrow2(o[2], o[3], tag),
                tq_norm::narrow2(o[4], o[5], tag), tq_norm::narrow2(o[6], o[7], tag));
        } else {
            dst[0] = make_uint4(__float_as_uint(o[0]), __float_as_uint(o[1]), __float_as_uint(o[2]),
                                __float_as_uint(o[3]));
            dst[1] = make_uint4(__float_as_uint(o[4]), __float_as_uint(o[5]), __float_as_uint(o[6]),
                                __float_as_uint(o[7]));
        }
    }
    if (kWantCodes || (kMode == kAny && qrow != nullptr)) {
        float scaled[kChunk];
        uint32_t w[2];
#pragma unroll
        for (int e = 0; e < kChunk; e++) scaled[e] = tq_mul(y[e], scale);
        tq_norm::cvt8x8(scaled, kMode == kAny && p.e5m2, w);
        qrow[c] = make_uint2(w[0], w[1]);
    }
}

/* The output pass over a thread's chunks of one row. */
template <typename T, int kT, int kC, bool kRms, bool kFull, int kMode>
__device__ __forceinline__ void fast_write_row(const FwdParams &p,
                                               const uint4 (&raw)[kC][kVecs<T>], int t,
                                               const float4 *g, const float4 *b, int nch,
                                               float mean, float rstd, float scale, T *yrow,
                                               uint2 *qrow, float &amax) {
#pragma unroll
    for (int j = 0; j < kC; j++) {
        const int c = t + j * kT;
        if (kFull || c < nch)
            fast_write<T, kRms, kMode>(p, raw[j], c, g, b, nch, mean, rstd, scale, yrow, qrow,
                                       amax);
    }
}

/* kT threads per row, kC chunks per thread, kCta threads per CTA; kFull: every row is exactly
 * kT * kC chunks (no bounds at all). Registers are capped so that 1024 threads fit an SM when
 * the packed row takes at most 32 registers per thread (else 512). */
template <typename T, int kT, int kC, bool kRms, bool kFull, int kCta>
__global__ void __launch_bounds__(kCta, (kC * kVecs<T> <= 8 ? 1024 : 512) / kCta)
    fast_kernel(const FwdParams p) {
    constexpr int kV = kVecs<T>, kSlots = kLanes / kT, kGroups = kCta / kT;
    /* named barriers 1..15, one per group of more than a warp */
    static_assert(kT % 32 == 0 && kT <= kLanes && kGroups >= 1 && (kT == 32 || kGroups <= 15),
                  "layout");
    /* gamma then beta: chunk c's elements 0..3 at [c], 4..7 at [nchunks + c] of each */
    extern __shared__ float4 w_smem[];
    __shared__ float red[2][kCta]; /* fold scratch, alternate buffers, kT floats per group */
    __shared__ float warp_amax[kCta / 32];
    const int nch = kFull ? kT * kC : (int)p.nchunks;
    const float4 *g_sm = w_smem, *b_sm = w_smem + 2 * nch;
    for (int64_t i = threadIdx.x; i < p.cols; i += kCta) {
        const int c = (int)(i / kChunk), e = (int)(i % kChunk);
        const int at = 4 * ((e < 4 ? 0 : nch) + c) + (e & 3);
        reinterpret_cast<float *>(w_smem)[at] =
            tq_norm_gamma(load_w1(p.gamma, p.w_dtype, i), p.zero_centered);
        if constexpr (!kRms)
            reinterpret_cast<float *>(w_smem)[8 * nch + at] =
                p.has_beta ? load_w1(p.beta, p.w_dtype, i) : -0.0f;
    }
    __syncthreads();

    const int t = threadIdx.x % kT, group = threadIdx.x / kT, bar = 1 + group;
    const float scale = cast_scale(p);
    if (blockIdx.x == 0 && threadIdx.x == 0 && p.quantize) *p.scale_inv = tq_rcp(scale);
    const bool codes_only = p.quantize && !p.e5m2 && p.y_hp == nullptr;
    const int mode = codes_only ? (p.amax != nullptr ? kCodesAmax : kCodes)
                     : (!p.quantize && p.y_hp == nullptr && p.amax != nullptr) ? kAmax : kAny;
    float amax = 0.0f;
    int buf = 0;
    for (int64_t row = (int64_t)blockIdx.x * kGroups + group; row < p.rows;
         row += (int64_t)gridDim.x * kGroups) {
        const uint4 *xr =
            reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + row * p.ld_x);
        uint4 raw[kC][kV];
#pragma unroll
        for (int j = 0; j < kC; j++) {
            const int c = t + j * kT;
#pragma unroll
            for (int i = 0; i < kV; i++)
                raw[j][i] = kFull || c < nch ? __ldg(xr + kV * c + i) : make_uint4(0u, 0u, 0u, 0u);
        }
        float acc[kSlots];
#pragma unroll
        for (int k = 0; k < kSlots; k++) acc[k] = 0.0f;
#pragma unroll
        for (int j = 0; j < kC; j++) {
            if (kFull || t + j * kT < nch) {
                float v[kChunk];
                widen8(raw[j], v, static_cast<const T *>(nullptr));
#pragma unroll
                for (int e = 0; e < kChunk; e++)
                    acc[j % kSlots] = tq_nadd(acc[j % kSlots], kRms ? tq_nmul(v[e], v[e]) : v[e]);
            }
        }
        float sum = group_fold<kT>(acc, &red[buf][group * kT], t, bar);
        buf ^= 1;
        float mean = 0.0f;
        if constexpr (!kRms) {
            mean = tq_norm_mean(sum, p.cols);
#pragma unroll
            for (int k = 0; k < kSlots; k++) acc[k] = 0.0f;
#pragma unroll
            for (int j = 0; j < kC; j++) {
                if (kFull || t + j * kT < nch) {
                    float v[kChunk];
                    widen8(raw[j], v, static_cast<const T *>(nullptr));
#pragma unroll
                    for (int e = 0; e < kChunk; e++) {
                        const float d = tq_nsub(v[e], mean);
                        acc[j % kSlots] = tq_nadd(acc[j % kSlots], tq_nmul(d, d));
                    }
                }
            }
            sum = group_fold<kT>(acc, &red[buf][group * kT], t, bar);
            buf ^= 1;
        }
        const float rstd = tq_norm_rstd(sum, p.cols, p.eps);
        if (t == 0) {
            if (p.mean != nullptr) p.mean[row] = tq_norm_canon(mean);
            if (p.rstd != nullptr) p.rstd[row] = tq_norm_canon(rstd);
        }
        T *yrow = p.y_hp != nullptr ? static_cast<T *>(p.y_hp) + row * p.ld_y : nullptr;
        uint2 *qrow = p.quantize ? reinterpret_cast<uint2 *>(p.y_q + row * p.ld_q) : nullptr;
#define TQ_FAST_WRITE_ROW(mode_)                                                                 \
    fast_write_row<T, kT, kC, kRms, kFull, mode_>(p, raw, t, g_sm, b_sm, nch, mean, rstd, scale, \
                                                  yrow, qrow, amax)
        if (mode == kCodesAmax) TQ_FAST_WRITE_ROW(kCodesAmax);
        else if (mode == kCodes) TQ_FAST_WRITE_ROW(kCodes);
        else if (mode == kAmax) TQ_FAST_WRITE_ROW(kAmax);
        else TQ_FAST_WRITE_ROW(kAny);
#undef TQ_FAST_WRITE_ROW
    }
    if (p.amax != nullptr) {
        for (int offset = 16; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < kCta / 32; w++) amax = fmaxf(amax, warp_amax[w]);
            atomicMax(reinterpret_cast<int *>(p.amax), __float_as_int(amax)); /* as above */
        }
    }
}

/* Launches fast_kernel; false (nothing launched, no error left pending) where this GPU cannot
 * hold one of its CTAs (shared memory: 136 KiB for LayerNorm at K = 16384; GPUs that JIT the
 * PTX may have less), and the caller runs the general kernel instead. */
template <typename T, int kT, int kC, bool kRms, bool kFull, int kCta>
bool launch_fast_kernel(const FwdParams &p, int sms, cudaStream_t s) {
    constexpr int kGroups = kCta / kT;
    const auto kernel = fast_kernel<T, kT, kC, kRms, kFull, kCta>;
    /* FP32 gamma (and beta): K floats each, at most 128 KiB; with the static fold scratch past
     * 48 KiB the kernel must opt in to more dynamic memory */
    const size_t smem = (kRms ? 1 : 2) * (size_t)p.cols * sizeof(float);
    if (smem + sizeof(float) * (2 * kCta + kCta / 32) > 48 * 1024
        && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)
               != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    /* one wave of CTAs striding over the rows (each stages gamma once) */
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCta, smem) != cudaSuccess
        || per_sm < 1) {
        (void)cudaGetLastError();
        return false;
    }
    int64_t grid = (p.rows + kGroups - 1) / kGroups;
    const int64_t cap = (int64_t)sms * per_sm;
    if (grid > cap) grid = cap;
    kernel<<<(unsigned)grid, kCta, smem, s>>>(p);
    return true;
}

template <typename T, int kT, int kC, bool kRms, int kCta>
bool launch_fast_as(const FwdParams &p, int sms, cudaStream_t s) {
    if (p.nchunks == (int64_t)kT * kC)
        return launch_fast_kernel<T, kT, kC, kRms, true, kCta>(p, sms, s);
    return launch_fast_kernel<T, kT, kC, kRms, false, kCta>(p, sms, s);
}

/* kT and kC by row length: the fewest threads per row that hold it in kC <= 8 (16-bit) or
 * kC <= 4 (FP32; 8 for K > 8192) chunks of registers. */
template <typename T, bool kRms>
bool launch_fast(const FwdParams &p, int sms, cudaStream_t s) {
    const int64_t n = p.nchunks;
    if (n <= 128) return launch_fast_as<T, 32, 4, kRms, 512>(p, sms, s);
    if constexpr (sizeof(T) == 2) {
        if (n <= 256) return launch_fast_as<T, 32, 8, kRms, 512>(p, sms, s);
        if (n <= 512) return launch_fast_as<T, 64, 8, kRms, 512>(p, sms, s);
        if (n <= 1024) return launch_fast_as<T, 128, 8, kRms, 512>(p, sms, s);
        return launch_fast_as<T, 256, 8, kRms, 1024>(p, sms, s);
    } else {
        if (n <= 256) return launch_fast_as<T, 64, 4, kRms, 512>(p, sms, s);
        if (n <= 512) return launch_fast_as<T, 128, 4, kRms, 512>(p, sms, s);
        if (n <= 1024) return launch_fast_as<T, 256, 4, kRms, 1024>(p, sms, s);
        return launch_fast_as<T, 256, 8, kRms, 512>(p, sms, s);
    }
}

/* The fast kernel takes the call: rows, whole chunks, aligned rows of every matrix given. */
bool fast_fits(const FwdParams &p) {
    return p.rows > 0 && p.cols % kChunk == 0 && p.nchunks <= kFastMaxChunks && p.x_vec &&
           (p.y_hp == nullptr || p.y_vec) && (!p.quantize || p.q_vec);
}

template <typename T, int kT, bool kCache>
void launch_as(const FwdParams &p, int sms, cudaStream_t s) {
    constexpr int kRows = kThreads / kT;
    int64_t grid = (p.rows + kRows - 1) / kRows;
    const int64_t cap = 8LL * sms; /* a full GPU of 256-thread CTAs, each striding over rows */
    if (grid > cap) grid = cap;
    if (grid < 1) grid = 1; /* M = 0: scale_inv and the amax slot still follow the rule */
    norm_forward_kernel<T, kT, kCache><<<(unsigned)grid, kThreads, 0, s>>>(p);
}

template <typename T>
void launch(const FwdParams &p, int sms, cudaStream_t s) {
    const int64_t per_thread = kCached;
    if (p.nchunks <= per_thread * 32) launch_as<T, 32, true>(p, sms, s);
    else if (p.nchunks <= per_thread * 64) launch_as<T, 64, true>(p, sms, s);
    else if (p.nchunks <= per_thread * 128) launch_as<T, 128, true>(p, sms, s);
    else if (p.nchunks <= per_thread * 256) launch_as<T, 256, true>(p, sms, s);
    else launch_as<T, 256, false>(p, sms, s);
}

}  // namespace

extern "C" tq_status tq_norm_forward_cuda(const tq_tensor *x, const tq_norm_forward_args *a,
                                          struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess)
        return cuda_failed("norm forward: making x's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const size_t elem = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    FwdParams p = {};
    p.x = x->data;
    p.rows = x->rows;
    p.cols = x->cols;
    p.ld_x = x->ld;
    p.nchunks = (x->cols + kChunk - 1) / kChunk;
    p.gamma = a->gamma.data;
    p.beta = a->beta.data;
    p.w_dtype = (int)a->gamma.dtype;
    p.zero_centered = (a->flags & TQ_NORM_ZERO_CENTERED_GAMMA) != 0;
    p.has_beta = a->beta.data != nullptr;
    p.rms = a->norm == TQ_NORM_RMSNORM;
    p.eps = a->eps;
    p.y_hp = a->y_hp.data;
    p.ld_y = a->y_hp.ld;
    p.mean = static_cast<float *>(a->mean.data);
    p.rstd = static_cast<float *>(a->rstd.data);
    p.amax = static_cast<float *>(a->amax.data);
    p.x_vec = tq_norm::rows_aligned16(x->data, x->ld, elem);
    p.y_vec = p.y_hp != nullptr && tq_norm::rows_aligned16(p.y_hp, p.ld_y, elem);
    p.w_vec = tq_norm::aligned(p.gamma, 16) && (!p.has_beta || tq_norm::aligned(p.beta, 16));
    if (a->config != nullptr) {
        const tq_quant_config *c = a->config;
        p.quantize = 1;
        p.y_q = static_cast<uint8_t *>(a->y_q.data);
        p.ld_q = a->y_q.ld;
        p.q_vec = tq_norm::aligned(p.y_q, 8) && p.ld_q % 8 == 0;
        p.scale_inv = static_cast<float *>(a->scale_inv.data);
        p.scale = c->scaling == TQ_SCALING_DELAYED ? static_cast<const float *>(a->scale.data) : nullptr;
        p.amax_in = c->scaling == TQ_SCALING_CURRENT ? static_cast<const float *>(a->amax_in.data) : nullptr;
        p.fmax = c->fmax;
        p.amax_eps = c->amax_epsilon;
        p.pow2 = (c->flags & TQ_QUANT_POW2_SCALE) != 0;
        p.e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    }
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x->device);
    bool launched = false;
    if (fast_fits(p)) {
        switch (x->dtype) {
            case TQ_DTYPE_FLOAT32:
                launched = p.rms ? launch_fast<float, true>(p, sms, s)
                                 : launch_fast<float, false>(p, sms, s);
                break;
            case TQ_DTYPE_BFLOAT16:
                launched = p.rms ? launch_fast<Bf16, true>(p, sms, s)
                                 : launch_fast<Bf16, false>(p, sms, s);
                break;
            default:
                launched = p.rms ? launch_fast<Half, true>(p, sms, s)
                                 : launch_fast<Half, false>(p, sms, s);
                break;
        }
    }
    if (!launched) {
        switch (x->dtype) {
            case TQ_DTYPE_FLOAT32: launch<float>(p, sms, s); break;
            case TQ_DTYPE_BFLOAT16: launch<Bf16>(p, sms, s); break;
            default: launch<Half>(p, sms, s); break;
        }
    }
    const cudaError_t err = cudaGetLastError(); /* cleared: must not poison later calls */
    if (err != cudaSuccess) return cuda_failed("norm forward kernel launch", err);
    return TQ_SUCCESS;
}
