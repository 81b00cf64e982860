/* act_quantize_mxfp8.cu: tq_act_forward with an MXFP8 config on CUDA: act(h), rounded to h's dtype,
 * quantized into MXFP8 blocks (1x32 rowwise, 32x1 columnwise, E8M0 exponents) as the tile is
 * loaded (MXFP8BlockScaling's fc2 input written by te.LayerNormMLP's activation, no
 * high-precision copy in HBM).
 *
 * Rule (fused.h): every element is tq_act_value (gated: one RN multiply by the second half),
 * canonical NaN, RNE to h's dtype: the bits tq_act_forward's y_hp holds. Those values go through
 * mxfp8_tile.cuh's kernel, the one tq_quantize runs on an x of h's dtype, so q equals tq_quantize
 * of that y_hp (rows past h's as zero rows) bit for bit, and csrc/ref/act_forward_ref.c, which
 * computes it that way. The loader is act_load.cuh's (the FP8 block formats' too): bf16 gelu /
 * silu / qgelu over enough elements read act(x) from act_table.cuh's table, filled once per CTA
 * by CTAs that stay resident and take tiles in turn.
 * tq_act_backward with an MXFP8 config is the same pass over dh = dy * act'(h) rounded to h's
 * dtype (act_grad_load.cuh: fc1's grad_output, MXFP8BlockScaling's, from dy and h).
 * Tests: tests/test_act_mxfp8.py (GPU cases: bit-exact against the C reference and against
 * tq_quantize of the activation's y_hp), tests/test_act_grad_block.py (the backward).
 */
#include <cuda_runtime.h>

#include "act_grad_load.cuh"
#include "act_load.cuh"
#include "internal_kernels.h"
#include "launch.cuh"
#include "mxfp8_tile.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::launch_failed;
static_assert(tq_mxfp8::kThreads == tq_act_load::kTileThreads, "launch_act's CTA size");

/* The MXFP8 kernel's element type of x's (fp8_block_tile.cuh's) E. */
template <typename E> struct MxOf { using type = tq_mxfp8::F32; };
template <> struct MxOf<tq_block::BF16> { using type = tq_mxfp8::Bf16; };
template <> struct MxOf<tq_block::F16> { using type = tq_mxfp8::F16; };

/* The MXFP8 tile kernel (1x32 E4M3, vector stores, rowwise + optionally columnwise) for
 * launch_act. */
struct MxKernel {
    template <typename E, typename L, bool kCol>
    static constexpr auto kernel() {
        return &tq_mxfp8::quantize_kernel<typename MxOf<E>::type, L, true, true, kCol, false, false>;
    }
};

/* The tile pass over q's [M, N] (M: the padded rows, >= h's; both % 32 == 0) that
 * launch(args, tiles, col) makes, on h's device; fn names the call in errors. */
template <typename Launch>
tq_status run(const tq_tensor *h, const tq_qtensor *q, const char *fn, Launch launch) {
    const int col = q->data_t.data != NULL;
    const int64_t M = q->rows, N = q->cols;
    if (M == 0 || N == 0) return TQ_SUCCESS;
    const int64_t tile = tq_mxfp8::kTile;
    const int64_t tiles_k = (N + tile - 1) / tile, tiles = (M + tile - 1) / tile * tiles_k;
    if (tiles > INT32_MAX)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "%s: [%lld, %lld] has more than 2^31 - 1 tiles of "
                       "128x128", fn, (long long)M, (long long)N);
    DeviceGuard guard(h->device);
    if (guard.status != cudaSuccess) return launch_failed(fn);
    tq_mxfp8::Args p = {};
    p.x = h->data;
    p.ld = h->ld, p.rows = M, p.cols = N;
    p.tiles_k = (uint32_t)tiles_k, p.n_tiles = (uint32_t)tiles;
    p.data = static_cast<uint8_t *>(q->data.data);
    p.scale_inv = static_cast<uint8_t *>(q->scale_inv.data);
    p.data_t = col ? static_cast<uint8_t *>(q->data_t.data) : nullptr;
    p.scale_inv_t = col ? static_cast<uint8_t *>(q->scale_inv_t.data) : nullptr;
    launch(p, tiles, col);
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed(fn);
    return TQ_SUCCESS;
}

}  // namespace

/* E4M3, 1D blocks, q's members 16-byte aligned (the kernel's vector stores): what act.c lets
 * through */
extern "C" tq_status tq_act_forward_mxfp8_cuda(const tq_tensor *h, const tq_act_forward_args *a,
                                               struct CUstream_st *stream) {
    return run(h, a->q, "act forward mxfp8 kernel", [&](const tq_mxfp8::Args &p, int64_t tiles,
                                                         int col) {
        tq_act_load::launch_act<MxKernel>(h, a->act, p, tiles, p.cols, col,
                                          reinterpret_cast<cudaStream_t>(stream));
    });
}

extern "C" tq_status tq_act_backward_mxfp8_cuda(const tq_tensor *dy, const tq_tensor *h,
                                                const tq_act_backward_args *a,
                                                struct CUstream_st *stream) {
    return run(h, a->q, "act backward mxfp8 kernel", [&](const tq_mxfp8::Args &p, int64_t tiles,
                                                          int col) {
        tq_act_load::launch_act_grad<MxKernel>(dy, h, a->act, p, tiles, col,
                                               reinterpret_cast<cudaStream_t>(stream));
    });
}
