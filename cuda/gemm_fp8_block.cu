/* gemm_fp8_block.cu: Float8BlockScaling's GEMMs on Hopper without cuBLASLt,
 * out[M, N] = sum over k blocks of (A[M, kb] B[N, kb]^T) * sa * sb (+ out) (+ bias), E4M3 codes,
 * 1x128 scales (one per row and 128 of K) or 128x128 scales (one per 128 rows and 128 of K) on
 * either side, FP32 accumulation, BF16 / FP16 / FP32 output. Not a general GEMM: K-major codes
 * only (tequant's TN layout), sm_90a only (csrc/core/gemm.c falls back to cuBLASLt elsewhere).
 *
 * Why: cuBLASLt's block-scaled kernels on Hopper run 10-45% longer than its per-tensor FP8 ones
 * (the wgrad's 1x128 x 1x128 the most; docs/results/NOTES.md, forty-third session). Here a CTA
 * owns a 128x128 tile of out: one producer warp streams 128x128 code tiles of A and B with TMA
 * (128-byte swizzle) and the 1x128 scale vectors with bulk copies into a ring of shared-memory
 * stages; two consumer warpgroups each multiply 64 rows by the 128 columns with wgmma
 * (m64n128k32, four per k block) into a fresh FP32 tile, then add it times the k block's scales
 * into their running FP32 accumulators (what cuBLASLt's "split accumulation" does per block).
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

constexpr int kBM = 128, kBN = 128, kBK = 128; /* tile of out; k block = one scale block */
constexpr int kStages = 6;
constexpr int kThreads = 384;                  /* warpgroup 0 produces, 1 and 2 consume */
constexpr int kTileBytes = kBM * kBK;          /* one E4M3 code tile, 16 KiB */

struct Smem {
    uint8_t a[kStages][kTileBytes]; /* 1024-byte aligned: the 128-byte swizzle's period */
    uint8_t b[kStages][kTileBytes];
    float sa[kStages][kBM];         /* 1x128 scale vectors of the stage's k block */
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

constexpr int kGroupM = 8; /* tile rows walked together (L2 reuse of B) */

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

__device__ __forceinline__ void bar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
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

/* d[64] (+)= A(64 x 32 codes) B(128 x 32 codes)^T; zero_d starts from 0 instead of d. */
__device__ __forceinline__ void wgmma_64x128x32(float *d, uint64_t desc_a, uint64_t desc_b, int zero_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.eq.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : TQ_D16(0), TQ_D16(16), TQ_D16(32), TQ_D16(48)
        : "l"(desc_a), "l"(desc_b), "r"(zero_d));
}

/* Keeps the compiler from moving reads of d across the wgmma wait. */
__device__ __forceinline__ void pin(float *d) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ float load_bias(const void *bias, int dtype, int64_t c) {
    if (dtype == TQ_DTYPE_BFLOAT16) return __bfloat162float(((const __nv_bfloat16 *)bias)[c]);
    if (dtype == TQ_DTYPE_FLOAT16) return __half2float(((const __half *)bias)[c]);
    return ((const float *)bias)[c];
}

/* out[r][c], out[r][c + 1] = v0, v1 (+ what is there) (+ bias), those inside out. */
__device__ __forceinline__ void store_pair(const Params &p, int64_t r, int64_t c, float v0, float v1) {
    if (r >= p.m || c >= p.n) return;
    const bool pair = c + 1 < p.n;
    if (p.bias_dtype >= 0) {
        v0 += load_bias(p.bias, p.bias_dtype, c);
        if (pair) v1 += load_bias(p.bias, p.bias_dtype, c + 1);
    }
    const int64_t at = r * p.ldo + c;
    if (p.out_dtype == TQ_DTYPE_FLOAT32) {
        float *o = (float *)p.out + at;
        if (p.accumulate) v0 += o[0], v1 += pair ? o[1] : 0.0f;
        o[0] = v0;
        if (pair) o[1] = v1;
    } else if (p.out_dtype == TQ_DTYPE_BFLOAT16) {
        __nv_bfloat16 *o = (__nv_bfloat16 *)p.out + at;
        if (p.accumulate) v0 += __bfloat162float(o[0]), v1 += pair ? __bfloat162float(o[1]) : 0.0f;
        if (pair && (at & 1) == 0) *(__nv_bfloat162 *)o = __floats2bfloat162_rn(v0, v1);
        else {
            o[0] = __float2bfloat16_rn(v0);
            if (pair) o[1] = __float2bfloat16_rn(v1);
        }
    } else {
        __half *o = (__half *)p.out + at;
        if (p.accumulate) v0 += __half2float(o[0]), v1 += pair ? __half2float(o[1]) : 0.0f;
        if (pair && (at & 1) == 0) *(__half2 *)o = __floats2half2_rn(v0, v1);
        else {
            o[0] = __float2half_rn(v0);
            if (pair) o[1] = __float2half_rn(v1);
        }
    }
}

__device__ __forceinline__ void produce(Smem &s, const CUtensorMap *map_a, const CUtensorMap *map_b,
                                        const Params &p, int64_t m0, int64_t n0, int nkb) {
    const uint32_t sa_bytes = p.a.per_row ? (uint32_t)min((int64_t)kBM, p.a.scale_rows - m0) * 4u : 0u;
    const uint32_t sb_bytes = p.b.per_row ? (uint32_t)min((int64_t)kBN, p.b.scale_rows - n0) * 4u : 0u;
    for (int kb = 0; kb < nkb; kb++) {
        const int st = kb % kStages;
        if (kb >= kStages) bar_wait(&s.empty[st], ((kb / kStages) - 1) & 1);
        bar_expect_tx(&s.full[st], 2u * kTileBytes + sa_bytes + sb_bytes);
        tma_tile(s.a[st], map_a, kb * kBK, (int)m0, &s.full[st]);
        tma_tile(s.b[st], map_b, kb * kBK, (int)n0, &s.full[st]);
        if (sa_bytes) bulk_copy(s.sa[st], p.a.scale + kb * p.a.scale_ld + m0, sa_bytes, &s.full[st]);
        if (sb_bytes) bulk_copy(s.sb[st], p.b.scale + kb * p.b.scale_ld + n0, sb_bytes, &s.full[st]);
    }
}

/* One consumer warpgroup: rows m0 + 64 * half onward, all kBN columns. */
__device__ __forceinline__ void consume(Smem &s, const Params &p, int64_t m0, int64_t n0, int nkb, int half) {
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int row0 = 64 * half + 16 * warp + lane / 4; /* this thread's rows: row0, row0 + 8 */
    const int col0 = 2 * (lane % 4);                   /* columns col0 + 8 j + {0, 1} */
    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
    const float *block_a = p.a.per_row ? nullptr : p.a.scale + (m0 / kBM) * p.a.scale_ld;
    const float *block_b = p.b.per_row ? nullptr : p.b.scale + (n0 / kBN) * p.b.scale_ld;
    for (int kb = 0; kb < nkb; kb++) {
        const int st = kb % kStages;
        const float blk_a = block_a ? __ldg(block_a + kb) : 0.0f;
        const float blk_b = block_b ? __ldg(block_b + kb) : 0.0f;
        bar_wait(&s.full[st], (kb / kStages) & 1);
        const uint64_t da = tile_desc(s.a[st] + 64 * half * kBK), db = tile_desc(s.b[st]);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < kBK / 32; kk++) wgmma_64x128x32(part, da + 2 * kk, db + 2 * kk, kk);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin(part);
        const float sa0 = block_a ? blk_a : s.sa[st][row0], sa1 = block_a ? blk_a : s.sa[st][row0 + 8];
        if (block_b) {
            const float f0 = sa0 * blk_b, f1 = sa1 * blk_b;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                acc[4 * j] = __fmaf_rn(part[4 * j], f0, acc[4 * j]);
                acc[4 * j + 1] = __fmaf_rn(part[4 * j + 1], f0, acc[4 * j + 1]);
                acc[4 * j + 2] = __fmaf_rn(part[4 * j + 2], f1, acc[4 * j + 2]);
                acc[4 * j + 3] = __fmaf_rn(part[4 * j + 3], f1, acc[4 * j + 3]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const float2 sb = *(const float2 *)&s.sb[st][col0 + 8 * j];
                acc[4 * j] = __fmaf_rn(part[4 * j], __fmul_rn(sa0, sb.x), acc[4 * j]);
                acc[4 * j + 1] = __fmaf_rn(part[4 * j + 1], __fmul_rn(sa0, sb.y), acc[4 * j + 1]);
                acc[4 * j + 2] = __fmaf_rn(part[4 * j + 2], __fmul_rn(sa1, sb.x), acc[4 * j + 2]);
                acc[4 * j + 3] = __fmaf_rn(part[4 * j + 3], __fmul_rn(sa1, sb.y), acc[4 * j + 3]);
            }
        }
        __syncwarp();
        if (lane == 0) bar_arrive(&s.empty[st]);
    }
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int64_t c = n0 + col0 + 8 * j;
        store_pair(p, m0 + row0, c, acc[4 * j], acc[4 * j + 1]);
        store_pair(p, m0 + row0 + 8, c, acc[4 * j + 2], acc[4 * j + 3]);
    }
}

#endif /* __CUDA_ARCH_FEAT_SM90_ALL */

__global__ void __launch_bounds__(kThreads, 1)
    block_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    Smem &s = *(Smem *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    /* tiles in groups of kGroupM tile rows, column by column: consecutive CTAs share B tiles */
    const int tile = blockIdx.x, per_group = kGroupM * p.tiles_n, group = tile / per_group;
    const int first_m = group * kGroupM, rows_here = min(p.tiles_m - first_m, kGroupM);
    const int tm = first_m + (tile % per_group) % rows_here, tn = (tile % per_group) / rows_here;
    const int64_t m0 = (int64_t)tm * kBM, n0 = (int64_t)tn * kBN;
    const int nkb = (int)((p.k + kBK - 1) / kBK);
    if (threadIdx.x == 0) {
        for (int i = 0; i < kStages; i++) {
            bar_init(&s.full[i], 1);
            bar_init(&s.empty[i], 8); /* one arrival per consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        if (threadIdx.x == 0) produce(s, &map_a, &map_b, p, m0, n0, nkb);
    } else {
        consume(s, p, m0, n0, nkb, threadIdx.x / 128 - 1);
    }
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

bool code_map(CUtensorMap *map, const tq_block_gemm_side *side, int64_t k) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
    if (encode == nullptr) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)side->rows};
    const cuuint64_t strides[1] = {(cuuint64_t)side->ld};
    const cuuint32_t box[2] = {kBK, kBM}, unit[2] = {1, 1};
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

}  // namespace

extern "C" int tq_gemm_fp8_block_runs(const tq_block_gemm *g) {
    int major = 0, minor = 0;
    if (g->device < 0 || g->device >= 64
        || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, g->device) != cudaSuccess
        || cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, g->device) != cudaSuccess)
        return 0;
    const tq_block_gemm_side *sides[2] = {&g->a, &g->b};
    for (const tq_block_gemm_side *s : sides) {
        /* TMA: 16-byte aligned base and row pitch; bulk copies: 16-byte aligned scale vectors */
        if (((uintptr_t)s->data & 15) != 0 || (s->ld & 15) != 0 || s->rows > INT32_MAX) return 0;
        if (s->per_row && (((uintptr_t)s->scale_inv & 15) != 0 || (s->scale_ld & 3) != 0)) return 0;
    }
    return major == 9 && minor == 0 && g->k > 0 && g->k <= INT32_MAX && encode_fn() != nullptr;
}

extern "C" tq_status tq_gemm_fp8_block_cuda(const tq_block_gemm *g, struct CUstream_st *stream) {
    tq_cuda::DeviceGuard guard(g->device);
    if (guard.status != cudaSuccess) return tq_cuda::cuda_failed("cudaSetDevice", guard.status);
    CUtensorMap map_a, map_b;
    if (!code_map(&map_a, &g->a, g->k) || !code_map(&map_b, &g->b, g->k))
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
    if (smem_set[g->device].load(std::memory_order_relaxed) == 0) {
        if (cudaFuncSetAttribute(block_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kSmemBytes) != cudaSuccess)
            return tq_cuda::launch_failed("cudaFuncSetAttribute(block_gemm_kernel)");
        smem_set[g->device].store(1, std::memory_order_relaxed);
    }
    const unsigned tiles = (unsigned)p.tiles_m * (unsigned)p.tiles_n;
    block_gemm_kernel<<<tiles, kThreads, kSmemBytes, stream>>>(map_a, map_b, p);
    return tq_cuda::launch_failed("block_gemm_kernel");
}
