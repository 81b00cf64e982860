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
 * Tests: tests/test_act_mxfp8.py (GPU cases: bit-exact against the C reference and against
 * tq_quantize of the activation's y_hp).
 */
#include <cuda_runtime.h>

#include "act_dispatch.cuh"
#include "act_load.cuh"
#include "internal_act.h"
#include "internal_kernels.h"
#include "launch.cuh"
#include "mxfp8_tile.cuh"

namespace {

using tq_act_load::ActLoad;
using tq_act_load::InOf;
using tq_act_load::launch_table;
using tq_cuda::DeviceGuard;
using tq_cuda::launch_failed;
using tq_mxfp8::Args;
using tq_mxfp8::quantize_kernel;

/* The MXFP8 kernel's element type of the dispatch's T (float, Bf16, Half). */
template <typename T> struct MxOf { using type = tq_mxfp8::F32; };
template <> struct MxOf<tq_fp::Bf16> { using type = tq_mxfp8::Bf16; };
template <> struct MxOf<tq_fp::Half> { using type = tq_mxfp8::F16; };

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" tq_status tq_act_forward_mxfp8_cuda(const tq_tensor *h, const tq_act_forward_args *a,
                                               struct CUstream_st *stream) {
    const tq_qtensor *q = a->q;
    const int col = q->data_t.data != NULL;
    const int64_t M = q->rows, N = q->cols; /* M: the padded rows (>= h's); both % 32 == 0 */
    if (M == 0 || N == 0) return TQ_SUCCESS;
    const int64_t tile = tq_mxfp8::kTile;
    const int64_t tiles_k = (N + tile - 1) / tile, tiles = (M + tile - 1) / tile * tiles_k;
    if (tiles > INT32_MAX)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "act forward: [%lld, %lld] has more than 2^31 - 1 "
                       "tiles of 128x128", (long long)M, (long long)N);
    DeviceGuard guard(h->device);
    if (guard.status != cudaSuccess) return launch_failed("act forward: making h's device current");
    const int64_t elem = h->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const int gated = tq_act_gated(a->act);
    Args p = {};
    p.x = h->data;
    p.ld = h->ld, p.rows = M, p.cols = N;
    p.tiles_k = (uint32_t)tiles_k, p.n_tiles = (uint32_t)tiles;
    p.data = static_cast<uint8_t *>(q->data.data);
    p.scale_inv = static_cast<uint8_t *>(q->scale_inv.data);
    p.data_t = col ? static_cast<uint8_t *>(q->data_t.data) : nullptr;
    p.scale_inv_t = col ? static_cast<uint8_t *>(q->scale_inv_t.data) : nullptr;
    const int act_vec = aligned16(h->data) && (h->ld * elem) % 16 == 0 && (!gated || (N * elem) % 16 == 0);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const int sms = tq_act_dispatch::sm_count(h->device);
    const bool table_pays = tq_act_table::worth_it(M * N, sms);
    /* E4M3, 1D blocks, q's members 16-byte aligned (the kernel's vector stores): what act.c
     * lets through */
    tq_act_dispatch::with_dtype_act(h->dtype, a->act, [&](auto t, auto act) {
        using A = decltype(act);
        using T = decltype(t);
        using In = typename MxOf<T>::type;
        using E = typename InOf<T>::type;
        if constexpr (A::base != TQ_ACT_IDENTITY) {
            if constexpr (tq_act_table::kUses<T, A::base>) {
                if (table_pays) {
                    using L = ActLoad<A::base, A::gated, true, E>;
                    const L l = {h->rows, act_vec, nullptr};
                    if (col) launch_table<quantize_kernel<In, L, true, true, true, false, false>>(p, l, tiles, h->device, sms, s);
                    else launch_table<quantize_kernel<In, L, true, true, false, false, false>>(p, l, tiles, h->device, sms, s);
                    return;
                }
            }
            using L = ActLoad<A::base, A::gated, false, E>;
            const L l = {h->rows, act_vec, nullptr};
            const unsigned grid = (unsigned)tiles;
            const unsigned threads = tq_mxfp8::kThreads;
            if (col) quantize_kernel<In, L, true, true, true, false, false><<<grid, threads, 0, s>>>(p, l);
            else quantize_kernel<In, L, true, true, false, false, false><<<grid, threads, 0, s>>>(p, l);
        }
    });
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("act forward mxfp8 kernel launch");
    return TQ_SUCCESS;
}
