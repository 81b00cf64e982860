/* act_backward.cu: tq_act_backward on CUDA: dh = dy * act'(h) (gated: both halves) with, in the
 * same pass, its per-tensor FP8 codes (DELAYED / CURRENT), max |dh| and dbias's column partials;
 * the identity's pass (tq_quantize's dbias pass) writes the columnwise codes too (dh_q_t:
 * identity_columnwise_kernel), the activations transpose their codes after it.
 *
 * Rule (tequant.h): every element is internal_act.h's tq_act_grad (tequant's own e^x, never
 * CUDA's), gated halves as act_backward_ref.c combines them; codes, dh and amax as
 * act_forward.cu writes its outputs (fp8_out.cuh). dbias follows the fixed column order: rows
 * in chunks of R(M, K) rows (tq_norm_partial_rows, the norm backward's), each chunk's partial
 * adding its rows in order onto +0, written to the workspace ([chunk][K] FP32); then
 * column_sums.cuh's kernel adds each column's partials in groups of 32 chunks and the group sums
 * in order, rounding once to dbias's dtype (the identity's columnwise pass, a cooperative launch,
 * does that itself after a grid barrier: no second launch; and with a DelayedScaling update,
 * rolls the slot its amax went into: no amax_update launch). So every output equals
 * csrc/ref/act_backward_ref.c bit for bit. TQ_ACT_IDENTITY (dh = dy) reads no h: its instance
 * is tq_quantize's dbias pass.
 * Layout: elementwise and memory-bound; a thread takes one chunk of 8 columns of dy (and of each
 * half of h and dh) for the rows of one row chunk (R rows with dbias, keeping the 8 or 16 column
 * partials in registers; without, 4 rows for the identity and 2 for the activations), four
 * rows' loads (the identity; two for the activations, one for the gated ones without dbias)
 * before their arithmetic, grid-striding over (row chunk, chunk) pairs with consecutive threads
 * on consecutive chunks: each row's loads are coalesced 16-byte loads where the rows (and a
 * gated h's second half) are aligned, element accesses otherwise.
 * No sync, no allocation: the caller's workspace holds the partials. gelu / silu / qgelu of bf16
 * h over enough elements read act'(x) (and act(x), gated) from per-CTA shared-memory tables
 * (act_table.cuh: the same bits, fewer instructions).
 * Tests: tests/test_act_kernels.py (GPU cases: bit-exact against the C reference).
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "act_dispatch.cuh"
#include "act_table.cuh"
#include "amax_roll.cuh"
#include "chunks.cuh"
#include "column_sums.cuh"
#include "fp8_out.cuh"
#include "tile_transpose.cuh"
#include "internal_act.h"
#include "internal_amax_update.h"
#include "internal_kernels.h"
#include "launch.cuh"

namespace {

using tq_chunk::Chunk;
using tq_chunk::chunk_len;
using tq_chunk::kChunk;
using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;

constexpr int kThreads = 256;

struct BwdParams {
    const void *dy, *h;
    int64_t rows, n, k, ld_dy, ld_h, nchunks; /* n: dy's columns (K, or K / 2 gated) */
    void *dh;
    int64_t ld_dh;
    tq_fp8out::Out out;
    uint8_t *q_t;           /* the identity's columnwise codes [k][rows], or NULL */
    int64_t ld_q_t;
    int q_t_vec;            /* q_t 16-byte aligned, ld_q_t % 16 == 0 */
    float *partials;        /* dbias: [p_count][k] */
    void *dbias;            /* identity_columnwise_kernel<kFinish>: the column sums' output */
    tq_dtype dbias_dtype;
    int64_t r_chunk, p_count;
    int dy_vec, h_vec, dh_vec; /* 16-byte rows (and second halves) of dy, h, dh */
    tq_amax_slot upd;       /* kFinish: the slot's update after the barrier (history NULL: none) */
    int64_t upd_len;
    int upd_max;            /* TQ_AMAX_ALGO_MAX */
};

/* One row's chunk c (n valid elements) of dh into the outputs, and amax; kWords: the codes
 * also into w, written or not (the identity's columnwise tile reuses them). */
template <typename T, bool kWords = false>
__device__ __forceinline__ void write_half(const BwdParams &p, int64_t r, int64_t col0,
                                           int64_t c, int n, const float (&d)[kChunk],
                                           float scale, float &amax, uint32_t (*w)[2] = nullptr) {
    /* every element, a partial chunk's tail too: dy's and h's loads zero-fill it, and with a
     * zero g every activation's gradient is 0, so the tail adds nothing */
#pragma unroll
    for (int e = 0; e < kChunk; e++) amax = tq_amax_step(amax, d[e]);
    if (p.dh != nullptr) {
        float o[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++) o[e] = tq_norm_canon(d[e]);
        tq_chunk::store_chunk(static_cast<T *>(p.dh) + r * p.ld_dh + col0, c, o, n, p.dh_vec);
    }
    if (kWords || p.out.q != nullptr) {
        uint32_t words[2];
        tq_fp8out::chunk_codes(d, scale, p.out.e5m2, words);
        if (p.out.q != nullptr)
            tq_fp8out::store_words(p.out.q + r * p.out.ld_q + col0 + (int64_t)kChunk * c, words,
                                   n, p.out.q_vec);
        if constexpr (kWords) (*w)[0] = words[0], (*w)[1] = words[1];
    }
}

/* One row's inputs at chunk c: dy, and h (both halves gated) unless kBase is the identity. */
template <typename T, int kBase, bool kGated>
struct Row {
    Chunk<T> g, a, b;
    __device__ __forceinline__ void load(const BwdParams &p, int64_t r, int64_t c, int n) {
        tq_chunk::load_chunk(g, static_cast<const T *>(p.dy) + r * p.ld_dy, c, n, p.dy_vec);
        if constexpr (kBase != TQ_ACT_IDENTITY) {
            const T *hr = static_cast<const T *>(p.h) + r * p.ld_h;
            tq_chunk::load_chunk(a, hr, c, n, p.h_vec);
            if constexpr (kGated) tq_chunk::load_chunk(b, hr + p.n, c, n, p.h_vec);
        }
    }
};

/* Row r's dh at chunk c into the outputs, amax and the dbias partials. */
template <typename T, int kBase, bool kGated, bool kDbias, bool kTable>
__device__ __forceinline__ void grad_row(const BwdParams &p, const Row<T, kBase, kGated> &in,
                                         int64_t r, int64_t c, int n, const float *value_table,
                                         const float *deriv_table, float scale, float &amax,
                                         float (&acc)[2][kChunk]) {
    float d[2][kChunk];
    if constexpr (kBase == TQ_ACT_IDENTITY) { /* dh = dy: h is not read */
#pragma unroll
        for (int e = 0; e < kChunk; e++) d[0][e] = tq_fp::widen(in.g.t[e]);
    } else if constexpr (kGated) {
        float gb[kChunk], value[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            gb[e] = tq_nmul(tq_fp::widen(in.g.t[e]), tq_fp::widen(in.b.t[e]));
        if constexpr (kTable) {
            tq_act_table::grads<kBase>(value_table, deriv_table, in.a.t, gb, d[0], value);
        } else {
#pragma unroll
            for (int e = 0; e < kChunk; e++)
                d[0][e] = tq_act_grad(kBase, tq_fp::widen(in.a.t[e]), gb[e], &value[e]);
        }
#pragma unroll
        for (int e = 0; e < kChunk; e++) d[1][e] = tq_nmul(tq_fp::widen(in.g.t[e]), value[e]);
    } else {
        float gy[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++) gy[e] = tq_fp::widen(in.g.t[e]);
        if constexpr (kTable) {
            tq_act_table::grads<kBase>(nullptr, deriv_table, in.a.t, gy, d[0], nullptr);
        } else {
            float value;
#pragma unroll
            for (int e = 0; e < kChunk; e++)
                d[0][e] = tq_act_grad(kBase, tq_fp::widen(in.a.t[e]), gy[e], &value);
        }
    }
    write_half<T>(p, r, 0, c, n, d[0], scale, amax);
    if constexpr (kGated) write_half<T>(p, r, p.n, c, n, d[1], scale, amax);
    if constexpr (kDbias) {
#pragma unroll
        for (int half = 0; half < (kGated ? 2 : 1); half++)
#pragma unroll
            for (int e = 0; e < kChunk; e++) acc[half][e] = tq_nadd(acc[half][e], d[half][e]);
    }
}

/* Rows the kernel loads before computing any of them: four for the identity (tq_quantize's dbias
 * pass, a pure read: two rows in flight left it at ~2.2 TB/s on an H200, 121 us for 8192 x
 * 16384 bf16, 98 us with four), two for the activations (four made the bf16 gelu's table
 * kernel slower: 273 -> 294 us at 8192 x 16384), one for the lean instances below. */
template <int kBase, bool kLean>
constexpr int kBatch = kBase == TQ_ACT_IDENTITY ? 4 : kLean ? 1 : 2;

/* Lean: a gated activation without dbias loads one row at a time and is compiled for 1024
 * threads per SM (<= 64 registers). With two rows its 90-92 registers let one 512-thread table
 * CTA (or two of 256) share an SM: a quarter of its threads for a memory-bound pass. H200,
 * bf16, 8192 rows, GPU us per call: swiglu dh [8192, 28672] 346 -> 315, [8192, 16384] 205 ->
 * 186; reglu unchanged. The dbias instances keep two rows: their partials left them slower in
 * the lean form (swiglu [8192, 16384] 199 -> 216 us; docs/results/NOTES.md, twenty-fifth
 * session). */
template <bool kGated, bool kDbias>
constexpr bool kLean = kGated && !kDbias;
constexpr int kLeanThreadsPerSm = 1024; /* the others: no minimum (launch bounds' 0) */

/* kTable: gelu / silu / qgelu of bf16 from act_table.cuh's shared-memory tables (the same bits).
 * A thread loads kBatch rows before computing any, then adds them to the partials in row order. */
template <bool kTable>
constexpr int kCtaOf = kTable ? tq_act_table::kThreads : kThreads;

template <typename T, int kBase, bool kGated, bool kDbias, bool kTable>
__global__ void __launch_bounds__(kCtaOf<kTable>,
                                  kLean<kGated, kDbias> ? kLeanThreadsPerSm / kCtaOf<kTable> : 0)
    act_backward_kernel(const BwdParams p) {
    constexpr int kCta = kCtaOf<kTable>;
    constexpr int kB = kBatch<kBase, kLean<kGated, kDbias>>;
    __shared__ float deriv_table[kTable ? tq_act_table::kEntries : 1];
    __shared__ float value_table[kTable && kGated ? tq_act_table::kEntries : 1];
    if constexpr (kTable) tq_act_table::fill<kBase>(kGated ? value_table : nullptr, deriv_table);
    const float scale = tq_fp8out::cast_scale(p.out);
    tq_fp8out::write_scale_inv(p.out, scale);
    float amax = 0.0f;
    if (p.nchunks > 0) {
        for (tq_chunk::Walk w((int64_t)blockIdx.x * kCta + threadIdx.x, (int64_t)gridDim.x * kCta,
                              p.nchunks);
             w.row < p.p_count; w.next()) {
            const int64_t chunk_p = w.row, c = w.chunk;
            const int n = chunk_len(c, p.n);
            const int64_t r_begin = chunk_p * p.r_chunk;
            const int64_t r_end = r_begin + p.r_chunk < p.rows ? r_begin + p.r_chunk : p.rows;
            float acc[2][kChunk]; /* dbias partials of the chunk's columns (each half) */
#pragma unroll
            for (int e = 0; e < kChunk; e++) acc[0][e] = acc[1][e] = 0.0f;
            for (int64_t r = r_begin; r < r_end; r += kB) {
                Row<T, kBase, kGated> in[kB];
#pragma unroll
                for (int j = 0; j < kB; j++)
                    if (r + j < r_end) in[j].load(p, r + j, c, n);
#pragma unroll
                for (int j = 0; j < kB; j++)
                    if (r + j < r_end)
                        grad_row<T, kBase, kGated, kDbias, kTable>(p, in[j], r + j, c, n,
                                                                   value_table, deriv_table,
                                                                   scale, amax, acc);
            }
            if constexpr (kDbias) { /* unrolled: a loop to n would put acc on the stack */
                float *out = p.partials + chunk_p * p.k + (int64_t)kChunk * c;
#pragma unroll
                for (int e = 0; e < kChunk; e++)
                    if (e < n) out[e] = acc[0][e];
                if constexpr (kGated) {
#pragma unroll
                    for (int e = 0; e < kChunk; e++)
                        if (e < n) out[p.n + e] = acc[1][e];
                }
            }
        }
    }
    tq_fp8out::block_amax<kCta>(p.out.amax, amax);
}

/* ---- the identity with the columnwise codes (tq_quantize's DelayedScaling dbias pass) -------
 * A warp takes 8 chunks (64 columns) of 4 consecutive row chunks (lane = 8 * row chunk + chunk):
 * its loads are whole 128-byte rows. Each thread walks its row chunk kG rows at a time, four
 * rows per load batch (for kG >= 16 the next batch loads while the current one converts:
 * kColPrefetch); a 4 x 4 byte transpose (tile_transpose.cuh) turns the batch's codes into
 * one word per column, stored in the warp's shared-memory tile. After kG rows the warp writes
 * the tile out: each column's rows of the 4 row chunks (kG = R: one run of 4 R bytes), 16 bytes
 * per lane (spanning 16 / R row chunks where R is 4 or 8), consecutive lanes on consecutive
 * bytes. Rows and columns past the tensor are
 * skipped. The rowwise outputs, amax and the dbias partials are grad_row's. */
constexpr int kColThreads = 128;

template <int kG>
struct ColTile {
    static constexpr int kColWords = kG / 4 + 1;       /* a column's words in a row chunk (+1 pad) */
    static constexpr int kSub = 64 * kColWords + 1;    /* a row chunk's sub-tile (+1: bank shift) */
    static constexpr int kWords = 4 * kSub;            /* the warp's tile */
};

template <typename T, bool kDbias>
__device__ __forceinline__ void identity_row(const BwdParams &p, const Chunk<T> &g, int64_t r,
                                             int64_t c, int n, float scale, float &amax,
                                             float (&acc)[kChunk], uint32_t (&w)[2]) {
    float d[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; e++) d[e] = tq_fp::widen(g.t[e]);
    write_half<T, true>(p, r, 0, c, n, d, scale, amax, &w); /* the rowwise codes, once */
    if constexpr (kDbias) {
#pragma unroll
        for (int e = 0; e < kChunk; e++) acc[e] = tq_nadd(acc[e], d[e]);
    }
}

/* store_tile for row chunks of kG = 4 or 8 rows (K <= 1024): the warp's four row chunks are 4 kG
 * consecutive rows, so a column's 16-byte segment spans 16 / kG of them. */
template <int kG>
__device__ __forceinline__ void store_tile_short(const BwdParams &p, const uint32_t *tile,
                                                 int64_t p0, int64_t c0, int lane) {
    using CT = ColTile<kG>;
    constexpr int kChunksPerSeg = 16 / kG, kSegs = 4 / kChunksPerSeg, kColsPerPass = 32 / kSegs;
    const int seg = lane % kSegs, cq = lane / kSegs;
    const int64_t row0 = p0 * p.r_chunk + 16 * seg;
    if (row0 >= p.rows) return;
    const bool whole = p.q_t_vec && row0 + 16 <= p.rows;
#pragma unroll 4
    for (int k = 0; k < 64; k += kColsPerPass) {
        const int col = k + cq;
        const int64_t gcol = (int64_t)kChunk * c0 + col;
        if (gcol >= p.n) continue;
        uint32_t ws[4]; /* word i: rows row0 + 4 i .. + 3, of row chunk spl */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int spl = seg * kChunksPerSeg + 4 * i / kG, w = (4 * i % kG) / 4;
            ws[i] = tile[spl * CT::kSub + col * CT::kColWords + w];
        }
        uint8_t *dst = p.q_t + gcol * p.ld_q_t + row0;
        if (whole) {
            *reinterpret_cast<uint4 *>(dst) = make_uint4(ws[0], ws[1], ws[2], ws[3]);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                if (row0 + i < p.rows) dst[i] = (uint8_t)(ws[i / 4] >> (8 * (i % 4)));
        }
    }
}

/* store_tile for row chunks of 16 or 32 k rows: row chunk spl's kG rows from group g. */
template <int kG>
__device__ __forceinline__ void store_tile_long(const BwdParams &p, const uint32_t *tile, int64_t p0,
                                                int64_t c0, int g, int lane) {
    using CT = ColTile<kG>;
    constexpr int kSegs = kG / 16, kLanesPerCol = 4 * kSegs, kColsPerPass = 32 / kLanesPerCol;
    const int s = lane % kLanesPerCol, cq = lane / kLanesPerCol;
    const int spl = s / kSegs, seg = s % kSegs;
    const int64_t sp = p0 + spl;
    if (sp >= p.p_count) return;
    const int64_t r_end = sp * p.r_chunk + p.r_chunk < p.rows ? sp * p.r_chunk + p.r_chunk : p.rows;
    const int64_t row0 = sp * p.r_chunk + (int64_t)g * kG + 16 * seg;
    if (row0 >= r_end) return;
    const bool whole = p.q_t_vec && row0 + 16 <= r_end;
#pragma unroll 4
    for (int k = 0; k < 64; k += kColsPerPass) {
        const int col = k + cq;
        const int64_t gcol = (int64_t)kChunk * c0 + col;
        if (gcol >= p.n) continue;
        const uint32_t *src = tile + spl * CT::kSub + col * CT::kColWords + 4 * seg;
        const uint32_t ws[4] = {src[0], src[1], src[2], src[3]};
        uint8_t *dst = p.q_t + gcol * p.ld_q_t + row0;
        if (whole) {
            *reinterpret_cast<uint4 *>(dst) = make_uint4(ws[0], ws[1], ws[2], ws[3]);
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                if (row0 + i < r_end) dst[i] = (uint8_t)(ws[i / 4] >> (8 * (i % 4)));
        }
    }
}

/* The warp's tile out after group g, 16 bytes per lane. */
template <int kG>
__device__ __forceinline__ void store_tile(const BwdParams &p, const uint32_t *tile, int64_t p0,
                                           int64_t c0, int g, int lane) {
    if constexpr (kG < 16) store_tile_short<kG>(p, tile, p0, c0, lane);
    else store_tile_long<kG>(p, tile, p0, c0, g, lane);
}

/* Groups of 16 or more rows load a lane's next four rows while the current four convert (eight
 * rows in flight), at four CTAs per SM (110 registers); groups of 4 or 8 rows load four at a
 * time at five (their pass is short, and the prefetch measured slower there). H200, bf16, dbias,
 * GPU us per call, before -> after: [8192, 1536] 20.8 -> 19.7, [8192, 2048] 24.6 -> 22.0,
 * [8192, 4096] 45.8 -> 43.0, [8192, 16384] 170.0 -> 161.2; [8192, 512] 6.8 either way (its
 * prefetch form 7.2 - 7.5; docs/results/NOTES.md, twenty-fourth session). */
template <int kG>
constexpr bool kColPrefetch = kG >= 16;

/* kFinish (with dbias; a cooperative launch): after a grid barrier the CTAs add up the partials
 * into dbias themselves (column_sums.cuh's finish_columns: column_sum_kernel's bits), so no
 * column-sum launch follows. */
template <typename T, bool kDbias, int kG, bool kFinish = false>
__global__ void __launch_bounds__(kColThreads, kColPrefetch<kG> ? 4 : 5)
    identity_columnwise_kernel(const BwdParams p) {
    static_assert(kDbias || !kFinish, "the sums are dbias's");
    using CT = ColTile<kG>;
    __shared__ uint32_t tiles[kColThreads / 32][CT::kWords];
    const float scale = tq_fp8out::cast_scale(p.out);
    tq_fp8out::write_scale_inv(p.out, scale);
    const int lane = threadIdx.x & 31, pl = lane >> 3, cl = lane & 7;
    uint32_t *tile = tiles[threadIdx.x >> 5];
    const int64_t tiles_p = (p.p_count + 3) / 4, count = tiles_p * ((p.nchunks + 7) / 8);
    const int64_t warps = (int64_t)gridDim.x * (kColThreads / 32);
    const int groups = (int)((p.r_chunk + kG - 1) / kG);
    float amax = 0.0f;
    for (int64_t t = (int64_t)blockIdx.x * (kColThreads / 32) + (threadIdx.x >> 5); t < count;
         t += warps) { /* warp-uniform */
        const int64_t p0 = (t % tiles_p) * 4, c0 = (t / tiles_p) * 8;
        const int64_t chunk_p = p0 + pl, c = c0 + cl;
        const bool valid = chunk_p < p.p_count && c < p.nchunks;
        const int n = valid ? chunk_len(c, p.n) : 0;
        const int64_t r_begin = chunk_p * p.r_chunk;
        const int64_t r_end = !valid ? r_begin
                              : r_begin + p.r_chunk < p.rows ? r_begin + p.r_chunk : p.rows;
        float acc[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++) acc[e] = 0.0f;
        uint32_t *mine = tile + pl * CT::kSub + 8 * cl * CT::kColWords;
        Row<T, TQ_ACT_IDENTITY, false> in[4];
        if constexpr (kColPrefetch<kG>) {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (r_begin + j < r_end) in[j].load(p, r_begin + j, c, n);
        }
        for (int g = 0; g < groups; g++) {
            const int64_t r0 = r_begin + (int64_t)g * kG;
#pragma unroll 1 /* a loop, not kG / 4 copies of the body (code size) */
            for (int i0 = 0; i0 < kG; i0 += 4) {
                /* with the prefetch, the next four rows (the next group's first, after the
                 * last four) load while these convert */
                Row<T, TQ_ACT_IDENTITY, false> next[4];
                if constexpr (kColPrefetch<kG>) {
                    const int64_t rn = r0 + i0 + 4;
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        if (rn + j < r_end) next[j].load(p, rn + j, c, n);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        if (r0 + i0 + j < r_end) in[j].load(p, r0 + i0 + j, c, n);
                }
                uint32_t lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (r0 + i0 + j >= r_end) continue;
                    uint32_t w[2];
                    identity_row<T, kDbias>(p, in[j].g, r0 + i0 + j, c, n, scale, amax, acc, w);
                    lo[j] = w[0], hi[j] = w[1];
                }
                uint32_t cols_lo[4], cols_hi[4]; /* column e's 4 rows as one word */
                tq_tile::transpose4x4(lo, cols_lo);
                tq_tile::transpose4x4(hi, cols_hi);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    mine[e * CT::kColWords + i0 / 4] = cols_lo[e];
                    mine[(e + 4) * CT::kColWords + i0 / 4] = cols_hi[e];
                }
                if constexpr (kColPrefetch<kG>) {
#pragma unroll
                    for (int j = 0; j < 4; j++) in[j] = next[j];
                }
            }
            __syncwarp();
            store_tile<kG>(p, tile, p0, c0, g, lane);
            __syncwarp();
        }
        if (kDbias && valid) {
            float *out = p.partials + chunk_p * p.k + (int64_t)kChunk * c;
#pragma unroll
            for (int e = 0; e < kChunk; e++)
                if (e < n) out[e] = acc[e];
        }
    }
    tq_fp8out::block_amax<kColThreads>(p.out.amax, amax);
    if constexpr (kFinish) { /* every CTA's partials are in after the barrier; the tiles are free */
        cooperative_groups::this_grid().sync();
        tq_colsum::finish_columns<kColThreads, kColThreads / TQ_NORM_GROUP>(
            p.partials, p.p_count, p.k, p.dbias, p.dbias_dtype, reinterpret_cast<float *>(tiles),
            blockIdx.x, gridDim.x);
        /* the amax slot is final too: the last CTA (the fewest columns to finish) rolls it.
         * Every CTA read the scale before the barrier, so the new one is for the next step. */
        if (p.upd.history != nullptr && blockIdx.x == gridDim.x - 1) {
            if (p.upd_max) tq_amax_roll::roll_slot<kColThreads, true>(p.upd, 0.0f, p.upd_len);
            else tq_amax_roll::roll_slot<kColThreads, false>(p.upd, 0.0f, p.upd_len);
        }
    }
}

/* The dbias pass with the columnwise codes as one cooperative launch that finishes dbias (grid:
 * at most what fits at once; the kernel strides over its tiles); false, nothing queued, where
 * the device cannot run it. */
template <typename T, int kG>
bool launch_finishing(const BwdParams &p, unsigned grid, int device, int sms, cudaStream_t s) {
    static std::atomic<int> cache[64]; /* this instance's */
    auto kernel = identity_columnwise_kernel<T, true, kG, true>;
    const int per_sm = tq_cuda::coop_blocks_per_sm(kernel, kColThreads, device, cache);
    if (per_sm <= 0) return false;
    const unsigned most = (unsigned)per_sm * (unsigned)sms;
    BwdParams args_p = p;
    void *args[] = {&args_p};
    cudaLaunchCooperativeKernel((const void *)kernel, dim3(grid < most ? grid : most),
                                dim3(kColThreads), args, 0, s);
    return true;
}

/* The identity's pass with the columnwise codes in row groups of kG: with dbias the finishing
 * launch where the device runs it (returns true: dbias written), else the pass whose partials
 * column_sums.cuh adds. Groups under 32 rows come from dbias's fixed row chunks only. */
template <typename T, int kG>
bool launch_columnwise(const BwdParams &p, unsigned grid, bool dbias, int device, int sms,
                       cudaStream_t s) {
    if constexpr (kG == 32) {
        if (!dbias) {
            identity_columnwise_kernel<T, false, 32><<<grid, kColThreads, 0, s>>>(p);
            return false;
        }
    }
    if (dbias && launch_finishing<T, kG>(p, grid, device, sms, s)) return true;
    identity_columnwise_kernel<T, true, kG><<<grid, kColThreads, 0, s>>>(p);
    return false;
}

}  // namespace

extern "C" tq_status tq_act_backward_cuda(const tq_tensor *dy, const tq_tensor *h,
                                          const tq_act_backward_args *a,
                                          struct CUstream_st *stream) {
    DeviceGuard guard(h->device);
    if (guard.status != cudaSuccess)
        return cuda_failed("act backward: making h's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const size_t elem = h->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int gated = tq_act_gated(a->act);
    const bool dbias = a->dbias.data != nullptr;
    BwdParams p = {};
    p.dy = dy->data;
    p.h = h->data;
    p.rows = h->rows;
    p.k = h->cols;
    p.n = gated ? h->cols / 2 : h->cols;
    p.ld_dy = dy->ld;
    p.ld_h = h->ld;
    p.nchunks = (p.n + kChunk - 1) / kChunk;
    p.dh = a->dh.data;
    p.ld_dh = a->dh.ld;
    p.out = tq_fp8out::make_out(a->config, a->dh_q, a->scale_inv, a->scale, a->amax_in, a->amax);
    p.partials = static_cast<float *>(a->workspace.data);
    p.dbias = a->dbias.data;
    p.dbias_dtype = a->dbias.dtype;
    if (a->update != nullptr) { /* read only by the finishing launch (else a launch follows) */
        p.upd = *a->update;
        p.upd_len = a->update_args->history_len;
        p.upd_max = a->update_args->amax_algo == TQ_AMAX_ALGO_MAX;
    }
    /* with dbias the row chunks are the fixed order's; without, any grouping gives the same
     * bits. The identity writes the columnwise codes in its pass (identity_columnwise_kernel:
     * chunks of 4, 8, 16 or a multiple of 32 rows, which tq_norm_partial_rows always gives);
     * an activation's are transposed after it. */
    const int64_t r_fixed = dbias ? tq_norm_partial_rows(p.rows, p.k) : 32;
    const int group = r_fixed % 32 == 0 ? 32 : r_fixed <= 16 ? (int)r_fixed : 0;
    const bool col = a->dh_q_t.data != nullptr && a->act == TQ_ACT_IDENTITY && group > 0;
    p.q_t = col ? static_cast<uint8_t *>(a->dh_q_t.data) : nullptr;
    p.ld_q_t = a->dh_q_t.ld;
    p.q_t_vec = col && tq_chunk::aligned(p.q_t, 16) && p.ld_q_t % 16 == 0;
    p.r_chunk = dbias || col ? r_fixed
                : a->act == TQ_ACT_IDENTITY ? 4 : 2; /* a thread's loads (kBatch) */
    p.p_count = p.rows == 0 ? 0 : (p.rows + p.r_chunk - 1) / p.r_chunk;
    const bool halves16 = !gated || (p.n * elem) % 16 == 0;
    p.dy_vec = tq_chunk::rows_aligned16(dy->data, dy->ld, elem);
    p.h_vec = tq_chunk::rows_aligned16(h->data, h->ld, elem) && halves16;
    p.dh_vec = p.dh != nullptr && tq_chunk::rows_aligned16(p.dh, p.ld_dh, elem) && halves16;
    p.out.q_vec = p.out.q != nullptr && tq_chunk::aligned(p.out.q, 8) && p.out.ld_q % 8 == 0
                  && (!gated || p.n % 8 == 0);
    const int sms = tq_act_dispatch::sm_count(h->device);
    const bool table_pays = tq_act_table::worth_it(p.rows * p.n, sms);
    bool finished = false; /* dbias written by the pass itself */
    tq_act_dispatch::with_dtype_act(h->dtype, a->act, [&](auto t, auto act) {
        using A = decltype(act);
        using T = decltype(t);
        if constexpr (A::base == TQ_ACT_IDENTITY) {
            if (col) {
                const int64_t warps = (p.p_count + 3) / 4 * ((p.nchunks + 7) / 8);
                const unsigned grid = tq_act_dispatch::grid_for(warps * 32, sms, kColThreads, 12);
                const int dev = h->device;
                finished = group == 32 ? launch_columnwise<T, 32>(p, grid, dbias, dev, sms, s)
                           : group == 16 ? launch_columnwise<T, 16>(p, grid, dbias, dev, sms, s)
                           : group == 8  ? launch_columnwise<T, 8>(p, grid, dbias, dev, sms, s)
                                         : launch_columnwise<T, 4>(p, grid, dbias, dev, sms, s);
                return;
            }
        }
        if constexpr (tq_act_table::kUses<T, A::base>) {
            if (table_pays) {
                const unsigned grid = tq_act_dispatch::grid_for(
                    p.p_count * p.nchunks, sms, tq_act_table::kThreads, tq_act_table::kCtasPerSm);
                if (dbias)
                    act_backward_kernel<T, A::base, A::gated, true, true>
                        <<<grid, tq_act_table::kThreads, 0, s>>>(p);
                else
                    act_backward_kernel<T, A::base, A::gated, false, true>
                        <<<grid, tq_act_table::kThreads, 0, s>>>(p);
                return;
            }
        }
        const unsigned grid = tq_act_dispatch::grid_for(p.p_count * p.nchunks, sms, kThreads);
        if (dbias) act_backward_kernel<T, A::base, A::gated, true, false><<<grid, kThreads, 0, s>>>(p);
        else act_backward_kernel<T, A::base, A::gated, false, false><<<grid, kThreads, 0, s>>>(p);
    });
    cudaError_t err = cudaGetLastError(); /* cleared: must not poison later calls */
    if (err != cudaSuccess) return cuda_failed("act backward kernel launch", err);
    if (dbias && !finished) {
        tq_colsum::launch(p.partials, p.p_count, p.k, a->dbias.data, nullptr, a->dbias.dtype, s);
        err = cudaGetLastError();
        if (err != cudaSuccess) return cuda_failed("act backward column-sum kernel launch", err);
    }
    if (a->dh_q_t.data != nullptr && !col) {
        tq_tensor codes = a->dh_q, codes_t = a->dh_q_t;
        const tq_status st = tq_transpose_cuda(&codes, &codes_t, stream);
        if (st != TQ_SUCCESS) return st;
    }
    if (a->update != nullptr && !finished) /* the slot's update as a launch of its own */
        return tq_amax_update_cuda(a->update, 1, a->update_args, stream);
    return TQ_SUCCESS;
}
