/* act_dispatch.cuh: how the activation kernels (act_forward.cu, act_backward.cu) are launched,
 * internal to cuda/: a run-time (dtype, tq_act) as the compile-time (element type, base
 * activation, gated) their kernels are instantiated for, and the grid of a grid-striding launch.
 * Tests: tests/test_act_kernels.py (GPU cases: every activation and dtype).
 */
#ifndef TEQUANT_CUDA_ACT_DISPATCH_CUH_
#define TEQUANT_CUDA_ACT_DISPATCH_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp_cast.cuh"
#include "tequant/tequant.h"

namespace tq_act_dispatch {

template <int kBase, bool kGated>
struct Act {
    static constexpr int base = kBase;
    static constexpr bool gated = kGated;
};

/* f(T{}, Act<base, gated>{}) with T the element type of dtype (float, Bf16, Half) and act's
 * base and gating: geglu / reglu / swiglu are gelu / relu / silu gated; identity is its own. */
template <typename T, typename F>
void with_act(tq_act act, F &&f) {
    switch (act) {
        case TQ_ACT_GELU: f(T{}, Act<TQ_ACT_GELU, false>{}); break;
        case TQ_ACT_RELU: f(T{}, Act<TQ_ACT_RELU, false>{}); break;
        case TQ_ACT_SILU: f(T{}, Act<TQ_ACT_SILU, false>{}); break;
        case TQ_ACT_QGELU: f(T{}, Act<TQ_ACT_QGELU, false>{}); break;
        case TQ_ACT_SRELU: f(T{}, Act<TQ_ACT_SRELU, false>{}); break;
        case TQ_ACT_GEGLU: f(T{}, Act<TQ_ACT_GELU, true>{}); break;
        case TQ_ACT_REGLU: f(T{}, Act<TQ_ACT_RELU, true>{}); break;
        case TQ_ACT_IDENTITY: f(T{}, Act<TQ_ACT_IDENTITY, false>{}); break;
        default: f(T{}, Act<TQ_ACT_SILU, true>{}); break;
    }
}

template <typename F>
void with_dtype_act(tq_dtype dtype, tq_act act, F &&f) {
    if (dtype == TQ_DTYPE_FLOAT32) with_act<float>(act, f);
    else if (dtype == TQ_DTYPE_BFLOAT16) with_act<tq_fp::Bf16>(act, f);
    else with_act<tq_fp::Half>(act, f);
}

inline int sm_count(int device) {
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms;
}

/* CTAs of `threads` for `items` work items, one item per thread and grid-striding: at most
 * ctas_per_sm per SM of the GPU's `sms` (a full GPU for the plain 256-thread launches), at least
 * one (M = 0: CTA 0 still writes scale_inv and every CTA the amax slot). */
inline unsigned grid_for(int64_t items, int sms, int threads, int ctas_per_sm = 8) {
    const int64_t cap = (int64_t)ctas_per_sm * sms;
    int64_t grid = (items + threads - 1) / threads;
    if (grid > cap) grid = cap;
    return grid < 1 ? 1u : (unsigned)grid;
}

}  // namespace tq_act_dispatch

#endif  // TEQUANT_CUDA_ACT_DISPATCH_CUH_
