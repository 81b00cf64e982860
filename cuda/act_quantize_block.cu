/* act_quantize_block.cu: tq_act_forward with a BLOCK (1x128, E4M3) config on CUDA: act(h), rounded
 * to h's dtype, quantized into FP8 1x128 blocks in both directions as the tile is loaded
 * (Float8BlockScaling's fc2 input written by te.LayerNormMLP's activation, no high-precision
 * copy in HBM).
 *
 * Rule (fused.h): every element is internal_act.h's tq_act_value (gated: one RN multiply by the
 * second half), canonical NaN, RNE to h's dtype: the bits tq_act_forward's y_hp holds. Those
 * values are quantized by fp8_block_tile.cuh's kernel, the one tq_quantize runs on an x of h's
 * dtype, so q equals tq_quantize of that y_hp (rows past M as zero rows) bit for bit, and
 * csrc/ref/act_forward_ref.c, which computes it that way. TransformerEngine's fused activation
 * + block-format casts round to the input type the same way, so the fused module multiplies
 * what the unfused one would.
 * Layout: CTAs of 128x128 output tiles; each thread computes the activation of its 8 or 16
 * chunks while loading them (16-byte loads of h, both halves when gated, where the rows allow),
 * then the tile kernel's rowwise and columnwise passes run unchanged. The arithmetic bounds the
 * pass (gelu ~75 instructions per element: docs/results/NOTES.md), so bf16 gelu / silu / qgelu
 * over enough elements read act(x) from act_table.cuh's table (the same bits), filled once per
 * CTA in dynamic shared memory by CTAs that stay resident and take tiles in turn.
 * Tests: tests/test_act_block.py (GPU cases: bit-exact against the C reference and against
 * tq_quantize of the activation's y_hp).
 */
#include <cuda_runtime.h>

#include "act_dispatch.cuh"
#include "act_table.cuh"
#include "fp8_block_tile.cuh"
#include "internal_act.h"
#include "internal_kernels.h"
#include "launch.cuh"

namespace {

using namespace tq_block;
using tq_cuda::DeviceGuard;
using tq_cuda::launch_failed;

/* The activation's loader: x = act(h) over the tile; h's row m holds the output's first half at
 * columns [0, cols) and, gated, the second at [cols, 2 cols). Rows >= h_rows and columns >= cols
 * give 0 (a padded operand's zero rows: no amax exceeds them). kTable: bf16 gelu / silu / qgelu
 * read act(x) from act_table.cuh's table (the same bits), which init fills in the launch's
 * dynamic shared memory (the tile kernel's static 32 KB leave too little beside it). */
template <int kBase, bool kGated, bool kTable>
struct ActLoad {
    float *table;
    __device__ __forceinline__ void init() {
        if constexpr (kTable) {
            extern __shared__ float act_table_smem[];
            table = act_table_smem;
            tq_act_table::fill<kBase>(table, nullptr);
        }
    }
    /* act(x) of a chunk's kVec elements (the words of a) into y. */
    template <typename In, int kVec>
    __device__ __forceinline__ void values(const uint4 &a, float (&y)[kVec]) const {
        constexpr int kPerWord = In::kPerWord;
        if constexpr (kTable) {
            tq_fp::Bf16 x[kVec];
#pragma unroll
            for (int e = 0; e < kVec; e++)
                x[e].bits = (uint16_t)(word_of(a, e / kPerWord) >> (16 * (e % kPerWord)));
            tq_act_table::values<kBase>(table, x, y);
        } else {
#pragma unroll
            for (int e = 0; e < kVec; e++)
                y[e] = tq_act_value(kBase, In::widen(word_of(a, e / kPerWord), e % kPerWord));
        }
    }
    /* Every chunk's loads first (kLoads 16-byte loads in flight per thread, as RawLoad's), then
     * the activation of each: a load consumed right away left one in flight, and the pass
     * waited on memory however cheap the activation (the table did not help that form). */
    template <typename In, int kLoads, int kRowsPerPass, int kVec>
    __device__ __forceinline__ void load(const Params &p, uint4 (&in)[kLoads], int64_t m0,
                                         int64_t col, int row_in_pass) const {
        constexpr int kPerWord = In::kPerWord;
        constexpr int kElemBytes = 4 / kPerWord;
        const int valid = col >= p.cols ? 0 : (col + kVec <= p.cols ? kVec : (int)(p.cols - col));
        uint4 second[kGated ? kLoads : 1];
#pragma unroll
        for (int i = 0; i < kLoads; i++) {
            const int64_t m = m0 + i * kRowsPerPass + row_in_pass;
            const int n = m < p.h_rows ? valid : 0;
            const char *first = static_cast<const char *>(p.x) + (m * p.ld + col) * kElemBytes;
            const char *other = first + p.cols * kElemBytes;
            uint4 b = make_uint4(0u, 0u, 0u, 0u);
            in[i] = b;
            if (n == kVec && p.act_vec) {
                in[i] = __ldcs(reinterpret_cast<const uint4 *>(first));
                if (kGated) b = __ldcs(reinterpret_cast<const uint4 *>(other));
            } else {
                uint32_t wa[4] = {0u, 0u, 0u, 0u}, wb[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int e = 0; e < kVec; e++) {
                    if (e >= n) continue;
                    const int sh = 16 * (e % kPerWord);
                    if (kElemBytes == 4) {
                        wa[e] = reinterpret_cast<const uint32_t *>(first)[e];
                        if (kGated) wb[e] = reinterpret_cast<const uint32_t *>(other)[e];
                    } else {
                        wa[e / kPerWord] |= (uint32_t)reinterpret_cast<const uint16_t *>(first)[e] << sh;
                        if (kGated)
                            wb[e / kPerWord] |= (uint32_t)reinterpret_cast<const uint16_t *>(other)[e] << sh;
                    }
                }
                in[i] = make_uint4(wa[0], wa[1], wa[2], wa[3]);
                b = make_uint4(wb[0], wb[1], wb[2], wb[3]);
            }
            if constexpr (kGated) second[i] = b;
        }
#pragma unroll
        for (int i = 0; i < kLoads; i++) {
            const int64_t m = m0 + i * kRowsPerPass + row_in_pass;
            const int n = m < p.h_rows ? valid : 0;
            float y[kVec];
            values<In, kVec>(in[i], y);
            if constexpr (kGated) {
#pragma unroll
                for (int e = 0; e < kVec; e++)
                    y[e] = tq_nmul(y[e], In::widen(word_of(second[i], e / kPerWord), e % kPerWord));
            }
            uint32_t w[4] = {0u, 0u, 0u, 0u};
            if constexpr (kPerWord == 2) { /* 16-bit: a pair per conversion (cvt.rn.*x2) */
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint32_t keep = 2 * j + 1 < n ? 0xFFFFFFFFu : 2 * j < n ? 0xFFFFu : 0u;
                    w[j] = In::narrow2(tq_norm_canon(y[2 * j]), tq_norm_canon(y[2 * j + 1])) & keep;
                }
            } else {
#pragma unroll
                for (int e = 0; e < kVec; e++)
                    if (e < n) w[e] = In::narrow(tq_norm_canon(y[e]));
            }
            in[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
};

template <typename T> struct InOf { using type = F32; };
template <> struct InOf<tq_fp::Bf16> { using type = BF16; };
template <> struct InOf<tq_fp::Half> { using type = F16; };

constexpr size_t kTableBytes = sizeof(float) * tq_act_table::kEntries;

/* A table launch: the table in dynamic shared memory beside the kernel's static tile (past the
 * 48 KB a launch gets without opting in, set once per kernel and device), and as many CTAs as
 * fit at once, each filling its table once and then taking tiles in turn. */
template <typename In, typename L, bool kCol>
void launch_table(const Params &p, int device, int sms, cudaStream_t s) {
    const auto kernel = quantize_kernel<In, L, true, kCol, false, false>;
    constexpr int kDevices = 64;
    static int per_sm[kDevices]; /* 0: not yet set up on that device (a race sets it twice) */
    int n = device >= 0 && device < kDevices ? per_sm[device] : 0;
    if (n == 0) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kTableBytes);
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kTableBytes)
                != cudaSuccess || n < 1)
            n = 1; /* a failed set-up shows as the launch's error */
        if (device >= 0 && device < kDevices) per_sm[device] = n;
    }
    int64_t grid = (int64_t)n * sms;
    if (grid > p.n_tiles) grid = p.n_tiles;
    kernel<<<(unsigned)grid, kThreads, kTableBytes, s>>>(p);
}

}  // namespace

extern "C" tq_status tq_act_forward_block_cuda(const tq_tensor *h, const tq_act_forward_args *a,
                                               struct CUstream_st *stream) {
    const tq_qtensor *q = a->q;
    const tq_quant_config *c = a->config;
    const int col = q->data_t.data != NULL;
    const int64_t M = q->rows, N = q->cols; /* M: the padded rows (>= h's) */
    if (M == 0 || N == 0) return TQ_SUCCESS;
    const int64_t kTileL = kTile;
    const int64_t n_mb = (M + kTileL - 1) / kTileL, n_kb = (N + kTileL - 1) / kTileL;
    if (n_mb > INT32_MAX / n_kb)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "act forward: [%lld, %lld] has more than 2^31 - 1 "
                       "tiles of 128x128", (long long)M, (long long)N);
    DeviceGuard guard(h->device);
    if (guard.status != cudaSuccess) return launch_failed("act forward: making h's device current");
    const int64_t elem = h->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int gated = tq_act_gated(a->act);
    Params p = tile_params(h->data, h->dtype, h->ld, M, N, c, q);
    p.h_rows = h->rows;
    p.act_vec = reinterpret_cast<uintptr_t>(h->data) % 16 == 0 && (h->ld * elem) % 16 == 0
                && (!gated || (N * elem) % 16 == 0);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const int sms = tq_act_dispatch::sm_count(h->device);
    const bool table_pays = tq_act_table::worth_it(M * N, sms);
    /* E4M3 rowwise (+ columnwise): what act.c lets through (a forward operand's format) */
    tq_act_dispatch::with_dtype_act(h->dtype, a->act, [&](auto t, auto act) {
        using A = decltype(act);
        using T = decltype(t);
        using In = typename InOf<T>::type;
        if constexpr (A::base != TQ_ACT_IDENTITY) {
            if constexpr (tq_act_table::kUses<T, A::base>) {
                if (table_pays) {
                    using L = ActLoad<A::base, A::gated, true>;
                    if (col) launch_table<In, L, true>(p, h->device, sms, s);
                    else launch_table<In, L, false>(p, h->device, sms, s);
                    return;
                }
            }
            using L = ActLoad<A::base, A::gated, false>;
            const unsigned grid = (unsigned)p.n_tiles;
            if (col) quantize_kernel<In, L, true, true, false, false><<<grid, kThreads, 0, s>>>(p);
            else quantize_kernel<In, L, true, false, false, false><<<grid, kThreads, 0, s>>>(p);
        }
    });
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("act forward block kernel launch");
    return TQ_SUCCESS;
}
