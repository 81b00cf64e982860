/* quantize_fp8_block.cu: FP8 block scaling on CUDA (Float8BlockScaling; NUMERICS 2, TE_REFERENCE
 * A.3 / 6.3), quantize and dequantize.
 *
 * Rule, per block (1x128 along K rowwise, 128x1 along M columnwise, or a 128x128 tile shared by
 * both directions with TQ_QUANT_2D): amax = max |x| of the valid elements (NaN ignored),
 * scale = tq_scale_from_amax(amax, fmax, eps, pow2, max finite of x's dtype),
 * q = tq_f32_to_fp8(tq_mul(x, scale)), scale_inv = tq_rcp(scale), from formats.h, so the bits
 * equal the CPU reference csrc/ref/quantize_fp8_block_ref.c exactly. Two exact equivalents keep
 * the kernel memory-bound: amax with packed NaN-ignoring max instructions, and the FP8 cast with
 * the hardware cvt.rn.satfinite (fp_cast.cuh's cvt8x2).
 * One CTA per 128x128 tile of x: 16-byte loads once, rowwise output straight from registers, the
 * columnwise (transposed) output through a swizzled shared-memory tile with 16-byte stores.
 * tq_quantize_pair's block half: two bfloat16 tensors' tiles in one launch (quantize_pair_kernel,
 * te.Linear's x and W), each tile as quantize_kernel's.
 * Tests: tests/test_quantize_fp8_block.py (GPU cases: CUDA vs the CPU reference, bit for bit),
 * tests/test_quantize_pair.py (the pair against two calls).
 */
#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "internal_kernels.h"
#include "launch.cuh"
#include "tile_transpose.cuh"
#include "tequant/formats.h"

#include "fp8_block_tile.cuh"

namespace {

using namespace tq_block;
using tq_cuda::DeviceGuard;
using tq_cuda::launch_failed;
/* Dequantize one direction: data [R, C] (data, or data_t) and its scales; 16 codes per thread,
 * all in one 1x128 block or tile. 1D scale entry [c / 128][r], 2D [r / 128][c / 128]. The value
 * is RN(fp8 * scale_inv), narrowed RNE to out's dtype. */
template <tq_dtype kOut, bool k2D, bool kE5M2>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t *__restrict__ codes, int64_t rows, int64_t cols,
                  const float *__restrict__ scale_inv, int64_t scale_ld, void *__restrict__ out,
                  int64_t out_ld, int vec_load) {
    const int64_t groups = (cols + 15) / 16;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < rows * groups; t += stride) {
        const int64_t r = t / groups, c0 = (t - r * groups) * 16;
        const uint8_t *src = codes + r * cols + c0;
        union {
            uint4 v;
            uint8_t b[16];
        } in;
        if (vec_load && c0 + 16 <= cols) {
            in.v = *reinterpret_cast<const uint4 *>(src);
        } else {
#pragma unroll
            for (int j = 0; j < 16; j++) in.b[j] = c0 + j < cols ? src[j] : 0;
        }
        const float s = k2D ? scale_inv[(r / kTile) * scale_ld + c0 / kTile]
                            : scale_inv[(c0 / kTile) * scale_ld + r];
        const int64_t o = r * out_ld + c0;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if (c0 + j >= cols) break;
            const float v = tq_mul(tq_fp8_to_f32(in.b[j], kE5M2), s);
            if (kOut == TQ_DTYPE_FLOAT32) static_cast<float *>(out)[o + j] = v;
            else if (kOut == TQ_DTYPE_BFLOAT16) static_cast<uint16_t *>(out)[o + j] = tq_f32_to_bf16(v);
            else static_cast<uint16_t *>(out)[o + j] = tq_f32_to_f16(v);
        }
    }
}


}  // namespace

namespace {

template <typename In, bool kRow, bool kCol, bool k2D>
void launch_format(const Params &p, int e5m2, unsigned grid, cudaStream_t s) {
    if (e5m2) quantize_kernel<In, RawLoad, kRow, kCol, k2D, true><<<grid, kThreads, 0, s>>>(p, RawLoad{});
    else quantize_kernel<In, RawLoad, kRow, kCol, k2D, false><<<grid, kThreads, 0, s>>>(p, RawLoad{});
}

template <typename In, bool k2D>
void launch_directions(const Params &p, int row, int col, int e5m2, unsigned grid, cudaStream_t s) {
    if (row && col) launch_format<In, true, true, k2D>(p, e5m2, grid, s);
    else if (row) launch_format<In, true, false, k2D>(p, e5m2, grid, s);
    else launch_format<In, false, true, k2D>(p, e5m2, grid, s);
}

template <typename In>
void launch_quantize(const Params &p, int two_d, int row, int col, int e5m2, unsigned grid,
                     cudaStream_t s) {
    if (two_d) launch_directions<In, true>(p, row, col, e5m2, grid, s);
    else launch_directions<In, false>(p, row, col, e5m2, grid, s);
}

/* Two tensors' block scaling in ONE launch (tq_quantize_pair: te.Linear's x and W): a CTA per
 * tile, p0's tiles first, each tile quantize_kernel's. Both directions, one element format,
 * each tensor its own block shape (x 1x128, W 128x128 under Float8BlockScaling). */
template <typename In, bool k2D0, bool k2D1, bool kE5M2>
__global__ void __launch_bounds__(kThreads) quantize_pair_kernel(const Params p0, const Params p1) {
    __shared__ uint4 smem[kTile][kSmemChunks];
    __shared__ float warp_amax[kWarps];
    RawLoad loader{};
    if ((int64_t)blockIdx.x < p0.n_tiles)
        quantize_tile<In, RawLoad, true, true, k2D0, kE5M2>(p0, loader, blockIdx.x, smem, warp_amax);
    else
        quantize_tile<In, RawLoad, true, true, k2D1, kE5M2>(p1, loader, blockIdx.x - p0.n_tiles, smem,
                                                            warp_amax);
}

template <bool k2D0, bool k2D1>
void launch_pair(const Params &p0, const Params &p1, int e5m2, unsigned grid, cudaStream_t s) {
    if (e5m2) quantize_pair_kernel<BF16, k2D0, k2D1, true><<<grid, kThreads, 0, s>>>(p0, p1);
    else quantize_pair_kernel<BF16, k2D0, k2D1, false><<<grid, kThreads, 0, s>>>(p0, p1);
}

/* x's tile parameters for the quantize kernels (vec_load: whether 16-byte loads apply). */
Params quantize_params(const tq_tensor *x, const tq_quant_config *c, tq_qtensor *q) {
    const int64_t elem_bytes = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    Params p = tile_params(x->data, x->dtype, x->ld, x->rows, x->cols, c, q);
    p.vec_load = reinterpret_cast<uintptr_t>(x->data) % 16 == 0 && (x->ld * elem_bytes) % 16 == 0;
    return p;
}

template <tq_dtype kOut>
void launch_dequantize(const tq_tensor *data, const tq_tensor *scale, tq_tensor *out, int two_d,
                       int e5m2, unsigned grid, cudaStream_t s) {
    const uint8_t *codes = static_cast<const uint8_t *>(data->data);
    const float *scale_inv = static_cast<const float *>(scale->data);
    const int vec_load = reinterpret_cast<uintptr_t>(codes) % 16 == 0 && data->cols % 16 == 0;
#define TQ_DEQ_ARGS codes, data->rows, data->cols, scale_inv, scale->ld, out->data, out->ld, vec_load
    if (two_d && e5m2) dequantize_kernel<kOut, true, true><<<grid, kThreads, 0, s>>>(TQ_DEQ_ARGS);
    else if (two_d) dequantize_kernel<kOut, true, false><<<grid, kThreads, 0, s>>>(TQ_DEQ_ARGS);
    else if (e5m2) dequantize_kernel<kOut, false, true><<<grid, kThreads, 0, s>>>(TQ_DEQ_ARGS);
    else dequantize_kernel<kOut, false, false><<<grid, kThreads, 0, s>>>(TQ_DEQ_ARGS);
#undef TQ_DEQ_ARGS
}

}  // namespace

extern "C" tq_status tq_quantize_fp8_block_cuda(const tq_tensor *x, const tq_quant_config *c,
                                                const tq_quantize_args *a, tq_qtensor *q,
                                                struct CUstream_st *stream) {
    const int row = (a->usage & TQ_USAGE_ROWWISE) != 0, col = (a->usage & TQ_USAGE_COLUMNWISE) != 0;
    const int64_t M = x->rows, K = x->cols;
    if (M == 0 || K == 0) return TQ_SUCCESS; /* every member, scales included, is empty */
    const int64_t n_mb = (M + kTile - 1) / kTile, n_kb = (K + kTile - 1) / kTile;
    if (n_mb > INT32_MAX / n_kb)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "FP8 block quantize: [%lld, %lld] has more than "
                       "2^31 - 1 tiles of 128x128", (long long)M, (long long)K);
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return launch_failed("FP8 block quantize: making x's device current");

    const Params p = quantize_params(x, c, q);

    const int two_d = (c->flags & TQ_QUANT_2D) != 0, e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const unsigned grid = (unsigned)(n_mb * n_kb);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32: launch_quantize<F32>(p, two_d, row, col, e5m2, grid, s); break;
        case TQ_DTYPE_BFLOAT16: launch_quantize<BF16>(p, two_d, row, col, e5m2, grid, s); break;
        default: launch_quantize<F16>(p, two_d, row, col, e5m2, grid, s); break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("FP8 block quantize kernel launch");
    return TQ_SUCCESS;
}

/* Whether x, c, a is one half of a pair quantize_pair_kernel takes: CUDA, a non-empty bfloat16
 * x, both directions, no dbias. */
static bool pair_half(const tq_tensor *x, const tq_quant_config *c, const tq_quantize_args *a) {
    return x->device != TQ_DEVICE_CPU && x->dtype == TQ_DTYPE_BFLOAT16 && x->rows > 0 && x->cols > 0
           && c->scaling == TQ_SCALING_BLOCK && a->dbias.data == nullptr
           && a->usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE);
}

extern "C" tq_status tq_quantize_fp8_block_pair_cuda(const tq_tensor *x0, const tq_quant_config *c0,
                                                     const tq_quantize_args *a0, tq_qtensor *q0,
                                                     const tq_tensor *x1, const tq_quant_config *c1,
                                                     const tq_quantize_args *a1, tq_qtensor *q1,
                                                     struct CUstream_st *stream, int *launched) {
    *launched = 0;
    if (!pair_half(x0, c0, a0) || !pair_half(x1, c1, a1) || x0->device != x1->device
        || c0->elem_dtype != c1->elem_dtype)
        return TQ_SUCCESS;
    const Params p0 = quantize_params(x0, c0, q0), p1 = quantize_params(x1, c1, q1);
    if (p0.n_tiles + p1.n_tiles > INT32_MAX) return TQ_SUCCESS; /* the single calls say why */
    DeviceGuard guard(x0->device);
    if (guard.status != cudaSuccess) return launch_failed("FP8 block quantize pair: making x's device current");
    const int e5m2 = c0->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const bool d0 = (c0->flags & TQ_QUANT_2D) != 0, d1 = (c1->flags & TQ_QUANT_2D) != 0;
    const unsigned grid = (unsigned)(p0.n_tiles + p1.n_tiles);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    if (d0 && d1) launch_pair<true, true>(p0, p1, e5m2, grid, s);
    else if (d0) launch_pair<true, false>(p0, p1, e5m2, grid, s);
    else if (d1) launch_pair<false, true>(p0, p1, e5m2, grid, s);
    else launch_pair<false, false>(p0, p1, e5m2, grid, s);
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("FP8 block quantize pair kernel launch");
    *launched = 1;
    return TQ_SUCCESS;
}

extern "C" tq_status tq_dequantize_fp8_block_cuda(const tq_quant_config *c, const tq_qtensor *q,
                                                  uint32_t usage, tq_tensor *out,
                                                  struct CUstream_st *stream) {
    const int row = usage == TQ_USAGE_ROWWISE;
    const tq_tensor *data = row ? &q->data : &q->data_t, *scale = row ? &q->scale_inv : &q->scale_inv_t;
    if (data->rows == 0 || data->cols == 0) return TQ_SUCCESS;
    DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return launch_failed("FP8 block dequantize: making out's device current");
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out->device);
    int64_t blocks = (data->rows * ((data->cols + 15) / 16) + kThreads - 1) / kThreads;
    if (blocks > 16LL * sms) blocks = 16LL * sms;
    const int two_d = (c->flags & TQ_QUANT_2D) != 0, e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32:
            launch_dequantize<TQ_DTYPE_FLOAT32>(data, scale, out, two_d, e5m2, (unsigned)blocks, s);
            break;
        case TQ_DTYPE_BFLOAT16:
            launch_dequantize<TQ_DTYPE_BFLOAT16>(data, scale, out, two_d, e5m2, (unsigned)blocks, s);
            break;
        default:
            launch_dequantize<TQ_DTYPE_FLOAT16>(data, scale, out, two_d, e5m2, (unsigned)blocks, s);
            break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("FP8 block dequantize kernel launch");
    return TQ_SUCCESS;
}
