/* quantize_mxfp8.cu: the MXFP8 quantizer on CUDA (NUMERICS.md 2 "MXFP8", TE_REFERENCE A.4 / 6.4).
 *
 * Rule: per block (1x32 along K rowwise, 32x1 along M columnwise, or one 32x32 tile for both
 * directions with TQ_QUANT_2D) amax A = max |x| with NaN ignored, e = tq_mxfp8_exponent(A) (E8M0
 * rounded up), q = cvt8(x * 2^(127-e)), scale byte = e. data_t [K, M] is quant(x^T).
 * One CTA per 128x128 tile of x, read once with 16-byte streaming loads into registers: the
 * rowwise codes leave straight from registers (a 1x32 block is 4 or 8 adjacent lanes: its amax
 * is a shuffle reduction), the columnwise ones through a swizzled shared-memory copy of the tile
 * in which each lane holds 16 rows of one or two columns (a 32x1 block is a lane pair) and
 * writes them as one 16-byte store into a data_t row. 2D tiles reduce their amax through shared
 * memory first. The exponents are block-major ([K/32, M] rowwise, [M/32, K] columnwise): a
 * tile's are staged in shared memory and leave as 16-byte pieces of four 128-byte runs (stored
 * [M, K/32] they were 4 bytes in each of 128 rows per direction: 15% of the kernel's time).
 * Elements go through the hardware cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (what TE
 * uses), which equals formats.h's tq_f32_to_fp8 on all 2^32 non-NaN fp32 inputs (checked on an
 * H200); NaN elements are re-encoded with tq_f32_to_fp8 itself, as the GPU's multiply and cvt
 * drop a NaN's sign. Also here: dequantize, and tq_gemm_values_mxfp8_cuda, both GEMM operands'
 * dequantization in one launch (gemm.c's emulated MXFP8 GEMM).
 * Reference: csrc/ref/quantize_mxfp8_ref.c. Tests: tests/test_quantize_mxfp8.py (GPU cases),
 * tests/test_gemm.py (the emulated GEMM).
 */
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "internal_gemm.h"
#include "internal_kernels.h"
#include "dequant_out.cuh"
#include "launch.cuh"
#include "tile_transpose.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

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
    int64_t ld, M, K;  /* x [M, K], row stride ld elements; M and K are multiples of 32 */
    uint32_t tiles_k;  /* tiles along K; tiles in all fit in 31 bits (checked at launch) */
    uint8_t *data, *scale_inv, *data_t, *scale_inv_t; /* NULL for a direction not produced */
};

/* Addresses: 64-bit bases are made once per CTA and per thread, offsets inside the tile are
 * 32-bit, and the in-tile guards compare against the tile's valid rows and columns (m_left,
 * k_left), which costs one compare per load or store (64-bit index math per element was a
 * third of the previous version's instructions). CTAs per SM: four for 16-bit inputs (64
 * registers; left alone the compiler takes 72 and fits three), two for fp32, whose tile takes
 * twice the registers (at 64 it spills; left alone it takes up to 135 and fits one). */
template <typename In>
constexpr int min_ctas_per_sm() { return sizeof(typename In::storage) == 2 ? 4 : 2; }

template <typename In, bool kVec, bool kRow, bool kCol, bool k2D, bool kE5M2>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm<In>()) quantize_kernel(const Args a) {
    using S = Tile<In>;
    __shared__ uint4 smem[kCol ? kTile : 1][kSmemChunks];
    __shared__ uint32_t tile_amax[k2D ? 4 : 1][k2D ? 4 : 1]; /* fp32 bits, >= 0: ordered as ints */
    __shared__ uint8_t tile_e[k2D ? 4 : 1][k2D ? 4 : 1];      /* their exponents */
    /* The tile's exponents, block-major as stored ([block][row] / [block][column]): written to
     * memory as 16-byte pieces of four 128-byte runs once the tile is done. */
    __shared__ __align__(16) uint8_t row_e[kRow ? 4 : 1][kTile], col_e[kCol ? 4 : 1][kTile];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunk = tid % S::kChunksPerRow, row_in_pass = tid / S::kChunksPerRow;
    const uint32_t mt = blockIdx.x / a.tiles_k, kt = blockIdx.x - mt * a.tiles_k;
    const int64_t m0 = (int64_t)mt * kTile, k0 = (int64_t)kt * kTile;
    const int m_left = (int)min(a.M - m0, (int64_t)kTile), k_left = (int)min(a.K - k0, (int64_t)kTile);
    const int c0 = chunk * S::kVec; /* this thread's first column in the tile */
    const bool col_ok = c0 < k_left; /* K % 32 == 0: a chunk is all inside or all outside */

    /* The tile, once; rows and columns outside x read as 0 (no amax can be below it). */
    uint4 in[S::kLoads];
    {
        const char *src = static_cast<const char *>(a.x) + ((m0 + row_in_pass) * a.ld + k0 + c0) * S::kElemBytes;
        const int64_t step = (int64_t)S::kRowsPerPass * a.ld * S::kElemBytes;
#pragma unroll
        for (int i = 0; i < S::kLoads; i++, src += step) {
            in[i] = make_uint4(0u, 0u, 0u, 0u);
            if (!col_ok || i * S::kRowsPerPass + row_in_pass >= m_left) continue;
            if (kVec) {
                in[i] = __ldcs(reinterpret_cast<const uint4 *>(src));
            } else {
                uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int e = 0; e < S::kVec; e++) {
                    const uint32_t bits = S::kElemBytes == 4 ? reinterpret_cast<const uint32_t *>(src)[e]
                                                             : reinterpret_cast<const uint16_t *>(src)[e];
                    w[e / S::kPerWord] |= bits << (16 * (e % S::kPerWord));
                }
                in[i] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }

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
        uint8_t *dst = a.data + (m0 + row_in_pass) * a.K + k0 + c0;
        const int64_t dst_step = S::kRowsPerPass * a.K;
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
        uint8_t *const dst = a.data_t + (k0 + k_lane) * a.M + m0 + 16 * c;
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
                    store_codes<4, kVec>(dst + kc * a.M, codes);
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
        store_codes<4, kVec>(a.scale_inv + (k0 / kBlock + run) * a.M + m0 + piece * 16,
                             reinterpret_cast<const uint32_t *>(&row_e[run][piece * 16]));
    if (kCol && tid >= 32 && tid < 64 && run * kBlock < m_left && piece * 16 < k_left)
        store_codes<4, kVec>(a.scale_inv_t + (m0 / kBlock + run) * a.K + k0 + piece * 16,
                             reinterpret_cast<const uint32_t *>(&col_e[run][piece * 16]));
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <typename In, bool kVec, bool k2D, bool kE5M2>
void launch_directions(const Args &a, unsigned grid, cudaStream_t st) {
    const bool row = a.data != nullptr, col = a.data_t != nullptr;
    if (row && col) quantize_kernel<In, kVec, true, true, k2D, kE5M2><<<grid, kThreads, 0, st>>>(a);
    else if (row) quantize_kernel<In, kVec, true, false, k2D, kE5M2><<<grid, kThreads, 0, st>>>(a);
    else quantize_kernel<In, kVec, false, true, k2D, kE5M2><<<grid, kThreads, 0, st>>>(a);
}

template <typename In>
void dispatch_quantize(const Args &a, bool vec, bool two_d, bool e5m2, unsigned grid, cudaStream_t st) {
#define TQ_MXFP8_LAUNCH(V, D, E) \
    if (vec == V && two_d == D && e5m2 == E) return launch_directions<In, V, D, E>(a, grid, st)
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
    const int64_t tiles_k = (K + kTile - 1) / kTile, tiles = (M + kTile - 1) / kTile * tiles_k;
    a.tiles_k = (uint32_t)tiles_k;
    if (tiles > INT32_MAX)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "mxfp8 quantize: x [%lld, %lld] needs more tiles "
                       "than one launch takes", (long long)M, (long long)K);
    a.data = rowwise ? static_cast<uint8_t *>(q->data.data) : nullptr;
    a.scale_inv = rowwise ? static_cast<uint8_t *>(q->scale_inv.data) : nullptr;
    a.data_t = columnwise ? static_cast<uint8_t *>(q->data_t.data) : nullptr;
    a.scale_inv_t = columnwise ? static_cast<uint8_t *>(q->scale_inv_t.data) : nullptr;
    /* 16-byte loads and stores need 16-byte aligned rows; output rows are multiples of 32
     * bytes, so aligned when their base is. Anything else takes the element-wise path. */
    const int esize = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const bool vec = aligned16(x->data) && (x->ld * esize) % 16 == 0
                     && (!rowwise || (aligned16(a.data) && aligned16(a.scale_inv)))
                     && (!columnwise || (aligned16(a.data_t) && aligned16(a.scale_inv_t)));
    const bool e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const bool two_d = (config->flags & TQ_QUANT_2D) != 0;
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32: dispatch_quantize<F32>(a, vec, two_d, e5m2, (unsigned)tiles, st); break;
        case TQ_DTYPE_BFLOAT16: dispatch_quantize<Bf16>(a, vec, two_d, e5m2, (unsigned)tiles, st); break;
        default: dispatch_quantize<F16>(a, vec, two_d, e5m2, (unsigned)tiles, st); break;
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

/* Two FP8 codes (low byte first) as fp32, through Hopper's exact FP8 -> fp16 pair convert:
 * every E4M3 / E5M2 value is an fp16 value (a NaN stays a NaN, whose product is canonical). */
__device__ __forceinline__ float2 fp8x2_to_f32x2(uint16_t codes, int e5m2) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, e5m2 ? __NV_E5M2 : __NV_E4M3);
    return __half22float2(__half2(h));
}

/* Dequantization: a thread takes unit u (8 codes, a quarter of a block: cols % 32 == 0) of 32
 * consecutive rows, so a warp reads 256 consecutive code bytes of a row and, bf16 / fp16 out,
 * writes 512 consecutive bytes, and the thread's exponents (block-major [cols / 32, rows]:
 * exps[(u / 4) * rows + r]) are 32 consecutive bytes, one sector.
 * value = RN(fp8 * 2^(e-127)), narrowed RNE to out's dtype. */
constexpr int kDequantThreads = 256;
constexpr int kDequantRows = 32;
using tq_cuda::kDequantUnit;

/* Unit u of the row groups y, y + ny, ...: the body of dequantize_kernel. exps_ld: the stride of
 * the block-major exponents (rows, or more for rows [r0, r0 + rows) of a taller direction, whose
 * exps start at its column r0: an emulated GEMM's chunks of A). */
template <typename Out, bool kVec>
__device__ __forceinline__ void dequantize_unit(const uint8_t *__restrict__ codes,
                                                const uint8_t *__restrict__ exps, int64_t exps_ld,
                                                int64_t rows, int64_t cols, int e5m2,
                                                typename Out::storage *__restrict__ out, int64_t ld,
                                                int64_t u, int64_t y, int64_t ny) {
    using T = typename Out::storage;
    if (u >= cols / kDequantUnit) return;
    const uint8_t *unit_exps = exps + (u >> 2) * exps_ld;
    for (int64_t r0 = y * kDequantRows; r0 < rows; r0 += ny * kDequantRows) {
        const int n = (int)min(rows - r0, (int64_t)kDequantRows);
#pragma unroll 4
        for (int i = 0; i < n; i++) {
            const int64_t r = r0 + i;
            const uint8_t *src = codes + r * cols + u * kDequantUnit;
            uint32_t words[2];
            if (kVec) {
                const uint2 w = *reinterpret_cast<const uint2 *>(src);
                words[0] = w.x, words[1] = w.y;
            } else {
#pragma unroll
                for (int k = 0; k < 2; k++)
                    words[k] = src[4 * k] | (uint32_t)src[4 * k + 1] << 8 | (uint32_t)src[4 * k + 2] << 16
                               | (uint32_t)src[4 * k + 3] << 24;
            }
            const float scale = tq_e8m0_to_f32(unit_exps[r]);
            __align__(16) T vals[kDequantUnit];
#pragma unroll
            for (int k = 0; k < kDequantUnit; k += 2) {
                const float2 v = fp8x2_to_f32x2((uint16_t)(words[k >> 2] >> (8 * (k & 3))), e5m2);
                Out::narrow2(v.x * scale, v.y * scale, &vals[k]);
            }
            tq_cuda::store_vals<T, kVec>(out + r * ld + u * kDequantUnit, vals);
        }
    }
}

template <typename Out, bool kVec>
__global__ void __launch_bounds__(kDequantThreads)
dequantize_kernel(const uint8_t *__restrict__ codes, const uint8_t *__restrict__ exps,
                  int64_t rows, int64_t cols, int e5m2, typename Out::storage *__restrict__ out,
                  int64_t ld) {
    dequantize_unit<Out, kVec>(codes, exps, rows, rows, cols, e5m2, out, ld,
                               (int64_t)blockIdx.x * kDequantThreads + threadIdx.x, blockIdx.y,
                               gridDim.y);
}

/* An emulated MXFP8 GEMM's two operands in one launch: x blocks [0, blocks_a) dequantize A's
 * direction, the rest B's, both to bf16 (the GEMM values; two launches were ~3.5 us more of
 * host time per GEMM). */
struct ValuesPair {
    const uint8_t *codes[2], *exps[2];
    int64_t exps_ld[2], rows[2], cols[2], ld[2];
    int e5m2[2];
    uint16_t *out[2];
    unsigned blocks_a;
};

template <bool kVec>
__global__ void __launch_bounds__(kDequantThreads) values_pair_kernel(const ValuesPair p) {
    const int i = blockIdx.x < p.blocks_a ? 0 : 1;
    const int64_t block = i ? blockIdx.x - p.blocks_a : blockIdx.x;
    dequantize_unit<tq_cuda::DequantBf16, kVec>(p.codes[i], p.exps[i], p.exps_ld[i], p.rows[i],
                                                p.cols[i],
                                                p.e5m2[i], p.out[i], p.ld[i],
                                                block * kDequantThreads + threadIdx.x, blockIdx.y,
                                                gridDim.y);
}

/* The dequantize grid of a [rows, cols] direction: unit groups in x, row groups in y. */
dim3 dequantize_grid(int64_t rows, int64_t cols) {
    const int64_t units = cols / kDequantUnit, row_groups = (rows + kDequantRows - 1) / kDequantRows;
    return dim3((unsigned)((units + kDequantThreads - 1) / kDequantThreads),
                (unsigned)(row_groups < 65535 ? row_groups : 65535));
}

/* 8-byte code loads and 16-byte stores: code rows are multiples of 32 bytes, so loads are
 * aligned when their base is; stores need a 16-aligned base and row pitch. */
bool dequantize_vec(const void *codes, const tq_tensor *out) {
    const int esize = out->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    return aligned16(codes) && aligned16(out->data) && (out->ld * esize) % 16 == 0;
}

template <typename Out>
void launch_dequantize(bool vec, const uint8_t *codes, const uint8_t *exps, int64_t rows,
                       int64_t cols, int e5m2, tq_tensor *out, cudaStream_t st) {
    const dim3 grid = dequantize_grid(rows, cols);
    auto *o = static_cast<typename Out::storage *>(out->data);
    if (vec)
        dequantize_kernel<Out, true><<<grid, kDequantThreads, 0, st>>>(codes, exps, rows, cols, e5m2, o, out->ld);
    else
        dequantize_kernel<Out, false><<<grid, kDequantThreads, 0, st>>>(codes, exps, rows, cols, e5m2, o, out->ld);
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
    const bool vec = dequantize_vec(data->data, out);
    const int e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const auto *codes = static_cast<const uint8_t *>(data->data);
    const auto *exps = static_cast<const uint8_t *>(scale->data);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32:
            launch_dequantize<tq_cuda::DequantF32>(vec, codes, exps, data->rows, data->cols, e5m2, out, st);
            break;
        case TQ_DTYPE_BFLOAT16:
            launch_dequantize<tq_cuda::DequantBf16>(vec, codes, exps, data->rows, data->cols, e5m2, out, st);
            break;
        default:
            launch_dequantize<tq_cuda::DequantF16>(vec, codes, exps, data->rows, data->cols, e5m2, out, st);
            break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("mxfp8 dequantize kernel launch");
    return TQ_SUCCESS;
}

extern "C" tq_status tq_gemm_values_mxfp8_cuda(const tq_quant_config *config_a, const tq_tensor *data_a,
                                               const tq_tensor *scale_a, tq_tensor *values_a,
                                               const tq_quant_config *config_b, const tq_tensor *data_b,
                                               const tq_tensor *scale_b, tq_tensor *values_b,
                                               struct CUstream_st *stream) {
    DeviceGuard guard(values_a->device);
    if (guard.status != cudaSuccess) return launch_failed("MXFP8 GEMM values: making the device current");
    const tq_quant_config *configs[2] = {config_a, config_b};
    const tq_tensor *data[2] = {data_a, data_b}, *scales[2] = {scale_a, scale_b};
    tq_tensor *values[2] = {values_a, values_b};
    ValuesPair p;
    dim3 grids[2];
    bool vec = true;
    for (int i = 0; i < 2; i++) {
        p.codes[i] = static_cast<const uint8_t *>(data[i]->data);
        p.exps[i] = static_cast<const uint8_t *>(scales[i]->data);
        p.rows[i] = values[i]->rows, p.cols[i] = values[i]->cols, p.ld[i] = values[i]->ld;
        p.exps_ld[i] = scales[i]->ld > values[i]->rows ? scales[i]->ld : values[i]->rows;
        p.e5m2[i] = configs[i]->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
        p.out[i] = static_cast<uint16_t *>(values[i]->data);
        grids[i] = dequantize_grid(values[i]->rows, values[i]->cols);
        vec = vec && dequantize_vec(data[i]->data, values[i]);
    }
    p.blocks_a = grids[0].x;
    const dim3 grid(grids[0].x + grids[1].x, grids[0].y > grids[1].y ? grids[0].y : grids[1].y);
    if (grid.x == 0 || grid.y == 0) return TQ_SUCCESS; /* nothing to write */
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (vec) values_pair_kernel<true><<<grid, kDequantThreads, 0, st>>>(p);
    else values_pair_kernel<false><<<grid, kDequantThreads, 0, st>>>(p);
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("MXFP8 GEMM values kernel launch");
    return TQ_SUCCESS;
}
