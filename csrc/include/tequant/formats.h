/* formats.h: scalar conversions shared by the CPU reference (C) and the CUDA kernels (TQ_HD).
 *
 * One definition of each rule. So far: exact widening of bf16 and fp16 bit patterns to fp32
 * (the quantizers' first step, NUMERICS.md "Inputs are widened exactly to FP32 first") and the
 * NaN-ignoring absolute max that every amax uses. Tests: tests/test_amax.py covers them
 * through the amax reference against torch's own conversions.
 */
#ifndef TEQUANT_FORMATS_H_
#define TEQUANT_FORMATS_H_

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define TQ_HD __host__ __device__ __forceinline__
#else
#define TQ_HD static inline
#endif

TQ_HD float tq_f32_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* bf16 is the top half of an fp32: widening is a shift. */
TQ_HD float tq_bf16_to_f32(uint16_t bits) { return tq_f32_from_bits((uint32_t)bits << 16); }

/* IEEE half -> single, exact for every pattern (subnormals renormalized, Inf/NaN kept). */
TQ_HD float tq_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0x1Fu) return tq_f32_from_bits(sign | 0x7F800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return tq_f32_from_bits(sign);
        int shift = 0; /* normalize: a subnormal half is a normal float */
        while ((mant & 0x400u) == 0) mant <<= 1, shift++;
        return tq_f32_from_bits(sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3FFu) << 13));
    }
    return tq_f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* max(running, |v|) where a NaN v leaves running unchanged (amax never sees NaN). */
TQ_HD float tq_amax_step(float running, float v) {
    float a = v < 0.0f ? -v : v;
    return a > running ? a : running; /* false for NaN */
}

#endif /* TEQUANT_FORMATS_H_ */
