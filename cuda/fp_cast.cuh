/* fp_cast.cuh: the device-side element casts every kernel of cuda/ shares, internal to cuda/:
 * the 16-bit storage types (Bf16, Half), their exact widening to FP32 and RNE narrowing from it,
 * and the hardware FP32 -> FP8 cast of value pairs. One definition of each; the rules are
 * formats.h's (the CPU references' codecs), and each helper here gives formats.h's bits:
 *   widen / narrow      tq_bf16_to_f32 / tq_f16_to_f32 and tq_f32_to_bf16 / tq_f32_to_f16 themselves;
 *   narrow2             cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32: RNE, fp16 overflowing to Inf, the
 *                       rule of tq_f32_to_bf16 / tq_f32_to_f16 (a NaN may keep another payload:
 *                       callers store canonical NaNs, 0x7FFFFFFF, which both turn into 0x7FFF);
 *   cvt8x2 / cvt8x8     cvt.rn.satfinite.{e4m3,e5m2}x2.f32: RNE, subnormals kept, +-Inf and
 *                       overflow saturating to +-fmax, NaN -> 0x7F: tq_f32_to_e4m3 / e5m2 on every
 *                       input but a negative NaN (formats.h 0xFF), which tq_mul never produces
 *                       on the device (CUDA's product NaN is +NaN). One instruction per pair
 *                       where the software codec costs ~20 per element.
 * Tests: tests/test_quantize_fp8.py and test_quantize_fp8_block.py compare the hardware cast
 * with the codec on every bf16 pattern and a dense fp32 sweep; tests/test_norm_kernels.py and
 * test_act_kernels.py compare whole kernels with the C references bit for bit.
 */
#ifndef TEQUANT_CUDA_FP_CAST_CUH_
#define TEQUANT_CUDA_FP_CAST_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "tequant/formats.h"

namespace tq_fp {

struct Bf16 {
    uint16_t bits;
};
struct Half {
    uint16_t bits;
};

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(Bf16 v) { return tq_bf16_to_f32(v.bits); }
__device__ __forceinline__ float widen(Half v) { return tq_f16_to_f32(v.bits); }

__device__ __forceinline__ void narrow(float v, float *out) { *out = v; }
__device__ __forceinline__ void narrow(float v, Bf16 *out) { out->bits = tq_f32_to_bf16(v); }
__device__ __forceinline__ void narrow(float v, Half *out) { out->bits = tq_f32_to_f16(v); }

/* Two values rounded to bf16 / fp16 in one instruction, `lo` in the low half. */
__device__ __forceinline__ uint32_t narrow2(float lo, float hi, const Bf16 *) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ uint32_t narrow2(float lo, float hi, const Half *) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Two FP8 codes, `lo` in bits 0..7 (the lower address), `hi` in bits 8..15. */
template <bool kE5M2>
__device__ __forceinline__ uint32_t cvt8x2(float lo, float hi) {
    uint16_t r;
    if constexpr (kE5M2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Eight values cast to FP8 codes, little-endian in w[0] (elements 0..3) and w[1] (4..7). */
__device__ __forceinline__ void cvt8x8(const float (&v)[8], bool e5m2, uint32_t (&w)[2]) {
    uint32_t r[4];
    if (e5m2) {
#pragma unroll
        for (int i = 0; i < 4; i++) r[i] = cvt8x2<true>(v[2 * i], v[2 * i + 1]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) r[i] = cvt8x2<false>(v[2 * i], v[2 * i + 1]);
    }
    w[0] = r[0] | r[1] << 16;
    w[1] = r[2] | r[3] << 16;
}

}  // namespace tq_fp

#endif  // TEQUANT_CUDA_FP_CAST_CUH_
