/* quantize_mxfp8.cu: the MXFP8 quantizer on CUDA (NUMERICS.md 2 "MXFP8", TE_REFERENCE A.4 / 6.4).
 *
 * Rule: per block (1x32 along K rowwise, 32x1 along M columnwise, or one 32x32 tile for both
 * directions with TQ_QUANT_2D) amax A = max |x| with NaN ignored, e = tq_mxfp8_exponent(A) (E8M0
 * rounded up), q = cvt8(x * 2^(127-e)), scale byte = e. data_t [K, M] is quant(x^T).
 * One fused, persistent kernel: each CTA walks tiles of 128 rows x 128 bytes of x, copying the
 * next tile into shared memory (cp.async, 16-byte coalesced, chunks XOR-swizzled) while it
 * quantizes the current one: each thread takes one rowwise block (written as whole 32-byte
 * sectors) and one columnwise block (staged in a second shared buffer, then written as 128-byte
 * segments of data_t rows). Elements go through the
 * hardware cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (what TE uses), which equals formats.h's
 * tq_f32_to_fp8 on all 2^32 non-NaN fp32 inputs (checked on an H200); NaN elements are
 * re-encoded with tq_f32_to_fp8 itself, as the GPU's multiply and cvt drop a NaN's sign.
 * Reference: csrc/ref/quantize_mxfp8_ref.c. Tests: tests/test_quantize_mxfp8.py (GPU cases).
 */
#include <atomic>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "internal_kernels.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

constexpr int kBlock = 32;            /* MXFP8 block length */
constexpr int kTileM = 128;           /* rows of x per tile: 4 columnwise blocks */
constexpr int kTileBytes = 128;       /* bytes of each tile row: 64 bf16/fp16 or 32 fp32 columns */
constexpr int kOutPitch = kTileM + 16; /* bytes per staged data_t row: 16-byte aligned, and the
                                          16-byte stores of 8 consecutive columns hit distinct
                                          bank groups */

/* Input element types: raw storage bits -> fp32. `widen` is exact; `widen_nan_exact` also keeps
 * a NaN's bits (the NaN path re-encodes from it). */
struct F32 {
    using storage = float;
    static __device__ __forceinline__ float widen(uint32_t bits) { return __uint_as_float(bits); }
    static __device__ __forceinline__ float widen_nan_exact(uint32_t bits) { return __uint_as_float(bits); }
};
struct Bf16 {
    using storage = uint16_t;
    static __device__ __forceinline__ float widen(uint32_t bits) { return tq_bf16_to_f32((uint16_t)bits); }
    static __device__ __forceinline__ float widen_nan_exact(uint32_t bits) { return tq_bf16_to_f32((uint16_t)bits); }
};
struct F16 {
    using storage = uint16_t;
    /* The hardware conversion is exact for every half (IEEE widening); formats.h's loops over
     * subnormals, so it serves the rare NaN path only. */
    static __device__ __forceinline__ float widen(uint32_t bits) {
        return __half2float(__ushort_as_half((unsigned short)bits));
    }
    static __device__ __forceinline__ float widen_nan_exact(uint32_t bits) { return tq_f16_to_f32((uint16_t)bits); }
};

template <typename In>
struct TileShape {
    using T = typename In::storage;
    static constexpr int kCols = kTileBytes / (int)sizeof(T);  /* columns of x per tile */
    static constexpr int kElems = 16 / (int)sizeof(T);          /* elements per 16-byte chunk */
    static constexpr int kBlocksPerRow = kCols / kBlock;        /* rowwise blocks per tile row */
    static constexpr int kThreads = kTileM * kBlocksPerRow;     /* = kCols * (kTileM / kBlock):
                                                                   one rowwise and one columnwise
                                                                   block per thread */
    static_assert(kThreads == kCols * (kTileM / kBlock), "one block of each direction per thread");
    /* resident CTAs per SM the register budget must allow (16-bit: 4 x 256 threads, <= 64 regs) */
    static constexpr int kMinBlocks = sizeof(T) == 2 ? 4 : 5;
};

/* Shared-memory index of element (r, c) of a tile: the 16-byte chunks of row r are permuted by
 * XOR with r % 8, so that 8 lanes reading the same chunk of 8 consecutive rows (rowwise pass),
 * and lanes reading consecutive columns of one row (columnwise pass), hit distinct banks. */
template <typename In>
__device__ __forceinline__ int swizzled(int r, int c) {
    using S = TileShape<In>;
    return r * S::kCols + (((c / S::kElems) ^ (r & 7)) * S::kElems) + c % S::kElems;
}

/* Element i of a 16-byte chunk held as 4 words. */
template <typename In>
__device__ __forceinline__ uint32_t element_bits(const uint32_t (&w)[4], int i) {
    if (sizeof(typename In::storage) == 4) return w[i];
    return (w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
}

/* Two fp32 values -> two FP8 codes (lo in the low byte), RNE, saturating. */
template <bool kE5M2>
__device__ __forceinline__ uint32_t cvt_pair(float lo, float hi) {
    unsigned short out;
    if (kE5M2)
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
    return out;
}

/* N (multiple of 4) elements value(i) times 2^(127-e) -> N/4 words of codes. In the rare case
 * that an element is NaN, it is re-encoded from its raw bits raw(i) exactly as the reference
 * does (sign kept). */
template <typename In, bool kE5M2, int N, typename Value, typename Raw>
__device__ __forceinline__ void quantize_run(Value value, uint8_t e, Raw raw, uint32_t (&codes)[N / 4]) {
    const float factor = tq_e8m0_rcp(e);
    uint32_t nan = 0;
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        codes[i] = cvt_pair<kE5M2>(value(4 * i) * factor, value(4 * i + 1) * factor)
                   | cvt_pair<kE5M2>(value(4 * i + 2) * factor, value(4 * i + 3) * factor) << 16;
        nan |= (codes[i] & 0x7F7F7F7Fu) + (kE5M2 ? 0x03030303u : 0x01010101u);
    }
    /* A NaN code (E4M3: |code| 0x7F; E5M2: |code| >= 0x7D; saturating conversion never makes
     * one from a non-NaN value) sets bit 7 of its byte in (code & 0x7F) + bias: no carries. */
    if (nan & 0x80808080u) {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const float x = In::widen_nan_exact(raw(i));
            if (tq_isnan(x)) {
                const int sh = 8 * (i & 3);
                codes[i >> 2] = (codes[i >> 2] & ~(0xFFu << sh)) | (uint32_t)tq_f32_to_fp8(x, kE5M2) << sh;
            }
        }
    }
}

/* max |x| over n raw words of one block, NaN ignored (exact: a max picks one of its inputs).
 * 16-bit inputs stay packed: abs and max (maxNum: a NaN loses) on both halves at once. */
template <typename In, int NWords>
__device__ __forceinline__ float words_amax(const uint32_t (&w)[NWords]) {
    if (sizeof(typename In::storage) == 4) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < NWords; i++) amax = fmaxf(amax, fabsf(__uint_as_float(w[i])));
        return amax;
    }
    uint32_t m = 0u;
#pragma unroll
    for (int i = 0; i < NWords; i++) {
        if (std::is_same<In, F16>::value)
            asm("{ .reg .b32 t; abs.f16x2 t, %1; max.f16x2 %0, %0, t; }" : "+r"(m) : "r"(w[i]));
        else
            asm("{ .reg .b32 t; abs.bf16x2 t, %1; max.bf16x2 %0, %0, t; }" : "+r"(m) : "r"(w[i]));
    }
    return fmaxf(In::widen(m & 0xFFFFu), In::widen(m >> 16));
}

template <int NWords, bool kVec>
__device__ __forceinline__ void store_codes(uint8_t *p, const uint32_t *codes) {
    if (kVec && NWords == 1) {
        *reinterpret_cast<uint32_t *>(p) = codes[0];
    } else if (kVec && NWords == 2) {
        *reinterpret_cast<uint2 *>(p) = make_uint2(codes[0], codes[1]);
    } else if (kVec && NWords == 4) {
        *reinterpret_cast<uint4 *>(p) = make_uint4(codes[0], codes[1], codes[2], codes[3]);
    } else {
#pragma unroll
        for (int i = 0; i < 4 * NWords; i++) p[i] = (uint8_t)(codes[i >> 2] >> (8 * (i & 3)));
    }
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all_but_one() {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

struct Args {
    const void *x;
    int64_t ld, M, K;
    int64_t tiles_k, n_tiles;
    uint8_t *data, *scale_inv, *data_t, *scale_inv_t; /* NULL for a direction not produced */
};

/* The raw 16-byte chunks of tile `tile` into buf (swizzled): cp.async (returns at once), or
 * element loads when x is not 16-byte aligned. Chunks outside x are skipped: nothing valid
 * reads them. */
template <typename In, bool kVec>
__device__ __forceinline__ void fetch_tile(const Args &a, int64_t tile, typename In::storage *buf) {
    using S = TileShape<In>;
    using T = typename In::storage;
    constexpr int kChunksPerRow = kTileBytes / 16;
    const int64_t m0 = tile / a.tiles_k * kTileM, k0 = tile % a.tiles_k * S::kCols;
    const T *x = static_cast<const T *>(a.x);
#pragma unroll
    for (int it = 0; it < kTileM * kChunksPerRow / S::kThreads; it++) {
        const int q = it * S::kThreads + threadIdx.x, r = q / kChunksPerRow;
        const int c = q % kChunksPerRow * S::kElems;
        if (m0 + r >= a.M || k0 + c >= a.K) continue;
        const T *src = x + (m0 + r) * a.ld + k0 + c;
        T *dst = buf + swizzled<In>(r, c);
        if (kVec) {
            cp_async16(dst, src);
        } else {
#pragma unroll
            for (int i = 0; i < S::kElems; i++) dst[i] = src[i];
        }
    }
}

__device__ __forceinline__ uint32_t smem_bits(const float &v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t smem_bits(const uint16_t &v) { return v; }

/* The address and validity of rowwise block `t` (a thread index) of the tile at (m0, k0). */
template <typename In>
__device__ __forceinline__ uint8_t *row_block(const Args &a, int64_t m0, int64_t k0, int t, bool &valid) {
    using S = TileShape<In>;
    const int64_t row = m0 + t / S::kBlocksPerRow, col = k0 + t % S::kBlocksPerRow * kBlock;
    valid = row < a.M && col < a.K;
    return a.data + row * a.K + col;
}

/* One rowwise block per thread (row r, block b of the tile), read from shared memory; 1D
 * blocks take their own amax, 2D blocks the tile's exponent. The 32 codes leave as two 16-byte
 * stores per lane pair so that each store instruction writes whole 32-byte sectors: the pair
 * swaps halves, then writes the even lane's block, then the odd lane's. All lanes of the warp
 * run this (shuffles). */
template <typename In, bool kVec, bool k2D, bool kE5M2>
__device__ __forceinline__ void rowwise_block(const Args &a, int64_t m0, int64_t k0,
                                              const typename In::storage *cur,
                                              const uint8_t (*tile_e)[2]) {
    using S = TileShape<In>;
    const int r = threadIdx.x / S::kBlocksPerRow, b = threadIdx.x % S::kBlocksPerRow;
    bool valid;
    uint8_t *dst = row_block<In>(a, m0, k0, threadIdx.x, valid);
    constexpr int kWords = kBlock * (int)sizeof(typename In::storage) / 4;
    uint32_t w[kWords]; /* the block's raw elements, packed as stored */
#pragma unroll
    for (int j = 0; j < kWords / 4; j++) {
        const uint4 u = *reinterpret_cast<const uint4 *>(cur + swizzled<In>(r, b * kBlock + j * S::kElems));
        w[4 * j] = u.x, w[4 * j + 1] = u.y, w[4 * j + 2] = u.z, w[4 * j + 3] = u.w;
    }
    const uint8_t e = k2D ? tile_e[r / kBlock][b] : tq_mxfp8_exponent(words_amax<In>(w), kE5M2);
    uint32_t codes[kBlock / 4] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (valid) {
        auto raw = [&](int i) {
            return sizeof(typename In::storage) == 4 ? w[i] : (w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu;
        };
        quantize_run<In, kE5M2, kBlock>([&](int i) { return In::widen(raw(i)); }, e, raw, codes);
    }
    if (kVec) {
        bool partner_valid;
        uint8_t *partner_dst = row_block<In>(a, m0, k0, threadIdx.x ^ 1, partner_valid);
        const int odd = threadIdx.x & 1;
        uint32_t half[4];
#pragma unroll
        for (int i = 0; i < 4; i++) half[i] = __shfl_xor_sync(0xFFFFFFFFu, odd ? codes[i] : codes[4 + i], 1);
        /* store 1: the even lane's block (even: its first half, odd: the even lane's second) */
        uint8_t *even_dst = odd ? partner_dst : dst;
        if (odd ? partner_valid : valid)
            *reinterpret_cast<uint4 *>(even_dst + 16 * odd) =
                odd ? make_uint4(half[0], half[1], half[2], half[3]) : make_uint4(codes[0], codes[1], codes[2], codes[3]);
        /* store 2: the odd lane's block (even: the odd lane's first half, odd: its second) */
        uint8_t *odd_dst = odd ? dst : partner_dst;
        if (odd ? valid : partner_valid)
            *reinterpret_cast<uint4 *>(odd_dst + 16 * odd) =
                odd ? make_uint4(codes[4], codes[5], codes[6], codes[7]) : make_uint4(half[0], half[1], half[2], half[3]);
    } else if (valid) {
        store_codes<kBlock / 4, false>(dst, codes);
    }
    if (valid) {
        const int64_t row = m0 + r, col = k0 + b * kBlock;
        a.scale_inv[row * (a.K / kBlock) + col / kBlock] = e;
    }
}

template <typename In, bool kVec, bool k2D, bool kE5M2>
__global__ void __launch_bounds__(TileShape<In>::kThreads, TileShape<In>::kMinBlocks)
quantize_kernel(const Args a) {
    using S = TileShape<In>;
    using T = typename In::storage;
    __shared__ __align__(16) T buf[2][kTileM * S::kCols];
    __shared__ __align__(16) uint8_t out_t[S::kCols][kOutPitch];
    __shared__ uint8_t tile_e[kTileM / kBlock][2];
    __shared__ __align__(4) uint8_t col_e[S::kCols][kTileM / kBlock]; /* scale_inv_t of the tile */
    const bool rowwise = a.data != nullptr, columnwise = a.data_t != nullptr;
    const int lane = threadIdx.x & 31;
    /* this thread's column block: lanes take consecutive columns of the same rows */
    const int col = threadIdx.x % S::kCols, rb = threadIdx.x / S::kCols;

    int64_t tile = blockIdx.x;
    if (tile < a.n_tiles) fetch_tile<In, kVec>(a, tile, buf[0]);
    cp_async_commit();
    for (int stage = 0; tile < a.n_tiles; tile += gridDim.x, stage ^= 1) {
        /* the next tile streams in while this one is quantized */
        if (tile + gridDim.x < a.n_tiles) fetch_tile<In, kVec>(a, tile + gridDim.x, buf[stage ^ 1]);
        cp_async_commit();
        cp_async_wait_all_but_one();
        __syncthreads();
        const T *cur = buf[stage];
        const int64_t m0 = tile / a.tiles_k * kTileM, k0 = tile % a.tiles_k * S::kCols;

        if (rowwise && !k2D) rowwise_block<In, kVec, false, kE5M2>(a, m0, k0, cur, tile_e);
        if (columnwise || k2D) {
            /* one 32x1 block per thread; in 2D a warp's 32 columns x 32 rows are one tile */
            const bool valid = m0 + rb * kBlock < a.M && k0 + col < a.K; /* uniform per warp */
            float v[kBlock];
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < kBlock; i++) {
                v[i] = In::widen(valid ? smem_bits(cur[swizzled<In>(rb * kBlock + i, col)]) : 0u);
                amax = fmaxf(amax, fabsf(v[i]));
            }
            if (k2D) {
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
            }
            const uint8_t e = tq_mxfp8_exponent(amax, kE5M2);
            if (k2D && lane == 0) tile_e[rb][col / kBlock] = e;
            if (columnwise && valid) {
                uint32_t codes[kBlock / 4];
                quantize_run<In, kE5M2, kBlock>([&](int i) { return v[i]; }, e,
                                                 [&](int i) { return smem_bits(cur[swizzled<In>(rb * kBlock + i, col)]); }, codes);
                uint4 *dst = reinterpret_cast<uint4 *>(&out_t[col][rb * kBlock]);
                dst[0] = make_uint4(codes[0], codes[1], codes[2], codes[3]);
                dst[1] = make_uint4(codes[4], codes[5], codes[6], codes[7]);
                col_e[col][rb] = e;
            }
            __syncthreads();
            if (rowwise && k2D) rowwise_block<In, kVec, true, kE5M2>(a, m0, k0, cur, tile_e);
            if (columnwise && threadIdx.x < S::kCols && k0 + threadIdx.x < a.K) {
                /* the tile's 4 exponents of column k0 + c are consecutive in scale_inv_t */
                uint8_t *dst = a.scale_inv_t + (k0 + threadIdx.x) * (a.M / kBlock) + m0 / kBlock;
                const int n = (int)min((int64_t)kTileM, a.M - m0) / kBlock;
                if (n == kTileM / kBlock && ((uintptr_t)dst & 3u) == 0)
                    *reinterpret_cast<uint32_t *>(dst) = *reinterpret_cast<const uint32_t *>(col_e[threadIdx.x]);
                else
                    for (int i = 0; i < n; i++) dst[i] = col_e[threadIdx.x][i];
            }
            if (columnwise) {
                /* data_t rows (columns of x) in 16-byte pieces, 8 lanes per 128-byte segment */
#pragma unroll
                for (int it = 0; it < S::kCols * (kTileM / 16) / S::kThreads; it++) {
                    const int q = it * S::kThreads + threadIdx.x, c = q / (kTileM / 16), j = q % (kTileM / 16) * 16;
                    if (k0 + c >= a.K || m0 + j >= a.M) continue;
                    const uint4 u = *reinterpret_cast<const uint4 *>(&out_t[c][j]);
                    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
                    store_codes<4, kVec>(a.data_t + (k0 + c) * a.M + m0 + j, words);
                }
            }
        }
        __syncthreads(); /* buf[stage], out_t, tile_e and col_e are rewritten next round */
    }
}


bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

constexpr int kMaxDevices = 64;

/* A persistent grid that fills the GPU once (resident CTAs per SM computed once per kernel
 * and device). */
template <typename In, bool kVec, bool k2D, bool kE5M2>
void launch_quantize(const Args &a, int device, cudaStream_t st) {
    static std::atomic<int> resident[kMaxDevices];
    auto kernel = quantize_kernel<In, kVec, k2D, kE5M2>;
    const int threads = TileShape<In>::kThreads;
    const bool cached = device >= 0 && device < kMaxDevices;
    int per_sm = cached ? resident[device].load(std::memory_order_relaxed) : 0;
    if (per_sm <= 0) {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess
            || per_sm < 1) {
            cudaGetLastError(); /* not fatal: one CTA per SM still covers every tile */
            per_sm = 1;
        }
        if (cached) resident[device].store(per_sm, std::memory_order_relaxed);
    }
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    const int64_t grid = a.n_tiles < (int64_t)sms * per_sm ? a.n_tiles : (int64_t)sms * per_sm;
    kernel<<<(unsigned)grid, threads, 0, st>>>(a);
}

template <typename In>
void dispatch_quantize(const Args &a, bool vec, bool two_d, bool e5m2, int device, cudaStream_t st) {
#define TQ_MXFP8_LAUNCH(V, D, E) \
    if (vec == V && two_d == D && e5m2 == E) return launch_quantize<In, V, D, E>(a, device, st)
    TQ_MXFP8_LAUNCH(true, false, false);
    TQ_MXFP8_LAUNCH(true, false, true);
    TQ_MXFP8_LAUNCH(true, true, false);
    TQ_MXFP8_LAUNCH(true, true, true);
    TQ_MXFP8_LAUNCH(false, false, false);
    TQ_MXFP8_LAUNCH(false, false, true);
    TQ_MXFP8_LAUNCH(false, true, false);
    TQ_MXFP8_LAUNCH(false, true, true);
#undef TQ_MXFP8_LAUNCH
}

tq_status quantize_mxfp8(const tq_tensor *x, const tq_quant_config *config, const tq_quantize_args *args,
                         tq_qtensor *q, cudaStream_t st) {
    const int64_t M = x->rows, K = x->cols;
    if (M == 0 || K == 0) return TQ_SUCCESS;
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return launch_failed("mxfp8 quantize: making x's device current");
    const bool rowwise = (args->usage & TQ_USAGE_ROWWISE) != 0;
    const bool columnwise = (args->usage & TQ_USAGE_COLUMNWISE) != 0;
    Args a;
    a.x = x->data;
    a.ld = x->ld, a.M = M, a.K = K;
    const int esize = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int64_t tile_cols = kTileBytes / esize;
    a.tiles_k = (K + tile_cols - 1) / tile_cols;
    a.n_tiles = (M + kTileM - 1) / kTileM * a.tiles_k;
    a.data = rowwise ? static_cast<uint8_t *>(q->data.data) : nullptr;
    a.scale_inv = rowwise ? static_cast<uint8_t *>(q->scale_inv.data) : nullptr;
    a.data_t = columnwise ? static_cast<uint8_t *>(q->data_t.data) : nullptr;
    a.scale_inv_t = columnwise ? static_cast<uint8_t *>(q->scale_inv_t.data) : nullptr;
    /* 16-byte copies and stores need 16-byte aligned rows; output rows are multiples of 32
     * bytes, so aligned when their base is. Anything else takes the element-wise path. */
    const bool vec = aligned16(x->data) && (x->ld * esize) % 16 == 0
                     && (!rowwise || aligned16(a.data)) && (!columnwise || aligned16(a.data_t));
    const bool e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const bool two_d = (config->flags & TQ_QUANT_2D) != 0;
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32: dispatch_quantize<F32>(a, vec, two_d, e5m2, x->device, st); break;
        case TQ_DTYPE_BFLOAT16: dispatch_quantize<Bf16>(a, vec, two_d, e5m2, x->device, st); break;
        default: dispatch_quantize<F16>(a, vec, two_d, e5m2, x->device, st); break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("mxfp8 quantize kernel launch");
    return TQ_SUCCESS;
}

}  // namespace

extern "C" tq_status tq_quantize_mxfp8_cuda(const tq_tensor *x, const tq_quant_config *config,
                                            const tq_quantize_args *args, tq_qtensor *q,
                                            struct CUstream_st *stream) {
    return quantize_mxfp8(x, config, args, q, reinterpret_cast<cudaStream_t>(stream));
}

namespace {

/* Output element types of dequantization: fp32 -> storage bits (bf16 / fp16 RNE, formats.h). */
struct OutF32 {
    using storage = float;
    static __device__ __forceinline__ float narrow(float v) { return v; }
};
struct OutBf16 {
    using storage = uint16_t;
    static __device__ __forceinline__ uint16_t narrow(float v) { return tq_f32_to_bf16(v); }
};
struct OutF16 {
    using storage = uint16_t;
    static __device__ __forceinline__ uint16_t narrow(float v) { return tq_f32_to_f16(v); }
};

/* Dequantization: 16 codes of one row per thread (rows have cols % 32 == 0, so a group never
 * crosses a row or a block). value = RN(fp8 * 2^(e-127)), narrowed RNE to out's dtype. */
constexpr int kDequantThreads = 256;

template <typename Out, bool kVec>
__global__ void __launch_bounds__(kDequantThreads)
dequantize_kernel(const uint8_t *__restrict__ codes, const uint8_t *__restrict__ exps,
                  int64_t rows, int64_t cols, int e5m2, typename Out::storage *__restrict__ out,
                  int64_t ld) {
    using T = typename Out::storage;
    const int64_t groups_per_row = cols / 16, n = rows * groups_per_row;
    for (int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; g < n;
         g += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = g / groups_per_row, c = (g - r * groups_per_row) * 16;
        uint32_t words[4];
        if (kVec) {
            const uint4 u = *reinterpret_cast<const uint4 *>(codes + r * cols + c);
            words[0] = u.x, words[1] = u.y, words[2] = u.z, words[3] = u.w;
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint8_t *b = codes + r * cols + c + 4 * i;
                words[i] = b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
            }
        }
        const float scale = tq_e8m0_to_f32(exps[r * (cols / kBlock) + c / kBlock]);
        __align__(16) T vals[16];
#pragma unroll
        for (int i = 0; i < 16; i++)
            vals[i] = Out::narrow(tq_fp8_to_f32((uint8_t)(words[i >> 2] >> (8 * (i & 3))), e5m2) * scale);
        T *dst = out + r * ld + c;
        if (kVec) {
#pragma unroll
            for (int i = 0; i < (int)sizeof(vals) / 16; i++)
                reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(vals)[i];
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++) dst[i] = vals[i];
        }
    }
}

template <typename Out>
void launch_dequantize(bool vec, const uint8_t *codes, const uint8_t *exps, int64_t rows,
                       int64_t cols, int e5m2, tq_tensor *out, int device, cudaStream_t st) {
    const int64_t n = rows * (cols / 16);
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    int64_t blocks = (n + kDequantThreads - 1) / kDequantThreads;
    if (blocks > 16LL * sms) blocks = 16LL * sms;
    auto *o = static_cast<typename Out::storage *>(out->data);
    if (vec)
        dequantize_kernel<Out, true><<<(unsigned)blocks, kDequantThreads, 0, st>>>(codes, exps, rows, cols, e5m2, o, out->ld);
    else
        dequantize_kernel<Out, false><<<(unsigned)blocks, kDequantThreads, 0, st>>>(codes, exps, rows, cols, e5m2, o, out->ld);
}

}  // namespace

extern "C" tq_status tq_dequantize_mxfp8_cuda(const tq_quant_config *config, const tq_qtensor *q,
                                              uint32_t usage, tq_tensor *out,
                                              struct CUstream_st *stream) {
    const bool rowwise = usage == TQ_USAGE_ROWWISE;
    const tq_tensor *data = rowwise ? &q->data : &q->data_t;
    const tq_tensor *scale = rowwise ? &q->scale_inv : &q->scale_inv_t;
    if (data->rows == 0 || data->cols == 0) return TQ_SUCCESS;
    DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return launch_failed("mxfp8 dequantize: making out's device current");
    const int esize = out->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    /* Code rows are multiples of 32 bytes, so aligned when their base is (torch's always is). */
    const bool vec = aligned16(data->data) && aligned16(out->data) && (out->ld * esize) % 16 == 0;
    const int e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const auto *codes = static_cast<const uint8_t *>(data->data);
    const auto *exps = static_cast<const uint8_t *>(scale->data);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32:
            launch_dequantize<OutF32>(vec, codes, exps, data->rows, data->cols, e5m2, out, out->device, st);
            break;
        case TQ_DTYPE_BFLOAT16:
            launch_dequantize<OutBf16>(vec, codes, exps, data->rows, data->cols, e5m2, out, out->device, st);
            break;
        default:
            launch_dequantize<OutF16>(vec, codes, exps, data->rows, data->cols, e5m2, out, out->device, st);
            break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("mxfp8 dequantize kernel launch");
    return TQ_SUCCESS;
}
