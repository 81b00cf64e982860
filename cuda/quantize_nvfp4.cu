/* quantize_nvfp4.cu: tq_quantize on CUDA for NVFP4 (NUMERICS.md 2 "NVFP4", "RHT", 3.1-3.3;
 * TE_REFERENCE A.5). Per direction with its global amax A: S_enc = tq_nvfp4_s_enc(A), per block
 * of 16 (or 16x16 tile, TQ_QUANT_2D) s_b = block_scale(amax_b, RN(S_enc*RN(1/6))),
 * code = cvt4(RN(v * tq_nvfp4_block_enc(s_b, RN(1/S_enc)))), or stochastic rounding with the
 * Philox bytes of the element's output index. Columnwise quantizes x^T, or RN_bf16(RHT) of
 * each 16-row group with TQ_QUANT_RHT. Two launches, no host sync: pass 1 reads x for the
 * global amaxes (q->amax, post-RHT q->amax_t; skipped when the caller gives them, a shard's
 * all-reduced amaxes); pass 2 reads each 128-row tile once into shared
 * memory and writes both directions. A tensor of at most 64K elements takes one launch of one
 * CTA running both passes (small_kernel). Pass 2 is issue-bound on Hopper (no E2M1 convert before
 * sm_100), so the per-element work is cut to the bone: the RHT is formats.h's butterfly, E2M1
 * codes come from one FPU-rounded add (e2m1_grid_code), block scales use the hardware E4M3
 * convert and an IEEE reciprocal (those per-element codings: nvfp4_codes.cuh). Dequantize: quantize_nvfp4_dequant.cu. Reference: csrc/ref/quantize_nvfp4_ref.c
 * (bit for bit). Tests: tests/test_quantize_nvfp4.py, tests/test_quantize_nvfp4_rht_sr.py.
 */
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "chunks.cuh"
#include "internal_kernels.h"
#include "launch.cuh"
#include "nvfp4_codes.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;
using tq_nvfp4::block_enc;
using tq_nvfp4::block_scale;
using tq_nvfp4::e2m1_rn_biased;
using tq_nvfp4::e2m1_sr_biased;
using tq_nvfp4::kGridBias;

constexpr int kThreads = 256;
constexpr int kTileRows = 128;               /* rows of x per pass-2 tile */
constexpr int kCastBlocksPerSm = 3;          /* pass 2 is latency bound at 2 CTAs (96 registers) */
constexpr int kTileBytes = 256;              /* bytes of x per tile row: 128 16-bit or 64 fp32 */
constexpr int kSmemStride = kTileBytes + 16; /* padding: row r starts 4*r banks further, so the
                                                rowwise 16-byte reads of 8 rows never collide */

/* Element types: how a stored element widens to fp32 exactly. */
struct F32 {
    using storage = float;
    static __device__ __forceinline__ float widen(float v) { return v; }
};
struct BF16 {
    using storage = uint16_t;
    static __device__ __forceinline__ float widen(uint16_t v) { return tq_bf16_to_f32(v); }
};
struct F16 {
    using storage = uint16_t;
    /* The hardware half -> single convert is exact, like tq_f16_to_f32 (NaN payloads aside). */
    static __device__ __forceinline__ float widen(uint16_t v) { return __half2float(__ushort_as_half(v)); }
};

/* Widens the n = 16 / sizeof(storage) elements packed in a 16-byte chunk. */
template <typename E>
__device__ __forceinline__ void widen_chunk(const uint4 &chunk, float *out) {
    using T = typename E::storage;
    constexpr int n = 16 / sizeof(T);
    T elems[n];
    memcpy(elems, &chunk, 16);
#pragma unroll
    for (int i = 0; i < n; i++) out[i] = E::widen(elems[i]);
}

/* Loads the V-sized chunk (uint4 or uint32_t) of x at row r, element column c: one vector load
 * when rows are sizeof(V)-aligned (kVec), else element by element. */
template <typename E, typename V, bool kVec>
__device__ __forceinline__ V load_chunk(const typename E::storage *x, int64_t ld, int64_t r,
                                        int64_t c) {
    using T = typename E::storage;
    const T *src = x + r * ld + c;
    if (kVec) return __ldg(reinterpret_cast<const V *>(src));
    constexpr int n = sizeof(V) / sizeof(T);
    T elems[n];
#pragma unroll
    for (int i = 0; i < n; i++) elems[i] = src[i];
    V chunk;
    memcpy(&chunk, elems, sizeof(V));
    return chunk;
}

/* RN_bf16 as a value: the hardware convert (F2FP) rounds like tq_f32_to_bf16 for every non-NaN
 * input; a NaN stays a NaN (payload aside), and NaN payloads never reach a code or an amax. */
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

/* The RHT of one group of 16 consecutive rows of a column (NUMERICS 2): inputs rounded to bf16,
 * formats.h's tq_rht16 butterfly (its order, bit for bit), outputs rounded to bf16 unless the
 * caller rounds later. Widened bf16 inputs round to themselves: no rounding for BF16. */
template <typename E, bool kRoundOut = true>
__device__ __forceinline__ void rht16(float *v) {
#pragma unroll
    for (int i = 0; i < 16; i++)
        if (!std::is_same<E, BF16>::value) v[i] = round_bf16(v[i]);
    tq_rht16(v);
#pragma unroll
    for (int j = 0; j < 16; j++)
        if (kRoundOut) v[j] = round_bf16(v[j]);
}

__device__ __forceinline__ float warp_amax(float m, int lanes) {
    for (int offset = 1; offset < lanes; offset <<= 1)
        m = tq_amax_step(m, __shfl_xor_sync(0xffffffffu, m, offset));
    return m;
}

/* The block's max of the threads' m, in thread 0 (scratch: kThreads / 32 floats). */
__device__ __forceinline__ float block_amax(float m, float *scratch) {
    m = warp_amax(m, 32);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : 0.0f;
        m = warp_amax(m, 32);
    }
    __syncthreads();
    return m;
}

/* Per-thread max-reduction to one atomicMax per block (values >= 0 and never NaN, so comparing
 * the float bits as unsigned integers orders them). */
__device__ __forceinline__ void block_amax_to(float m, float *out, float *scratch) {
    m = block_amax(m, scratch);
    if (threadIdx.x == 0 && m > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(out), __float_as_uint(m));
}

struct AmaxParams {
    const void *x;
    int64_t rows, cols, ld;
    float *amax;   /* max|x|, or NULL when not needed */
    float *amax_t; /* columnwise: max|x| without RHT, max|RN_bf16(RHT)| with it; or NULL */
};

/* Pass 1. Work item = 16 rows x one chunk of columns (16 bytes; 4 bytes with the RHT, whose 16
 * outputs per column would not fit in registers for 8 columns); consecutive threads take
 * consecutive chunks of the same rows (coalesced). The RHT groups are the item's 16 rows. */
template <typename E, bool kVec, bool kRht>
__device__ __forceinline__ void amax_items(const AmaxParams &p, int64_t first, int64_t stride,
                                           float &amax, float &amax_rht) {
    using T = typename E::storage;
    using V = typename std::conditional<kRht, uint32_t, uint4>::type;
    constexpr int n = sizeof(V) / sizeof(T);
    const T *x = static_cast<const T *>(p.x);
    const int64_t chunks_per_row = p.cols / n, items = (p.rows / 16) * chunks_per_row;
    for (int64_t item = first; item < items; item += stride) {
        const int64_t r0 = item / chunks_per_row * 16, c = item % chunks_per_row * n;
        T elems[16][n];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const V raw = load_chunk<E, V, kVec>(x, p.ld, r0 + i, c);
            memcpy(elems[i], &raw, sizeof(V));
        }
#pragma unroll
        for (int i = 0; i < 16; i++)
#pragma unroll
            for (int e = 0; e < n; e++) amax = tq_amax_step(amax, E::widen(elems[i][e]));
        if (kRht) {
#pragma unroll
            for (int e = 0; e < n; e++) { /* column c + e: one RHT group */
                float group[16];
#pragma unroll
                for (int i = 0; i < 16; i++) group[i] = E::widen(elems[i][e]);
                /* max_j |RN_bf16(y_j)| = RN_bf16(max_j |y_j|): the rounding is monotonic and
                 * odd (NaN ignored either way), so round the group's max once. */
                rht16<E, false>(group);
                float group_max = 0.0f;
#pragma unroll
                for (int j = 0; j < 16; j++) group_max = tq_amax_step(group_max, group[j]);
                amax_rht = tq_amax_step(amax_rht, round_bf16(group_max));
            }
        }
    }
}

template <typename E, bool kVec, bool kRht>
__global__ void __launch_bounds__(kThreads) amax_kernel(AmaxParams p) {
    float amax = 0.0f, amax_rht = 0.0f;
    amax_items<E, kVec, kRht>(p, (int64_t)blockIdx.x * kThreads + threadIdx.x,
                              (int64_t)gridDim.x * kThreads, amax, amax_rht);
    __shared__ float scratch[kThreads / 32];
    if (p.amax != nullptr) block_amax_to(amax, p.amax, scratch);
    if (p.amax_t != nullptr) block_amax_to(kRht ? amax_rht : amax, p.amax_t, scratch);
}

struct CastParams {
    const void *x;
    int64_t rows, cols, ld;
    uint8_t *data, *scale_inv;     /* rowwise [M, K/2] bytes, [M, K/16]; NULL when not produced */
    uint8_t *data_t, *scale_inv_t; /* columnwise [K, M/2], [K, M/16]; NULL when not produced */
    const float *amax, *amax_t;    /* the global amaxes written by pass 1 */
    int vec16; /* every row of x starts 16-byte aligned */
    uint64_t seed, offset;
    const uint64_t *rng_state; /* when set, (seed, offset) read at run time (CUDA graphs) */
};

/* The per-tensor factors of one direction from its global amax (device memory, no host sync). */
struct TensorScale {
    float s_dec, s_enc_div6;
    __device__ explicit TensorScale(const float *amax) {
        const float s_enc = tq_nvfp4_s_enc(amax != nullptr ? *amax : 0.0f);
        s_dec = tq_rcp(s_enc);
        s_enc_div6 = s_enc * TQ_RCP_6;
    }
};

/* Quantizes the 16 values of one block with its block amax: returns its E4M3 scale byte and
 * writes the 16 codes packed into 8 bytes (even element in the low nibble). `group` is the
 * block's Philox group (its first output index / 16) when stochastic rounding is on. */
template <bool kSr>
__device__ __forceinline__ uint8_t quantize_block(const float *v, float block_amax,
                                                  const TensorScale &ts, const CastParams &p,
                                                  uint64_t group, uint2 *packed) {
    const uint8_t s_b = block_scale(block_amax, ts.s_enc_div6);
    const float enc = block_enc(s_b, ts.s_dec);
    uint32_t words[4] = {0, 0, 0, 0};
    if (kSr) tq_sr_group_bits(p.seed, p.offset, group, words);
    uint32_t mag[2] = {0, 0}, sign[2] = {0, 0};
#pragma unroll
    for (int e = 0; e < 16; e++) {
        const float scaled = tq_mul(v[e], enc);
        const uint32_t code = kSr ? e2m1_sr_biased(scaled, words[e / 4], e % 4) : e2m1_rn_biased(scaled);
        const int shift = 4 * (e % 8);
        mag[e / 8] += code << shift;
        sign[e / 8] |= (__float_as_uint(scaled) >> (28 - shift)) & (8u << shift);
    }
    *packed = make_uint2((mag[0] - kGridBias) | sign[0], (mag[1] - kGridBias) | sign[1]);
    return s_b;
}

/* The staged output of one direction (shared memory) -> global memory, coalesced: `lines` lines
 * of `pieces` 8-byte pieces each (line l, piece j at stage[l * pitch + 8 j]) go to
 * dst + l * dst_ld + 8 j, consecutive lanes taking consecutive pieces of a line, so each store
 * instruction writes whole 32-byte sectors. Only lines < n_lines and pieces < n_pieces exist. */
template <int kPieces>
__device__ __forceinline__ void copy_out(const uint8_t *stage, int pitch, int lines, int n_lines,
                                         int n_pieces, uint8_t *dst, int64_t dst_ld) {
    for (int idx = threadIdx.x; idx < lines * kPieces; idx += kThreads) {
        const int l = idx / kPieces, j = idx % kPieces;
        if (l < n_lines && j < n_pieces)
            *reinterpret_cast<uint2 *>(dst + l * dst_ld + 8 * j) = *reinterpret_cast<const uint2 *>(stage + l * pitch + 8 * j);
    }
}

/* The staged scale bytes of `lines` lines (8 per line at scales[8 l]; n_valid of them exist)
 * -> dst + l * dst_ld: one 8-byte store per line when all 8 exist and dst is aligned, else
 * byte by byte. */
__device__ __forceinline__ void copy_scales(const uint8_t *scales, int lines, int n_lines, int n_valid,
                                            uint8_t *dst, int64_t dst_ld) {
    for (int l = threadIdx.x; l < n_lines && l < lines; l += kThreads) {
        uint8_t *d = dst + l * dst_ld;
        if (n_valid == 8 && (reinterpret_cast<uintptr_t>(d) & 7) == 0) {
            *reinterpret_cast<uint2 *>(d) = *reinterpret_cast<const uint2 *>(scales + 8 * l);
        } else {
            for (int i = 0; i < n_valid; i++) d[i] = scales[8 * l + i];
        }
    }
}

/* Pass 2: one CTA per 128-row x 256-byte tile of x, read once into shared memory.
 * Rowwise: thread t takes row t % 128 and half t / 128 of the tile's columns (2 or 4 blocks),
 * so a warp reads 32 rows at the same offset (conflict-free with the padded stride). With 2D,
 * the 16 lanes of a tile's 16 rows reduce its amax.
 * Columnwise: thread t takes the 4-byte word column t % 64 (2 16-bit columns or 1 fp32 column)
 * and rows 32*(t / 64) .. +31 (two groups of 16), so a warp reads 32 consecutive words of a row.
 * Each direction's codes and scales are staged in shared memory and leave as coalesced
 * stores (copy_out): written straight from the threads above, every store instruction touched
 * 32 half-filled sectors, and L2 traffic (6x the bytes written) bounded the kernel. */
template <typename E, bool kRht, bool k2D, bool kSr>
__device__ __forceinline__ void cast_tile(const CastParams &p, int64_t tile_index) {
    using T = typename E::storage;
    constexpr int kTileCols = kTileBytes / (int)sizeof(T);
    constexpr int kChunkElems = 16 / (int)sizeof(T);
    constexpr int kChunksPerRow = kTileBytes / 16;
    __shared__ __align__(16) uint8_t tile[kTileRows * kSmemStride];
    /* Output staging, one direction at a time: codes (kTileCols/2 bytes per row, or 64 per
     * column, padded pitches against bank conflicts), then 8 scale bytes per line. */
    constexpr int kRowPitch = kTileCols / 2 + 16, kColPitch = kTileRows / 2 + 8;
    constexpr int kRowStage = kTileRows * kRowPitch + 8 * kTileRows;
    constexpr int kColStage = kTileCols * kColPitch + 8 * kTileCols;
    __shared__ __align__(16) uint8_t stage[kRowStage > kColStage ? kRowStage : kColStage];

    const int64_t tiles_k = (p.cols + kTileCols - 1) / kTileCols;
    const int64_t m0 = tile_index / tiles_k * kTileRows;
    const int64_t k0 = tile_index % tiles_k * kTileCols;
    const int tile_rows = (int)min((int64_t)kTileRows, p.rows - m0); /* multiples of 16 */
    const int tile_cols = (int)min((int64_t)kTileCols, p.cols - k0);
    const T *x = static_cast<const T *>(p.x);

    /* The whole tile is requested before anything waits: cp.async (16 bytes, zero-filled
     * outside x) when rows are 16-byte aligned, else all element loads into registers first. */
    constexpr int kChunksPerThread = kTileRows * kChunksPerRow / kThreads;
    if (p.vec16) {
#pragma unroll
        for (int i = 0; i < kChunksPerThread; i++) {
            const int chunk = i * kThreads + threadIdx.x;
            const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow * kChunkElems;
            const bool inside = r < tile_rows && c < tile_cols;
            const T *src = inside ? x + (m0 + r) * p.ld + k0 + c : x;
            tq_chunk::copy16_async_or_zeros(&tile[r * kSmemStride + c * (int)sizeof(T)], src,
                                            inside);
        }
        tq_chunk::copies_commit();
        tq_chunk::copies_wait();
    } else {
        uint4 v[kChunksPerThread];
#pragma unroll
        for (int i = 0; i < kChunksPerThread; i++) {
            const int chunk = i * kThreads + threadIdx.x;
            const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow * kChunkElems;
            v[i] = make_uint4(0u, 0u, 0u, 0u);
            if (r < tile_rows && c < tile_cols) v[i] = load_chunk<E, uint4, false>(x, p.ld, m0 + r, k0 + c);
        }
#pragma unroll
        for (int i = 0; i < kChunksPerThread; i++) {
            const int chunk = i * kThreads + threadIdx.x;
            const int r = chunk / kChunksPerRow, c = chunk % kChunksPerRow * kChunkElems;
            *reinterpret_cast<uint4 *>(&tile[r * kSmemStride + c * (int)sizeof(T)]) = v[i];
        }
    }
    __syncthreads();

    if (p.data != nullptr) {
        constexpr int kBlocks = kTileCols / 2 / 16; /* per thread: 4 (16-bit) or 2 (fp32) */
        const TensorScale ts(p.amax);
        const int r = threadIdx.x % kTileRows, half = threadIdx.x / kTileRows;
        const int c_first = half * (kTileCols / 2);
        const int64_t m = m0 + r;
        uint8_t *row_scales = stage + kTileRows * kRowPitch;
#pragma unroll
        for (int b = 0; b < kBlocks; b++) {
            const int c = c_first + b * 16;
            float v[16];
#pragma unroll
            for (int q = 0; q < 16 / kChunkElems; q++)
                widen_chunk<E>(*reinterpret_cast<const uint4 *>(
                                   &tile[r * kSmemStride + (c + q * kChunkElems) * (int)sizeof(T)]),
                               &v[q * kChunkElems]);
            float amax_b = 0.0f;
#pragma unroll
            for (int e = 0; e < 16; e++) amax_b = tq_amax_step(amax_b, v[e]);
            if (k2D) amax_b = warp_amax(amax_b, 16); /* lanes 16a..16a+15 = the tile's rows */
            const int64_t k = k0 + c;
            const uint64_t group = (uint64_t)(m * p.cols + k) / 16u;
            uint2 packed;
            row_scales[8 * r + c / 16] = quantize_block<kSr>(v, amax_b, ts, p, group, &packed);
            *reinterpret_cast<uint2 *>(&stage[r * kRowPitch + c / 2]) = packed;
        }
        __syncthreads();
        copy_out<kTileCols / 16>(stage, kRowPitch, kTileRows, tile_rows, tile_cols / 16,
                                 p.data + (m0 * p.cols + k0) / 2, p.cols / 2);
        copy_scales(row_scales, kTileRows, tile_rows, tile_cols / 16, p.scale_inv + m0 * (p.cols / 16) + k0 / 16,
                    p.cols / 16);
        __syncthreads(); /* the columnwise direction reuses the stage */
    }

    if (p.data_t != nullptr) {
        constexpr int kColsPerWord = 4 / (int)sizeof(T);
        constexpr int kWordCols = kTileBytes / 4;
        const TensorScale ts(p.amax_t);
        const int wc = threadIdx.x % kWordCols, quarter = threadIdx.x / kWordCols;
        uint8_t *col_scales = stage + kTileCols * kColPitch;
        const int r_first = quarter * 32;
        /* The thread's word column, rows r_first + i: one 4-byte shared load per row (a warp
         * reads 32 consecutive words of one row: no bank conflict), kept packed; columns are
         * widened one at a time to keep 32 floats live, not 64. */
        const uint8_t *base = &tile[r_first * kSmemStride + wc * 4];
        uint32_t words[32];
#pragma unroll
        for (int i = 0; i < 32; i++) words[i] = *reinterpret_cast<const uint32_t *>(base + i * kSmemStride);
        auto value = [&](int i, int c) {
            T elems[kColsPerWord];
            memcpy(elems, &words[i], 4);
            return E::widen(elems[c]);
        };
        float tile_amax[2] = {0.0f, 0.0f}; /* 2D: per group, over the 16x16 tile */
        if (k2D) {
#pragma unroll
            for (int c = 0; c < kColsPerWord; c++)
#pragma unroll
                for (int i = 0; i < 32; i++) tile_amax[i / 16] = tq_amax_step(tile_amax[i / 16], value(i, c));
#pragma unroll /* the lanes holding the tile's 16 columns */
            for (int g = 0; g < 2; g++) tile_amax[g] = warp_amax(tile_amax[g], 16 / kColsPerWord);
        }
#pragma unroll
        for (int c = 0; c < kColsPerWord; c++) {
            float v[32];
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = value(i, c);
            const int col = wc * kColsPerWord + c;
            const int64_t k = k0 + col, m = m0 + r_first;
#pragma unroll
            for (int g = 0; g < 2; g++) {
                float *group_v = &v[16 * g];
                if (kRht) rht16<E>(group_v);
                float amax_g = tile_amax[g];
                if (!k2D) {
#pragma unroll
                    for (int i = 0; i < 16; i++) amax_g = tq_amax_step(amax_g, group_v[i]);
                }
                const uint64_t group = (uint64_t)(k * p.rows + m) / 16u + (uint64_t)g;
                uint2 packed;
                col_scales[8 * col + r_first / 16 + g] = quantize_block<kSr>(group_v, amax_g, ts, p, group, &packed);
                *reinterpret_cast<uint2 *>(&stage[col * kColPitch + r_first / 2 + 8 * g]) = packed;
            }
        }
        __syncthreads();
        copy_out<kTileRows / 16>(stage, kColPitch, kTileCols, tile_cols, tile_rows / 16,
                                 p.data_t + (k0 * p.rows + m0) / 2, p.rows / 2);
        copy_scales(col_scales, kTileCols, tile_cols, tile_rows / 16, p.scale_inv_t + k0 * (p.rows / 16) + m0 / 16,
                    p.rows / 16);
    }
}

template <typename E, bool kRht, bool k2D, bool kSr>
__global__ void __launch_bounds__(kThreads, kSr ? 2 : kCastBlocksPerSm) cast_kernel(CastParams p) {
    if (kSr && p.rng_state != nullptr) p.seed = p.rng_state[0], p.offset = p.rng_state[1];
    cast_tile<E, kRht, k2D, kSr>(p, blockIdx.x);
}

/* A small x (at most kSmallElems elements) in ONE launch and one CTA: the amaxes (stored, so no
 * memset first), then every tile in turn. Both passes are the ones above, in the same order of
 * operations per element, so the bits are the two-launch path's. Small tensors are bound by
 * launch overhead (two launches and two memsets otherwise), not by bandwidth. */
constexpr int64_t kSmallElems = 1 << 16;

template <typename E, bool kRht, bool k2D, bool kSr>
__global__ void __launch_bounds__(kThreads) small_kernel(AmaxParams ap, CastParams p) {
    if (kSr && p.rng_state != nullptr) p.seed = p.rng_state[0], p.offset = p.rng_state[1];
    float amax = 0.0f, amax_rht = 0.0f;
    /* element loads (any alignment); the RHT amax only when the columnwise copy is made */
    if (kRht && ap.amax_t != nullptr) amax_items<E, false, true>(ap, threadIdx.x, kThreads, amax, amax_rht);
    else amax_items<E, false, false>(ap, threadIdx.x, kThreads, amax, amax_rht);
    __shared__ float scratch[kThreads / 32];
    amax = block_amax(amax, scratch);
    const bool rht_t = kRht && ap.amax_t != nullptr;
    amax_rht = rht_t ? block_amax(amax_rht, scratch) : amax;
    if (threadIdx.x == 0) {
        if (ap.amax != nullptr) *ap.amax = amax;
        if (ap.amax_t != nullptr) *ap.amax_t = amax_rht;
    }
    __syncthreads(); /* the tiles read the amaxes back through p.amax / p.amax_t */
    const int64_t tile_cols = kTileBytes / (int64_t)sizeof(typename E::storage);
    const int64_t tiles = (p.rows + kTileRows - 1) / kTileRows * ((p.cols + tile_cols - 1) / tile_cols);
    for (int64_t t = 0; t < tiles; t++) {
        cast_tile<E, kRht, k2D, kSr>(p, t);
        __syncthreads(); /* the next tile reuses the shared buffers */
    }
}


template <typename E, bool kVec>
void launch_amax(const AmaxParams &ap, bool rht, int sms, cudaStream_t s) {
    const int64_t chunk = rht ? 4 : 16;
    const int64_t items = ap.rows / 16 * (ap.cols / (chunk / (int64_t)sizeof(typename E::storage)));
    const int64_t blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, 8LL * sms);
    if (rht) amax_kernel<E, kVec, true><<<(unsigned)blocks, kThreads, 0, s>>>(ap);
    else amax_kernel<E, kVec, false><<<(unsigned)blocks, kThreads, 0, s>>>(ap);
}

template <typename E, bool kSr>
void launch_cast(const CastParams &cp, bool rht, bool two_d, cudaStream_t s) {
    using T = typename E::storage;
    constexpr int64_t kTileCols = kTileBytes / sizeof(T);
    const int64_t tiles = (cp.rows + kTileRows - 1) / kTileRows * ((cp.cols + kTileCols - 1) / kTileCols);
    if (two_d) cast_kernel<E, false, true, kSr><<<(unsigned)tiles, kThreads, 0, s>>>(cp);
    else if (rht) cast_kernel<E, true, false, kSr><<<(unsigned)tiles, kThreads, 0, s>>>(cp);
    else cast_kernel<E, false, false, kSr><<<(unsigned)tiles, kThreads, 0, s>>>(cp);
}

template <typename E, bool kSr>
void launch_small(const AmaxParams &ap, const CastParams &cp, bool rht, bool two_d, cudaStream_t s) {
    if (two_d) small_kernel<E, false, true, kSr><<<1, kThreads, 0, s>>>(ap, cp);
    else if (rht) small_kernel<E, true, false, kSr><<<1, kThreads, 0, s>>>(ap, cp);
    else small_kernel<E, false, false, kSr><<<1, kThreads, 0, s>>>(ap, cp);
}

/* vec16 / vec4: every row start of x is 16- / 4-byte aligned. The amax pass uses the RHT
 * kernel only when the columnwise amax needs the transform. */
template <typename E>
void launch(const AmaxParams &ap, const CastParams &cp, bool vec16, bool vec4, bool rht, bool two_d,
            bool sr, bool amax_given, int sms, cudaStream_t s) {
    if (amax_given) { /* the amaxes are in place: pass 2 alone */
        if (sr) launch_cast<E, true>(cp, rht, two_d, s);
        else launch_cast<E, false>(cp, rht, two_d, s);
        return;
    }
    if (ap.rows * ap.cols <= kSmallElems) {
        if (sr) launch_small<E, true>(ap, cp, rht, two_d, s);
        else launch_small<E, false>(ap, cp, rht, two_d, s);
        return;
    }
    const bool rht_amax = rht && ap.amax_t != nullptr;
    const bool amax_vec = rht_amax ? vec4 : vec16;
    if (amax_vec) launch_amax<E, true>(ap, rht_amax, sms, s);
    else launch_amax<E, false>(ap, rht_amax, sms, s);
    if (cudaPeekAtLastError() != cudaSuccess) return;
    if (sr) launch_cast<E, true>(cp, rht, two_d, s);
    else launch_cast<E, false>(cp, rht, two_d, s);
}

}  // namespace

extern "C" tq_status tq_quantize_nvfp4_cuda(const tq_tensor *x, const tq_quant_config *config,
                                            const tq_quantize_args *args, tq_qtensor *q,
                                            struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return cuda_failed("NVFP4 quantize: making x's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const bool row = (args->usage & TQ_USAGE_ROWWISE) != 0, col = (args->usage & TQ_USAGE_COLUMNWISE) != 0;
    const bool rht = (config->flags & TQ_QUANT_RHT) != 0, two_d = (config->flags & TQ_QUANT_2D) != 0;
    float *amax = row ? static_cast<float *>(q->amax.data) : nullptr;
    float *amax_t = col ? static_cast<float *>(q->amax_t.data) : nullptr;
    /* the tiled pass 1 max-accumulates into zeroed amaxes; the one-CTA path stores them; given
     * amaxes (a shard's all-reduced ones, tq_quantize_args.amax) are copied in, no pass 1 */
    const void *given = args->amax.data, *given_t = args->amax_t.data ? args->amax_t.data : given;
    const bool small = !given && x->rows * x->cols > 0 && x->rows * x->cols <= kSmallElems;
    cudaError_t err = cudaSuccess;
    for (int i = 0; i < 2 && err == cudaSuccess; i++) {
        float *slot = i ? amax_t : amax;
        if (slot != nullptr && given)
            err = cudaMemcpyAsync(slot, i ? given_t : given, sizeof(float), cudaMemcpyDeviceToDevice, s);
        else if (slot != nullptr && !small) err = cudaMemsetAsync(slot, 0, sizeof(float), s);
    }
    if (err != cudaSuccess) return cuda_failed("NVFP4 quantize: setting the amaxes", err);
    if (x->rows == 0 || x->cols == 0) return TQ_SUCCESS;
    if ((x->rows / kTileRows + 1) * (x->cols / 64 + 1) > INT32_MAX)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "NVFP4 quantize: x [%lld, %lld] needs more tiles "
                       "than one launch takes", (long long)x->rows, (long long)x->cols);
    int sms = 132;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x->device) != cudaSuccess) sms = 132;

    const AmaxParams ap = {x->data, x->rows, x->cols, x->ld, amax, amax_t};
    CastParams cp = {x->data, x->rows, x->cols, x->ld, nullptr, nullptr, nullptr, nullptr,
                     amax, amax_t, 0, args->rng_seed, args->rng_offset,
                     static_cast<const uint64_t *>(args->rng_state.data)};
    const bool sr = (config->flags & TQ_QUANT_STOCHASTIC_ROUNDING) != 0;
    if (row) cp.data = static_cast<uint8_t *>(q->data.data), cp.scale_inv = static_cast<uint8_t *>(q->scale_inv.data);
    if (col) cp.data_t = static_cast<uint8_t *>(q->data_t.data), cp.scale_inv_t = static_cast<uint8_t *>(q->scale_inv_t.data);
    /* 16-byte loads need every row start aligned: the base pointer and the row pitch. */
    const int64_t elem = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const uintptr_t base = reinterpret_cast<uintptr_t>(x->data);
    const bool vec16 = (base & 15) == 0 && (x->ld * elem) % 16 == 0;
    const bool vec4 = (base & 3) == 0 && (x->ld * elem) % 4 == 0;
    cp.vec16 = vec16;
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32: launch<F32>(ap, cp, vec16, vec4, rht, two_d, sr, given != nullptr, sms, s); break;
        case TQ_DTYPE_BFLOAT16: launch<BF16>(ap, cp, vec16, vec4, rht, two_d, sr, given != nullptr, sms, s); break;
        default: launch<F16>(ap, cp, vec16, vec4, rht, two_d, sr, given != nullptr, sms, s); break;
    }
    err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("NVFP4 quantize kernel launch", err);
    return TQ_SUCCESS;
}
