/* quantize_nvfp4_dequant.cu: tq_dequantize on CUDA for NVFP4, one direction (NUMERICS.md 2,
 * TE_REFERENCE 6.5): value = e2m1(code) * tq_nvfp4_block_dec(s_b, A), with A the amax of that
 * direction (q->amax rowwise, q->amax_t columnwise), written as fp32, or RNE to bf16 / fp16.
 * With that amax's data NULL it writes e2m1(code) * s_b: the values the GEMM multiplies (gemm.c);
 * tq_gemm_values_nvfp4_cuda writes both operands' values and the GEMM's device alpha in one launch.
 * Reference: csrc/ref/quantize_nvfp4_ref.c (bit for bit). Tests: tests/test_quantize_nvfp4*.py
 * (dequantize), tests/test_gemm.py (the GEMM values).
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "internal_gemm.h"
#include "internal_kernels.h"
#include "dequant_out.cuh"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;

constexpr int kThreads = 256;
constexpr int kUnit = tq_cuda::kDequantUnit; /* codes per thread: half a 16-code block */

/* e2m1(code) for the low 4 bits of code, as tq_e2m1_to_f32 but in four instructions: the three
 * magnitude bits placed at fp32's exponent LSBs and first mantissa bit give 2^(e-127)(1 + m/2)
 * (e > 0) or m 2^-127 (a subnormal), so times 2^126 (exact) it is {0, .5, 1, 1.5, 2, 3, 4, 6}. */
__device__ __forceinline__ float e2m1_value(uint32_t code) {
    return __uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)) * 0x1p126f;
}

/* One thread per 8 codes (4 bytes, half of a block: its scale byte is at g / 2, the scales being
 * compact [rows, cols / 16]); a warp reads 128 consecutive code bytes and, bf16 / fp16 out,
 * writes 512 consecutive output bytes. kValues: the GEMM values e2m1 * s_b, exact in bf16 (at
 * most 6 significant bits), so bf16 is a truncation. */
template <typename Out, bool kValues, bool kVec>
__device__ __forceinline__ void dequantize_units(const uint8_t *__restrict__ data,
                                                 const uint8_t *__restrict__ scale_inv,
                                                 float global_amax, int64_t rows, int64_t cols,
                                                 typename Out::storage *__restrict__ out,
                                                 int64_t ld, int64_t first, int64_t stride) {
    using T = typename Out::storage;
    const int64_t units_per_row = cols / kUnit, n = rows * units_per_row;
    for (int64_t g = first; g < n; g += stride) {
        uint32_t codes; /* code i in bits 4i..4i+3 */
        if (kVec) {
            codes = *reinterpret_cast<const uint32_t *>(data + g * 4);
        } else {
            const uint8_t *p = data + g * 4;
            codes = p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        }
        const uint8_t s_b = scale_inv[g >> 1];
        const float dec = kValues ? tq_e4m3_to_f32(s_b) : tq_nvfp4_block_dec(s_b, global_amax);
        __align__(16) T vals[kUnit];
#pragma unroll
        for (int i = 0; i < kUnit; i += 2) {
            const float a = e2m1_value(codes >> (4 * i)) * dec;
            const float b = e2m1_value(codes >> (4 * i + 4)) * dec;
            if constexpr (kValues && std::is_same<Out, tq_cuda::DequantBf16>::value)
                vals[i] = (T)(__float_as_uint(a) >> 16), vals[i + 1] = (T)(__float_as_uint(b) >> 16);
            else
                Out::narrow2(a, b, &vals[i]);
        }
        tq_cuda::store_unit<T, kVec>(out, g, units_per_row, cols, ld, vals);
    }
}

template <typename Out, bool kValues, bool kVec>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t *__restrict__ data,
                                                              const uint8_t *__restrict__ scale_inv,
                                                              const float *__restrict__ amax,
                                                              int64_t rows, int64_t cols,
                                                              typename Out::storage *__restrict__ out,
                                                              int64_t ld) {
    dequantize_units<Out, kValues, kVec>(data, scale_inv, kValues ? 0.0f : *amax, rows, cols, out,
                                         ld, (int64_t)blockIdx.x * kThreads + threadIdx.x,
                                         (int64_t)gridDim.x * kThreads);
}

/* An emulated NVFP4 GEMM's prologue in one launch: blocks [0, blocks_a) write A's GEMM values,
 * the rest B's (bf16, as dequantize_kernel<DequantBf16, kValues>), and thread 0 the device
 * alpha and beta (gemm_alpha.cu's rule). Three launches were ~7 us of host time per GEMM. */
struct ValuesPair {
    const uint8_t *data[2], *scale_inv[2];
    int64_t rows[2], cols[2], ld[2];
    uint16_t *out[2];
    unsigned blocks_a;
    const float *amax_a, *amax_b;
    float beta;
    float *alpha_beta;
};

template <bool kVec>
__global__ void __launch_bounds__(kThreads) values_pair_kernel(const ValuesPair p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        p.alpha_beta[0] = p.amax_a != nullptr ? tq_nvfp4_gemm_alpha(*p.amax_a, *p.amax_b) : 1.0f;
        p.alpha_beta[1] = p.beta;
    }
    const int i = blockIdx.x < p.blocks_a ? 0 : 1;
    const int64_t block = i ? blockIdx.x - p.blocks_a : blockIdx.x;
    const int64_t blocks = i ? gridDim.x - p.blocks_a : p.blocks_a;
    dequantize_units<tq_cuda::DequantBf16, true, kVec>(p.data[i], p.scale_inv[i], 0.0f, p.rows[i],
                                                       p.cols[i], p.out[i], p.ld[i],
                                                       block * kThreads + threadIdx.x, blocks * kThreads);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* 4-byte code loads need a 4-aligned base (rows are multiples of 8 bytes); 16-byte output
 * stores a 16-aligned base and row pitch. */
bool vec_ok(const void *data, const tq_tensor *out) {
    const int esize = out->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    return ((uintptr_t)data & 3u) == 0 && aligned16(out->data) && (out->ld * esize) % 16 == 0;
}

int sm_count(int device) {
    int sms = 132;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) sms = 132;
    return sms;
}

int64_t grid_for(const tq_tensor *out, int sms) {
    const int64_t n = out->rows * (out->cols / kUnit);
    return std::min<int64_t>((n + kThreads - 1) / kThreads, 16LL * sms);
}

template <typename Out, bool kValues>
void launch_with(bool vec, const uint8_t *data, const uint8_t *scale_inv, const float *amax,
                 tq_tensor *out, int sms, cudaStream_t s) {
    const int64_t blocks = grid_for(out, sms);
    auto *o = static_cast<typename Out::storage *>(out->data);
    if (vec)
        dequantize_kernel<Out, kValues, true><<<(unsigned)blocks, kThreads, 0, s>>>(
            data, scale_inv, amax, out->rows, out->cols, o, out->ld);
    else
        dequantize_kernel<Out, kValues, false><<<(unsigned)blocks, kThreads, 0, s>>>(
            data, scale_inv, amax, out->rows, out->cols, o, out->ld);
}

template <typename Out>
void launch_dequantize(bool vec, const uint8_t *data, const uint8_t *scale_inv, const float *amax,
                       tq_tensor *out, int sms, cudaStream_t s) {
    if (amax == nullptr) launch_with<Out, true>(vec, data, scale_inv, amax, out, sms, s);
    else launch_with<Out, false>(vec, data, scale_inv, amax, out, sms, s);
}

}  // namespace

extern "C" tq_status tq_gemm_values_nvfp4_cuda(const tq_tensor *data_a, const tq_tensor *scale_a,
                                               tq_tensor *values_a, const tq_tensor *data_b,
                                               const tq_tensor *scale_b, tq_tensor *values_b,
                                               const float *amax_a, const float *amax_b,
                                               float beta, float *alpha_beta,
                                               struct CUstream_st *stream) {
    DeviceGuard guard(values_a->device);
    if (guard.status != cudaSuccess) return cuda_failed("NVFP4 GEMM values: making the device current", guard.status);
    const int sms = sm_count(values_a->device);
    ValuesPair p;
    const tq_tensor *data[2] = {data_a, data_b}, *scales[2] = {scale_a, scale_b};
    tq_tensor *values[2] = {values_a, values_b};
    int64_t blocks[2];
    bool vec = true;
    for (int i = 0; i < 2; i++) {
        p.data[i] = static_cast<const uint8_t *>(data[i]->data);
        p.scale_inv[i] = static_cast<const uint8_t *>(scales[i]->data);
        p.rows[i] = values[i]->rows, p.cols[i] = values[i]->cols, p.ld[i] = values[i]->ld;
        p.out[i] = static_cast<uint16_t *>(values[i]->data);
        blocks[i] = std::max<int64_t>(grid_for(values[i], sms), 1); /* block 0 writes alpha */
        vec = vec && vec_ok(data[i]->data, values[i]);
    }
    p.blocks_a = (unsigned)blocks[0];
    p.amax_a = amax_a, p.amax_b = amax_b, p.beta = beta, p.alpha_beta = alpha_beta;
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const unsigned grid = (unsigned)(blocks[0] + blocks[1]);
    if (vec) values_pair_kernel<true><<<grid, kThreads, 0, s>>>(p);
    else values_pair_kernel<false><<<grid, kThreads, 0, s>>>(p);
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("NVFP4 GEMM values kernel launch", err);
    return TQ_SUCCESS;
}

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
    const int sms = sm_count(out->device);
    const bool vec = vec_ok(data, out);
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32: launch_dequantize<tq_cuda::DequantF32>(vec, data, scale_inv, amax, out, sms, s); break;
        case TQ_DTYPE_BFLOAT16: launch_dequantize<tq_cuda::DequantBf16>(vec, data, scale_inv, amax, out, sms, s); break;
        default: launch_dequantize<tq_cuda::DequantF16>(vec, data, scale_inv, amax, out, sms, s); break;
    }
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return cuda_failed("NVFP4 dequantize kernel launch", err);
    return TQ_SUCCESS;
}
