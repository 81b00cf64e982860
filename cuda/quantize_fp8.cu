/* quantize_fp8.cu: FP8 per-tensor quantization (DELAYED and CURRENT scaling) on CUDA (its
 * dequantization: quantize_fp8_dequant.cu).
 *
 * Rule (NUMERICS.md 2, TE_REFERENCE A.1 / A.2): q = cvt8(RN(x * scale)), scale_inv = RN(1/scale);
 * CURRENT: scale = tq_scale_from_amax(max|x|, fmax, eps, pow2, FLT_MAX), amax written to q->amax
 * (or the caller's amax, tq_quantize_args.amax, read in place and copied there by the cast's
 * first CTA: no amax pass, no memcpy call);
 * DELAYED: scale given, max|x| max-accumulated into the caller's history slot (atomicMax on the
 * float's signed bits). Multiplies are tq_mul: a NaN element encodes as 0x7F, dequantizes to
 * 0x7FFFFFFF.
 * cvt8 is the hardware's cvt.rn.satfinite (fp_cast.cuh's cvt8x2: the rule of formats.h, tested on
 * every bf16 pattern). One pass over x produces both directions: a CTA loads a 128x128 tile
 * with coalesced 16-byte loads, writes the rowwise codes directly and the transposed codes
 * through a swizzled shared tile with 16-byte stores. CURRENT needs max |x| before the first
 * cast, so it reads x twice. By size: a small x (<= 64K elements: launch-bound, e.g. te.Linear
 * on tiny shapes) runs amax and cast in one single-CTA launch (small_current_kernel); a medium
 * one (<= 16M elements, e.g. the activations and weights of a d=512-4096 model) in one
 * cooperative launch whose CTAs meet at a grid barrier between the two (fused_current_kernel;
 * a CTA keeps up to two of its tiles on chip across the barrier, so on an H200 a bf16 x is read
 * once);
 * a larger one runs tq_amax_cuda first (same stream, no host sync): 6 bytes moved per 4 counted
 * for bf16 (walking the tiles in reverse to reuse x's tail in L2, with streaming stores, measured
 * no gain on H200).
 * Current scaling's one launch also sums a bf16 grad_output's columns for dbias where
 * quantize_dbias.c asks (tq_fp8_current_fuses_dbias). The tile code: fp8_cast_tile.cuh; the
 * launch helpers shared with tq_quantize_pair's kernels (quantize_fp8_pair.cu):
 * fp8_quantize_launch.cuh.
 * Reference: csrc/ref/quantize_fp8_ref.c. Tests: tests/test_quantize_fp8.py,
 * tests/test_dbias_fused.py.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "column_sums.cuh"
#include "fp8_cast_tile.cuh"
#include "fp8_quantize_launch.cuh"
#include "internal_kernels.h"
#include "launch.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;
using namespace tq_fp8cast;

/* 16-bit inputs: 4 CTAs (1024 threads, 64 registers each) per SM keep enough loads in flight. */
template <typename T, bool kRow, bool kCol, bool kDelayed, bool kE5M2>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 2) cast_kernel(const CastParams p) {
    __shared__ alignas(16) uint8_t tile_t[kCol ? kTile * kTile : 16];
    __shared__ float warp_amax[kThreads / 32];
    int64_t m0, k0;
    tile_origin(p, blockIdx.x, m0, k0);
    if (full_tile(p, kRow, kCol, m0, k0)) cast_tile<T, kRow, kCol, kDelayed, kE5M2, true>(p, m0, k0, tile_t, warp_amax);
    else cast_tile<T, kRow, kCol, kDelayed, kE5M2, false>(p, m0, k0, tile_t, warp_amax);
}

/* An empty x: no tile to cast, but scale_inv (and the delayed slot) still follow the rule. */
__global__ void empty_kernel(const CastParams p, float *own_amax) {
    if (own_amax != nullptr) *own_amax = 0.0f; /* CURRENT: max |x| of no element */
    *p.scale_inv = tq_rcp(cast_scale(p));
    if (p.amax_copy != nullptr) *p.amax_copy = *p.amax_in;
    if (p.amax_out != nullptr) atomicMax(reinterpret_cast<int *>(p.amax_out), 0);
}

template <typename T, bool kRow, bool kCol, bool kDelayed>
void launch_cast(const CastParams &p, int e5m2, unsigned grid, cudaStream_t s) {
    if (e5m2) cast_kernel<T, kRow, kCol, kDelayed, true><<<grid, kThreads, 0, s>>>(p);
    else cast_kernel<T, kRow, kCol, kDelayed, false><<<grid, kThreads, 0, s>>>(p);
}

/* CURRENT scaling of a small x (at most kSmallElems elements) in ONE launch and one CTA: the
 * amax (max |x|, NaN ignored: the same exact max tq_amax_cuda computes, in another order, which
 * a max does not see), then every tile in turn. Small tensors are bound by launch overhead, not
 * bandwidth: this saves the memset and the separate amax kernel. */
template <typename T, bool kRow, bool kCol, bool kE5M2>
__global__ void __launch_bounds__(kThreads) small_current_kernel(const CastParams p, float *amax) {
    __shared__ alignas(16) uint8_t tile_t[kCol ? kTile * kTile : 16];
    __shared__ float warp_amax[kThreads / 32];
    const T *x = static_cast<const T *>(p.x);
    constexpr int kVec = 16 / sizeof(T);
    float a = 0.0f;
    if (p.x_vec_ok && p.cols % kVec == 0) { /* 16-byte loads: a quarter of the iterations */
        const int64_t per_row = p.cols / kVec, n_vec = p.rows * per_row;
        for (int64_t i = threadIdx.x; i < n_vec; i += kThreads) {
            const int64_t r = i / per_row, v = i - r * per_row;
            Vec16<T> chunk;
            chunk.u = __ldg(reinterpret_cast<const uint4 *>(x + r * p.ld + v * kVec));
#pragma unroll
            for (int e = 0; e < kVec; e++) a = fmaxf(a, fabsf(widen(chunk.t[e])));
        }
    } else {
        for (int64_t i = threadIdx.x; i < p.rows * p.cols; i += kThreads) {
            const int64_t r = i / p.cols, c = i - r * p.cols;
            a = fmaxf(a, fabsf(widen(x[r * p.ld + c])));
        }
    }
    a = block_max(a, warp_amax);
    if (threadIdx.x == 0) *amax = a; /* cast_scale reads it back through p.amax_in */
    __syncthreads();
    const int64_t tiles = ((p.rows + kTile - 1) / kTile) * p.tiles_k;
    for (int64_t tile = 0; tile < tiles; tile++) {
        int64_t m0, k0;
        tile_origin(p, tile, m0, k0);
        if (full_tile(p, kRow, kCol, m0, k0)) cast_tile<T, kRow, kCol, false, kE5M2, true>(p, m0, k0, tile_t, warp_amax);
        else cast_tile<T, kRow, kCol, false, kE5M2, false>(p, m0, k0, tile_t, warp_amax);
        __syncthreads(); /* the next tile reuses tile_t */
    }
}

template <typename T, bool kRow, bool kCol>
void launch_small(const CastParams &p, int e5m2, float *amax, cudaStream_t s) {
    if (e5m2) small_current_kernel<T, kRow, kCol, true><<<1, kThreads, 0, s>>>(p, amax);
    else small_current_kernel<T, kRow, kCol, false><<<1, kThreads, 0, s>>>(p, amax);
}

template <typename T>
void launch_small(const CastParams &p, uint32_t usage, int e5m2, float *amax, cudaStream_t s) {
    if (usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE)) launch_small<T, true, true>(p, e5m2, amax, s);
    else if (usage == TQ_USAGE_ROWWISE) launch_small<T, true, false>(p, e5m2, amax, s);
    else launch_small<T, false, true>(p, e5m2, amax, s);
}

/* Tile number `tile` loaded into raw, its column partials written (dbias); a's max with it. */
template <typename T, bool kRow, bool kCol, bool kDbias>
__device__ __forceinline__ float load_for_amax(const CastParams &p, int64_t tile, TileRegs<T> &raw, float a,
                                               float *carry) {
    int64_t m0, k0;
    tile_origin(p, tile, m0, k0);
    if (full_tile(p, kRow, kCol, m0, k0)) load_tile<T, true>(p, m0, k0, raw);
    else load_tile<T, false>(p, m0, k0, raw);
    if constexpr (kDbias) tile_partials<T>(p, m0, k0, raw, carry);
    return regs_amax<T>(raw, a);
}

/* CURRENT scaling of a medium x (kSmallElems < n <= kFusedMaxElems) in ONE cooperative
 * launch: each CTA takes max |x| over its tiles (cast_tile's loads), the grid meets at a
 * barrier, the CTA maxima meet in q's amax (zeroed by CTA 0 before the first barrier), a second
 * barrier, then each CTA casts the same tiles: from its registers when it has one; with more, its
 * last from registers, its first from shared memory (the stash) and any between loaded again
 * (x of 8192 x 2048 bf16, 1024 tiles on an H200's 528 CTAs: 32 loaded twice). Bits: the
 * amax is the same exact max as tq_amax_cuda's (a max has no order), the cast is cast_tile's.
 * Against the amax kernel + cast kernel it saves a memset and a launch per quantization (host
 * time, te.Linear's forward and backward: ~9 us each on an H200 host) and most of the second
 * read from HBM. The grid is at most what fits on the GPU at once (the cooperative launch's
 * rule, which also guarantees every CTA runs while the others wait at the barrier).
 * With dbias (te.Linear's grad_output) the CTAs also write the column partials before the
 * barrier, and the workspace has a slot per CTA: each CTA's max goes to its slot, and after
 * ONE barrier every CTA reads them all (no zeroing, no atomic, no second barrier); after the
 * cast the CTAs finish the column sums themselves (column_sums.cuh's finish_columns, the bits
 * of column_sum_kernel, which no longer runs as a launch of its own). */
template <typename T, bool kRow, bool kCol, bool kE5M2, bool kDbias>
__global__ void __launch_bounds__(kThreads, kFusedMinCtas<T, kDbias>) fused_current_kernel(const CastParams p, float *amax) {
    __shared__ alignas(16) uint8_t tile_t[kCol ? kTile * kTile : 16];
    __shared__ float warp_amax[kThreads / 32];
    __shared__ float amax_s;
    /* dbias: the partials' carry between warps, then finish_columns' group sums */
    __shared__ float carry[kDbias ? kThreads / 32 * 8 * (16 / sizeof(T)) : 1];
    static_assert(!kDbias || kThreads / 32 * 8 * (16 / sizeof(T)) >= TQ_NORM_GROUP * (kThreads / TQ_NORM_GROUP + 1),
                  "carry holds finish_columns' group sums");
    extern __shared__ uint4 stash[]; /* kStashBytes<T> where a CTA has more than one tile */
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    const int64_t tiles = ((p.rows + kTile - 1) / kTile) * p.tiles_k;
    /* A CTA's tiles: blockIdx.x + j * gridDim.x, j < n. One (the grid covers x): it stays in
     * registers across the barriers and x is read once. More: the last stays in registers, the
     * first in the stash, any between are read twice (the second time the latest first, the
     * likeliest still in L2). With dbias the grid may have CTAs past the tiles (n = 0): they
     * only finish the column sums. */
    const int64_t n = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    if (!kDbias && blockIdx.x == 0 && threadIdx.x == 0) *amax = 0.0f;
    /* with dbias the tile_partials' registers leave no room for a kept tile beside a loaded one
     * (ptxas: spills), so there only a CTA with one tile keeps it in registers */
    const bool keep_last = !kDbias || n == 1;
    TileRegs<T> raw;
    int64_t m0, k0;
    float a = 0.0f;
    if (keep_last) {
#pragma unroll 1
        for (int64_t j = 0; j < n; j++) {
            a = load_for_amax<T, kRow, kCol, kDbias>(p, blockIdx.x + j * gridDim.x, raw, a, carry);
            if (j == 0 && n > 1) stash_tile<T>(raw, stash);
        }
    } else {
#pragma unroll 1
        for (int64_t j = 0; j < n; j++) {
            TileRegs<T> r;
            a = load_for_amax<T, kRow, kCol, kDbias>(p, blockIdx.x + j * gridDim.x, r, a, carry);
            if (j == 0) stash_tile<T>(r, stash);
        }
    }
    a = block_max(a, warp_amax);
    if constexpr (kDbias) { /* the workspace holds a slot per CTA: one barrier, no zeroing */
        if (threadIdx.x == 0) p.cta_max[blockIdx.x] = a;
        grid.sync(); /* the maxima and the column partials are in */
        float m = 0.0f;
        for (int i = threadIdx.x; i < (int)gridDim.x; i += kThreads) m = fmaxf(m, __ldcg(p.cta_max + i));
        m = block_max(m, warp_amax);
        if (threadIdx.x == 0) {
            amax_s = m;
            if (blockIdx.x == 0) *amax = m;
        }
    } else {
        grid.sync(); /* CTA 0's zero is visible */
        if (threadIdx.x == 0 && a > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(amax), __float_as_uint(a));
        grid.sync(); /* every CTA's max is in */
        if (threadIdx.x == 0) amax_s = __ldcg(amax); /* from L2, not a stale L1 line */
    }
    __syncthreads();
    CastParams q = p;
    q.amax_in = &amax_s;
#pragma unroll 1
    for (int64_t j = 0; j < n; j++) { /* kept: the last, the first, n - 2 .. 1; else the first, n - 1 .. 1 */
        const int64_t i = keep_last ? (j == 0 ? n - 1 : j == 1 ? 0 : n - j) : (j == 0 ? 0 : n - j);
        tile_origin(p, blockIdx.x + i * gridDim.x, m0, k0);
        const bool full = full_tile(p, kRow, kCol, m0, k0);
        if (j > 0) __syncthreads(); /* tile_t is free */
        if (j == (keep_last ? 1 : 0)) unstash_tile<T>(stash, raw);
        else if (j == 0) {
        } else if (full) load_tile<T, true>(p, m0, k0, raw);
        else load_tile<T, false>(p, m0, k0, raw);
        if (full) cast_loaded<T, kRow, kCol, false, kE5M2, true>(q, m0, k0, raw, tile_t, warp_amax);
        else cast_loaded<T, kRow, kCol, false, kE5M2, false>(q, m0, k0, raw, tile_t, warp_amax);
    }
    if constexpr (kDbias) { /* dbias from the partials every CTA wrote before the barrier: by
                               * the CTAs past the tiles where the grid has them (beside the
                               * others' casts), else by every CTA after its cast */
        const int64_t p_count = (p.rows + ((int64_t)1 << p.r_shift) - 1) >> p.r_shift;
        const int64_t extra = (int64_t)gridDim.x - tiles;
        __syncthreads(); /* carry is free */
        if (extra <= 0 || n == 0)
            tq_colsum::finish_columns<kThreads, kThreads / TQ_NORM_GROUP>(
                p.partials, p_count, p.cols, p.dbias, p.dbias_dtype, carry,
                extra > 0 ? blockIdx.x - tiles : blockIdx.x, extra > 0 ? extra : gridDim.x);
    }
}

/* CTAs per SM of one fused_current_kernel instance on `device` (0: no cooperative launch). */
template <typename T, bool kRow, bool kCol, bool kE5M2, bool kDbias>
int fused_per_sm(int device) {
    static std::atomic<int> cache[64]; /* this instance's */
    return tq_cuda::coop_blocks_per_sm(fused_current_kernel<T, kRow, kCol, kE5M2, kDbias>, kThreads, device,
                                      cache, kStashBytes<T>);
}

/* Launches the fused kernel; false (nothing queued) where the device cannot run it. */
template <typename T, bool kRow, bool kCol, bool kE5M2, bool kDbias = false>
bool launch_fused(const CastParams &p, float *amax, int device, unsigned tiles, cudaStream_t s) {
    auto kernel = fused_current_kernel<T, kRow, kCol, kE5M2, kDbias>;
    const int per_sm = fused_per_sm<T, kRow, kCol, kE5M2, kDbias>(device);
    int sms = 0;
    if (per_sm <= 0 || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return false;
    unsigned most = (unsigned)per_sm * (unsigned)sms, ctas = tiles;
    if (kDbias) {
        if (most > TQ_FP8_CURRENT_MAX_CTAS) most = TQ_FP8_CURRENT_MAX_CTAS; /* the maxima's slots */
        /* a CTA per 8 columns beside the tiles' CTAs, for the column sums, where they all fit */
        const unsigned chunks = (unsigned)((p.cols + 7) / 8);
        if (tiles + chunks <= most) ctas += chunks;
    }
    CastParams args_p = p;
    float *args_amax = amax;
    void *args[] = {&args_p, &args_amax};
    const unsigned grid = ctas < most ? ctas : most;
    /* the stash only where a CTA has more than one of x's tiles */
    cudaLaunchCooperativeKernel((const void *)kernel, dim3(grid), dim3(kThreads), args,
                                tiles > grid ? (size_t)kStashBytes<T> : 0, s);
    return true;
}

template <typename T, bool kRow, bool kCol>
bool launch_fused(const CastParams &p, int e5m2, float *amax, int device, unsigned tiles, cudaStream_t s) {
    return e5m2 ? launch_fused<T, kRow, kCol, true>(p, amax, device, tiles, s)
                : launch_fused<T, kRow, kCol, false>(p, amax, device, tiles, s);
}

/* With dbias (p.partials set: bf16, both directions, te.Linear's grad_output) the summing
 * instances; other dtypes keep the pass (tq_fp8_current_fuses_dbias), so their instances are
 * not compiled. */
template <typename T>
bool launch_fused(const CastParams &p, uint32_t usage, int e5m2, float *amax, int device,
                  unsigned tiles, cudaStream_t s) {
    if (p.partials != nullptr) {
        if constexpr (std::is_same<T, Bf16>::value)
            return e5m2 ? launch_fused<T, true, true, true, true>(p, amax, device, tiles, s)
                        : launch_fused<T, true, true, false, true>(p, amax, device, tiles, s);
        return false;
    }
    if (usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE))
        return launch_fused<T, true, true>(p, e5m2, amax, device, tiles, s);
    if (usage == TQ_USAGE_ROWWISE) return launch_fused<T, true, false>(p, e5m2, amax, device, tiles, s);
    return launch_fused<T, false, true>(p, e5m2, amax, device, tiles, s);
}

template <typename T, bool kRow, bool kCol>
void launch_cast(const CastParams &p, int delayed, int e5m2, unsigned grid, cudaStream_t s) {
    if (delayed) launch_cast<T, kRow, kCol, true>(p, e5m2, grid, s);
    else launch_cast<T, kRow, kCol, false>(p, e5m2, grid, s);
}

template <typename T>
void launch_cast(const CastParams &p, uint32_t usage, int delayed, int e5m2, unsigned grid,
                 cudaStream_t s) {
    if (usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE))
        launch_cast<T, true, true>(p, delayed, e5m2, grid, s);
    else if (usage == TQ_USAGE_ROWWISE) launch_cast<T, true, false>(p, delayed, e5m2, grid, s);
    else launch_cast<T, false, true>(p, delayed, e5m2, grid, s);
}

}  // namespace

extern "C" int tq_fp8_current_one_launch(int64_t elems) {
    return elems > 0 && elems <= kFusedMaxElems;
}


extern "C" int tq_fp8_current_fuses_dbias(const tq_tensor *x, const tq_quant_config *c,
                                          uint32_t usage) {
    const int64_t n = x->rows * x->cols;
    if (x->device == TQ_DEVICE_CPU || x->dtype != TQ_DTYPE_BFLOAT16
        || c->scaling != TQ_SCALING_CURRENT || usage != (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE)
        || n <= kSmallElems || n > kFusedMaxElems || tq_norm_partial_rows(x->rows, x->cols) > kTile)
        return 0;
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return (c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2 ? fused_per_sm<Bf16, true, true, true, true>(x->device)
                                                  : fused_per_sm<Bf16, true, true, false, true>(x->device)) > 0;
}

extern "C" tq_status tq_quantize_fp8_cuda(const tq_tensor *x, const tq_quant_config *c,
                                          const tq_quantize_args *a, tq_qtensor *q,
                                          struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return cuda_failed("fp8 quantize: making x's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const int delayed = c->scaling == TQ_SCALING_DELAYED;
    const int e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const int64_t n = x->rows * x->cols;
    const bool given = a->amax.data != nullptr; /* CURRENT: a shard's all-reduced amax */
    const bool own_amax = !delayed && !given;
    CastParams p = cast_params(x, c, a, q);
    /* dbias only where tq_fp8_current_fuses_dbias said yes (quantize_dbias.c) */
    const bool dbias = a->dbias.data != nullptr;
    if (dbias) { /* the workspace: partials, the pass's amax slot, the CTA maxima */
        size_t partial_bytes = 0;
        tq_status st = tq_act_backward_workspace_size(x->rows, x->cols, &partial_bytes);
        if (st != TQ_SUCCESS) return st;
        p.partials = static_cast<float *>(a->workspace.data);
        p.cta_max = reinterpret_cast<float *>(static_cast<char *>(a->workspace.data) + partial_bytes) + 1;
        p.dbias = a->dbias.data;
        p.dbias_dtype = a->dbias.dtype;
        while ((int64_t)1 << p.r_shift < tq_norm_partial_rows(x->rows, x->cols)) p.r_shift++;
    }

    if (n == 0) {
        empty_kernel<<<1, 1, 0, s>>>(p, own_amax ? static_cast<float *>(q->amax.data) : nullptr);
    } else {
        const int64_t tiles_m = (x->rows + kTile - 1) / kTile, tiles_k = p.tiles_k;
        if (tiles_m * tiles_k > 0x7FFFFFFFLL)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "fp8 quantize: x [%lld, %lld] has more "
                           "than 2^31 tiles of 128x128", (long long)x->rows, (long long)x->cols);
        const unsigned grid = (unsigned)(tiles_m * tiles_k);
        float *amax = static_cast<float *>(q->amax.data);
        bool done = false;
        if (own_amax && n <= kSmallElems) {
            switch (x->dtype) {
                case TQ_DTYPE_FLOAT32: launch_small<float>(p, a->usage, e5m2, amax, s); break;
                case TQ_DTYPE_BFLOAT16: launch_small<Bf16>(p, a->usage, e5m2, amax, s); break;
                default: launch_small<Half>(p, a->usage, e5m2, amax, s); break;
            }
            done = true;
        } else if (own_amax && n <= kFusedMaxElems) {
            switch (x->dtype) {
                case TQ_DTYPE_FLOAT32: done = launch_fused<float>(p, a->usage, e5m2, amax, x->device, grid, s); break;
                case TQ_DTYPE_BFLOAT16: done = launch_fused<Bf16>(p, a->usage, e5m2, amax, x->device, grid, s); break;
                default: done = launch_fused<Half>(p, a->usage, e5m2, amax, x->device, grid, s); break;
            }
        }
        if (dbias) { /* the launch summed and finished the columns */
            if (!done)
                return tq_fail(TQ_ERROR_INTERNAL, "fp8 quantize: dbias asked of a launch that "
                               "cannot sum (x [%lld, %lld])", (long long)x->rows, (long long)x->cols);
        } else if (!done) {
            if (own_amax) { /* the amax pass; the cast reads it from device memory */
                tq_status st = tq_amax_cuda(x, &q->amax, stream);
                if (st != TQ_SUCCESS) return st;
            }
            switch (x->dtype) {
                case TQ_DTYPE_FLOAT32: launch_cast<float>(p, a->usage, delayed, e5m2, grid, s); break;
                case TQ_DTYPE_BFLOAT16: launch_cast<Bf16>(p, a->usage, delayed, e5m2, grid, s); break;
                default: launch_cast<Half>(p, a->usage, delayed, e5m2, grid, s); break;
            }
        }
    }
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("fp8 quantize kernel launch", err);
    return TQ_SUCCESS;
}


