/* quantize_nvfp4_dequant.cu: tq_dequantize on CUDA for NVFP4, one direction (NUMERICS.md 2,
 * TE_REFERENCE 6.5): value = e2m1(code) * tq_nvfp4_block_dec(s_b, A), with A the amax of that
 * direction (q->amax rowwise, q->amax_t columnwise), written as fp32, or RNE to bf16 / fp16.
 * With that amax's data NULL it writes e2m1(code) * s_b: the values the GEMM multiplies (gemm.c).
 * Reference: csrc/ref/quantize_nvfp4_ref.c (bit for bit). Tests: tests/test_quantize_nvfp4*.py.
 */
#include <cuda_runtime.h>

#include <algorithm>

#include "internal_kernels.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

constexpr int kThreads = 256;


template <typename Out>
__device__ __forceinline__ void store_out(Out *out, float v);
template <>
__device__ __forceinline__ void store_out<float>(float *out, float v) { *out = v; }
struct OutBF16 { uint16_t bits; };
struct OutF16 { uint16_t bits; };
template <>
__device__ __forceinline__ void store_out<OutBF16>(OutBF16 *out, float v) { out->bits = tq_f32_to_bf16(v); }
template <>
__device__ __forceinline__ void store_out<OutF16>(OutF16 *out, float v) { out->bits = tq_f32_to_f16(v); }

/* One thread per packed byte (two neighbouring codes of a row): a warp reads 32 consecutive
 * bytes and writes 64 consecutive outputs. */
template <typename Out>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t *__restrict__ data,
                                                              const uint8_t *__restrict__ scale_inv,
                                                              const float *__restrict__ amax,
                                                              int64_t rows, int64_t cols,
                                                              Out *__restrict__ out, int64_t ld) {
    /* amax == nullptr: the GEMM values q * s_b (the global factor is the GEMM's alpha). */
    const bool with_global = amax != nullptr;
    const float global_amax = with_global ? *amax : 0.0f;
    const int64_t bytes_per_row = cols / 2, n = rows * bytes_per_row;
    for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * kThreads) {
        const int64_t r = i / bytes_per_row, c = (i - r * bytes_per_row) * 2;
        const uint8_t byte = data[i];
        const uint8_t s_b = scale_inv[r * (cols / 16) + c / 16];
        const float dec = with_global ? tq_nvfp4_block_dec(s_b, global_amax) : tq_e4m3_to_f32(s_b);
        store_out(&out[r * ld + c], tq_mul(tq_e2m1_to_f32((uint8_t)(byte & 0xFu)), dec));
        store_out(&out[r * ld + c + 1], tq_mul(tq_e2m1_to_f32((uint8_t)(byte >> 4)), dec));
    }
}

template <typename Out>
void launch_dequantize(const uint8_t *data, const uint8_t *scale_inv, const float *amax,
                       tq_tensor *out, int sms, cudaStream_t s) {
    const int64_t n = out->rows * (out->cols / 2);
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 16LL * sms);
    dequantize_kernel<Out><<<(unsigned)blocks, kThreads, 0, s>>>(
        data, scale_inv, amax, out->rows, out->cols, static_cast<Out *>(out->data), out->ld);
}

}  // namespace

extern "C" tq_status tq_dequantize_nvfp4_cuda(const tq_quant_config *config, const tq_qtensor *q,
                                              uint32_t usage, tq_tensor *out,
                                              struct CUstream_st *stream) {
    (void)config;
    if (out->rows == 0 || out->cols == 0) return TQ_SUCCESS;
    DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return cuda_failed("NVFP4 dequantize: making out's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const bool row = usage == TQ_USAGE_ROWWISE;
    const uint8_t *data = static_cast<const uint8_t *>(row ? q->data.data : q->data_t.data);
    const uint8_t *scale_inv = static_cast<const uint8_t *>(row ? q->scale_inv.data : q->scale_inv_t.data);
    const float *amax = static_cast<const float *>(row ? q->amax.data : q->amax_t.data);
    int sms = 132;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out->device) != cudaSuccess) sms = 132;
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32: launch_dequantize<float>(data, scale_inv, amax, out, sms, s); break;
        case TQ_DTYPE_BFLOAT16: launch_dequantize<OutBF16>(data, scale_inv, amax, out, sms, s); break;
        default: launch_dequantize<OutF16>(data, scale_inv, amax, out, sms, s); break;
    }
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("NVFP4 dequantize kernel launch", err);
    return TQ_SUCCESS;
}
