/* amax_update.cu: tq_amax_update on CUDA: delayed scaling's history roll and scale update, TE's
 * FUSED semantics (tequant.h "Delayed scaling", NUMERICS.md 2, TE_REFERENCE 6.1): last =
 * reduced_amax[i] if given and != 0, else h[0]; last == 0 changes nothing; else h becomes
 * [0, h[2], ..., h[L-1], last], amax = fmaxf over (h[1..L-1], last) (MAX) or last (MOST_RECENT),
 * scale = RN(scaled_max / amax) (Inf -> FLT_MAX) when amax is finite and > 0.
 * One CTA per slot (cuda/amax_roll.cuh: the roll, shared with the grad_output cast that runs a
 * Linear's update itself); slots travel by value in the kernel parameters, up to kBatch per
 * launch. Equals csrc/ref/amax_update_ref.c bit for bit. No sync, no allocation.
 * Tests: tests/test_amax_update.py (GPU cases).
 */
#include <cuda_runtime.h>

#include "amax_roll.cuh"
#include "internal_amax_update.h"
#include "launch.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;

constexpr int kThreads = 256;

/* Slots travel by value in the kernel parameters. Big batches: 512 slots of 32 bytes, 16 KB of
 * parameters (under the 32764 bytes Hopper + CUDA 12.1+ take); a launch of a few slots (a
 * Linear's backward update under torch.compile where its grad_output cast does not run it:
 * one slot) takes a small batch instead, 256 bytes of parameters for the GPU to fetch rather
 * than 16 KB. */
constexpr int kBatch = 512;
constexpr int kSmallBatch = 8;

template <int kN>
struct SlotBatch {
    tq_amax_slot slot[kN];
};
static_assert(sizeof(SlotBatch<kBatch>) <= 16384, "keep the kernel parameters well under 32 KB");

/* One CTA per slot (amax_roll.cuh). __grid_constant__: slot[blockIdx.x] is read straight from
 * parameter space (no local copy). */
template <bool kMax, int kN>
__global__ void __launch_bounds__(kThreads)
amax_update_kernel(const __grid_constant__ SlotBatch<kN> batch, const float *__restrict__ reduced,
                   int64_t len) {
    const float r = reduced != nullptr ? reduced[blockIdx.x] : 0.0f;
    tq_amax_roll::roll_slot<kThreads, kMax>(batch.slot[blockIdx.x], r, len);
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
