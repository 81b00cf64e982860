/* quantize_fp8.cu: FP8 per-tensor quantization (DELAYED and CURRENT scaling) on CUDA (its
 * dequantization: quantize_fp8_dequant.cu).
 *
 * Rule (NUMERICS.md 2, TE_REFERENCE A.1 / A.2): q = cvt8(RN(x * scale)), scale_inv = RN(1/scale);
 * CURRENT: scale = tq_scale_from_amax(max|x|, fmax, eps, pow2, FLT_MAX), amax written to q->amax
 * (or the caller's amax, tq_quantize_args.amax, read in place and copied there by the cast's
 * first CTA: no amax pass, no memcpy call);
 * DELAYED: scale given, max|x| max-accumulated into the caller's history slot (atomicMax on the
 * float's signed bits). Multiplies are tq_mul: a NaN element encodes as 0x7F, dequantizes to
 * 0x7FFFFFFF.
 * cvt8 is the hardware's cvt.rn.satfinite (fp_cast.cuh's cvt8x2: the rule of formats.h, tested on
 * every bf16 pattern). One pass over x produces both directions: a CTA loads a 128x128 tile
 * with coalesced 16-byte loads, writes the rowwise codes directly and the transposed codes
 * through a swizzled shared tile with 16-byte stores. CURRENT needs max |x| before the first
 * cast, so it reads x twice. By size: a small x (<= 64K elements: launch-bound, e.g. te.Linear
 * on tiny shapes) runs amax and cast in one single-CTA launch (small_current_kernel); a medium
 * one (<= 16M elements, e.g. the activations and weights of a d=512-4096 model) in one
 * cooperative launch whose CTAs meet at a grid barrier between the two (fused_current_kernel;
 * up to one tile per CTA, ~8.6M bf16 elements on an H200, x is read once);
 * a larger one runs tq_amax_cuda first (same stream, no host sync): 6 bytes moved per 4 counted
 * for bf16 (walking the tiles in reverse to reuse x's tail in L2, with streaming stores, measured
 * no gain on H200).
 * Reference: csrc/ref/quantize_fp8_ref.c. Tests: tests/test_quantize_fp8.py.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>

#include "fp_cast.cuh"
#include "internal_kernels.h"
#include "launch.cuh"
#include "tile_transpose.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

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

/* 16-bit inputs: 4 CTAs (1024 threads, 64 registers each) per SM keep enough loads in flight. */
template <typename T, bool kRow, bool kCol, bool kDelayed, bool kE5M2>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 2) cast_kernel(const CastParams p) {
    __shared__ alignas(16) uint8_t tile_t[kCol ? kTile * kTile : 16];
    __shared__ float warp_amax[kThreads / 32];
    int64_t m0, k0;
    tile_origin(p, blockIdx.x, m0, k0);
    if (full_tile(p, kRow, kCol, m0, k0)) cast_tile<T, kRow, kCol, kDelayed, kE5M2, true>(p, m0, k0, tile_t, warp_amax);
    else cast_tile<T, kRow, kCol, kDelayed, kE5M2, false>(p, m0, k0, tile_t, warp_amax);
}

/* An empty x: no tile to cast, but scale_inv (and the delayed slot) still follow the rule. */
__global__ void empty_kernel(const CastParams p, float *own_amax) {
    if (own_amax != nullptr) *own_amax = 0.0f; /* CURRENT: max |x| of no element */
    *p.scale_inv = tq_rcp(cast_scale(p));
    if (p.amax_copy != nullptr) *p.amax_copy = *p.amax_in;
    if (p.amax_out != nullptr) atomicMax(reinterpret_cast<int *>(p.amax_out), 0);
}

template <typename T, bool kRow, bool kCol, bool kDelayed>
void launch_cast(const CastParams &p, int e5m2, unsigned grid, cudaStream_t s) {
    if (e5m2) cast_kernel<T, kRow, kCol, kDelayed, true><<<grid, kThreads, 0, s>>>(p);
    else cast_kernel<T, kRow, kCol, kDelayed, false><<<grid, kThreads, 0, s>>>(p);
}

/* The max of each thread's a over the CTA (fmaxf: NaN dropped), valid in thread 0. */
__device__ __forceinline__ float block_max(float a, float *warp_amax) {
    for (int offset = 16; offset > 0; offset >>= 1)
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = a;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < kThreads / 32; w++) a = fmaxf(a, warp_amax[w]);
    return a;
}

/* CURRENT scaling of a small x (at most kSmallElems elements) in ONE launch and one CTA: the
 * amax (max |x|, NaN ignored: the same exact max tq_amax_cuda computes, in another order, which
 * a max does not see), then every tile in turn. Small tensors are bound by launch overhead, not
 * bandwidth: this saves the memset and the separate amax kernel. */
constexpr int64_t kSmallElems = 1 << 16;

template <typename T, bool kRow, bool kCol, bool kE5M2>
__global__ void __launch_bounds__(kThreads) small_current_kernel(const CastParams p, float *amax) {
    __shared__ alignas(16) uint8_t tile_t[kCol ? kTile * kTile : 16];
    __shared__ float warp_amax[kThreads / 32];
    const T *x = static_cast<const T *>(p.x);
    constexpr int kVec = 16 / sizeof(T);
    float a = 0.0f;
    if (p.x_vec_ok && p.cols % kVec == 0) { /* 16-byte loads: a quarter of the iterations */
        const int64_t per_row = p.cols / kVec, n_vec = p.rows * per_row;
        for (int64_t i = threadIdx.x; i < n_vec; i += kThreads) {
            const int64_t r = i / per_row, v = i - r * per_row;
            Vec16<T> chunk;
            chunk.u = __ldg(reinterpret_cast<const uint4 *>(x + r * p.ld + v * kVec));
#pragma unroll
            for (int e = 0; e < kVec; e++) a = fmaxf(a, fabsf(widen(chunk.t[e])));
        }
    } else {
        for (int64_t i = threadIdx.x; i < p.rows * p.cols; i += kThreads) {
            const int64_t r = i / p.cols, c = i - r * p.cols;
            a = fmaxf(a, fabsf(widen(x[r * p.ld + c])));
        }
    }
    a = block_max(a, warp_amax);
    if (threadIdx.x == 0) *amax = a; /* cast_scale reads it back through p.amax_in */
    __syncthreads();
    const int64_t tiles = ((p.rows + kTile - 1) / kTile) * p.tiles_k;
    for (int64_t tile = 0; tile < tiles; tile++) {
        int64_t m0, k0;
        tile_origin(p, tile, m0, k0);
        if (full_tile(p, kRow, kCol, m0, k0)) cast_tile<T, kRow, kCol, false, kE5M2, true>(p, m0, k0, tile_t, warp_amax);
        else cast_tile<T, kRow, kCol, false, kE5M2, false>(p, m0, k0, tile_t, warp_amax);
        __syncthreads(); /* the next tile reuses tile_t */
    }
}

template <typename T, bool kRow, bool kCol>
void launch_small(const CastParams &p, int e5m2, float *amax, cudaStream_t s) {
    if (e5m2) small_current_kernel<T, kRow, kCol, true><<<1, kThreads, 0, s>>>(p, amax);
    else small_current_kernel<T, kRow, kCol, false><<<1, kThreads, 0, s>>>(p, amax);
}

template <typename T>
void launch_small(const CastParams &p, uint32_t usage, int e5m2, float *amax, cudaStream_t s) {
    if (usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE)) launch_small<T, true, true>(p, e5m2, amax, s);
    else if (usage == TQ_USAGE_ROWWISE) launch_small<T, true, false>(p, e5m2, amax, s);
    else launch_small<T, false, true>(p, e5m2, amax, s);
}

/* CURRENT scaling of a medium x (kSmallElems < n <= kFusedMaxElems) in ONE cooperative
 * launch: each CTA takes max |x| over its tiles (cast_tile's loads), the grid meets at a
 * barrier, the CTA maxima meet in q's amax (zeroed by CTA 0 before the first barrier), a second
 * barrier, then each CTA casts the same tiles: from its registers when it has one, else loaded
 * again (mostly from L2). Bits: the
 * amax is the same exact max as tq_amax_cuda's (a max has no order), the cast is cast_tile's.
 * Against the amax kernel + cast kernel it saves a memset and a launch per quantization (host
 * time, te.Linear's forward and backward: ~9 us each on an H200 host) and most of the second
 * read from HBM. The grid is at most what fits on the GPU at once (the cooperative launch's
 * rule, which also guarantees every CTA runs while the others wait at the barrier). */
constexpr int64_t kFusedMaxElems = 1 << 24;

template <typename T, bool kRow, bool kCol, bool kE5M2>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 2) fused_current_kernel(const CastParams p, float *amax) {
    __shared__ alignas(16) uint8_t tile_t[kCol ? kTile * kTile : 16];
    __shared__ float warp_amax[kThreads / 32];
    __shared__ float amax_s;
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    const int64_t tiles = ((p.rows + kTile - 1) / kTile) * p.tiles_k;
    /* One tile per CTA (the grid covers x): the tile stays in registers across the barriers and
     * x is read once. Else each CTA reads its tiles twice, the second time mostly from L2. */
    const bool one_tile = tiles == (int64_t)gridDim.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) *amax = 0.0f;
    TileRegs<T> raw;
    int64_t m0, k0;
    tile_origin(p, blockIdx.x, m0, k0);
    const bool full = full_tile(p, kRow, kCol, m0, k0);
    float a = 0.0f;
    if (one_tile) {
        if (full) load_tile<T, true>(p, m0, k0, raw);
        else load_tile<T, false>(p, m0, k0, raw);
        a = regs_amax<T>(raw, a);
    } else {
        for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int64_t tm0, tk0;
            tile_origin(p, tile, tm0, tk0);
            TileRegs<T> r;
            if (full_tile(p, kRow, kCol, tm0, tk0)) load_tile<T, true>(p, tm0, tk0, r);
            else load_tile<T, false>(p, tm0, tk0, r);
            a = regs_amax<T>(r, a);
        }
    }
    a = block_max(a, warp_amax);
    grid.sync(); /* CTA 0's zero is visible */
    if (threadIdx.x == 0 && a > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(amax), __float_as_uint(a));
    grid.sync(); /* every CTA's max is in */
    if (threadIdx.x == 0) amax_s = __ldcg(amax); /* from L2, not a stale L1 line */
    __syncthreads();
    CastParams q = p;
    q.amax_in = &amax_s;
    if (one_tile) {
        if (full) cast_loaded<T, kRow, kCol, false, kE5M2, true>(q, m0, k0, raw, tile_t, warp_amax);
        else cast_loaded<T, kRow, kCol, false, kE5M2, false>(q, m0, k0, raw, tile_t, warp_amax);
        return;
    }
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        tile_origin(p, tile, m0, k0);
        if (full_tile(p, kRow, kCol, m0, k0)) cast_tile<T, kRow, kCol, false, kE5M2, true>(q, m0, k0, tile_t, warp_amax);
        else cast_tile<T, kRow, kCol, false, kE5M2, false>(q, m0, k0, tile_t, warp_amax);
        __syncthreads(); /* the next tile reuses tile_t */
    }
}

/* CTAs of `kernel` that fit on one SM of `device`, 0 where cooperative launches are not
 * supported; asked once per kernel and device, the answer kept in the kernel's own cache (0
 * unknown, else blocks + 1). Every fused_current_kernel instance has the same function type, so
 * a cache keyed by that type would hand one instance's occupancy to the others: a heavier one
 * then failed with cudaErrorCooperativeLaunchTooLarge, depending on which ran first. */
template <typename Kernel>
int fused_blocks_per_sm(Kernel kernel, int device, std::atomic<int> (&cache)[64]) {
    if (device < 0 || device >= 64) return 0;
    int v = cache[device].load(std::memory_order_relaxed);
    if (v > 0) return v - 1;
    int coop = 0, blocks = 0;
    if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) != cudaSuccess
        || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    v = coop ? blocks : 0;
    cache[device].store(v + 1, std::memory_order_relaxed);
    return v;
}

/* Launches the fused kernel; false (nothing queued) where the device cannot run it. */
template <typename T, bool kRow, bool kCol, bool kE5M2>
bool launch_fused(const CastParams &p, float *amax, int device, unsigned tiles, cudaStream_t s) {
    auto kernel = fused_current_kernel<T, kRow, kCol, kE5M2>;
    static std::atomic<int> cache[64]; /* this instance's */
    const int per_sm = fused_blocks_per_sm(kernel, device, cache);
    int sms = 0;
    if (per_sm <= 0 || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return false;
    const unsigned most = (unsigned)per_sm * (unsigned)sms;
    CastParams args_p = p;
    float *args_amax = amax;
    void *args[] = {&args_p, &args_amax};
    cudaLaunchCooperativeKernel((const void *)kernel, dim3(tiles < most ? tiles : most),
                                dim3(kThreads), args, 0, s);
    return true;
}

template <typename T, bool kRow, bool kCol>
bool launch_fused(const CastParams &p, int e5m2, float *amax, int device, unsigned tiles, cudaStream_t s) {
    return e5m2 ? launch_fused<T, kRow, kCol, true>(p, amax, device, tiles, s)
                : launch_fused<T, kRow, kCol, false>(p, amax, device, tiles, s);
}

template <typename T>
bool launch_fused(const CastParams &p, uint32_t usage, int e5m2, float *amax, int device,
                  unsigned tiles, cudaStream_t s) {
    if (usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE))
        return launch_fused<T, true, true>(p, e5m2, amax, device, tiles, s);
    if (usage == TQ_USAGE_ROWWISE) return launch_fused<T, true, false>(p, e5m2, amax, device, tiles, s);
    return launch_fused<T, false, true>(p, e5m2, amax, device, tiles, s);
}

template <typename T, bool kRow, bool kCol>
void launch_cast(const CastParams &p, int delayed, int e5m2, unsigned grid, cudaStream_t s) {
    if (delayed) launch_cast<T, kRow, kCol, true>(p, e5m2, grid, s);
    else launch_cast<T, kRow, kCol, false>(p, e5m2, grid, s);
}

template <typename T>
void launch_cast(const CastParams &p, uint32_t usage, int delayed, int e5m2, unsigned grid,
                 cudaStream_t s) {
    if (usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE))
        launch_cast<T, true, true>(p, delayed, e5m2, grid, s);
    else if (usage == TQ_USAGE_ROWWISE) launch_cast<T, true, false>(p, delayed, e5m2, grid, s);
    else launch_cast<T, false, true>(p, delayed, e5m2, grid, s);
}

bool aligned16(const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

extern "C" int tq_fp8_current_one_launch(int64_t elems) {
    return elems > 0 && elems <= kFusedMaxElems;
}

extern "C" tq_status tq_quantize_fp8_cuda(const tq_tensor *x, const tq_quant_config *c,
                                          const tq_quantize_args *a, tq_qtensor *q,
                                          struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return cuda_failed("fp8 quantize: making x's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const int delayed = c->scaling == TQ_SCALING_DELAYED;
    const int e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const size_t elem_size = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;

    const int64_t n = x->rows * x->cols;
    const bool given = a->amax.data != nullptr; /* CURRENT: a shard's all-reduced amax */
    const bool own_amax = !delayed && !given;
    CastParams p = {};
    p.x = x->data;
    p.rows = x->rows;
    p.cols = x->cols;
    p.ld = x->ld;
    p.data = static_cast<uint8_t *>(q->data.data);
    p.data_t = static_cast<uint8_t *>(q->data_t.data);
    p.scale = delayed ? static_cast<const float *>(a->scale.data) : nullptr;
    p.amax_in = delayed ? nullptr : static_cast<const float *>(given ? a->amax.data : q->amax.data);
    /* A given amax is read where it is; CTA 0 copies it into q's (no memcpy call). */
    p.amax_copy = given && a->amax.data != q->amax.data ? static_cast<float *>(q->amax.data) : nullptr;
    p.amax_out = delayed ? static_cast<float *>(q->amax.data) : nullptr;
    p.scale_inv = static_cast<float *>(q->scale_inv.data);
    p.fmax = c->fmax;
    p.eps = c->amax_epsilon;
    p.pow2 = (c->flags & TQ_QUANT_POW2_SCALE) != 0;

    if (n == 0) {
        empty_kernel<<<1, 1, 0, s>>>(p, own_amax ? static_cast<float *>(q->amax.data) : nullptr);
    } else {
        const int64_t vec = 16 / (int64_t)elem_size;
        const int64_t tiles_m = (x->rows + kTile - 1) / kTile, tiles_k = (x->cols + kTile - 1) / kTile;
        if (tiles_m * tiles_k > 0x7FFFFFFFLL)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "fp8 quantize: x [%lld, %lld] has more "
                           "than 2^31 tiles of 128x128", (long long)x->rows, (long long)x->cols);
        p.tiles_k = tiles_k;
        p.x_vec_ok = aligned16(x->data) && ((uint64_t)x->ld * elem_size) % 16 == 0;
        p.data_vec_ok = p.data != nullptr && aligned16(p.data) && x->cols % vec == 0;
        p.data_t_vec_ok = p.data_t != nullptr && aligned16(p.data_t) && x->rows % 16 == 0;
        const unsigned grid = (unsigned)(tiles_m * tiles_k);
        float *amax = static_cast<float *>(q->amax.data);
        bool done = false;
        if (own_amax && n <= kSmallElems) {
            switch (x->dtype) {
                case TQ_DTYPE_FLOAT32: launch_small<float>(p, a->usage, e5m2, amax, s); break;
                case TQ_DTYPE_BFLOAT16: launch_small<Bf16>(p, a->usage, e5m2, amax, s); break;
                default: launch_small<Half>(p, a->usage, e5m2, amax, s); break;
            }
            done = true;
        } else if (own_amax && n <= kFusedMaxElems) {
            switch (x->dtype) {
                case TQ_DTYPE_FLOAT32: done = launch_fused<float>(p, a->usage, e5m2, amax, x->device, grid, s); break;
                case TQ_DTYPE_BFLOAT16: done = launch_fused<Bf16>(p, a->usage, e5m2, amax, x->device, grid, s); break;
                default: done = launch_fused<Half>(p, a->usage, e5m2, amax, x->device, grid, s); break;
            }
        }
        if (!done) {
            if (own_amax) { /* the amax pass; the cast reads it from device memory */
                tq_status st = tq_amax_cuda(x, &q->amax, stream);
                if (st != TQ_SUCCESS) return st;
            }
            switch (x->dtype) {
                case TQ_DTYPE_FLOAT32: launch_cast<float>(p, a->usage, delayed, e5m2, grid, s); break;
                case TQ_DTYPE_BFLOAT16: launch_cast<Bf16>(p, a->usage, delayed, e5m2, grid, s); break;
                default: launch_cast<Half>(p, a->usage, delayed, e5m2, grid, s); break;
            }
        }
    }
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("fp8 quantize kernel launch", err);
    return TQ_SUCCESS;
}
