/* fp8_cast_tile.cuh: the per-tensor FP8 cast's 128x128 tile (its parameters, loads, amax, cast
 * of both directions, and the dbias column partials of current scaling's one-launch kernel),
 * internal to cuda/: quantize_fp8.cu's kernels are built from it. The rule is quantize_fp8.cu's
 * header comment.
 * Tests: tests/test_quantize_fp8.py, tests/test_dbias_fused.py (GPU cases: bit-exact against the
 * CPU references).
 */
#ifndef TEQUANT_CUDA_FP8_CAST_TILE_CUH_
#define TEQUANT_CUDA_FP8_CAST_TILE_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp_cast.cuh"
#include "tile_transpose.cuh"
#include "tequant/formats.h"

namespace tq_fp8cast {

constexpr int kTile = 128;    /* a CTA's tile of x: kTile rows x kTile cols */
constexpr int kThreads = 256; /* 8 warps; each thread owns 4 row segments of 16 elements */
constexpr int kIters = kTile * kTile / 16 / kThreads;

using tq_fp::Bf16;
using tq_fp::Half;
using tq_fp::cvt8x2;
using tq_fp::widen;

template <typename T>
union Vec16 { /* 16 bytes of x: 4 floats or 8 bf16 / fp16 */
    uint4 u;
    T t[16 / sizeof(T)];
};

struct CastParams {
    const void *x;
    int64_t rows, cols, ld;
    uint8_t *data;         /* [rows, cols] rowwise codes, or NULL */
    uint8_t *data_t;       /* [cols, rows] columnwise codes, or NULL */
    const float *scale;    /* DELAYED: the scale to cast with */
    const float *amax_in;  /* CURRENT: max|x| from the amax pass, or the caller's given amax */
    float *amax_copy;      /* CURRENT with a given amax: q's amax, set to it by CTA 0 */
    float *amax_out;       /* DELAYED: the history slot to max-accumulate into */
    float *scale_inv;
    float fmax, eps;
    int pow2;
    int64_t tiles_k;       /* tiles along cols */
    float *partials;       /* CURRENT one launch with dbias: [ceil(rows / R)][cols] */
    float *cta_max;        /* ... and its CTAs' maxima, [gridDim.x] (the workspace's tail) */
    void *dbias;           /* ... and the column sums it finishes, [cols] of dbias_dtype */
    tq_dtype dbias_dtype;
    int r_shift;           /* log2 R, R = R(rows, cols) of fused.h's column order, 4 .. kTile */
    int x_vec_ok;          /* x's base and row pitch allow 16-byte loads */
    int data_vec_ok;       /* rowwise rows allow kVec-byte stores */
    int data_t_vec_ok;     /* columnwise rows allow 16-byte stores */
};

__device__ __forceinline__ float cast_scale(const CastParams &p) {
    if (p.scale != nullptr) return *p.scale;
    return tq_scale_from_amax(*p.amax_in, p.fmax, p.eps, p.pow2, TQ_FLT_MAX);
}

/* Rowwise store of n <= 8 codes packed little-endian in `codes` at row-major position dst. */
template <int kN>
__device__ __forceinline__ void store_codes(uint8_t *dst, const uint32_t (&codes)[kN / 4],
                                            int valid, bool vec_ok) {
    if (vec_ok && valid >= kN) {
        if constexpr (kN == 8) *reinterpret_cast<uint2 *>(dst) = make_uint2(codes[0], codes[1]);
        else *reinterpret_cast<uint32_t *>(dst) = codes[0];
        return;
    }
#pragma unroll
    for (int e = 0; e < kN; e++) /* constant indices keep codes in registers */
        if (e < valid) dst[e] = (uint8_t)(codes[e / 4] >> (8 * (e % 4)));
}

/* One CTA = one 128x128 tile of x. Thread t owns rows 4*(t/8) + it (it < 4) and, in each, the
 * vectors v*8 + t%8 (v < 16/kVec) of kVec elements: a warp's load instruction covers 4 whole
 * 128-column rows (coalesced). Its 4 consecutive rows make 4x4 byte blocks that a register
 * transpose turns into 32-bit words of the transposed tile. That tile, [k][m] bytes in shared
 * memory, has its 16-byte chunks of m XOR-swizzled by (k/kVec)%8 = t%8, so a warp's word stores
 * hit 32 different banks and each row is still 8 whole chunks for the 16-byte read-back. */
template <typename T>
using TileRegs = Vec16<T>[kIters][16 / (16 / sizeof(T))]; /* a thread's part of a tile */

/* A thread's loaded tile into and out of its CTA's shared stash: vector i of every thread is the
 * 16 bytes at stash[i * kThreads + thread], so a warp's 32 accesses are 512 contiguous bytes (no
 * bank conflict). Each thread reads back only what it wrote: no barrier between. Current
 * scaling's cooperative kernels keep a CTA's first tile there across their grid barrier when
 * the CTA has more than one (quantize_fp8.cu, quantize_fp8_pair.cu): one tile fewer loaded twice. */
template <typename T>
constexpr int kStashBytes = (int)sizeof(TileRegs<T>) * kThreads;

template <typename T>
__device__ __forceinline__ void stash_tile(const TileRegs<T> &raw, uint4 *stash) {
    constexpr int kNV = (int)sizeof(T); /* vectors per row segment: 16 / kVec */
#pragma unroll
    for (int it = 0; it < kIters; it++)
#pragma unroll
        for (int v = 0; v < kNV; v++) stash[(it * kNV + v) * kThreads + threadIdx.x] = raw[it][v].u;
}

template <typename T>
__device__ __forceinline__ void unstash_tile(const uint4 *stash, TileRegs<T> &raw) {
    constexpr int kNV = (int)sizeof(T);
#pragma unroll
    for (int it = 0; it < kIters; it++)
#pragma unroll
        for (int v = 0; v < kNV; v++) raw[it][v].u = stash[(it * kNV + v) * kThreads + threadIdx.x];
}

/* The tile's loads, all issued before any use: 4 x 16 elements in flight per thread; elements
 * past x's edge load as 0 (no code is stored for them, and 0 leaves a max unchanged). */
template <typename T, bool kFull>
__device__ __forceinline__ void load_tile(const CastParams &p, int64_t m0, int64_t k0,
                                          TileRegs<T> &raw) {
    constexpr int kVec = 16 / sizeof(T), kNV = 16 / kVec;
    const int lane8 = threadIdx.x & 7, row8 = threadIdx.x >> 3;
    const T *x = static_cast<const T *>(p.x);
#pragma unroll
    for (int it = 0; it < kIters; it++) {
        const int64_t gr = m0 + 4 * row8 + it;
#pragma unroll
        for (int v = 0; v < kNV; v++) {
            const int64_t gc = k0 + (v * 8 + lane8) * kVec;
            if (kFull || (p.x_vec_ok && gr < p.rows && gc + kVec <= p.cols)) {
                raw[it][v].u = __ldg(reinterpret_cast<const uint4 *>(x + gr * p.ld + gc));
            } else {
#pragma unroll
                for (int e = 0; e < kVec; e++)
                    raw[it][v].t[e] = (gr < p.rows && gc + e < p.cols) ? x[gr * p.ld + gc + e] : T{0};
            }
        }
    }
}

/* max(a, |v|) over a thread's loaded elements: fmaxf drops NaN and fabsf makes -0 +0, the rule
 * of tq_amax_step. */
template <typename T>
__device__ __forceinline__ float regs_amax(const TileRegs<T> &raw, float a) {
    constexpr int kVec = 16 / sizeof(T), kNV = 16 / kVec;
#pragma unroll
    for (int it = 0; it < kIters; it++)
#pragma unroll
        for (int v = 0; v < kNV; v++)
#pragma unroll
            for (int e = 0; e < kVec; e++) a = fmaxf(a, fabsf(widen(raw[it][v].t[e])));
    return a;
}

/* bf16: the same maximum on packed pairs, widened once at the end: |v| by clearing the sign
 * bits, then max.bf16x2, which returns the other operand where one is NaN (tq_amax_step's
 * rule; the running maxima start at +0 and so are never NaN). Every bf16 widens exactly, so
 * the result is the element-wise one's; half its instructions (current scaling's first phase
 * widened every element once for the amax and again for the cast: docs/results/NOTES.md,
 * thirty-second session). Four running maxima, one per word of a vector, keep the dependent
 * chain short. */
template <>
__device__ __forceinline__ float regs_amax<Bf16>(const TileRegs<Bf16> &raw, float a) {
    uint32_t m[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int it = 0; it < kIters; it++)
#pragma unroll
        for (int v = 0; v < 2; v++) {
            const uint32_t w[4] = {raw[it][v].u.x, raw[it][v].u.y, raw[it][v].u.z, raw[it][v].u.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
                asm("max.bf16x2 %0, %0, %1;" : "+r"(m[i]) : "r"(w[i] & 0x7FFF7FFFu));
        }
    asm("max.bf16x2 %0, %0, %1;" : "+r"(m[0]) : "r"(m[1]));
    asm("max.bf16x2 %0, %0, %1;" : "+r"(m[2]) : "r"(m[3]));
    asm("max.bf16x2 %0, %0, %1;" : "+r"(m[0]) : "r"(m[2]));
    return fmaxf(a, fmaxf(__uint_as_float(m[0] << 16), __uint_as_float(m[0] & 0xFFFF0000u)));
}

/* The partials of vector kV of the thread's rows (columns (kV * 8 + lane8) * kVec ..); kV is a
 * template argument so that raw is indexed by constants (a loop over the vectors around the
 * runtime loops below was not unrolled, which put raw on the stack). */
template <typename T, int kV>
__device__ __forceinline__ void vector_partials(const CastParams &p, int64_t m0, int64_t k0,
                                                const TileRegs<T> &raw, float *carry) {
    constexpr int kVec = 16 / sizeof(T);
    const int lane8 = threadIdx.x & 7, row8 = threadIdx.x >> 3, warp = threadIdx.x >> 5;
    const int g4 = row8 & 3;                       /* the thread's 4-row group in its warp */
    const int groups = 1 << (p.r_shift - 2);       /* 4-row groups per chunk: 1 .. 32 */
    const int in_warp = groups < 4 ? groups : 4;   /* groups chained inside one warp */
    const int warps = groups > 4 ? groups >> 2 : 1; /* warps per chunk (all powers of two) */
    const int wq = warp & (warps - 1), q = g4 & (in_warp - 1); /* places in the chunk, the run */
    float s[kVec];
#pragma unroll
    for (int e = 0; e < kVec; e++) s[e] = 0.0f;
    for (int ws = 0; ws < warps; ws++) {
        if (ws > 0) {
            __syncthreads(); /* the previous warp's carry is written */
            if (wq == ws && g4 == 0)
#pragma unroll
                for (int e = 0; e < kVec; e++) s[e] = carry[((warp - 1) * 8 + lane8) * kVec + e];
        }
        for (int step = 0; step < in_warp; step++) {
            if (wq == ws && q == step) {
#pragma unroll
                for (int it = 0; it < kIters; it++)
#pragma unroll
                    for (int e = 0; e < kVec; e++) s[e] = __fadd_rn(s[e], widen(raw[it][kV].t[e]));
            }
            if (step + 1 < in_warp) {
#pragma unroll
                for (int e = 0; e < kVec; e++) {
                    const float up = __shfl_up_sync(0xffffffffu, s[e], 8);
                    if (q == step + 1) s[e] = up;
                }
            }
        }
        if (warps > 1 && wq == ws && g4 == 3 && ws + 1 < warps)
#pragma unroll
            for (int e = 0; e < kVec; e++) carry[(warp * 8 + lane8) * kVec + e] = s[e];
    }
    if (warps > 1) __syncthreads(); /* carry is free for the next vector */
    const int64_t chunk_row = m0 + 4 * (row8 & ~(groups - 1));
    if (q == in_warp - 1 && wq == warps - 1 && chunk_row < p.rows) {
        const int64_t gc = k0 + (int64_t)(kV * 8 + lane8) * kVec;
        float *out = p.partials + (chunk_row >> p.r_shift) * p.cols + gc;
#pragma unroll
        for (int e = 0; e < kVec; e++)
            if (gc + e < p.cols) out[e] = s[e];
    }
}

/* dbias (quantize_dbias.c) from a loaded tile: the column partials of each chunk of R =
 * 2^p.r_shift rows (4 <= R <= kTile, so a tile holds whole chunks), each its rows
 * in order onto +0 (__fadd_rn, tq_nadd), into p.partials[chunk][col]: the partials the identity's
 * dbias pass writes (act_backward.cu), so column_sums.cuh finishes them to the same bits. A
 * thread's 4 consecutive rows continue the sums of the rows above them in the chunk, handed 8
 * lanes up inside a warp (lane / 8 = row8 % 4) and, for R >= 32, from the warp before through
 * `carry` (kWarps x 8 x kVec floats). Rows past x's end were loaded as 0: adding +0 to a sum
 * that started at +0 keeps its bits. */
template <typename T, int kV = 0>
__device__ __forceinline__ void tile_partials(const CastParams &p, int64_t m0, int64_t k0,
                                              const TileRegs<T> &raw, float *carry) {
    if constexpr (kV < (int)sizeof(T)) { /* 16 / kVec = sizeof(T) vectors per row segment */
        vector_partials<T, kV>(p, m0, k0, raw, carry);
        tile_partials<T, kV + 1>(p, m0, k0, raw, carry);
    }
}

/* One CTA = one 128x128 tile of x. Thread t owns rows 4*(t/8) + it (it < 4) and, in each, the
 * vectors v*8 + t%8 (v < 16/kVec) of kVec elements: a warp's load instruction covers 4 whole
 * 128-column rows (coalesced). Its 4 consecutive rows make 4x4 byte blocks that a register
 * transpose turns into 32-bit words of the transposed tile. That tile, [k][m] bytes in shared
 * memory, has its 16-byte chunks of m XOR-swizzled by (k/kVec)%8 = t%8, so a warp's word stores
 * hit 32 different banks and each row is still 8 whole chunks for the 16-byte read-back.
 * cast_loaded casts a tile load_tile has loaded; cast_tile loads and casts. */
template <typename T, bool kRow, bool kCol, bool kDelayed, bool kE5M2, bool kFull>
__device__ __forceinline__ void cast_loaded(const CastParams &p, int64_t m0, int64_t k0,
                                            const TileRegs<T> &raw, uint8_t *tile_t,
                                            float *warp_amax) {
    constexpr int kVec = 16 / sizeof(T), kNV = 16 / kVec, kWords = kVec / 4;
    const int lane8 = threadIdx.x & 7, row8 = threadIdx.x >> 3;

    const float scale = cast_scale(p);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *p.scale_inv = tq_rcp(scale);
        if (p.amax_copy != nullptr) *p.amax_copy = *p.amax_in;
    }

    /* Where this thread's 4 rows sit in a row of the transposed tile (m = 4*row8 .. +3). */
    const int swizzled_m = (((row8 >> 2) ^ lane8) << 4) | ((row8 & 3) << 2);
    float amax = 0.0f;
#pragma unroll
    for (int v = 0; v < kNV; v++) {
        const int c = (v * 8 + lane8) * kVec; /* the vector's first column in the tile */
        uint32_t codes[kIters][kWords];
#pragma unroll
        for (int it = 0; it < kIters; it++) {
#pragma unroll
            for (int g = 0; g < kWords; g++) {
                float x_hp[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    x_hp[e] = widen(raw[it][v].t[4 * g + e]);
                    /* = tq_amax_step (NaN ignored, |x| >= 0) in one FMNMX; out-of-range
                     * elements were loaded as 0 */
                    if constexpr (kDelayed) amax = fmaxf(amax, fabsf(x_hp[e]));
                }
                codes[it][g] = cvt8x2<kE5M2>(tq_mul(x_hp[0], scale), tq_mul(x_hp[1], scale))
                               | cvt8x2<kE5M2>(tq_mul(x_hp[2], scale), tq_mul(x_hp[3], scale)) << 16;
            }
            const int64_t gr = m0 + 4 * row8 + it;
            if (kRow && (kFull || (gr < p.rows && k0 + c < p.cols)))
                store_codes<kVec>(p.data + gr * p.cols + k0 + c, codes[it],
                                  kFull ? kVec : (int)(p.cols - k0 - c), kFull || p.data_vec_ok);
        }
        if constexpr (kCol) {
#pragma unroll
            for (int g = 0; g < kWords; g++) {
                const uint32_t rows4[4] = {codes[0][g], codes[1][g], codes[2][g], codes[3][g]};
                uint32_t cols4[4];
                tq_tile::transpose4x4(rows4, cols4);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    *reinterpret_cast<uint32_t *>(&tile_t[(c + 4 * g + e) * kTile + swizzled_m]) = cols4[e];
            }
        }
    }

    if constexpr (kCol) {
        __syncthreads();
#pragma unroll
        for (int it = 0; it < kIters; it++) {
            const int k = it * 32 + row8, j = lane8;
            const int64_t gk = k0 + k, gm = m0 + 16 * j;
            if (!kFull && (gk >= p.cols || gm >= p.rows)) continue;
            const uint4 chunk = *reinterpret_cast<const uint4 *>(
                &tile_t[k * kTile + ((j ^ ((k / kVec) & 7)) << 4)]);
            uint8_t *dst = p.data_t + gk * p.rows + gm;
            if (kFull || (p.data_t_vec_ok && gm + 16 <= p.rows)) {
                *reinterpret_cast<uint4 *>(dst) = chunk;
            } else {
                const uint32_t w[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
                for (int i = 0; i < 16; i++)
                    if (gm + i < p.rows) dst[i] = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
            }
        }
    }

    if constexpr (kDelayed) {
        for (int offset = 16; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < kThreads / 32; w++) amax = fmaxf(amax, warp_amax[w]);
            /* Signed compare of the bits, as the reference: float max for values >= 0. Always
             * issued so a zero tile still replaces a negative old slot, like the reference. */
            atomicMax(reinterpret_cast<int *>(p.amax_out), __float_as_int(amax));
        }
    }
}

template <typename T, bool kRow, bool kCol, bool kDelayed, bool kE5M2, bool kFull>
__device__ __forceinline__ void cast_tile(const CastParams &p, int64_t m0, int64_t k0,
                                          uint8_t *tile_t, float *warp_amax) {
    TileRegs<T> raw;
    load_tile<T, kFull>(p, m0, k0, raw);
    cast_loaded<T, kRow, kCol, kDelayed, kE5M2, kFull>(p, m0, k0, raw, tile_t, warp_amax);
}

/* The first row and column of tile number `tile` (row-major over the tiles). */
__device__ __forceinline__ void tile_origin(const CastParams &p, int64_t tile, int64_t &m0,
                                            int64_t &k0) {
    const int64_t tm = tile / p.tiles_k;
    m0 = tm * kTile;
    k0 = (tile - tm * p.tiles_k) * kTile;
}

/* Interior tiles with aligned rows (nearly all of a large tensor) skip every bounds check. */
__device__ __forceinline__ bool full_tile(const CastParams &p, bool row, bool col, int64_t m0,
                                          int64_t k0) {
    return p.x_vec_ok && (!row || p.data_vec_ok) && (!col || p.data_t_vec_ok)
           && m0 + kTile <= p.rows && k0 + kTile <= p.cols;
}

}  // namespace tq_fp8cast

#endif  // TEQUANT_CUDA_FP8_CAST_TILE_CUH_
