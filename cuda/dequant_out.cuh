/* dequant_out.cuh: what the MXFP8 and NVFP4 dequantize kernels share, internal to cuda/: the
 * output element types (fp32, or bf16 / fp16 rounded to nearest even as formats.h rounds) and
 * the store of one thread's 8 consecutive values of a row. Tests: tests/test_quantize_mxfp8.py,
 * tests/test_quantize_nvfp4.py and tests/test_gemm.py (the GEMM values), bit for bit against
 * the CPU reference.
 */
#ifndef TEQUANT_CUDA_DEQUANT_OUT_CUH_
#define TEQUANT_CUDA_DEQUANT_OUT_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "tequant/formats.h"

namespace tq_cuda {

/* Two fp32 -> storage bits. bf16 goes through the paired convert instruction: RNE like
 * tq_f32_to_bf16, and a NaN is 0x7FFF either way (the values are GPU products, whose NaNs are
 * canonical). */
struct DequantF32 {
    using storage = float;
    static __device__ __forceinline__ void narrow2(float a, float b, float *out) {
        out[0] = a, out[1] = b;
    }
};
struct DequantBf16 {
    using storage = uint16_t;
    static __device__ __forceinline__ void narrow2(float a, float b, uint16_t *out) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        memcpy(out, &v, sizeof v);
    }
};
struct DequantF16 {
    using storage = uint16_t;
    static __device__ __forceinline__ void narrow2(float a, float b, uint16_t *out) {
        out[0] = tq_f32_to_f16(a), out[1] = tq_f32_to_f16(b);
    }
};

constexpr int kDequantUnit = 8; /* values per thread and step */

/* One unit's 8 values to dst: 16-byte stores when kVec (dst 16-byte aligned). */
template <typename T, bool kVec>
__device__ __forceinline__ void store_vals(T *__restrict__ dst, const T *vals) {
    if (kVec) {
#pragma unroll
        for (int i = 0; i < kDequantUnit * (int)sizeof(T) / 16; i++)
            reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(vals)[i];
    } else {
#pragma unroll
        for (int i = 0; i < kDequantUnit; i++) dst[i] = vals[i];
    }
}

/* Stores the 8 values of unit g (row g / units_per_row) into out, whose rows are ld elements
 * apart (kVec: out and its row pitch 16-byte aligned). A division only when the rows are
 * padded (ld != cols). */
template <typename T, bool kVec>
__device__ __forceinline__ void store_unit(T *__restrict__ out, int64_t g, int64_t units_per_row,
                                           int64_t cols, int64_t ld, const T *vals) {
    int64_t at = g * kDequantUnit;
    if (ld != cols) {
        const int64_t r = g / units_per_row;
        at = r * ld + (g - r * units_per_row) * kDequantUnit;
    }
    store_vals<T, kVec>(out + at, vals);
}

}  // namespace tq_cuda

#endif  // TEQUANT_CUDA_DEQUANT_OUT_CUH_
