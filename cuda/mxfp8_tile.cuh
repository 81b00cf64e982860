/* mxfp8_tile.cuh: the MXFP8 tile kernel (one CTA per 128x128 tile, both directions), internal to
 * cuda/: quantize_mxfp8.cu runs it on x itself (RawLoad), act_quantize_mxfp8.cu on an activation
 * computed as the tile is loaded (act_load.cuh's ActLoad). The rule and the layout are
 * quantize_mxfp8.cu's header comment.
 * Tests: tests/test_quantize_mxfp8.py, tests/test_act_mxfp8.py (GPU cases: bit-exact against the
 * CPU references).
 */
#ifndef TEQUANT_CUDA_MXFP8_TILE_CUH_
#define TEQUANT_CUDA_MXFP8_TILE_CUH_

#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "tile_transpose.cuh"
#include "tequant/formats.h"

namespace tq_mxfp8 {

constexpr int kBlock = 32;       /* MXFP8 block length */
constexpr int kTile = 128;       /* CTA tile edge (elements): 4x4 blocks of 32 */
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
using tq_tile::kSmemChunks;

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

using tq_fp::cvt8x2; /* two fp32 values -> two FP8 codes (lo in the low byte) */

/* N (multiple of 4) elements value(i) times 2^(127-e) -> N/4 words of codes. In the rare case
 * that an element is NaN, it is re-encoded from its raw bits raw(i) exactly as the reference
 * does (sign kept). */
template <typename In, bool kE5M2, int N, typename Value, typename Raw>
__device__ __forceinline__ void quantize_run(Value value, uint8_t e, Raw raw, uint32_t (&codes)[N / 4]) {
    const float factor = tq_e8m0_rcp(e);
    uint32_t nan = 0;
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        codes[i] = cvt8x2<kE5M2>(value(4 * i) * factor, value(4 * i + 1) * factor)
                   | cvt8x2<kE5M2>(value(4 * i + 2) * factor, value(4 * i + 3) * factor) << 16;
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

/* Running max |x| per element position of a 32-bit word of In, NaN ignored (exact: a max picks
 * one of its inputs). 16-bit inputs stay packed: abs and max (maxNum: a NaN loses) on both
 * halves at once. */
template <typename In>
__device__ __forceinline__ uint32_t acc_word(uint32_t acc, uint32_t w) {
    if (sizeof(typename In::storage) == 4) return __float_as_uint(fmaxf(__uint_as_float(acc), fabsf(__uint_as_float(w))));
    if (std::is_same<In, F16>::value)
        asm("{ .reg .b32 t; abs.f16x2 t, %1; max.f16x2 %0, %0, t; }" : "+r"(acc) : "r"(w));
    else
        asm("{ .reg .b32 t; abs.bf16x2 t, %1; max.bf16x2 %0, %0, t; }" : "+r"(acc) : "r"(w));
    return acc;
}

/* Layout of a 128x128 tile of In: each 16-byte chunk holds kVec elements; a tile row is
 * kChunksPerRow lanes, a 1x32 block kLanesPerBlock of them. */
template <typename In>
struct Tile {
    static constexpr int kElemBytes = (int)sizeof(typename In::storage);
    static constexpr int kPerWord = 4 / kElemBytes;                 /* elements per 32-bit word */
    static constexpr int kVec = 16 / kElemBytes;                    /* elements per chunk: 8 or 4 */
    static constexpr int kChunksPerRow = kTile / kVec;              /* 16 or 32 */
    static constexpr int kRowsPerPass = kThreads / kChunksPerRow;   /* 16 or 8 */
    static constexpr int kLoads = kTile / kRowsPerPass;             /* chunks per thread: 8 or 16 */
    static constexpr int kLanesPerBlock = kBlock / kVec;            /* 4 or 8 */
    static constexpr int kRounds = kChunksPerRow / kSmemChunks;     /* shared-memory rounds: 1 or 2 */
};

/* Raw bits of element e of a word (16-bit elements: e-th half). */
template <typename In>
__device__ __forceinline__ uint32_t elem_bits(uint32_t w, int e) {
    return sizeof(typename In::storage) == 4 ? w : (w >> (16 * e)) & 0xFFFFu;
}

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

template <int kWidth>
__device__ __forceinline__ float lane_group_max(float m) {
#pragma unroll
    for (int offset = kWidth / 2; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
    return m;
}


struct Args {
    const void *x;
    int64_t ld, rows, cols; /* x [rows, cols], row stride ld elements; both multiples of 32 */
    uint32_t tiles_k, n_tiles; /* tiles along cols, in all (31 bits: checked at launch) */
    uint8_t *data, *scale_inv, *data_t, *scale_inv_t; /* NULL for a direction not produced */
};

/* The plain loader: the tile of x itself; rows and columns outside x read as 0 (no amax can be
 * below it). kVec: 16-byte loads (x and its row stride aligned). */
template <bool kVec>
struct RawLoad {
    static constexpr bool kManyTiles = false; /* launched with a CTA per tile */
    __device__ __forceinline__ void init() {}
    template <typename In, int kLoads, int kRowsPerPass, int kElems>
    __device__ __forceinline__ void load(const Args &a, uint4 (&in)[kLoads], int64_t m0,
                                         int64_t col, int row_in_pass) const {
        constexpr int kElemBytes = (int)sizeof(typename In::storage), kPerWord = 4 / kElemBytes;
        const int m_left = (int)min(a.rows - m0, (int64_t)kTile);
        const bool col_ok = col < a.cols; /* cols % 32 == 0: a chunk is all inside or all outside */
        const char *src = static_cast<const char *>(a.x) + ((m0 + row_in_pass) * a.ld + col) * kElemBytes;
        const int64_t step = (int64_t)kRowsPerPass * a.ld * kElemBytes;
#pragma unroll
        for (int i = 0; i < kLoads; i++, src += step) {
            in[i] = make_uint4(0u, 0u, 0u, 0u);
            if (!col_ok || i * kRowsPerPass + row_in_pass >= m_left) continue;
            if (kVec) {
                in[i] = __ldcs(reinterpret_cast<const uint4 *>(src));
            } else {
                uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int e = 0; e < kElems; e++) {
                    const uint32_t bits = kElemBytes == 4 ? reinterpret_cast<const uint32_t *>(src)[e]
                                                          : reinterpret_cast<const uint16_t *>(src)[e];
                    w[e / kPerWord] |= bits << (16 * (e % kPerWord));
                }
                in[i] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
};

/* Addresses: 64-bit bases are made once per CTA and per thread, offsets inside the tile are
 * 32-bit, and the in-tile guards compare against the tile's valid rows and columns (m_left,
 * k_left), which costs one compare per load or store (64-bit index math per element was a
 * third of the previous version's instructions). CTAs per SM: four for 16-bit inputs (64
 * registers; left alone the compiler takes 72 and fits three), two for fp32, whose tile takes
 * twice the registers (at 64 it spills; left alone it takes up to 135 and fits one). */
template <typename In, typename Load>
struct Ctas { /* a loader that computes (ActLoad) holds more per element: half the CTAs */
    static constexpr int kPerSm = sizeof(typename In::storage) == 2 ? 2 : 1;
};
template <typename In, bool kVec>
struct Ctas<In, RawLoad<kVec>> {
    static constexpr int kPerSm = sizeof(typename In::storage) == 2 ? 4 : 2;
};

/* Load (a kernel argument: a loader's state is its own): RawLoad, or a loader with its init() (every thread, then a barrier of its own) and
 * load(). A tile per CTA, or with Load::kManyTiles the CTA's tiles in turn where the grid is
 * smaller (launches that amortize the loader's init over several tiles). The loop is compiled
 * only where a loader asks for it: around RawLoad's 2D tiles it cost spills (44 bytes) and 24%
 * of the 32x32 weight quantization's time. */
template <typename In, typename Load, bool kVec, bool kRow, bool kCol, bool k2D, bool kE5M2>
__global__ void __launch_bounds__(kThreads, (Ctas<In, Load>::kPerSm)) quantize_kernel(const Args a, Load loader) {
    using S = Tile<In>;
    __shared__ uint4 smem[kCol ? kTile : 1][kSmemChunks];
    __shared__ uint32_t tile_amax[k2D ? 4 : 1][k2D ? 4 : 1]; /* fp32 bits, >= 0: ordered as ints */
    __shared__ uint8_t tile_e[k2D ? 4 : 1][k2D ? 4 : 1];      /* their exponents */
    /* The tile's exponents, block-major as stored ([block][row] / [block][column]): written to
     * memory as 16-byte pieces of four 128-byte runs once the tile is done. */
    __shared__ __align__(16) uint8_t row_e[kRow ? 4 : 1][kTile], col_e[kCol ? 4 : 1][kTile];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunk = tid % S::kChunksPerRow, row_in_pass = tid / S::kChunksPerRow;
    loader.init();
    uint32_t tile = blockIdx.x;
    do {
        if (tile != blockIdx.x) __syncthreads(); /* the last tile's shared-memory reads are done */
        const uint32_t mt = tile / a.tiles_k, kt = tile - mt * a.tiles_k;
        const int64_t m0 = (int64_t)mt * kTile, k0 = (int64_t)kt * kTile;
        const int m_left = (int)min(a.rows - m0, (int64_t)kTile), k_left = (int)min(a.cols - k0, (int64_t)kTile);
        const int c0 = chunk * S::kVec; /* this thread's first column in the tile */
        const bool col_ok = c0 < k_left; /* cols % 32 == 0: a chunk is all inside or all outside */

        /* The tile, once (Load's rule). */
        uint4 in[S::kLoads];
        loader.template load<In, S::kLoads, S::kRowsPerPass, S::kVec>(a, in, m0, k0 + c0, row_in_pass);

        /* 2D: each 32x32 tile's amax: lane groups of one row block, then one shared atomicMax per
         * group and 32-row block. */
        if (k2D) {
            if (tid < 16) tile_amax[tid / 4][tid % 4] = 0u;
            __syncthreads();
            constexpr int kLoadsPerBlock = kBlock / S::kRowsPerPass;
#pragma unroll
            for (int rb = 0; rb < 4; rb++) {
                uint32_t acc = 0u;
#pragma unroll
                for (int i = rb * kLoadsPerBlock; i < (rb + 1) * kLoadsPerBlock; i++)
#pragma unroll
                    for (int w = 0; w < 4; w++) acc = acc_word<In>(acc, word_of(in[i], w));
                float m = In::widen(elem_bits<In>(acc, 0));
                if (S::kPerWord == 2) m = fmaxf(m, In::widen(elem_bits<In>(acc, 1)));
                m = lane_group_max<S::kLanesPerBlock>(m);
                if (chunk % S::kLanesPerBlock == 0 && m > 0.0f)
                    atomicMax(&tile_amax[rb][chunk / S::kLanesPerBlock], __float_as_uint(m));
            }
            __syncthreads();
            if (tid < 16) tile_e[tid / 4][tid % 4] = tq_mxfp8_exponent(__uint_as_float(tile_amax[tid / 4][tid % 4]), kE5M2);
            __syncthreads();
        }

        /* Rowwise: one chunk of one row per load; kVec codes out per lane. The kLanesPerBlock lanes
         * of a block share the exponent work: lane q (= lane % kLanesPerBlock) computes the
         * exponents of the loads i with i % kLanesPerBlock == q, the others read them by shuffle. */
        if (kRow) {
            constexpr int kL = S::kLanesPerBlock, kOwn = S::kLoads / kL;
            uint8_t own_e[kOwn];
            if (!k2D) {
                const int q = lane % kL;
                float block_amax[S::kLoads];
#pragma unroll
                for (int i = 0; i < S::kLoads; i++) {
                    uint32_t acc = 0u;
#pragma unroll
                    for (int w = 0; w < 4; w++) acc = acc_word<In>(acc, word_of(in[i], w));
                    float amax = In::widen(elem_bits<In>(acc, 0));
                    if (S::kPerWord == 2) amax = fmaxf(amax, In::widen(elem_bits<In>(acc, 1)));
                    block_amax[i] = lane_group_max<kL>(amax);
                }
#pragma unroll
                for (int j = 0; j < kOwn; j++) {
                    float mine = block_amax[j * kL];
#pragma unroll
                    for (int t = 1; t < kL; t++) mine = q == t ? block_amax[j * kL + t] : mine;
                    own_e[j] = tq_mxfp8_exponent(mine, kE5M2);
                }
            }
            uint8_t *dst = a.data + (m0 + row_in_pass) * a.cols + k0 + c0;
            const int64_t dst_step = S::kRowsPerPass * a.cols;
#pragma unroll
            for (int i = 0; i < S::kLoads; i++, dst += dst_step) {
                const int r = i * S::kRowsPerPass + row_in_pass;
                const uint8_t e = k2D ? tile_e[r / kBlock][chunk / kL]
                                      : (uint8_t)__shfl_sync(0xFFFFFFFFu, (uint32_t)own_e[i / kL], (lane & ~(kL - 1)) + i % kL);
                if (chunk % kL == 0) row_e[chunk / kL][r] = e;
                if (!col_ok || r >= m_left) continue;
                auto raw = [&](int j) { return elem_bits<In>(word_of(in[i], j / S::kPerWord), j % S::kPerWord); };
                uint32_t codes[S::kVec / 4];
                quantize_run<In, kE5M2, S::kVec>([&](int j) { return In::widen(raw(j)); }, e, raw, codes);
                store_codes<S::kVec / 4, kVec>(dst, codes);
            }
        }

        /* Columnwise through shared memory, 256 bytes of each tile row per round. In a pass, lane
         * (g = lane / 8, c = lane % 8) reads word g of its warp's chunk in rows 16c .. 16c + 15:
         * kPerWord columns x 16 rows. Lanes c and c ^ 1 hold one 32x1 block; each lane writes its
         * 16 codes of a column as one 16-byte store into a row of data_t. */
        if (kCol) {
            const int g = lane >> 3, c = lane & 7;
            /* The lane's first tile column (round 0, pass 0, element 0); the others add kc below. */
            const int k_lane = (warp * 4 + g) * S::kPerWord;
            uint8_t *const dst = a.data_t + (k0 + k_lane) * a.rows + m0 + 16 * c;
            const bool m_ok = 16 * c < m_left; /* M % 32 == 0: a lane pair is all in or out */
#pragma unroll
            for (int round = 0; round < S::kRounds; round++) {
                if (round > 0) __syncthreads(); /* the previous round's reads are done */
                tq_tile::stage_round<S::kLoads, S::kRowsPerPass>(smem, in, round, chunk, row_in_pass);
                __syncthreads();
#pragma unroll
                for (int pass = 0; pass < kSmemChunks / kWarps; pass++) {
                    const int lc = pass * kWarps + warp; /* logical chunk of this warp */
                    uint32_t words[16];
                    tq_tile::column_words(smem, lc, g, c, words);
                    const int k_pass = round * kSmemChunks * S::kVec + pass * kWarps * 4 * S::kPerWord;
                    /* 1D: the lane pair shares its kPerWord exponents: lane c takes column c % kPerWord */
                    uint8_t pair_e = 0;
                    if (!k2D) {
                        uint32_t acc = 0u;
#pragma unroll
                        for (int j = 0; j < 16; j++) acc = acc_word<In>(acc, words[j]);
                        float mine = lane_group_max<2>(In::widen(elem_bits<In>(acc, 0)));
                        if (S::kPerWord == 2) {
                            const float other = lane_group_max<2>(In::widen(elem_bits<In>(acc, 1)));
                            mine = (c & 1) ? other : mine;
                        }
                        pair_e = tq_mxfp8_exponent(mine, kE5M2);
                    }
#pragma unroll
                    for (int e = 0; e < S::kPerWord; e++) {
                        const int kc = k_pass + e; /* tile column k_lane + kc */
                        const uint8_t x_e = k2D ? tile_e[c / 2][(k_lane + kc) / kBlock]
                                            : S::kPerWord == 1 ? pair_e
                                            : (uint8_t)__shfl_sync(0xFFFFFFFFu, (uint32_t)pair_e, (lane & ~1) | e);
                        if ((c & 1) == 0) col_e[c / 2][k_lane + kc] = x_e;
                        if (!m_ok || k_lane + kc >= k_left) continue;
                        auto raw = [&](int j) { return elem_bits<In>(words[j], e); };
                        uint32_t codes[4];
                        quantize_run<In, kE5M2, 16>([&](int j) { return In::widen(raw(j)); }, x_e, raw, codes);
                        store_codes<4, kVec>(dst + kc * a.rows, codes);
                    }
                }
            }
        }

        /* The exponents: thread t < 32 writes piece t % 8 of rowwise run t / 8 (block column
         * k0/32 + t/8, rows m0 + 16(t%8) ..), threads 32..63 the same of the columnwise runs. Runs
         * and pieces outside x are skipped (M and K are multiples of 32: a piece is all in or out). */
        __syncthreads();
        const int run = (tid & 31) >> 3, piece = tid & 7;
        if (kRow && tid < 32 && run * kBlock < k_left && piece * 16 < m_left)
            store_codes<4, kVec>(a.scale_inv + (k0 / kBlock + run) * a.rows + m0 + piece * 16,
                                 reinterpret_cast<const uint32_t *>(&row_e[run][piece * 16]));
        if (kCol && tid >= 32 && tid < 64 && run * kBlock < m_left && piece * 16 < k_left)
            store_codes<4, kVec>(a.scale_inv_t + (m0 / kBlock + run) * a.cols + k0 + piece * 16,
                                 reinterpret_cast<const uint32_t *>(&col_e[run][piece * 16]));
    } while (Load::kManyTiles && (tile += gridDim.x) < a.n_tiles);
}

}  // namespace tq_mxfp8

#endif  // TEQUANT_CUDA_MXFP8_TILE_CUH_
