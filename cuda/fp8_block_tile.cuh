/* fp8_block_tile.cuh: the FP8 block-scaling tile kernel (one CTA per 128x128 tile, both
 * directions), internal to cuda/: quantize_fp8_block.cu runs it on x itself (RawLoad),
 * act_quantize_block.cu on an activation computed as the tile is loaded (ActLoad there). The
 * tile's work is quantize_tile, so a kernel can take tiles of two tensors (quantize_fp8_block.cu's
 * quantize_pair_kernel). The rule and the layout are quantize_fp8_block.cu's header comment.
 * Tests: tests/test_quantize_fp8_block.py, tests/test_act_block.py (GPU cases: bit-exact
 * against the CPU references).
 */
#ifndef TEQUANT_CUDA_FP8_BLOCK_TILE_CUH_
#define TEQUANT_CUDA_FP8_BLOCK_TILE_CUH_

#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "tile_transpose.cuh"
#include "tequant/formats.h"
#include "tequant/tequant.h"

namespace tq_block {


constexpr int kTile = 128;   /* block length and CTA tile edge */
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
using tq_tile::kSmemChunks;

/* max of two pairs of 16-bit floats, per half: exact, and a NaN half yields the other operand's
 * half (PTX max without .NaN), so NaN never wins: tq_amax_step's rule, two elements at a time. */
__device__ __forceinline__ uint32_t max_bf16x2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ uint32_t max_f16x2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

/* Input element types, seen as 32-bit words of kPerWord elements (element e in bits 16e..).
 * Acc holds, per element position of a word, the running max |x| (NaN ignored, exact: the same
 * value as folding tq_amax_step over the widened elements); acc_elem widens one position.
 * widen is the exact widening of formats.h, narrow its RNE narrowing (an element's bits). */
struct F32 {
    static constexpr int kPerWord = 1;
    using Acc = float;
    static __device__ __forceinline__ Acc acc_zero() { return 0.0f; }
    static __device__ __forceinline__ Acc acc_word(Acc a, uint32_t w) {
        return fmaxf(a, fabsf(__uint_as_float(w))); /* fmaxf drops a NaN operand */
    }
    static __device__ __forceinline__ Acc acc_max(Acc a, Acc b) { return fmaxf(a, b); }
    static __device__ __forceinline__ float acc_elem(Acc a, int) { return a; }
    static __device__ __forceinline__ float widen(uint32_t w, int) { return __uint_as_float(w); }
    static __device__ __forceinline__ uint32_t narrow(float v) { return __float_as_uint(v); }
};
struct BF16 {
    static constexpr int kPerWord = 2;
    using Acc = uint32_t;
    static __device__ __forceinline__ Acc acc_zero() { return 0u; }
    static __device__ __forceinline__ Acc acc_word(Acc a, uint32_t w) { return max_bf16x2(a, w & 0x7FFF7FFFu); }
    static __device__ __forceinline__ Acc acc_max(Acc a, Acc b) { return max_bf16x2(a, b); }
    static __device__ __forceinline__ float acc_elem(Acc a, int e) { return widen(a, e); }
    static __device__ __forceinline__ float widen(uint32_t w, int e) {
        return tq_bf16_to_f32((uint16_t)(w >> (16 * e)));
    }
    static __device__ __forceinline__ uint32_t narrow(float v) { return tq_f32_to_bf16(v); }
    /* two values in one word (lo in the low half): the hardware's RNE, narrow's bits but for a
     * NaN's payload (pass canonical NaNs: fp_cast.cuh) */
    static __device__ __forceinline__ uint32_t narrow2(float lo, float hi) {
        return tq_fp::narrow2(lo, hi, static_cast<const tq_fp::Bf16 *>(nullptr));
    }
};
struct F16 {
    static constexpr int kPerWord = 2;
    using Acc = uint32_t;
    static __device__ __forceinline__ Acc acc_zero() { return 0u; }
    static __device__ __forceinline__ Acc acc_word(Acc a, uint32_t w) { return max_f16x2(a, w & 0x7FFF7FFFu); }
    static __device__ __forceinline__ Acc acc_max(Acc a, Acc b) { return max_f16x2(a, b); }
    static __device__ __forceinline__ float acc_elem(Acc a, int e) { return widen(a, e); }
    static __device__ __forceinline__ float widen(uint32_t w, int e) {
        return tq_f16_to_f32((uint16_t)(w >> (16 * e)));
    }
    static __device__ __forceinline__ uint32_t narrow(float v) { return tq_f32_to_f16(v); }
    static __device__ __forceinline__ uint32_t narrow2(float lo, float hi) {
        return tq_fp::narrow2(lo, hi, static_cast<const tq_fp::Half *>(nullptr));
    }
};

using tq_fp::cvt8x2;

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

struct Params {
    const void *x;
    int64_t rows, cols, ld;      /* x: [M, K], row stride ld elements */
    int64_t n_kb, n_tiles;       /* tiles along K, in all */
    uint8_t *data;               /* [M, K] or NULL */
    float *scale_inv;            /* 1D [ceil(K/128), pad4(M)]; 2D [ceil(M/128), pad4(ceil(K/128))] */
    int64_t scale_ld;
    uint8_t *data_t;             /* [K, M] or NULL */
    float *scale_inv_t;          /* 1D [ceil(M/128), pad4(K)]; 2D [ceil(K/128), pad4(ceil(M/128))] */
    int64_t scale_t_ld;
    float fmax, eps, value_for_inf;
    int pow2;
    int vec_load;  /* x and ld allow 16-byte loads */
    int vec_row;   /* data rows allow one vector store per 16-byte input chunk */
    int vec_col;   /* data_t rows allow 16-byte stores (M % 16 == 0) */
};

/* max over groups of kWidth lanes (a power of two <= 32); the values are never NaN. */
template <int kWidth, typename T, typename Max>
__device__ __forceinline__ T lane_group_max(T m, Max max) {
#pragma unroll
    for (int offset = kWidth / 2; offset > 0; offset >>= 1)
        m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    return m;
}

/* The scale used when fmax / amax overflows: the max finite value of x's dtype (TE's
 * value_for_inf; bf16 0x7F7F0000). */
inline float input_max(tq_dtype dtype) {
    if (dtype == TQ_DTYPE_BFLOAT16) return tq_f32_from_bits(0x7F7F0000u);
    if (dtype == TQ_DTYPE_FLOAT16) return 65504.0f;
    return TQ_FLT_MAX;
}

/* Params of a launch over an [rows, cols] x of `dtype` (row stride ld) into q with config c:
 * the members, the block rule and the stores' alignment; vec_load (RawLoad's) is the
 * caller's. */
inline Params tile_params(const void *x, tq_dtype dtype, int64_t ld, int64_t rows, int64_t cols,
                          const tq_quant_config *c, const tq_qtensor *q) {
    const int64_t vec = dtype == TQ_DTYPE_FLOAT32 ? 4 : 8; /* elements per 16-byte load */
    Params p = {};
    p.x = x;
    p.rows = rows, p.cols = cols, p.ld = ld, p.n_kb = (cols + kTile - 1) / kTile;
    p.n_tiles = (rows + kTile - 1) / kTile * p.n_kb;
    p.data = static_cast<uint8_t *>(q->data.data);
    p.scale_inv = static_cast<float *>(q->scale_inv.data);
    p.scale_ld = q->scale_inv.ld;
    p.data_t = static_cast<uint8_t *>(q->data_t.data);
    p.scale_inv_t = static_cast<float *>(q->scale_inv_t.data);
    p.scale_t_ld = q->scale_inv_t.ld;
    p.fmax = c->fmax, p.eps = c->amax_epsilon, p.value_for_inf = input_max(dtype);
    p.pow2 = (c->flags & TQ_QUANT_POW2_SCALE) != 0;
    p.vec_row = reinterpret_cast<uintptr_t>(p.data) % vec == 0 && cols % vec == 0;
    p.vec_col = reinterpret_cast<uintptr_t>(p.data_t) % 16 == 0 && rows % 16 == 0;
    return p;
}

__device__ __forceinline__ float block_scale(const Params &p, float amax) {
    return tq_scale_from_amax(amax, p.fmax, p.eps, p.pow2, p.value_for_inf);
}


/* The plain loader: the tile of x itself (16-byte loads where x's rows allow). */
struct RawLoad {
    __device__ __forceinline__ void init() {}
    template <typename In, int kLoads, int kRowsPerPass, int kVec>
    __device__ __forceinline__ void load(const Params &p, uint4 (&in)[kLoads], int64_t m0,
                                         int64_t col, int row_in_pass) const {
        constexpr int kPerWord = In::kPerWord;
        constexpr int kElemBytes = 4 / kPerWord;
#pragma unroll
        for (int i = 0; i < kLoads; i++) {
            const int64_t m = m0 + i * kRowsPerPass + row_in_pass;
            const char *src = static_cast<const char *>(p.x) + (m * p.ld + col) * kElemBytes;
            if (m < p.rows && p.vec_load && col + kVec <= p.cols) {
                in[i] = __ldcs(reinterpret_cast<const uint4 *>(src));
            } else {
                uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int e = 0; e < kVec; e++) {
                    if (m >= p.rows || col + e >= p.cols) continue;
                    const uint32_t bits = kElemBytes == 4
                                              ? *reinterpret_cast<const uint32_t *>(src + 4 * e)
                                              : *reinterpret_cast<const uint16_t *>(src + 2 * e);
                    w[e / kPerWord] |= bits << (16 * (e % kPerWord));
                }
                in[i] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
};

/* One 128x128 tile of x (tile: its index, row-major over the tiles) through loader, into p's
 * members. smem: the columnwise staging tile (kCol), warp_amax: kWarps floats; both free when
 * called (the caller's barrier between tiles). */
template <typename In, typename Load, bool kRow, bool kCol, bool k2D, bool kE5M2, int kSmemRows>
__device__ __forceinline__ void quantize_tile(const Params &p, Load &loader, int64_t tile,
                                              uint4 (&smem)[kSmemRows][kSmemChunks],
                                              float *warp_amax) {
    using Acc = typename In::Acc;
    constexpr int kPerWord = In::kPerWord;
    constexpr int kElemBytes = 4 / kPerWord;
    constexpr int kVec = 16 / kElemBytes;         /* elements per 16-byte chunk: 8 or 4 */
    constexpr int kChunksPerRow = kTile / kVec;   /* threads per tile row: 16 or 32 */
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    constexpr int kLoads = kTile / kRowsPerPass;  /* chunks per thread: 8 or 16 */
    constexpr int kRounds = kChunksPerRow / kSmemChunks; /* shared-memory rounds: 1 or 2 */
    static_assert(!kCol || kSmemRows == kTile, "the columnwise staging tile holds 128 rows");
    const auto acc_max = [](Acc a, Acc b) { return In::acc_max(a, b); };
    const auto f32_max = [](float a, float b) { return fmaxf(a, b); };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunk = tid % kChunksPerRow, row_in_pass = tid / kChunksPerRow;
    {
        const int64_t mb = tile / p.n_kb, kb = tile - mb * p.n_kb;
        const int64_t m0 = mb * kTile, k0 = kb * kTile;
        const int64_t col = k0 + (int64_t)chunk * kVec;

        /* Load the tile once (Load's rule). Out-of-range elements read as 0, which no amax can
         * exceed. */
        uint4 in[kLoads];
        loader.template load<In, kLoads, kRowsPerPass, kVec>(p, in, m0, col, row_in_pass);

        /* 2D: one amax for the whole tile. */
        float tile_scale = 1.0f;
        if (k2D) {
            Acc acc = In::acc_zero();
#pragma unroll
            for (int i = 0; i < kLoads; i++)
#pragma unroll
                for (int w = 0; w < 4; w++) acc = In::acc_word(acc, word_of(in[i], w));
            float m = 0.0f;
#pragma unroll
            for (int e = 0; e < kPerWord; e++) m = fmaxf(m, In::acc_elem(acc, e));
            m = lane_group_max<32>(m, f32_max);
            if (lane == 0) warp_amax[warp] = m;
            __syncthreads();
            m = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; w++) m = fmaxf(m, warp_amax[w]);
            tile_scale = block_scale(p, m);
            if (tid == 0) {
                const float scale_inv = tq_rcp(tile_scale);
                const int64_t n_mb = (p.rows + kTile - 1) / kTile;
                if (kRow) {
                    p.scale_inv[mb * p.scale_ld + kb] = scale_inv;
                    if (kb == p.n_kb - 1) /* this row of tiles' padding entries */
                        for (int64_t j = p.n_kb; j < p.scale_ld; j++) p.scale_inv[mb * p.scale_ld + j] = 0.0f;
                }
                if (kCol) {
                    p.scale_inv_t[kb * p.scale_t_ld + mb] = scale_inv;
                    if (mb == n_mb - 1)
                        for (int64_t j = n_mb; j < p.scale_t_ld; j++) p.scale_inv_t[kb * p.scale_t_ld + j] = 0.0f;
                }
            }
        }

        /* Rowwise: each tile row is one 1x128 block (or part of the 2D tile), held by kChunksPerRow
         * consecutive lanes; codes go out straight from registers, kVec bytes per lane. The lanes of
         * a row group share the division work: lane j computes the scale of its j-th row (mod
         * kLoads) and the others read it with a shuffle. */
        if (kRow) {
            float my_scale = tile_scale;
            if (!k2D) {
                const int my_i = chunk % kLoads;
                float my_amax = 0.0f;
#pragma unroll
                for (int i = 0; i < kLoads; i++) {
                    Acc acc = In::acc_zero();
#pragma unroll
                    for (int w = 0; w < 4; w++) acc = In::acc_word(acc, word_of(in[i], w));
                    float a = 0.0f;
#pragma unroll
                    for (int e = 0; e < kPerWord; e++) a = fmaxf(a, In::acc_elem(acc, e));
                    a = lane_group_max<kChunksPerRow>(a, f32_max);
                    my_amax = i == my_i ? a : my_amax;
                }
                my_scale = block_scale(p, my_amax);
                const int64_t m = m0 + my_i * kRowsPerPass + row_in_pass;
                if (chunk < kLoads && m < p.scale_ld) /* rows M .. pad4(M) get the padding 0 */
                    p.scale_inv[kb * p.scale_ld + m] = m < p.rows ? tq_rcp(my_scale) : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < kLoads; i++) {
                const int64_t m = m0 + i * kRowsPerPass + row_in_pass;
                const float scale = k2D ? tile_scale : __shfl_sync(0xffffffffu, my_scale, i, kChunksPerRow);
                if (m >= p.rows) continue;
                uint32_t codes[kVec / 4] = {};
#pragma unroll
                for (int t = 0; t < kVec / 2; t++) { /* elements 2t, 2t + 1 */
                    const int e0 = 2 * t, e1 = 2 * t + 1;
                    const float lo = tq_mul(In::widen(word_of(in[i], e0 / kPerWord), e0 % kPerWord), scale);
                    const float hi = tq_mul(In::widen(word_of(in[i], e1 / kPerWord), e1 % kPerWord), scale);
                    codes[t / 2] |= cvt8x2<kE5M2>(lo, hi) << (16 * (t % 2));
                }
                uint8_t *dst = p.data + m * p.cols + col;
                if (p.vec_row && col + kVec <= p.cols) {
                    if constexpr (kVec == 8) *reinterpret_cast<uint2 *>(dst) = make_uint2(codes[0], codes[1]);
                    else *reinterpret_cast<uint32_t *>(dst) = codes[0];
                } else {
#pragma unroll
                    for (int e = 0; e < kVec; e++)
                        if (col + e < p.cols) dst[e] = (uint8_t)(codes[e / 4] >> (8 * (e % 4)));
                }
            }
        }

        /* Columnwise through shared memory, 64 words (256 bytes) of each tile row per round. In a
         * pass, lane (g = lane / 8, c = lane % 8) reads word g of its warp's chunk in rows
         * 16c .. 16c + 15, i.e. kPerWord columns x 16 rows; 8 lanes cover a column's 128 rows,
         * and each writes its 16 codes per column as one 16-byte store into a row of data_t. */
        if (kCol) {
            const int g = lane >> 3, c = lane & 7;
#pragma unroll
            for (int round = 0; round < kRounds; round++) {
                if (round > 0) __syncthreads(); /* the previous round's reads are done */
                tq_tile::stage_round<kLoads, kRowsPerPass>(smem, in, round, chunk, row_in_pass);
                __syncthreads();
#pragma unroll
                for (int pass = 0; pass < kSmemChunks / kWarps; pass++) {
                    const int lc = pass * kWarps + warp; /* logical chunk of this warp */
                    uint32_t words[16];
                    tq_tile::column_words(smem, lc, g, c, words);
                    /* tile column of element e of word (lc * 4 + g) in this round: k_first + e */
                    const int64_t k_first = k0 + (int64_t)round * kSmemChunks * kVec + (int64_t)(lc * 4 + g) * kPerWord;
                    float scale[kPerWord];
                    if (k2D) {
#pragma unroll
                        for (int e = 0; e < kPerWord; e++) scale[e] = tile_scale;
                    } else {
                        Acc acc = In::acc_zero();
#pragma unroll
                        for (int j = 0; j < 16; j++) acc = In::acc_word(acc, words[j]);
                        acc = lane_group_max<8>(acc, acc_max);
                        /* lane c computes the scale of column c mod kPerWord; its group reads it */
                        const int my_e = c % kPerWord;
                        float my_amax = In::acc_elem(acc, 0);
#pragma unroll
                        for (int e = 1; e < kPerWord; e++) my_amax = e == my_e ? In::acc_elem(acc, e) : my_amax;
                        const float my_scale = block_scale(p, my_amax);
                        const int64_t k = k_first + my_e;
                        if (c < kPerWord && k < p.scale_t_ld) /* columns K .. pad4(K): padding 0 */
                            p.scale_inv_t[mb * p.scale_t_ld + k] = k < p.cols ? tq_rcp(my_scale) : 0.0f;
#pragma unroll
                        for (int e = 0; e < kPerWord; e++) scale[e] = __shfl_sync(0xffffffffu, my_scale, e, 8);
                    }
#pragma unroll
                    for (int e = 0; e < kPerWord; e++) {
                        const int64_t k = k_first + e;
                        if (k >= p.cols) continue;
                        uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                        for (int t = 0; t < 8; t++) { /* rows 16c + 2t, 16c + 2t + 1 */
                            const float lo = tq_mul(In::widen(words[2 * t], e), scale[e]);
                            const float hi = tq_mul(In::widen(words[2 * t + 1], e), scale[e]);
                            packed[t / 2] |= cvt8x2<kE5M2>(lo, hi) << (16 * (t % 2));
                        }
                        const int64_t m = m0 + 16 * c;
                        uint8_t *dst = p.data_t + k * p.rows + m;
                        if (p.vec_col && m + 16 <= p.rows) {
                            *reinterpret_cast<uint4 *>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
                        } else {
#pragma unroll
                            for (int j = 0; j < 16; j++)
                                if (m + j < p.rows) dst[j] = (uint8_t)(packed[j / 4] >> (8 * (j % 4)));
                        }
                    }
                }
            }
        }
    }
}

template <typename In, typename Load, bool kRow, bool kCol, bool k2D, bool kE5M2>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const Params p, Load loader) {
    __shared__ uint4 smem[kCol ? kTile : 1][kSmemChunks];
    __shared__ float warp_amax[kWarps];
    loader.init(); /* e.g. an activation's table: every thread, then a barrier */
    /* A tile per CTA, or the CTA's tiles in turn where the grid is smaller (launches that
     * amortize the loader's init over several tiles). */
    for (int64_t tile = blockIdx.x; tile < p.n_tiles; tile += gridDim.x) {
        if (tile != blockIdx.x) __syncthreads(); /* the last tile's shared-memory reads are done */
        quantize_tile<In, Load, kRow, kCol, k2D, kE5M2>(p, loader, tile, smem, warp_amax);
    }
}

}  // namespace tq_block

#endif  // TEQUANT_CUDA_FP8_BLOCK_TILE_CUH_
