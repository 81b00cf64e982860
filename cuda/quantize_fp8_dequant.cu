/* quantize_fp8_dequant.cu: tq_dequantize on CUDA for per-tensor FP8 (DELAYED and CURRENT
 * scaling), one direction (NUMERICS.md 2): out = RN(fp8 * scale_inv), then RNE to out's dtype
 * (fp32, bf16 or fp16). The quantizer is quantize_fp8.cu.
 * Reference: csrc/ref/quantize_fp8_ref.c (bit for bit). Tests: tests/test_quantize_fp8.py.
 */
#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "internal_kernels.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_fp::Bf16;
using tq_fp::Half;

constexpr int kThreads = 256;

template <typename TOut, bool kE5M2>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t *__restrict__ codes,
                                                              int64_t rows, int64_t cols,
                                                              const float *scale_inv,
                                                              TOut *__restrict__ out, int64_t ld) {
    const float s = *scale_inv;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += stride) {
            tq_fp::narrow(tq_mul(tq_fp8_to_f32(codes[r * cols + c], kE5M2), s), out + r * ld + c);
        }
    }
}

template <typename TOut>
void launch_dequantize(const uint8_t *codes, const tq_tensor *out, const float *scale_inv,
                       int e5m2, cudaStream_t s) {
    const int64_t bx = (out->cols + kThreads - 1) / kThreads;
    const dim3 grid((unsigned)(bx < 4096 ? bx : 4096), (unsigned)(out->rows < 65535 ? out->rows : 65535));
    TOut *o = static_cast<TOut *>(out->data);
    if (e5m2)
        dequantize_kernel<TOut, true><<<grid, kThreads, 0, s>>>(codes, out->rows, out->cols, scale_inv, o, out->ld);
    else
        dequantize_kernel<TOut, false><<<grid, kThreads, 0, s>>>(codes, out->rows, out->cols, scale_inv, o, out->ld);
}

}  // namespace

extern "C" tq_status tq_dequantize_fp8_cuda(const tq_quant_config *c, const tq_qtensor *q,
                                            uint32_t usage, tq_tensor *out,
                                            struct CUstream_st *stream) {
    if (out->rows == 0 || out->cols == 0) return TQ_SUCCESS;
    DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return cuda_failed("fp8 dequantize: making out's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const int e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const uint8_t *codes = static_cast<const uint8_t *>(usage == TQ_USAGE_ROWWISE ? q->data.data : q->data_t.data);
    const float *scale_inv = static_cast<const float *>(q->scale_inv.data);
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32: launch_dequantize<float>(codes, out, scale_inv, e5m2, s); break;
        case TQ_DTYPE_BFLOAT16: launch_dequantize<Bf16>(codes, out, scale_inv, e5m2, s); break;
        default: launch_dequantize<Half>(codes, out, scale_inv, e5m2, s); break;
    }
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("fp8 dequantize kernel launch", err);
    return TQ_SUCCESS;
}
