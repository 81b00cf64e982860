/* amax_update.cu: tq_amax_update on CUDA: delayed scaling's history roll and scale update, TE's
 * FUSED semantics (tequant.h "Delayed scaling", NUMERICS.md 2, TE_REFERENCE 6.1): last =
 * reduced_amax[i] if given and != 0, else h[0]; last == 0 changes nothing; else h becomes
 * [0, h[2], ..., h[L-1], last], amax = fmaxf over (h[1..L-1], last) (MAX) or last (MOST_RECENT),
 * scale = RN(scaled_max / amax) (Inf -> FLT_MAX) when amax is finite and > 0.
 * One CTA per slot; slots travel by value in the kernel parameters, up to kBatch per launch. fmaxf
 * skips NaN and its order does not change the scale, so this equals csrc/ref/amax_update_ref.c
 * bit for bit. No sync, no allocation. Tests: tests/test_amax_update.py (GPU cases).
 */
#include <cuda_runtime.h>

#include "internal_amax_update.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;

constexpr int kThreads = 256;
/* Each thread holds kPer history entries in registers: a history of up to kThreads * kPer
 * entries (1024, DelayedScaling's default length) rolls with one load, one barrier, one store,
 * where a chunk of 128 per barrier took eight dependent global loads (~5 us per launch on an
 * H200, most of it that latency). Longer histories roll in passes of that size. */
constexpr int kPer = 4;
constexpr int kPass = kThreads * kPer;

/* Slots travel by value in the kernel parameters. Big batches: 512 slots of 32 bytes, 16 KB of
 * parameters (under the 32764 bytes Hopper + CUDA 12.1+ take); a launch of a few slots (a
 * Linear's backward update under torch.compile: one slot) takes a small batch instead, 256
 * bytes of parameters for the GPU to fetch rather than 16 KB. */
constexpr int kBatch = 512;
constexpr int kSmallBatch = 8;

template <int kN>
struct SlotBatch {
    tq_amax_slot slot[kN];
};
static_assert(sizeof(SlotBatch<kBatch>) <= 16384, "keep the kernel parameters well under 32 KB");

/* __grid_constant__: slot[blockIdx.x] is read straight from parameter space (no local copy). */
template <bool kMax, int kN>
__global__ void __launch_bounds__(kThreads)
amax_update_kernel(const __grid_constant__ SlotBatch<kN> batch, const float *__restrict__ reduced,
                   int64_t len) {
    const tq_amax_slot &s = batch.slot[blockIdx.x];
    float *h = s.history;
    const int64_t stride = s.stride;
    const float r = reduced != nullptr ? reduced[blockIdx.x] : 0.0f;
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
        __shared__ float warp_max[kThreads / 32];
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

/* One launch over slots[0, count) (count <= kN). */
template <int kN>
void launch(const tq_amax_slot *slots, int count, bool max_algo, const float *reduced,
            int64_t len, cudaStream_t s) {
    SlotBatch<kN> batch = {}; /* unused tail entries travel too: keep them defined */
    for (int j = 0; j < count; j++) batch.slot[j] = slots[j];
    if (max_algo) amax_update_kernel<true, kN><<<count, kThreads, 0, s>>>(batch, reduced, len);
    else amax_update_kernel<false, kN><<<count, kThreads, 0, s>>>(batch, reduced, len);
}

}  // namespace

extern "C" tq_status tq_amax_update_cuda(const tq_amax_slot *slots, int64_t n_slots,
                                         const tq_amax_update_args *args,
                                         struct CUstream_st *stream) {
    DeviceGuard guard(args->device);
    if (guard.status != cudaSuccess)
        return cuda_failed("amax update: making the device current", guard.status);
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const bool max_algo = args->amax_algo == TQ_AMAX_ALGO_MAX;
    for (int64_t start = 0; start < n_slots; start += kBatch) {
        const int count = (int)(n_slots - start < kBatch ? n_slots - start : kBatch);
        /* reduced_amax is indexed by the global slot index */
        const float *reduced = args->reduced_amax != nullptr ? args->reduced_amax + start : nullptr;
        const int64_t len = args->history_len;
        if (count <= kSmallBatch) launch<kSmallBatch>(slots + start, count, max_algo, reduced, len, s);
        else launch<kBatch>(slots + start, count, max_algo, reduced, len, s);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return cuda_failed("amax update kernel launch", err);
    }
    return TQ_SUCCESS;
}
