/* act_forward.cu: tq_act_forward on CUDA: y = act(h) (gated: act(first) * second) of h [M, K]
 * with, in the same pass, its per-tensor FP8 codes (DELAYED / CURRENT scaling) and max |y|.
 *
 * Rule (tequant.h): every element is internal_act.h's tq_act_value (tequant's own e^x from RN
 * operations and fma, never CUDA's expf), the gated product one RN multiply; codes are
 * cvt8(tq_mul(y, scale)) by the hardware's cvt.rn.satfinite (fp_cast.cuh: formats.h's rule);
 * y_hp is rounded by cvt.rn after the canonical NaN; amax is fmaxf(|y|) (NaN ignored) per CTA,
 * then one atomicMax on the slot's signed bits (fp8_out.cuh). So every output equals
 * csrc/ref/act_forward_ref.c bit for bit, whatever the launch shape. CURRENT scaling is two
 * launches by the caller, as tq_norm_forward's: the amax run, then the cast run with amax_in.
 * Layout: elementwise and memory-bound; a thread takes chunks of 8 output columns of one row,
 * two at a time (grid-striding over rows x chunks, consecutive threads on consecutive chunks of a
 * row): 16-byte loads of h (both halves when gated) and stores of y_hp, 8-byte stores of codes,
 * where the rows (and a gated h's second half) are aligned; element accesses otherwise and for a
 * row's last, partial chunk. No sync, no allocation. gelu / silu / qgelu of bf16 h over enough
 * elements read act(x) from a per-CTA shared-memory table (act_table.cuh: the same bits, fewer
 * instructions: the arithmetic made these kernels compute-bound).
 * The amax run of those three (current scaling's first launch) reads h at memory speed with one
 * activation a CTA (monotone_amax_kernel: they are monotone where amax is decided).
 * y_q_t (the codes transposed, wgrad's operand): colt_kernel writes both directions where
 * colt_fits (16-bit h, codes without y_hp, M % 32 == 0, N % 256 == 0); else tq_transpose_cuda
 * runs on y_q after the pass (same bits either way).
 * Tests: tests/test_act_kernels.py (GPU cases: bit-exact against the C reference),
 * tests/test_act_columnwise.py (y_q_t), tests/test_act_amax.py (the amax run).
 */
#include <cuda_runtime.h>

#include "act_dispatch.cuh"
#include "act_table.cuh"
#include "chunks.cuh"
#include "fp8_out.cuh"
#include "internal_act.h"
#include "internal_kernels.h"
#include "launch.cuh"
#include "tile_transpose.cuh"

namespace {

using tq_chunk::Chunk;
using tq_chunk::chunk_len;
using tq_chunk::kChunk;
using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;

constexpr int kThreads = 256;

struct FwdParams {
    const void *h;
    int64_t rows, n, ld_h, nchunks; /* n: output columns (K, or K / 2 gated) */
    void *y_hp;
    int64_t ld_y;
    tq_fp8out::Out out;
    int h_vec, y_vec; /* 16-byte rows of h (and its second half) and of y_hp */
    uint8_t *y_q_t;   /* [N, M] codes, y_q transposed (colt_kernel writes it) */
    int64_t ld_qt;
};

/* One work item's inputs: chunk c of row r of h (and of its second half, gated). */
template <typename T, bool kGated>
struct Item {
    int64_t r, c;
    int n;
    Chunk<T> a, b;
    __device__ __forceinline__ void load(const FwdParams &p, int64_t row, int64_t chunk) {
        r = row, c = chunk, n = chunk_len(chunk, p.n);
        const T *hr = static_cast<const T *>(p.h) + r * p.ld_h;
        tq_chunk::load_chunk(a, hr, c, n, p.h_vec);
        if constexpr (kGated) tq_chunk::load_chunk(b, hr + p.n, c, n, p.h_vec);
    }
};

/* An item's y (act, gated product) and its share of amax. */
template <typename T, int kBase, bool kGated, bool kTable>
__device__ __forceinline__ void item_values(const Item<T, kGated> &it, const float *table,
                                            float (&y)[kChunk], float &amax) {
    if constexpr (kTable) {
        tq_act_table::values<kBase>(table, it.a.t, y);
    } else {
#pragma unroll
        for (int e = 0; e < kChunk; e++) y[e] = tq_act_value(kBase, tq_fp::widen(it.a.t[e]));
    }
    if constexpr (kGated) {
#pragma unroll
        for (int e = 0; e < kChunk; e++) y[e] = tq_nmul(y[e], tq_fp::widen(it.b.t[e]));
    }
    /* every element, a partial chunk's tail too: load_chunk zero-fills it and act(0) = 0 for
     * every activation, so the tail adds nothing, and no per-element test costs ALU slots */
#pragma unroll
    for (int e = 0; e < kChunk; e++) amax = tq_amax_step(amax, y[e]);
}

/* An item's outputs (y_hp, codes) and its share of amax. */
template <typename T, int kBase, bool kGated, bool kTable>
__device__ __forceinline__ void act_item(const FwdParams &p, const Item<T, kGated> &it,
                                         const float *table, float scale, float &amax) {
    float y[kChunk];
    item_values<T, kBase, kGated, kTable>(it, table, y, amax);
    if (p.y_hp != nullptr) {
        float o[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++) o[e] = tq_norm_canon(y[e]);
        tq_chunk::store_chunk(static_cast<T *>(p.y_hp) + it.r * p.ld_y, it.c, o, it.n, p.y_vec);
    }
    if (p.out.q != nullptr)
        tq_fp8out::store_codes(p.out.q + it.r * p.out.ld_q + (int64_t)kChunk * it.c, y, scale,
                               p.out.e5m2, it.n, p.out.q_vec);
}

/* kTable: gelu / silu / qgelu of bf16 from act_table.cuh's shared-memory table (the same bits).
 * A thread loads two items before computing either (two 16-byte loads in flight: one left the
 * kernel short of HBM bandwidth, the table launches with their fewer threads most). */
template <typename T, int kBase, bool kGated, bool kTable>
__global__ void __launch_bounds__(kTable ? tq_act_table::kThreads : kThreads)
    act_forward_kernel(const FwdParams p) {
    constexpr int kCta = kTable ? tq_act_table::kThreads : kThreads;
    __shared__ float table[kTable ? tq_act_table::kEntries : 1];
    if constexpr (kTable) tq_act_table::fill<kBase>(table, nullptr);
    const float scale = tq_fp8out::cast_scale(p.out);
    tq_fp8out::write_scale_inv(p.out, scale);
    float amax = 0.0f;
    if (p.nchunks > 0) {
        tq_chunk::Walk w((int64_t)blockIdx.x * kCta + threadIdx.x, (int64_t)gridDim.x * kCta,
                         p.nchunks);
        while (w.row < p.rows) {
            Item<T, kGated> first, second;
            first.load(p, w.row, w.chunk);
            w.next();
            const bool two = w.row < p.rows;
            if (two) second.load(p, w.row, w.chunk);
            act_item<T, kBase, kGated, kTable>(p, first, table, scale, amax);
            if (two) {
                act_item<T, kBase, kGated, kTable>(p, second, table, scale, amax);
                w.next();
            }
        }
    }
    tq_fp8out::block_amax<kCta>(p.out.amax, amax);
}

/* The amax run (no y_hp, no codes) of gelu / silu / qgelu of bf16 h: these are non-negative and
 * non-decreasing over every non-negative bf16 x (+Inf included), and |act(x)| < neg_bound(act)
 * for every negative one (-Inf and NaN give NaN, which amax ignores): checked over all 65536
 * values by tests/test_act_amax.py. So where m, the largest x a CTA reads, has act(m) >=
 * neg_bound, act(m) is that CTA's max |act(x)| exactly: every x >= 0 it reads has act(x) <=
 * act(m), every negative one |act(x)| < act(m). The CTA reads h at memory speed and computes one
 * activation. The decision is the CTA's, not each thread's: a thread's own few dozen elements
 * are often all below the bound (h of a small GPT at initialization, std ~0.45: ~1% of threads
 * at 62 elements each), and one slow thread holds its CTA; a CTA's ~16K elements are not. A CTA
 * whose act(m) is smaller (every x it reads below ~0.3-0.5) reads its items again and computes
 * each act(x). Same bits as act_forward_kernel's amax. */
template <int kBase>
__device__ __forceinline__ float neg_bound() { /* max |act(x)| over negative bf16 x, above */
    return kBase == TQ_ACT_SILU ? 0.3125f : 0.1875f; /* silu 0.2785, gelu 0.1700, qgelu 0.1645 */
}

template <int kBase>
__global__ void __launch_bounds__(kThreads) monotone_amax_kernel(const FwdParams p) {
    using T = tq_fp::Bf16;
    __shared__ float warp_m[kThreads / 32];
    float m = 0.0f;
    const int64_t start = (int64_t)blockIdx.x * kThreads + threadIdx.x,
                  stride = (int64_t)gridDim.x * kThreads;
    const int64_t rows = p.rows; /* nchunks >= 1: tq_act_forward refuses h without features */
    for (tq_chunk::Walk w(start, stride, p.nchunks); w.row < rows;) {
        Item<T, false> first, second;
        first.load(p, w.row, w.chunk);
        w.next();
        const bool two = w.row < rows;
        if (two) second.load(p, w.row, w.chunk);
#pragma unroll
        for (int e = 0; e < kChunk; e++) m = fmaxf(m, tq_fp::widen(first.a.t[e])); /* NaN: m */
        if (two) {
#pragma unroll
            for (int e = 0; e < kChunk; e++) m = fmaxf(m, tq_fp::widen(second.a.t[e]));
            w.next();
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if ((threadIdx.x & 31) == 0) warp_m[threadIdx.x >> 5] = m;
    __syncthreads();
    for (int w = 0; w < kThreads / 32; w++) m = fmaxf(m, warp_m[w]); /* the CTA's m, uniform */
    float amax = threadIdx.x == 0 ? tq_act_value(kBase, m) : 0.0f;
    if (!(tq_act_value(kBase, m) >= neg_bound<kBase>())) { /* uniform: every thread computes */
        amax = 0.0f;
        for (tq_chunk::Walk w(start, stride, p.nchunks); w.row < rows; w.next()) {
            Item<T, false> it;
            it.load(p, w.row, w.chunk);
#pragma unroll
            for (int e = 0; e < kChunk; e++)
                amax = tq_amax_step(amax, tq_act_value(kBase, tq_fp::widen(it.a.t[e])));
        }
    }
    tq_fp8out::block_amax<kThreads>(p.out.amax, amax);
}

/* colt_kernel: the codes alone (no y_hp), in both directions. A CTA takes tiles of 32 rows x
 * 256 output columns (CTAs grid-striding over the tiles): each thread its 1024 / kCta items of
 * the tile (all loads first), their codes into y_q (8-byte stores) and into a shared-memory copy
 * of the tile (rows 260 bytes apart), then, after a barrier, the tile's columns into y_q_t
 * (tile_transpose.cuh's store_columns32: whole 32-byte sectors) and a barrier before the next
 * tile. colt_fits: M % 32 == 0, N % 256 == 0, 16-byte rows of h, 8-byte ones of y_q and y_q_t. */
constexpr int kTileRows = 32, kTileChunks = 32, kStageLd = kTileChunks * kChunk + 4;

template <typename T, int kBase, bool kGated, bool kTable>
__global__ void __launch_bounds__(kTable ? tq_act_table::kThreads : kThreads)
    colt_kernel(const FwdParams p) {
    constexpr int kCta = kTable ? tq_act_table::kThreads : kThreads;
    constexpr int kItems = kTileRows * kTileChunks / kCta;
    __shared__ float table[kTable ? tq_act_table::kEntries : 1];
    __shared__ __align__(16) uint8_t stage[kTileRows * kStageLd];
    if constexpr (kTable) tq_act_table::fill<kBase>(table, nullptr);
    const float scale = tq_fp8out::cast_scale(p.out);
    tq_fp8out::write_scale_inv(p.out, scale);
    float amax = 0.0f;
    /* tiles column block by column block: CTAs that run together write neighbouring sectors
     * of y_q_t's rows (its lines, and HBM pages, fill in one go) */
    const int64_t row_tiles = p.rows / kTileRows, tiles = row_tiles * (p.nchunks / kTileChunks);
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int64_t r0 = tile % row_tiles * kTileRows, c0 = tile / row_tiles * kTileChunks;
        Item<T, kGated> it[kItems];
#pragma unroll
        for (int i = 0; i < kItems; i++) {
            const int at = threadIdx.x + i * kCta; /* consecutive threads: consecutive chunks */
            it[i].load(p, r0 + at / kTileChunks, c0 + at % kTileChunks);
        }
#pragma unroll
        for (int i = 0; i < kItems; i++) {
            float y[kChunk];
            uint32_t w[2];
            item_values<T, kBase, kGated, kTable>(it[i], table, y, amax);
            tq_fp8out::chunk_codes(y, scale, p.out.e5m2, w);
            *reinterpret_cast<uint2 *>(p.out.q + it[i].r * p.out.ld_q + kChunk * it[i].c) =
                make_uint2(w[0], w[1]);
            const int at = threadIdx.x + i * kCta;
            uint32_t *s = reinterpret_cast<uint32_t *>(stage + at / kTileChunks * kStageLd
                                                       + kChunk * (at % kTileChunks));
            s[0] = w[0], s[1] = w[1];
        }
        __syncthreads(); /* the tile's codes are staged */
        tq_tile::store_columns32<kCta>(stage, kStageLd, kTileChunks * kChunk,
                                       p.y_q_t + kChunk * c0 * p.ld_qt + r0, p.ld_qt);
        __syncthreads(); /* read before the next tile overwrites them */
    }
    tq_fp8out::block_amax<kCta>(p.out.amax, amax);
}

bool colt_fits(const FwdParams &p, size_t elem) {
    return p.y_q_t != nullptr && p.y_hp == nullptr && p.out.q != nullptr && elem == 2
           && p.rows % kTileRows == 0 && p.n % (kTileChunks * kChunk) == 0 && p.h_vec
           && p.out.q_vec && tq_chunk::aligned(p.y_q_t, 8) && p.ld_qt % 8 == 0;
}

}  // namespace

extern "C" tq_status tq_act_forward_cuda(const tq_tensor *h, const tq_act_forward_args *a,
                                         struct CUstream_st *stream) {
    DeviceGuard guard(h->device);
    if (guard.status != cudaSuccess)
        return cuda_failed("act forward: making h's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const size_t elem = h->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int gated = tq_act_gated(a->act);
    FwdParams p = {};
    p.h = h->data;
    p.rows = h->rows;
    p.n = gated ? h->cols / 2 : h->cols;
    p.ld_h = h->ld;
    p.nchunks = (p.n + kChunk - 1) / kChunk;
    p.y_hp = a->y_hp.data;
    p.ld_y = a->y_hp.ld;
    p.out = tq_fp8out::make_out(a->config, a->y_q, a->scale_inv, a->scale, a->amax_in, a->amax);
    p.h_vec = tq_chunk::rows_aligned16(h->data, h->ld, elem) && (!gated || (p.n * elem) % 16 == 0);
    p.y_vec = p.y_hp != nullptr && tq_chunk::rows_aligned16(p.y_hp, p.ld_y, elem);
    p.out.q_vec = p.out.q != nullptr && tq_chunk::aligned(p.out.q, 8) && p.out.ld_q % 8 == 0;
    p.y_q_t = static_cast<uint8_t *>(a->y_q_t.data);
    p.ld_qt = a->y_q_t.ld;
    const bool colt = colt_fits(p, elem);
    const int sms = tq_act_dispatch::sm_count(h->device);
    const bool table_pays = tq_act_table::worth_it(p.rows * p.n, sms);
    tq_act_dispatch::with_dtype_act(h->dtype, a->act, [&](auto t, auto act) {
        using A = decltype(act);
        using T = decltype(t);
        const int64_t items = p.rows * p.nchunks, tiles = items / (kTileRows * kTileChunks);
        if constexpr (tq_act_table::kUses<T, A::base> && !A::gated) {
            if (a->config == nullptr && p.y_hp == nullptr) { /* current scaling's amax run */
                monotone_amax_kernel<A::base>
                    <<<tq_act_dispatch::grid_for(items, sms, kThreads), kThreads, 0, s>>>(p);
                return;
            }
        }
        if constexpr (tq_act_table::kUses<T, A::base>) {
            if (table_pays) {
                const unsigned grid = tq_act_dispatch::grid_for(
                    items, sms, tq_act_table::kThreads, tq_act_table::kCtasPerSm);
                if (colt)
                    colt_kernel<T, A::base, A::gated, true><<<
                        tq_act_dispatch::grid_for(tiles, sms, 1, tq_act_table::kCtasPerSm),
                        tq_act_table::kThreads, 0, s>>>(p);
                else
                    act_forward_kernel<T, A::base, A::gated, true>
                        <<<grid, tq_act_table::kThreads, 0, s>>>(p);
                return;
            }
        }
        const unsigned grid = tq_act_dispatch::grid_for(items, sms, kThreads);
        if constexpr (sizeof(T) == 2) {
            if (colt) {
                colt_kernel<T, A::base, A::gated, false>
                    <<<tq_act_dispatch::grid_for(tiles, sms, 1), kThreads, 0, s>>>(p);
                return;
            }
        }
        act_forward_kernel<T, A::base, A::gated, false><<<grid, kThreads, 0, s>>>(p);
    });
    const cudaError_t err = cudaGetLastError(); /* cleared: must not poison later calls */
    if (err != cudaSuccess) return cuda_failed("act forward kernel launch", err);
    /* y_q_t where colt_kernel did not run: the codes transposed after the pass */
    if (p.y_q_t != nullptr && !colt && p.rows > 0) {
        tq_tensor y_q_t = a->y_q_t;
        return tq_transpose_cuda(&a->y_q, &y_q_t, stream);
    }
    return TQ_SUCCESS;
}
