/* fp8_quantize_launch.cuh: what the per-tensor FP8 quantize kernels' translation units share on
 * the host side and around the tile (fp8_cast_tile.cuh): the size classes of current scaling's
 * launches, a CTA's max and the cast's parameters
 * from the C API's arguments. Internal to cuda/: quantize_fp8.cu (one tensor) and
 * quantize_fp8_pair.cu (two in one launch).
 * Tests: tests/test_quantize_fp8.py, tests/test_quantize_pair.py.
 */
#ifndef TEQUANT_CUDA_FP8_QUANTIZE_LAUNCH_CUH_
#define TEQUANT_CUDA_FP8_QUANTIZE_LAUNCH_CUH_

#include <cuda_runtime.h>

#include "internal_kernels.h" /* before the tile code, which uses its types */
#include "fp8_cast_tile.cuh"

namespace tq_fp8cast {

/* Current scaling by x's elements: up to kSmallElems one single-CTA launch (launch-bound
 * sizes), up to kFusedMaxElems one cooperative launch, above that an amax pass then the cast. */
constexpr int64_t kSmallElems = 1 << 16;
constexpr int64_t kFusedMaxElems = 1 << 24;

/* CTAs per SM the registers are planned for: 16-bit x 4; with dbias (bf16 only) 3, as the sums'
 * registers spilled at 4 (ptxas -v: 260 bytes; 20 at 3). */
template <typename T, bool kDbias>
constexpr int kFusedMinCtas = sizeof(T) == 4 ? 2 : kDbias ? 3 : 4;

/* The max of each thread's a over the CTA (fmaxf: NaN dropped), valid in thread 0. */
__device__ __forceinline__ float block_max(float a, float *warp_amax) {
    for (int offset = 16; offset > 0; offset >>= 1)
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = a;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < kThreads / 32; w++) a = fmaxf(a, warp_amax[w]);
    return a;
}

inline bool aligned16(const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

/* The cast's parameters for x into q (DELAYED: a->scale and q's amax as the history slot;
 * CURRENT: q's amax, or the given a->amax copied there by CTA 0); dbias apart. */
inline CastParams cast_params(const tq_tensor *x, const tq_quant_config *c, const tq_quantize_args *a,
                       tq_qtensor *q) {
    const bool delayed = c->scaling == TQ_SCALING_DELAYED, given = a->amax.data != nullptr;
    const int64_t elem_size = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2, vec = 16 / elem_size;
    CastParams p = {};
    p.x = x->data;
    p.rows = x->rows;
    p.cols = x->cols;
    p.ld = x->ld;
    p.data = static_cast<uint8_t *>(q->data.data);
    p.data_t = static_cast<uint8_t *>(q->data_t.data);
    p.scale = delayed ? static_cast<const float *>(a->scale.data) : nullptr;
    p.amax_in = delayed ? nullptr : static_cast<const float *>(given ? a->amax.data : q->amax.data);
    /* A given amax is read where it is; CTA 0 copies it into q's (no memcpy call). */
    p.amax_copy = given && a->amax.data != q->amax.data ? static_cast<float *>(q->amax.data) : nullptr;
    p.amax_out = delayed ? static_cast<float *>(q->amax.data) : nullptr;
    p.scale_inv = static_cast<float *>(q->scale_inv.data);
    p.fmax = c->fmax;
    p.eps = c->amax_epsilon;
    p.pow2 = (c->flags & TQ_QUANT_POW2_SCALE) != 0;
    p.tiles_k = (x->cols + kTile - 1) / kTile;
    p.x_vec_ok = aligned16(x->data) && ((uint64_t)x->ld * elem_size) % 16 == 0;
    p.data_vec_ok = p.data != nullptr && aligned16(p.data) && x->cols % vec == 0;
    p.data_t_vec_ok = p.data_t != nullptr && aligned16(p.data_t) && x->rows % 16 == 0;
    return p;
}

}  // namespace tq_fp8cast

#endif  // TEQUANT_CUDA_FP8_QUANTIZE_LAUNCH_CUH_
