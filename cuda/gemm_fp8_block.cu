/* gemm_fp8_block.cu: Float8BlockScaling's GEMMs on Hopper without cuBLASLt,
 * out[M, N] = sum over k blocks of (A[M, kb] B[N, kb]^T) * sa * sb (+ out) (+ bias), FP8 codes,
 * 1x128 scales (one per row and 128 of K) or 128x128 scales (one per 128 rows and 128 of K) on
 * either side, E4M3 or E5M2 codes on either side, FP32 accumulation, BF16 / FP16 / FP32 output.
 * Not a general GEMM: K-major codes only (tequant's TN layout), sm_90a only (csrc/core/gemm.c
 * runs it where TEQUANT_BLOCK_GEMM=tequant and falls back to cuBLASLt elsewhere).
 *
 * Why: cuBLASLt's block-scaled kernels on Hopper run 10-45% longer than its per-tensor FP8 ones
 * (docs/results/NOTES.md, forty-third session). Design: persistent CTA pairs (clusters of 2
 * along M), each CTA a 128 x 256 tile of out at a time; one producer thread streams 128-deep k
 * blocks of A (its own rows) and B (half the pair's B rows, TMA-multicast into both CTAs) with
 * 128-byte swizzle, plus the 1x128 scale vectors, into a 4-stage ring; two consumer warpgroups
 * each multiply 64 rows by two 128-column halves with wgmma (m64n128k32, four per k block and
 * half) into a fresh FP32 tile, then add it times the k block's scales into their running FP32
 * accumulators (what cuBLASLt's "split accumulation" does per block); each warp stores its rows
 * through a small shared slab while the producer already loads the next tile. Measured (H200)
 * at 0.75x of cuBLASLt's block-scaled speed on the GPT block's GEMMs, hence opt-in: the promotion
 * costs it ~45% (without it the same pipeline runs within 15% of cuBLASLt's per-tensor speed).
 * Reference: csrc/ref/gemm_fp8_block_ref.c (same order: per k block an FP32 sum, then scaled).
 * Tests: tests/test_gemm_fp8_block.py; timings: benchmarks/gemm_block_probe.cu.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include <atomic>

#include "internal_gemm.h"
#include "launch.cuh"

namespace {

/* 128 x 256 tiles, 4 stages: the fastest of the forms measured (docs/results/NOTES.md, forty-fifth
 * session: 128 x 128 tiles with two k blocks in flight per warpgroup and 6 stages ran 12% longer) */
constexpr int kBM = 128, kBN = 256, kBK = 128; /* tile of out; k block = one scale block */
constexpr int kShareRows = kBN / 2;   /* B rows each CTA of a pair loads for both */
constexpr int kStages = 4;            /* as many as fit beside the epilogue's slabs */
constexpr int kThreads = 384;                  /* warpgroup 0 produces, 1 and 2 consume */
constexpr int kBytesA = kBM * kBK, kBytesB = kBN * kBK; /* code tiles, 16 and 32 KiB */
constexpr int kSlabLd = 32 + 4; /* a warp's epilogue slab: 16 rows of 32 FP32 (+4: banks) */

struct Smem {
    uint8_t a[kStages][kBytesA]; /* 1024-byte aligned: the 128-byte swizzle's period */
    uint8_t b[kStages][kBytesB];
    float slab[8][16][kSlabLd];  /* per consumer warp, apart from the stages: the producer loads
                                    the next tile's first k blocks while the consumers store */
    float sa[kStages][kBM];      /* 1x128 scale vectors of the stage's k block */
    float sb[kStages][kBN];
    uint64_t full[kStages], empty[kStages];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024; /* + alignment slack */

struct Side {
    const float *scale;   /* 1x128: [kb][row], ld scale_ld; 128x128: [row / 128][kb] */
    int64_t scale_ld, scale_rows; /* scale_rows: rows the 1x128 vectors hold (pad4 of rows) */
    int per_row;
};

struct Params {
    int64_t m, n, k;
    Side a, b;
    void *out;
    int64_t ldo;
    int out_dtype, bias_dtype; /* tq_dtype; bias_dtype < 0: no bias */
    const void *bias;
    int accumulate;
    int tiles_m, tiles_n;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kHalfN = 128;           /* columns one wgmma chain covers */
constexpr int kChains = kBN / kHalfN; /* chains per k block, one after the other (registers) */
constexpr int kGroupM = 8;   /* tile rows walked together (L2 reuse of B) */

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void bar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void bar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

/* Returns once the barrier's phase of this parity has completed. */
__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

/* A 128 x 128-byte box of a code matrix (columns c, rows r onward; zeros beyond its edge). */
__device__ __forceinline__ void tma_tile(void *dst, const CUtensorMap *map, int c, int r, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst)), "l"(map), "r"(c), "r"(r), "r"(smem_addr(bar))
        : "memory");
}

/* The same box into this and the other CTA of the pair (same shared offsets), each CTA's own
 * barrier at `bar`'s offset counting its bytes. */
__device__ __forceinline__ void tma_tile_both(void *dst, const CUtensorMap *map, int c, int r, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(smem_addr(dst)), "l"(map), "r"(c), "r"(r), "r"(smem_addr(bar)), "h"((uint16_t)3)
        : "memory");
}

/* Arrives on the barrier at `bar`'s offset in CTA `rank` of the cluster. The default (CTA-scope)
 * release: what it orders are this warp's wgmma reads of the stage, already complete (their
 * wait_group returned); a cluster-scope release compiled to a fence per arrival that cost 28% of
 * the consumers' stall samples (ncu, forty-fifth session). */
__device__ __forceinline__ void bar_arrive_in(uint64_t *bar, uint32_t rank) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(smem_addr(bar)), "r"(rank)
        : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every thread of both CTAs (threads may diverge: not .aligned). */
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

/* wgmma's shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row
 * core-matrix groups 1024 bytes apart. */
__device__ __forceinline__ uint64_t tile_desc(const void *p) {
    const uint64_t addr = smem_addr(p);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

#define TQ_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define TQ_D16(i) TQ_D4(i), TQ_D4(i + 4), TQ_D4(i + 8), TQ_D4(i + 12)

/* d[64] = A(64 x 32 codes) B(128 x 32 codes)^T, plus d where add_d is nonzero; one function per
 * pair of code formats (E4M3 / E5M2: Float8BlockScaling's HYBRID gradients). */
#define TQ_WGMMA_FP8(name, types)                                                                   \
    __device__ __forceinline__ void name(float *d, uint64_t desc_a, uint64_t desc_b, int add_d) {  \
        asm volatile(                                                                               \
            "{\n"                                                                                   \
            ".reg .pred p;\n"                                                                       \
            "setp.ne.b32 p, %66, 0;\n"                                                              \
            "wgmma.mma_async.sync.aligned.m64n128k32.f32" types " "                                 \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "               \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "      \
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "      \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "     \
            "%64, %65, p, 1, 1;\n"                                                                  \
            "}\n"                                                                                   \
            : TQ_D16(0), TQ_D16(16), TQ_D16(32), TQ_D16(48)                                         \
            : "l"(desc_a), "l"(desc_b), "r"(add_d));                                                \
    }
TQ_WGMMA_FP8(wgmma_e4m3_e4m3, ".e4m3.e4m3")
TQ_WGMMA_FP8(wgmma_e4m3_e5m2, ".e4m3.e5m2")
TQ_WGMMA_FP8(wgmma_e5m2_e4m3, ".e5m2.e4m3")
TQ_WGMMA_FP8(wgmma_e5m2_e5m2, ".e5m2.e5m2")

/* kPair: bit 0 set where A holds E5M2 codes, bit 1 where B does. */
template <int kPair>
__device__ __forceinline__ void wgmma_64x128x32(float *d, uint64_t desc_a, uint64_t desc_b, int add_d) {
    if constexpr (kPair == 0) wgmma_e4m3_e4m3(d, desc_a, desc_b, add_d);
    else if constexpr (kPair == 1) wgmma_e5m2_e4m3(d, desc_a, desc_b, add_d);
    else if constexpr (kPair == 2) wgmma_e4m3_e5m2(d, desc_a, desc_b, add_d);
    else wgmma_e5m2_e5m2(d, desc_a, desc_b, add_d);
}

/* Keeps the compiler from moving reads of d across the wgmma wait. */
__device__ __forceinline__ void pin(float *d) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ float load_out(const void *out, int dtype, int64_t at) {
    if (dtype == TQ_DTYPE_BFLOAT16) return __bfloat162float(((const __nv_bfloat16 *)out)[at]);
    if (dtype == TQ_DTYPE_FLOAT16) return __half2float(((const __half *)out)[at]);
    return ((const float *)out)[at];
}

__device__ __forceinline__ void store_out(void *out, int dtype, int64_t at, float v) {
    if (dtype == TQ_DTYPE_BFLOAT16) ((__nv_bfloat16 *)out)[at] = __float2bfloat16_rn(v);
    else if (dtype == TQ_DTYPE_FLOAT16) ((__half *)out)[at] = __float2half_rn(v);
    else ((float *)out)[at] = v;
}

struct F8 {
    float v[8];
};

/* out[at .. at + n - 1] = v (+ what is there), element by element: row ends, odd pitches. Not
 * a call: it would save the live accumulators around it. */
__device__ __forceinline__ void store_slow(const Params &p, int64_t at, int n, F8 v) {
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < n)
            store_out(p.out, p.out_dtype, at + i, v.v[i] + (p.accumulate ? load_out(p.out, p.out_dtype, at + i) : 0.0f));
}

/* out[r][c .. c + 7] = v (+ what is there): one 16-byte (BF16 / FP16) or two (FP32) accesses
 * where `wide` and the 8 columns lie inside N. */
__device__ __forceinline__ void store_row8(const Params &p, int64_t r, int64_t c, F8 v, bool wide) {
    const int64_t at = r * p.ldo + c;
    const int n = (int)min((int64_t)8, p.n - c);
    if (!wide || n < 8) {
        store_slow(p, at, n, v);
        return;
    }
    if (p.out_dtype != TQ_DTYPE_FLOAT32) {
        uint4 *o = (uint4 *)((uint16_t *)p.out + at);
        const bool bf16 = p.out_dtype == TQ_DTYPE_BFLOAT16;
        if (p.accumulate) {
            const uint4 old = *o;
            const uint16_t *h = (const uint16_t *)&old;
#pragma unroll
            for (int i = 0; i < 8; i++)
                v.v[i] += bf16 ? __bfloat162float(__ushort_as_bfloat16(h[i])) : __half2float(__ushort_as_half(h[i]));
        }
        uint4 packed;
        uint16_t *h = (uint16_t *)&packed;
#pragma unroll
        for (int i = 0; i < 8; i++)
            h[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v.v[i])) : __half_as_ushort(__float2half_rn(v.v[i]));
        *o = packed;
        return;
    }
    float4 *o = (float4 *)((float *)p.out + at);
    if (p.accumulate) {
        const float4 o0 = o[0], o1 = o[1];
        v.v[0] += o0.x, v.v[1] += o0.y, v.v[2] += o0.z, v.v[3] += o0.w;
        v.v[4] += o1.x, v.v[5] += o1.y, v.v[6] += o1.z, v.v[7] += o1.w;
    }
    o[0] = make_float4(v.v[0], v.v[1], v.v[2], v.v[3]);
    o[1] = make_float4(v.v[4], v.v[5], v.v[6], v.v[7]);
}

/* The epilogue, warp by warp (no block barrier): the warp's 16 rows in chunks of 32 columns
 * through its slab, its fragments (rows lane / 4 and + 8, columns 2 (lane % 4) + 8 j + {0, 1})
 * in, then each lane half a row out: 16 consecutive columns, two 16- or 32-byte stores. */
__device__ __forceinline__ void write_tile(Smem &s, const Params &p, int64_t m0, int64_t n0,
                                           const float (*acc)[64], int half) {
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    float(*slab)[kSlabLd] = s.slab[4 * half + warp];
    const int wr = lane / 4, wc = 2 * (lane % 4); /* fragment position in the slab */
    const int rr = lane / 2, cc = 16 * (lane % 2); /* what this lane stores */
    const int64_t row = m0 + 64 * half + 16 * warp + rr;
    const int elem = p.out_dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const bool wide = ((uintptr_t)p.out % 16) == 0 && (p.ldo * elem) % 16 == 0;
    /* a runtime loop over the chunks (the stores once in the code, not once per chunk: the
     * instruction cache), each chunk's fragments picked by a compile-time index */
#pragma unroll 1
    for (int chunk = 0; chunk < 4 * kChains; chunk++) {
        __syncwarp();
#pragma unroll
        for (int k = 0; k < 4 * kChains; k++) {
            if (k != chunk) continue;
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int h = k / 4, j = 4 * (k % 4) + jj;
                *(float2 *)&slab[wr][8 * jj + wc] = make_float2(acc[h][4 * j], acc[h][4 * j + 1]);
                *(float2 *)&slab[wr + 8][8 * jj + wc] = make_float2(acc[h][4 * j + 2], acc[h][4 * j + 3]);
            }
        }
        __syncwarp();
        const int64_t col = n0 + 32 * chunk + cc; /* chunk 4 h + q: columns 128 h + 32 q onward */
        if (row >= p.m || col >= p.n) continue;
#pragma unroll 1
        for (int e = 0; e < 2 && col + 8 * e < p.n; e++) {
            F8 v;
            const float4 lo = *(const float4 *)&slab[rr][cc + 8 * e], hi = *(const float4 *)&slab[rr][cc + 8 * e + 4];
            v.v[0] = lo.x, v.v[1] = lo.y, v.v[2] = lo.z, v.v[3] = lo.w;
            v.v[4] = hi.x, v.v[5] = hi.y, v.v[6] = hi.z, v.v[7] = hi.w;
            const int64_t c = col + 8 * e;
            if (p.bias_dtype >= 0) {
#pragma unroll
                for (int i = 0; i < 8; i++) v.v[i] += c + i < p.n ? load_out(p.bias, p.bias_dtype, c + i) : 0.0f;
            }
            store_row8(p, row, c, v, wide);
        }
    }
}

/* The CTA pair's tile `pair` (two tile rows, one tile column) in groups of kGroupM tile rows,
 * column by column: the pairs working at one time share B tiles (and A's rows) in L2. This CTA
 * takes the pair's tile row `rank` (which may lie past M: its rows are then TMA's zeros). */
__device__ __forceinline__ void tile_origin(const Params &p, int pair, uint32_t rank, int64_t *m0, int64_t *n0) {
    const int pair_rows = (p.tiles_m + 1) / 2, group_rows = kGroupM / 2;
    const int per_group = group_rows * p.tiles_n, group = pair / per_group;
    const int first = group * group_rows, rows_here = min(pair_rows - first, group_rows);
    *m0 = (int64_t)(2 * (first + (pair % per_group) % rows_here) + (int)rank) * kBM;
    *n0 = (int64_t)((pair % per_group) / rows_here) * kBN;
}

__device__ __forceinline__ int pairs_of(const Params &p) { return (p.tiles_m + 1) / 2 * p.tiles_n; }

/* The producer thread: every k block of every tile this CTA owns, through the stage ring; A
 * its own, B's half `rank` for both CTAs of the pair (TMA multicast: B read once per pair). */
__device__ __forceinline__ void produce(Smem &s, const CUtensorMap *map_a, const CUtensorMap *map_b,
                                        const Params &p, int nkb, uint32_t rank) {
    int it = 0; /* k blocks loaded so far: stage it % kStages, its use it / kStages */
    for (int pair = blockIdx.x / 2; pair < pairs_of(p); pair += gridDim.x / 2) {
        int64_t m0, n0;
        tile_origin(p, pair, rank, &m0, &n0);
        const uint32_t sa_bytes = p.a.per_row ? (uint32_t)max((int64_t)0, min((int64_t)kBM, p.a.scale_rows - m0)) * 4u : 0u;
        const uint32_t sb_bytes = p.b.per_row ? (uint32_t)min((int64_t)kBN, p.b.scale_rows - n0) * 4u : 0u;
        for (int kb = 0; kb < nkb; kb++, it++) {
            const int st = it % kStages;
            /* both CTAs' consumers have released the stage: the multicast writes into both */
            if (it >= kStages) bar_wait(&s.empty[st], ((it / kStages) - 1) & 1);
            bar_expect_tx(&s.full[st], (uint32_t)(kBytesA + kBytesB) + sa_bytes + sb_bytes);
            tma_tile(s.a[st], map_a, kb * kBK, (int)m0, &s.full[st]);
            tma_tile_both(s.b[st] + rank * kShareRows * kBK, map_b, kb * kBK, (int)(n0 + rank * kShareRows),
                          &s.full[st]);
            if (sa_bytes) bulk_copy(s.sa[st], p.a.scale + kb * p.a.scale_ld + m0, sa_bytes, &s.full[st]);
            if (sb_bytes) bulk_copy(s.sb[st], p.b.scale + kb * p.b.scale_ld + n0, sb_bytes, &s.full[st]);
        }
    }
}

/* acc += part * the k block's scales, for one kHalfN-column half: f0 / f1 the row scales of rows
 * row0 / row0 + 8 times the half's 128x128 B scale, or (sb != NULL) times B's 1x128 scales. */
__device__ __forceinline__ void promote(float *acc, const float *part, float f0, float f1, const float *sb,
                                        int col0) {
    if (sb == nullptr) {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            acc[4 * j] = __fmaf_rn(part[4 * j], f0, acc[4 * j]);
            acc[4 * j + 1] = __fmaf_rn(part[4 * j + 1], f0, acc[4 * j + 1]);
            acc[4 * j + 2] = __fmaf_rn(part[4 * j + 2], f1, acc[4 * j + 2]);
            acc[4 * j + 3] = __fmaf_rn(part[4 * j + 3], f1, acc[4 * j + 3]);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const float2 b = *(const float2 *)&sb[col0 + 8 * j];
        acc[4 * j] = __fmaf_rn(part[4 * j], __fmul_rn(f0, b.x), acc[4 * j]);
        acc[4 * j + 1] = __fmaf_rn(part[4 * j + 1], __fmul_rn(f0, b.y), acc[4 * j + 1]);
        acc[4 * j + 2] = __fmaf_rn(part[4 * j + 2], __fmul_rn(f1, b.x), acc[4 * j + 2]);
        acc[4 * j + 3] = __fmaf_rn(part[4 * j + 3], __fmul_rn(f1, b.y), acc[4 * j + 3]);
    }
}

/* One consumer warpgroup: rows m0 + 64 * half onward, all kBN columns, as two kHalfN-column
 * wgmma chains into one FP32 tile `part` (each promoted before the next starts: registers). */
template <int kPair>
__device__ __forceinline__ void consume(Smem &s, const Params &p, int nkb, int half) {
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int row0 = 64 * half + 16 * warp + lane / 4; /* this thread's rows: row0, row0 + 8 */
    const int col0 = 2 * (lane % 4);                   /* columns col0 + 8 j + {0, 1} of each half */
    float acc[kChains][64], part[64];
    int it = 0; /* as the producer counts */
    const uint32_t rank = cluster_rank();
    /* stage 0's descriptors; a stage's are these plus its offset in 16-byte units (the start
     * address field holds any shared address, under 256 KiB) */
    const uint64_t desc_a0 = tile_desc(s.a[0] + 64 * half * kBK), desc_b0 = tile_desc(s.b[0]);
    for (int pair = blockIdx.x / 2; pair < pairs_of(p); pair += gridDim.x / 2) {
        int64_t m0, n0;
        tile_origin(p, pair, rank, &m0, &n0);
#pragma unroll
        for (int i = 0; i < 64; i++)
#pragma unroll
            for (int h = 0; h < kChains; h++) acc[h][i] = 0.0f;
        /* (a tile past M reads no scales: its rows are zeros and never stored) */
        const float *block_a = p.a.per_row || m0 >= p.m ? nullptr : p.a.scale + (m0 / kBM) * p.a.scale_ld;
        const float *block_b = p.b.per_row ? nullptr : p.b.scale + (n0 / kHalfN) * p.b.scale_ld;
        const bool second_block_b = n0 + kHalfN < p.n; /* B's second half holds rows */
        for (int kb = 0; kb < nkb; kb++, it++) {
            const int st = it % kStages;
            const float blk_a = block_a ? __ldg(block_a + kb) : 1.0f;
            const float blk_b0 = block_b ? __ldg(block_b + kb) : 1.0f;
            const float blk_b1 = block_b && second_block_b ? __ldg(block_b + p.b.scale_ld + kb) : 1.0f;
            bar_wait(&s.full[st], (it / kStages) & 1);
            const bool row_scales = p.a.per_row;
            const float sa0 = row_scales ? s.sa[st][row0] : blk_a, sa1 = row_scales ? s.sa[st][row0 + 8] : blk_a;
            const uint64_t da = desc_a0 + (uint64_t)(st * (kBytesA >> 4));
#pragma unroll
            for (int h = 0; h < kChains; h++) {
                const uint64_t db = desc_b0 + (uint64_t)((st * kBytesB + h * kHalfN * kBK) >> 4);
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < kBK / 32; kk++) wgmma_64x128x32<kPair>(part, da + 2 * kk, db + 2 * kk, kk);
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                pin(part);
                const float fb = h == 0 ? blk_b0 : blk_b1;
                promote(acc[h], part, sa0 * fb, sa1 * fb, block_b ? nullptr : s.sb[st] + h * kHalfN, col0);
            }
            __syncwarp();
            if (lane < 2) bar_arrive_in(&s.empty[st], (uint32_t)lane); /* both CTAs, at once */
        }
        write_tile(s, p, m0, n0, acc, half);
    }
}

#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

template <int kPair>
__global__ void __launch_bounds__(kThreads, 1)
    block_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    /* 1024-byte aligned by an offset into the shared array (a pointer through an integer would
     * lose the address space: generic loads and stores for every shared access) */
    Smem &s = *(Smem *)(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
    const int nkb = (int)((p.k + kBK - 1) / kBK);
    if (threadIdx.x == 0) {
        for (int i = 0; i < kStages; i++) {
            bar_init(&s.full[i], 1);
            bar_init(&s.empty[i], 16); /* one arrival per consumer warp of both CTAs */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_sync(); /* both CTAs' barriers exist before either loads or arrives */
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) produce(s, &map_a, &map_b, p, nkb, cluster_rank());
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        consume<kPair>(s, p, nkb, threadIdx.x / 128 - 1);
    }
    cluster_sync(); /* the other CTA's arrivals on this CTA's barriers are over */
#endif
}

/* cuTensorMapEncodeTiled from the driver, looked up once (no -lcuda link). */
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
    static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> fn{nullptr};
    PFN_cuTensorMapEncodeTiled_v12000 f = fn.load(std::memory_order_acquire);
    if (f == nullptr) {
        void *sym = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &sym, 12000, cudaEnableDefault, &found)
                == cudaSuccess
            && found == cudaDriverEntryPointSuccess)
            f = (PFN_cuTensorMapEncodeTiled_v12000)sym;
        fn.store(f, std::memory_order_release);
    }
    return f;
}

bool code_map(CUtensorMap *map, const tq_block_gemm_side *side, int64_t k, int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
    if (encode == nullptr) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)side->rows};
    const cuuint64_t strides[1] = {(cuuint64_t)side->ld};
    const cuuint32_t box[2] = {kBK, (cuuint32_t)box_rows}, unit[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)side->data, dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

Side side_of(const tq_block_gemm_side *g) {
    Side s;
    s.scale = g->scale_inv;
    s.scale_ld = g->scale_ld;
    s.scale_rows = g->per_row ? g->scale_ld : 0;
    s.per_row = g->per_row;
    return s;
}

std::atomic<int> smem_set[64];

/* The SMs of `device` (asked once; 132 if the runtime will not say). */
int sm_count(int device) {
    static std::atomic<int> known[64];
    int v = known[device].load(std::memory_order_relaxed);
    if (v == 0) {
        if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || v <= 0) v = 132;
        known[device].store(v, std::memory_order_relaxed);
    }
    return v;
}

/* Whether `device` is an sm_90 GPU, asked once per device (0 unknown, 1 yes, 2 no). */
bool hopper(int device) {
    static std::atomic<int> known[64];
    if (device < 0 || device >= 64) return false;
    int v = known[device].load(std::memory_order_relaxed);
    if (v == 0) {
        int major = 0, minor = 0;
        const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess
                        && cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
        if (!ok) return false;
        v = major == 9 && minor == 0 ? 1 : 2;
        known[device].store(v, std::memory_order_relaxed);
    }
    return v == 1;
}

}  // namespace

extern "C" int tq_gemm_fp8_block_runs(const tq_block_gemm *g) {
    if (!hopper(g->device)) return 0;
    const tq_block_gemm_side *sides[2] = {&g->a, &g->b};
    for (const tq_block_gemm_side *s : sides) {
        /* TMA: 16-byte aligned base and row pitch; bulk copies: 16-byte aligned scale vectors */
        if (((uintptr_t)s->data & 15) != 0 || (s->ld & 15) != 0 || s->rows > INT32_MAX) return 0;
        if (s->per_row && (((uintptr_t)s->scale_inv & 15) != 0 || (s->scale_ld & 3) != 0)) return 0;
    }
    const int64_t tiles = ((g->a.rows + kBM - 1) / kBM) * ((g->b.rows + kBN - 1) / kBN);
    return g->k > 0 && g->k <= INT32_MAX && tiles <= INT32_MAX && encode_fn() != nullptr;
}

extern "C" tq_status tq_gemm_fp8_block_cuda(const tq_block_gemm *g, struct CUstream_st *stream) {
    tq_cuda::DeviceGuard guard(g->device);
    if (guard.status != cudaSuccess) return tq_cuda::cuda_failed("cudaSetDevice", guard.status);
    CUtensorMap map_a, map_b;
    if (!code_map(&map_a, &g->a, g->k, kBM) || !code_map(&map_b, &g->b, g->k, kShareRows))
        return tq_fail(TQ_ERROR_CUDA, "block-scaled GEMM: cuTensorMapEncodeTiled refused the codes "
                       "(A [%lld, %lld] ld %lld, B [%lld, %lld] ld %lld)", (long long)g->a.rows,
                       (long long)g->k, (long long)g->a.ld, (long long)g->b.rows, (long long)g->k,
                       (long long)g->b.ld);
    Params p;
    p.m = g->a.rows, p.n = g->b.rows, p.k = g->k;
    p.a = side_of(&g->a), p.b = side_of(&g->b);
    p.out = g->out, p.ldo = g->ldo, p.out_dtype = g->out_dtype;
    p.bias = g->bias, p.bias_dtype = g->bias != nullptr ? g->bias_dtype : -1;
    p.accumulate = g->accumulate;
    p.tiles_m = (int)((p.m + kBM - 1) / kBM), p.tiles_n = (int)((p.n + kBN - 1) / kBN);
    if (p.m == 0 || p.n == 0) return TQ_SUCCESS;
    const int types = (g->a.e5m2 ? 1 : 0) | (g->b.e5m2 ? 2 : 0);
    void (*const kernels[4])(const CUtensorMap, const CUtensorMap, const Params) = {
        block_gemm_kernel<0>, block_gemm_kernel<1>, block_gemm_kernel<2>, block_gemm_kernel<3>};
    const int bit = 1 << types;
    if ((smem_set[g->device].load(std::memory_order_relaxed) & bit) == 0) {
        if (cudaFuncSetAttribute(kernels[types], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kSmemBytes) != cudaSuccess)
            return tq_cuda::launch_failed("cudaFuncSetAttribute(block_gemm_kernel)");
        smem_set[g->device].fetch_or(bit, std::memory_order_relaxed);
    }
    /* persistent: CTA pairs (clusters of 2, one CTA per SM), each pair walking tile pairs a grid
     * apart; as many pairs as fit at once (a GPC with an odd SM count leaves one SM out) */
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes;
    config.stream = stream;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    config.attrs = &cluster, config.numAttrs = 1;
    config.gridDim = dim3(2); /* for the occupancy query: a whole cluster */
    static std::atomic<int> fit[64];
    int most = fit[g->device].load(std::memory_order_relaxed);
    if (most == 0) {
        if (cudaOccupancyMaxActiveClusters(&most, kernels[types], &config) != cudaSuccess || most <= 0) {
            (void)cudaGetLastError();
            most = sm_count(g->device) / 2;
        }
        fit[g->device].store(most, std::memory_order_relaxed);
    }
    const int64_t pairs = (int64_t)((p.tiles_m + 1) / 2) * p.tiles_n;
    config.gridDim = dim3((unsigned)(2 * (pairs < most ? pairs : most)));
    const cudaError_t err = cudaLaunchKernelEx(&config, kernels[types], map_a, map_b, p);
    if (err != cudaSuccess) return tq_cuda::cuda_failed("block_gemm_kernel launch", err);
    if (cudaPeekAtLastError() != cudaSuccess) return tq_cuda::launch_failed("block_gemm_kernel launch");
    return TQ_SUCCESS;
}
