/* act_grad_load.cuh: the activation backward's loader for the 128x128-tile block quantizers
 * (fp8_block_tile.cuh, mxfp8_tile.cuh), internal to cuda/: dh = dy * act'(h) rounded to h's
 * dtype, computed as the tile is loaded, so fc1's grad_output is written in the block formats
 * from dy and h in one pass (act_quantize_block.cu, act_quantize_mxfp8.cu), and its launch
 * (launch_act_grad, through act_load.cuh's launch_loaded).
 * The tile kernel's params P give the loader h (x), its ld and K (cols: dh's columns, h's);
 * the loader holds dy (its ld; [M, N], N = K or K / 2 gated), h_rows (rows past it read as
 * zeros), vec (16-byte loads) and the tables.
 * Tests: tests/test_act_grad_block.py (GPU cases: bit-exact against the C references).
 */
#ifndef TEQUANT_CUDA_ACT_GRAD_LOAD_CUH_
#define TEQUANT_CUDA_ACT_GRAD_LOAD_CUH_

#include <cuda_runtime.h>

#include "act_load.cuh"

namespace tq_act_load {

/* dh's loader: column c of dh is, per internal_act.h's tq_act_grad (the C reference's
 * dh_elems): RN(dy[c] * act'(h[c])) ungated; gated, c < N: RN(RN(dy[c] * h[N + c]) *
 * act'(h[c])), c >= N: RN(dy[c - N] * act(h[c - N])). kTable: bf16 gelu / silu / qgelu read
 * act' (and, gated, act) from act_table.cuh's tables (the same bits), which init fills in the
 * launch's dynamic shared memory. */
template <int kBase, bool kGated, bool kTable, typename E>
struct ActGradLoad {
    static constexpr bool kManyTiles = kTable; /* the table launches' resident CTAs */
    static constexpr size_t kTableBytes = (kGated ? 2 : 1) * sizeof(float) * tq_act_table::kEntries;
    int64_t h_rows;
    int vec;          /* 16-byte loads of h's and dy's rows (a chunk lies in one half) */
    const void *dy;
    int64_t dy_ld;
    float *deriv, *value;
    __device__ __forceinline__ void init() {
        if constexpr (kTable) {
            extern __shared__ float act_table_smem[];
            deriv = act_table_smem;
            value = kGated ? act_table_smem + tq_act_table::kEntries : nullptr;
            tq_act_table::fill<kBase>(value, deriv);
        }
    }
    /* dh of a whole chunk in one half: a = h's words at the chunk's activation input, b = the
     * second half's (gated, first half), g = dy's. */
    template <int kVec>
    __device__ __forceinline__ void grads(const uint4 &a, const uint4 &b, const uint4 &g,
                                          bool second, float (&d)[kVec]) const {
        constexpr int kPerWord = E::kPerWord;
        float gf[kVec];
#pragma unroll
        for (int e = 0; e < kVec; e++) {
            gf[e] = E::widen(word_of(g, e / kPerWord), e % kPerWord);
            if (kGated && !second)
                gf[e] = tq_nmul(gf[e], E::widen(word_of(b, e / kPerWord), e % kPerWord));
        }
        if constexpr (kTable) {
            tq_fp::Bf16 x[kVec];
#pragma unroll
            for (int e = 0; e < kVec; e++)
                x[e].bits = (uint16_t)(word_of(a, e / kPerWord) >> (16 * (e % kPerWord)));
            if (kGated && second) {
                float v[kVec];
                tq_act_table::values<kBase>(value, x, v);
#pragma unroll
                for (int e = 0; e < kVec; e++) d[e] = tq_nmul(gf[e], v[e]);
            } else {
                tq_act_table::grads<kBase>(nullptr, deriv, x, gf, d, nullptr);
            }
        } else {
#pragma unroll
            for (int e = 0; e < kVec; e++) {
                const float x = E::widen(word_of(a, e / kPerWord), e % kPerWord);
                float v;
                d[e] = kGated && second ? tq_nmul(gf[e], tq_act_value(kBase, x))
                                        : tq_act_grad(kBase, x, gf[e], &v);
            }
        }
    }
    /* One element's load, widened (the unaligned path). */
    __device__ __forceinline__ float at(const void *base, int64_t ld, int64_t m, int64_t c) const {
        const char *p = static_cast<const char *>(base);
        if constexpr (E::kPerWord == 1)
            return __uint_as_float(reinterpret_cast<const uint32_t *>(p)[m * ld + c]);
        else
            return E::widen(reinterpret_cast<const uint16_t *>(p)[m * ld + c], 0);
    }
    /* dh of n elements from column col of row m, element by element (unaligned rows, the last
     * columns; a chunk may cross the halves): the direct arithmetic, the table's bits. */
    template <int kVec, typename P>
    __device__ __forceinline__ void slow(const P &p, int64_t m, int64_t col, int n,
                                         float (&d)[kVec]) const {
        const int64_t half = kGated ? p.cols / 2 : p.cols;
#pragma unroll
        for (int e = 0; e < kVec; e++) {
            d[e] = 0.0f;
            if (e >= n) continue;
            const int64_t c = col + e;
            const bool second = kGated && c >= half;
            const int64_t hc = second ? c - half : c;
            const float x = at(p.x, p.ld, m, hc);
            float g = at(dy, dy_ld, m, hc), v;
            if (kGated && !second) g = tq_nmul(g, at(p.x, p.ld, m, half + c));
            d[e] = second ? tq_nmul(g, tq_act_value(kBase, x)) : tq_act_grad(kBase, x, g, &v);
        }
    }
    /* The tile kernel's load: its kLoads chunks of dh (rows kRowsPerPass apart), in batches
     * whose loads (h, dy and, gated, h's second half) are all issued before any is used. */
    template <typename In, int kLoads, int kRowsPerPass, int kVec, typename P>
    __device__ __forceinline__ void load(const P &p, uint4 (&in)[kLoads], int64_t m0,
                                         int64_t col, int row_in_pass) const {
        constexpr int kElemBytes = 4 / E::kPerWord;
        constexpr int kMaxBatch = kGated ? 4 : 8; /* 16-byte registers: two or three per chunk */
        constexpr int kBatch = kLoads < kMaxBatch ? kLoads : kMaxBatch;
        static_assert(kLoads % kBatch == 0, "whole batches");
        const int64_t k = p.cols, half = kGated ? k / 2 : k;
        const bool second = kGated && col >= half;
        const int64_t hc = second ? col - half : col;
        const int valid = col >= k ? 0 : (col + kVec <= k ? kVec : (int)(k - col));
        const char *h_base = static_cast<const char *>(p.x);
        const char *dy_base = static_cast<const char *>(dy);
#pragma unroll
        for (int i0 = 0; i0 < kLoads; i0 += kBatch) {
            uint4 g[kBatch], b[kGated ? kBatch : 1];
#pragma unroll
            for (int i = 0; i < kBatch; i++) {
                const int64_t m = m0 + (i0 + i) * kRowsPerPass + row_in_pass;
                const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
                in[i0 + i] = g[i] = zero;
                if constexpr (kGated) b[i] = zero;
                if (m >= h_rows || valid != kVec || !vec) continue;
                const char *h_row = h_base + m * p.ld * kElemBytes;
                in[i0 + i] = __ldcs(reinterpret_cast<const uint4 *>(h_row + hc * kElemBytes));
                g[i] = __ldcs(reinterpret_cast<const uint4 *>(dy_base + (m * dy_ld + hc) * kElemBytes));
                if (kGated && !second)
                    b[i] = __ldcs(reinterpret_cast<const uint4 *>(h_row + (half + col) * kElemBytes));
            }
#pragma unroll
            for (int i = 0; i < kBatch; i++) {
                const int64_t m = m0 + (i0 + i) * kRowsPerPass + row_in_pass;
                const int n = m < h_rows ? valid : 0;
                float d[kVec];
                if (n == kVec && vec) grads<kVec>(in[i0 + i], b[kGated ? i : 0], g[i], second, d);
                else slow<kVec>(p, m, col, n, d);
                in[i0 + i] = pack_chunk<E, kVec>(d, n);
            }
        }
    }
};

/* The activation backward's tile pass (ActGradLoad) of dy and h into a format's blocks of dh
 * (q: [M, K] in p, K = h's columns). */
template <typename K, typename P>
void launch_act_grad(const tq_tensor *dy, const tq_tensor *h, tq_act act, const P &p,
                     int64_t n_tiles, bool col, cudaStream_t s) {
    const int64_t elem = h->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int64_t n = tq_act_gated(act) ? h->cols / 2 : h->cols;
    const int vec = vec_ok(h) && vec_ok(dy) && (!tq_act_gated(act) || (n * elem) % 16 == 0);
    launch_loaded<ActGradLoad, K>(h->dtype, h->device, act, p, n_tiles, p.rows * h->cols, col, s,
                                  [&](auto tag) {
                                      using L = typename decltype(tag)::type;
                                      return L{h->rows, vec, dy->data, dy->ld, nullptr, nullptr};
                                  });
}

}  // namespace tq_act_load

#endif  // TEQUANT_CUDA_ACT_GRAD_LOAD_CUH_
