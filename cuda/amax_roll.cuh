/* amax_roll.cuh: one DelayedScaling history slot's roll and scale update, run by one whole CTA
 * (tequant.h "Delayed scaling", TE's FUSED rule; the C reference is csrc/ref/amax_update_ref.c).
 * amax_update_kernel (amax_update.cu) runs it once per slot; the grad_output cast's cooperative
 * dbias pass (act_backward.cu, identity_columnwise_kernel<kFinish>) runs it in one CTA after its
 * grid barrier, where the amax it accumulated is final: a Linear's backward update without a
 * launch of its own. fmaxf skips NaN and its order does not change the scale, so every thread
 * count gives the reference's bits. Tests: tests/test_amax_update.py, tests/test_linear_dbias.py.
 */
#ifndef TEQUANT_CUDA_AMAX_ROLL_CUH_
#define TEQUANT_CUDA_AMAX_ROLL_CUH_

#include <cuda_runtime.h>

#include "tequant/formats.h"
#include "tequant/tequant.h"

namespace tq_amax_roll {

/* Every thread of a CTA of kThreads calls this (no thread may have returned). r: the reduced
 * amax of the slot, 0 for none. Each thread holds kPer entries in registers: a history of up
 * to 1024 entries (DelayedScaling's default length) rolls with one load, one barrier, one
 * store; longer ones in passes of that size. */
template <int kThreads, bool kMax>
__device__ __forceinline__ void roll_slot(const tq_amax_slot &s, float r, int64_t len) {
    constexpr int kPer = kThreads >= 1024 ? 1 : 1024 / kThreads;
    constexpr int kPass = kThreads * kPer;
    __shared__ float warp_max[kThreads / 32];
    float *h = s.history;
    const int64_t stride = s.stride;
    const float last = r != 0.0f ? r : h[0];
    if (last == 0.0f) return; /* uniform across the CTA: no roll, the scale stays */
    float amax = last;
    /* In place, pass by pass: read the pass's entries into registers, sync, write. A pass writes
     * only indices below the next pass's reads, so one barrier per pass suffices. */
    for (int64_t off = 0; off < len; off += kPass) {
        float a[kPer];
#pragma unroll
        for (int j = 0; j < kPer; j++) {
            const int64_t i = off + j * kThreads + threadIdx.x;
            a[j] = 0.0f;
            if (i < len) {
                a[j] = i + 1 < len ? h[(i + 1) * stride] : last; /* i = 0 reads h[1]: in the window */
                if (kMax) amax = fmaxf(amax, a[j]);
            }
        }
        __syncthreads(); /* every read of this pass (and h[0] for last) before any write */
#pragma unroll
        for (int j = 0; j < kPer; j++) {
            const int64_t i = off + j * kThreads + threadIdx.x;
            if (i < len) h[i * stride] = i > 0 ? a[j] : 0.0f;
        }
    }
    if (kMax) {
        for (int offset = 16; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x != 0) return;
        for (int w = 1; w < kThreads / 32; w++) amax = fmaxf(amax, warp_max[w]);
    } else if (threadIdx.x != 0) {
        return;
    }
    if (isfinite(amax) && amax > 0.0f) {
        float scale = __fdiv_rn(s.scaled_max, amax);
        if (scale == INFINITY) scale = TQ_FLT_MAX;
        *s.scale = scale;
    }
}

}  // namespace tq_amax_roll

#endif  // TEQUANT_CUDA_AMAX_ROLL_CUH_
