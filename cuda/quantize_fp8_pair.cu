/* quantize_fp8_pair.cu: tq_quantize_pair's launch on CUDA (csrc/core/quantize.c): two
 * tensors' per-tensor FP8 quantization in ONE launch, te.Linear's x and W in its forward. Each
 * tensor keeps its own scale, amax and codes; the bits are those of two tq_quantize calls
 * (quantize_fp8.cu, whose rule and reference, csrc/ref/quantize_fp8_ref.c, apply member by
 * member). CURRENT: fused_pair_kernel, the cooperative one-launch kernel over both tensors'
 * tiles (a CTA with several keeps its first and last across the barrier, as
 * fused_current_kernel does), up to 16M elements each; small tensors too, where single calls
 * would launch one single-CTA kernel each (te.Linear's forward at M=128, 256 -> 256: the
 * launches' host time 11.5 -> 4.9 us on an H200 host, NOTES.md). DELAYED: delayed_pair_kernel, the cast kernel over both tensors'
 * tiles (no barrier: a launch's fixed cost saved, ~2-3 us on an H200 for a d=512 te.Linear's
 * W). Both directions, bfloat16 x, one element format; other pairs run as two calls.
 * Tests: tests/test_quantize_pair.py.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>

#include "fp8_quantize_launch.cuh"
#include "launch.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using namespace tq_fp8cast;

/* Two tensors' CURRENT scaling in ONE cooperative launch (te.Linear's x and W in its forward:
 * tq_quantize_pair): fused_current_kernel over one index space of tiles, p0's first, each
 * tensor with its own amax (both zeroed by CTA 0, both max-accumulated between the barriers),
 * scale and codes: the bits of two launches, one launch fewer. Both directions, bfloat16 x. */
template <typename T>
__device__ __forceinline__ float pair_load(const CastParams &p, int64_t tile, TileRegs<T> &raw) {
    int64_t m0, k0;
    tile_origin(p, tile, m0, k0);
    if (full_tile(p, true, true, m0, k0)) load_tile<T, true>(p, m0, k0, raw);
    else load_tile<T, false>(p, m0, k0, raw);
    return regs_amax<T>(raw, 0.0f);
}

template <typename T, bool kE5M2>
__device__ __forceinline__ void pair_cast(const CastParams &p, int64_t tile, const TileRegs<T> &raw,
                                          uint8_t *tile_t, float *warp_amax) {
    int64_t m0, k0;
    tile_origin(p, tile, m0, k0);
    if (full_tile(p, true, true, m0, k0)) cast_loaded<T, true, true, false, kE5M2, true>(p, m0, k0, raw, tile_t, warp_amax);
    else cast_loaded<T, true, true, false, kE5M2, false>(p, m0, k0, raw, tile_t, warp_amax);
}

template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads, kFusedMinCtas<T, false>) fused_pair_kernel(const CastParams p0, const CastParams p1,
                                                                                       float *amax0, float *amax1) {
    extern __shared__ uint4 stash[]; /* kStashBytes<T> where a CTA has more than one tile */
    __shared__ alignas(16) uint8_t tile_t[kTile * kTile];
    __shared__ float warp_amax[kThreads / 32];
    __shared__ float amax_s[2];
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    const int64_t tiles0 = ((p0.rows + kTile - 1) / kTile) * p0.tiles_k;
    const int64_t tiles = tiles0 + ((p1.rows + kTile - 1) / kTile) * p1.tiles_k;
    /* A CTA's tiles (blockIdx.x + j * gridDim.x, j < n) kept as fused_current_kernel keeps them */
    const int64_t n = (tiles - 1 - blockIdx.x) / gridDim.x + 1;
    if (blockIdx.x == 0 && threadIdx.x == 0) *amax0 = *amax1 = 0.0f;
    TileRegs<T> raw;
    float a0 = 0.0f, a1 = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const int64_t tile = blockIdx.x + j * gridDim.x;
        if (tile < tiles0) a0 = fmaxf(a0, pair_load<T>(p0, tile, raw));
        else a1 = fmaxf(a1, pair_load<T>(p1, tile - tiles0, raw));
        if (j == 0 && n > 1) stash_tile<T>(raw, stash);
    }
    a0 = block_max(a0, warp_amax);
    __syncthreads(); /* thread 0 has read warp_amax */
    a1 = block_max(a1, warp_amax);
    grid.sync(); /* CTA 0's zeros are visible */
    if (threadIdx.x == 0) {
        if (a0 > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(amax0), __float_as_uint(a0));
        if (a1 > 0.0f) atomicMax(reinterpret_cast<unsigned int *>(amax1), __float_as_uint(a1));
    }
    grid.sync(); /* every CTA's maxima are in */
    if (threadIdx.x == 0) {
        amax_s[0] = __ldcg(amax0);
        amax_s[1] = __ldcg(amax1);
        if (blockIdx.x == 0) /* cast_loaded sets scale_inv in CTA 0, which may hold no p1 tile */
            *p1.scale_inv = tq_rcp(tq_scale_from_amax(amax_s[1], p1.fmax, p1.eps, p1.pow2, TQ_FLT_MAX));
    }
    __syncthreads();
    CastParams q0 = p0, q1 = p1;
    q0.amax_in = &amax_s[0];
    q1.amax_in = &amax_s[1];
    for (int64_t j = 0; j < n; j++) { /* the last tile, the first, then n - 2 .. 1 */
        const int64_t tile = blockIdx.x + (j == 0 ? n - 1 : j == 1 ? 0 : n - j) * gridDim.x;
        if (j > 0) {
            __syncthreads(); /* tile_t is free */
            if (j == 1) unstash_tile<T>(stash, raw);
            else if (tile < tiles0) pair_load<T>(q0, tile, raw);
            else pair_load<T>(q1, tile - tiles0, raw);
        }
        if (tile < tiles0) pair_cast<T, kE5M2>(q0, tile, raw, tile_t, warp_amax);
        else pair_cast<T, kE5M2>(q1, tile - tiles0, raw, tile_t, warp_amax);
    }
}

/* One DELAYED tile of p (tile: its index within p's tiles). */
template <typename T, bool kE5M2>
__device__ __forceinline__ void delayed_tile(const CastParams &p, int64_t tile, uint8_t *tile_t,
                                             float *warp_amax) {
    int64_t m0, k0;
    tile_origin(p, tile, m0, k0);
    if (full_tile(p, true, true, m0, k0)) cast_tile<T, true, true, true, kE5M2, true>(p, m0, k0, tile_t, warp_amax);
    else cast_tile<T, true, true, true, kE5M2, false>(p, m0, k0, tile_t, warp_amax);
}

/* Two tensors' DELAYED scaling in ONE launch: a CTA per tile, p0's tiles first; each casts with
 * its tensor's scale and max-accumulates into its tensor's history slot, as cast_kernel does. */
template <typename T, bool kE5M2>
__global__ void __launch_bounds__(kThreads, 4) delayed_pair_kernel(const CastParams p0, const CastParams p1,
                                                                   unsigned tiles0) {
    __shared__ alignas(16) uint8_t tile_t[kTile * kTile];
    __shared__ float warp_amax[kThreads / 32];
    if (blockIdx.x < tiles0) {
        delayed_tile<T, kE5M2>(p0, blockIdx.x, tile_t, warp_amax);
        return;
    }
    /* cast_tile writes scale_inv in CTA 0, which holds a p0 tile */
    if (blockIdx.x == tiles0 && threadIdx.x == 0) *p1.scale_inv = tq_rcp(cast_scale(p1));
    delayed_tile<T, kE5M2>(p1, blockIdx.x - tiles0, tile_t, warp_amax);
}

/* Launches fused_pair_kernel; false (nothing queued) where the device cannot run it. */
template <typename T, bool kE5M2>
bool launch_pair(const CastParams &p0, const CastParams &p1, float *amax0, float *amax1, int device,
                 unsigned tiles, cudaStream_t s) {
    static std::atomic<int> cache[64];
    auto kernel = fused_pair_kernel<T, kE5M2>;
    const int per_sm = tq_cuda::coop_blocks_per_sm(kernel, kThreads, device, cache, kStashBytes<T>);
    int sms = 0;
    if (per_sm <= 0 || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return false;
    const unsigned most = (unsigned)per_sm * (unsigned)sms;
    CastParams args_p0 = p0, args_p1 = p1;
    float *args_a0 = amax0, *args_a1 = amax1;
    void *args[] = {&args_p0, &args_p1, &args_a0, &args_a1};
    cudaLaunchCooperativeKernel((const void *)kernel, dim3(tiles < most ? tiles : most), dim3(kThreads),
                                args, tiles > most ? (size_t)kStashBytes<T> : 0, s);
    return true;
}

/* Whether x, c, a is one half of a pair the kernels above take: CUDA, both directions, no dbias
 * and no given amax, a bfloat16 x (float16's CURRENT instances spilled: ptxas -v, 168 bytes);
 * any non-empty x, at most kFusedMaxElems for CURRENT. */
bool pair_half(const tq_tensor *x, const tq_quant_config *c, const tq_quantize_args *a) {
    const int64_t n = x->rows * x->cols;
    if (x->device == TQ_DEVICE_CPU || a->amax.data != nullptr || a->dbias.data != nullptr
        || a->usage != (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE) || x->dtype != TQ_DTYPE_BFLOAT16)
        return false;
    if (c->scaling == TQ_SCALING_DELAYED) return n > 0;
    return c->scaling == TQ_SCALING_CURRENT && n > 0 && n <= kFusedMaxElems;
}

}  // namespace

extern "C" tq_status tq_quantize_fp8_pair_cuda(const tq_tensor *x0, const tq_quant_config *c0,
                                               const tq_quantize_args *a0, tq_qtensor *q0,
                                               const tq_tensor *x1, const tq_quant_config *c1,
                                               const tq_quantize_args *a1, tq_qtensor *q1,
                                               struct CUstream_st *stream, int *launched) {
    *launched = 0;
    if (!pair_half(x0, c0, a0) || !pair_half(x1, c1, a1) || x0->device != x1->device
        || c0->scaling != c1->scaling || c0->elem_dtype != c1->elem_dtype)
        return TQ_SUCCESS;
    const int64_t tiles0 = ((x0->rows + kTile - 1) / kTile) * ((x0->cols + kTile - 1) / kTile);
    const int64_t tiles1 = ((x1->rows + kTile - 1) / kTile) * ((x1->cols + kTile - 1) / kTile);
    if (tiles0 + tiles1 > 0x7FFFFFFFLL) return TQ_SUCCESS; /* the single calls say why */
    DeviceGuard guard(x0->device);
    if (guard.status != cudaSuccess) return cuda_failed("fp8 quantize pair: making x's device current", guard.status);
    const CastParams p0 = cast_params(x0, c0, a0, q0), p1 = cast_params(x1, c1, a1, q1);
    const unsigned tiles = (unsigned)(tiles0 + tiles1);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const bool e5m2 = c0->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    bool done = true;
    if (c0->scaling == TQ_SCALING_DELAYED) {
        if (e5m2) delayed_pair_kernel<Bf16, true><<<tiles, kThreads, 0, s>>>(p0, p1, (unsigned)tiles0);
        else delayed_pair_kernel<Bf16, false><<<tiles, kThreads, 0, s>>>(p0, p1, (unsigned)tiles0);
    } else {
        float *amax0 = static_cast<float *>(q0->amax.data), *amax1 = static_cast<float *>(q1->amax.data);
        done = e5m2 ? launch_pair<Bf16, true>(p0, p1, amax0, amax1, x0->device, tiles, s)
                    : launch_pair<Bf16, false>(p0, p1, amax0, amax1, x0->device, tiles, s);
    }
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("fp8 quantize pair kernel launch", err);
    *launched = done;
    return TQ_SUCCESS;
}
