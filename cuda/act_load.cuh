/* act_load.cuh: the activation's loader for the 128x128-tile block quantizers (fp8_block_tile.cuh,
 * mxfp8_tile.cuh), internal to cuda/: act(h) rounded to h's dtype, computed as the tile is loaded,
 * so the block formats are written from h in one pass (act_quantize_block.cu,
 * act_quantize_mxfp8.cu), and their launch (launch_act; the table instances' CTAs stay
 * resident).
 * A tile kernel's params P give the loader x (h), ld and cols (the output's columns, where a
 * gated h's second half starts); the loader holds h_rows (rows past it read as zeros) and vec
 * (16-byte loads of h's rows and, gated, of the second half).
 * Tests: tests/test_act_block.py, tests/test_act_mxfp8.py (GPU cases: bit-exact against the C
 * references).
 */
#ifndef TEQUANT_CUDA_ACT_LOAD_CUH_
#define TEQUANT_CUDA_ACT_LOAD_CUH_

#include <cuda_runtime.h>

#include "act_dispatch.cuh"
#include "act_table.cuh"
#include "fp8_block_tile.cuh"
#include "internal_act.h"

namespace tq_act_load {

using tq_block::word_of;

/* A chunk's values y (n of kVec valid, the rest 0) rounded to E's dtype after the canonical
 * NaN, as the tile kernel's 16-byte input chunk: the bits a y_hp / dh output of that dtype
 * holds. */
template <typename E, int kVec>
__device__ __forceinline__ uint4 pack_chunk(const float (&y)[kVec], int n) {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if constexpr (E::kPerWord == 2) { /* 16-bit: a pair per conversion (cvt.rn.*x2) */
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t keep = 2 * j + 1 < n ? 0xFFFFFFFFu : 2 * j < n ? 0xFFFFu : 0u;
            w[j] = E::narrow2(tq_norm_canon(y[2 * j]), tq_norm_canon(y[2 * j + 1])) & keep;
        }
    } else {
#pragma unroll
        for (int e = 0; e < kVec; e++)
            if (e < n) w[e] = E::narrow(tq_norm_canon(y[e]));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The activation's loader: x = act(h) over the tile; h's row m holds the output's first half at
 * columns [0, cols) and, gated, the second at [cols, 2 cols). Rows >= h_rows and columns >= cols
 * give 0 (a padded operand's zero rows: no amax exceeds them). kTable: bf16 gelu / silu / qgelu
 * read act(x) from act_table.cuh's table (the same bits), which init fills in the launch's
 * dynamic shared memory (the tile kernel's static 32 KB leave too little beside it). */
template <int kBase, bool kGated, bool kTable, typename E>
struct ActLoad {
    static constexpr bool kManyTiles = kTable; /* the table launches' resident CTAs */
    static constexpr size_t kTableBytes = sizeof(float) * tq_act_table::kEntries; /* act(x) */
    int64_t h_rows;
    int vec;
    float *table;
    __device__ __forceinline__ void init() {
        if constexpr (kTable) {
            extern __shared__ float act_table_smem[];
            table = act_table_smem;
            tq_act_table::fill<kBase>(table, nullptr);
        }
    }
    /* act(x) of a chunk's kVec elements (the words of a) into y. */
    template <int kVec>
    __device__ __forceinline__ void values(const uint4 &a, float (&y)[kVec]) const {
        constexpr int kPerWord = E::kPerWord;
        if constexpr (kTable) {
            tq_fp::Bf16 x[kVec];
#pragma unroll
            for (int e = 0; e < kVec; e++)
                x[e].bits = (uint16_t)(word_of(a, e / kPerWord) >> (16 * (e % kPerWord)));
            tq_act_table::values<kBase>(table, x, y);
        } else {
#pragma unroll
            for (int e = 0; e < kVec; e++)
                y[e] = tq_act_value(kBase, E::widen(word_of(a, e / kPerWord), e % kPerWord));
        }
    }
    /* Every chunk's loads first (kLoads 16-byte loads in flight per thread, as RawLoad's), then
     * the activation of each: a load consumed right away left one in flight, and the pass
     * waited on memory however cheap the activation (the table did not help that form). */
    template <typename In, int kLoads, int kRowsPerPass, int kVec, typename P>
    __device__ __forceinline__ void load(const P &p, uint4 (&in)[kLoads], int64_t m0,
                                         int64_t col, int row_in_pass) const {
        constexpr int kPerWord = E::kPerWord; /* the tile kernel's In: the same storage */
        constexpr int kElemBytes = 4 / kPerWord;
        const int valid = col >= p.cols ? 0 : (col + kVec <= p.cols ? kVec : (int)(p.cols - col));
        uint4 second[kGated ? kLoads : 1];
#pragma unroll
        for (int i = 0; i < kLoads; i++) {
            const int64_t m = m0 + i * kRowsPerPass + row_in_pass;
            const int n = m < h_rows ? valid : 0;
            const char *first = static_cast<const char *>(p.x) + (m * p.ld + col) * kElemBytes;
            const char *other = first + p.cols * kElemBytes;
            uint4 b = make_uint4(0u, 0u, 0u, 0u);
            in[i] = b;
            if (n == kVec && vec) {
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
            const int n = m < h_rows ? valid : 0;
            float y[kVec];
            values<kVec>(in[i], y);
            if constexpr (kGated) {
#pragma unroll
                for (int e = 0; e < kVec; e++)
                    y[e] = tq_nmul(y[e], E::widen(word_of(second[i], e / kPerWord), e % kPerWord));
            }
            in[i] = pack_chunk<E, kVec>(y, n);
        }
    }
};

/* The element type (as fp8_block_tile.cuh's) of the dispatch's T (float, Bf16, Half). */
template <typename T> struct InOf { using type = tq_block::F32; };
template <> struct InOf<tq_fp::Bf16> { using type = tq_block::BF16; };
template <> struct InOf<tq_fp::Half> { using type = tq_block::F16; };

constexpr int kTileThreads = 256; /* the tile kernels' CTA (static_assert by each format) */

/* A table launch of kKernel (256 threads, P params): the loader's tables (L::kTableBytes) in
 * dynamic shared memory beside the kernel's static tile (past the 48 KB a launch gets without
 * opting in, set once per kernel and device: each instance has its own kKernel, so its own
 * cache), and as many CTAs as fit at once (at most n_tiles), each filling its tables once and
 * then taking tiles in turn. */
template <auto kKernel, typename P, typename L>
void launch_table(const P &p, const L &loader, int64_t n_tiles, int device, int sms,
                  cudaStream_t s) {
    constexpr int kDevices = 64, kThreads = kTileThreads;
    constexpr int kBytes = (int)L::kTableBytes;
    static int per_sm[kDevices]; /* 0: not yet set up on that device (a race sets it twice) */
    int n = device >= 0 && device < kDevices ? per_sm[device] : 0;
    if (n == 0) {
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kThreads, kBytes)
                != cudaSuccess || n < 1)
            n = 1; /* a failed set-up shows as the launch's error */
        if (device >= 0 && device < kDevices) per_sm[device] = n;
    }
    int64_t grid = (int64_t)n * sms;
    if (grid > n_tiles) grid = n_tiles;
    kKernel<<<(unsigned)grid, kThreads, kBytes, s>>>(p, loader);
}

template <typename T> struct Tag { using type = T; };

/* A loader family's tile pass of h into a format's blocks (q: [M, N] in the launch's params p,
 * n_tiles 128x128 tiles, checked to fit 31 bits, `elements` computed in all), every activation
 * but the identity and every dtype: K::kernel<E, L, kCol>() is the format's tile kernel
 * instance for x's element type E (fp8_block_tile.cuh's), loader L = Loader<base, gated,
 * table, E> and the columnwise direction or not (rowwise always); make(Tag<L>{}) gives the
 * loader's state. bf16 gelu / silu / qgelu over enough elements take the table launch. */
template <template <int, bool, bool, typename> class Loader, typename K, typename P,
          typename Make>
void launch_loaded(tq_dtype dtype, int device, tq_act act, const P &p, int64_t n_tiles,
                   int64_t elements, bool col, cudaStream_t s, Make make) {
    const int sms = tq_act_dispatch::sm_count(device);
    const bool table_pays = tq_act_table::worth_it(elements, sms);
    tq_act_dispatch::with_dtype_act(dtype, act, [&](auto t, auto a) {
        using A = decltype(a);
        using T = decltype(t);
        using E = typename InOf<T>::type;
        if constexpr (A::base != TQ_ACT_IDENTITY) {
            if constexpr (tq_act_table::kUses<T, A::base>) {
                if (table_pays) {
                    using L = Loader<A::base, A::gated, true, E>;
                    const L l = make(Tag<L>{});
                    if (col) launch_table<K::template kernel<E, L, true>()>(p, l, n_tiles, device, sms, s);
                    else launch_table<K::template kernel<E, L, false>()>(p, l, n_tiles, device, sms, s);
                    return;
                }
            }
            using L = Loader<A::base, A::gated, false, E>;
            const L l = make(Tag<L>{});
            const auto kernel = col ? K::template kernel<E, L, true>() : K::template kernel<E, L, false>();
            kernel<<<(unsigned)n_tiles, kTileThreads, 0, s>>>(p, l);
        }
    });
}

/* Whether 16-byte loads of a 16-bit or FP32 matrix t (its start and row stride) are allowed. */
inline bool vec_ok(const tq_tensor *t) {
    const int64_t elem = t->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    return reinterpret_cast<uintptr_t>(t->data) % 16 == 0 && (t->ld * elem) % 16 == 0;
}

/* The activation's tile pass (ActLoad) of h into a format's blocks: launch_loaded for the
 * forward, n the output's columns. */
template <typename K, typename P>
void launch_act(const tq_tensor *h, tq_act act, const P &p, int64_t n_tiles, int64_t n,
                bool col, cudaStream_t s) {
    const int64_t elem = h->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int vec = vec_ok(h) && (!tq_act_gated(act) || (n * elem) % 16 == 0);
    launch_loaded<ActLoad, K>(h->dtype, h->device, act, p, n_tiles, p.rows * n, col, s,
                              [&](auto tag) {
                                  using L = typename decltype(tag)::type;
                                  return L{h->rows, vec, nullptr};
                              });
}

}  // namespace tq_act_load

#endif  // TEQUANT_CUDA_ACT_LOAD_CUH_
