/* act_quantize_block.cu: tq_act_forward with a BLOCK (1x128, E4M3) config on CUDA: act(h), rounded
 * to h's dtype, quantized into FP8 1x128 blocks in both directions as the tile is loaded
 * (Float8BlockScaling's fc2 input written by te.LayerNormMLP's activation, no high-precision
 * copy in HBM).
 *
 * Rule (fused.h): every element is internal_act.h's tq_act_value (gated: one RN multiply by the
 * second half), canonical NaN, RNE to h's dtype: the bits tq_act_forward's y_hp holds. Those
 * values are quantized by fp8_block_tile.cuh's kernel, the one tq_quantize runs on an x of h's
 * dtype, so q equals tq_quantize of that y_hp (rows past M as zero rows) bit for bit, and
 * csrc/ref/act_forward_ref.c, which computes it that way. TransformerEngine's fused activation
 * + block-format casts round to the input type the same way, so the fused module multiplies
 * what the unfused one would.
 * Layout: CTAs of 128x128 output tiles; each thread computes the activation of its 8 or 16
 * chunks while loading them (16-byte loads of h, both halves when gated, where the rows allow),
 * then the tile kernel's rowwise and columnwise passes run unchanged. The arithmetic bounds the
 * pass (gelu ~75 instructions per element: docs/results/NOTES.md), so bf16 gelu / silu / qgelu
 * over enough elements read act(x) from act_table.cuh's table (the same bits), filled once per
 * CTA in dynamic shared memory by CTAs that stay resident and take tiles in turn.
 * tq_act_backward with a BLOCK config is the same pass over dh = dy * act'(h) rounded to h's
 * dtype (act_grad_load.cuh: fc1's grad_output, Float8BlockScaling's, from dy and h).
 * Tests: tests/test_act_block.py (GPU cases: bit-exact against the C reference and against
 * tq_quantize of the activation's y_hp), tests/test_act_grad_block.py (the backward).
 */
#include <cuda_runtime.h>

#include "act_grad_load.cuh"
#include "act_load.cuh"
#include "fp8_block_tile.cuh"
#include "internal_kernels.h"
#include "launch.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::launch_failed;
static_assert(tq_block::kThreads == tq_act_load::kTileThreads, "launch_act's CTA size");

/* The FP8 block tile kernel (1x128 E4M3, rowwise + optionally columnwise) for launch_act. */
struct BlockKernel {
    template <typename E, typename L, bool kCol>
    static constexpr auto kernel() { return &tq_block::quantize_kernel<E, L, true, kCol, false, false>; }
};

/* The tile pass over q's [M, N] (M: the padded rows, >= h's) that launch(p) makes, on h's device;
 * fn names the call in errors. */
template <typename Launch>
tq_status run(const tq_tensor *h, const tq_quant_config *config, const tq_qtensor *q,
              const char *fn, Launch launch) {
    const int64_t M = q->rows, N = q->cols;
    if (M == 0 || N == 0) return TQ_SUCCESS;
    const int64_t tile = tq_block::kTile;
    const int64_t n_mb = (M + tile - 1) / tile, n_kb = (N + tile - 1) / tile;
    if (n_mb > INT32_MAX / n_kb)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "%s: [%lld, %lld] has more than 2^31 - 1 tiles of "
                       "128x128", fn, (long long)M, (long long)N);
    DeviceGuard guard(h->device);
    if (guard.status != cudaSuccess) return launch_failed(fn);
    launch(tq_block::tile_params(h->data, h->dtype, h->ld, M, N, config, q));
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed(fn);
    return TQ_SUCCESS;
}

}  // namespace

/* E4M3 rowwise (+ columnwise): what act.c lets through */
extern "C" tq_status tq_act_forward_block_cuda(const tq_tensor *h, const tq_act_forward_args *a,
                                               struct CUstream_st *stream) {
    const tq_qtensor *q = a->q;
    return run(h, a->config, q, "act forward block kernel", [&](const tq_block::Params &p) {
        tq_act_load::launch_act<BlockKernel>(h, a->act, p, p.n_tiles, q->cols,
                                             q->data_t.data != NULL,
                                             reinterpret_cast<cudaStream_t>(stream));
    });
}

extern "C" tq_status tq_act_backward_block_cuda(const tq_tensor *dy, const tq_tensor *h,
                                                const tq_act_backward_args *a,
                                                struct CUstream_st *stream) {
    const tq_qtensor *q = a->q;
    return run(h, a->config, q, "act backward block kernel", [&](const tq_block::Params &p) {
        tq_act_load::launch_act_grad<BlockKernel>(dy, h, a->act, p, p.n_tiles,
                                                  q->data_t.data != NULL,
                                                  reinterpret_cast<cudaStream_t>(stream));
    });
}
