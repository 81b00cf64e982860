/* nvfp4_codes.cuh: the per-element NVFP4 coding of quantize_nvfp4.cu's pass 2, on the device:
 * E2M1 codes by one FPU-rounded add (round to nearest, and stochastic rounding's floor), the E4M3
 * block scale by the hardware convert and its encode factor by an IEEE reciprocal. Each equals
 * formats.h's rule (tq_f32_to_e2m1 / _sr, tq_nvfp4_block_scale, tq_nvfp4_block_enc) on the inputs
 * pass 2 gives it; the kernel's reference is csrc/ref/quantize_nvfp4_ref.c (bit for bit).
 * Tests: tests/test_quantize_nvfp4.py, tests/test_quantize_nvfp4_rht_sr.py.
 */
#ifndef TEQUANT_CUDA_NVFP4_CODES_CUH_
#define TEQUANT_CUDA_NVFP4_CODES_CUH_

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "tequant/formats.h"

namespace tq_nvfp4 {

/* The E2M1 magnitude code of m in [0, 6] (not NaN), rounded to nearest even (kRz false) or
 * toward zero (kRz true), plus 298 (the caller subtracts it once per packed word). E2M1's grid
 * step in [0, 2), [2, 4), [4, 6] is 2^(e-1), e = max(exponent of m, 0) (e = 0, 1, 2), and
 * c = 2^(e+22) has exactly that ulp, so the one fp32 add m + c rounds m to the grid (RN: ties
 * to an even multiple of the step, which is E2M1's even mantissa). bits(m + c) - bits(c) counts
 * steps; the code adds 2e, and (bits(c) >> 22) = 298 + 2e supplies it. Checked equal to
 * tq_f32_to_e2m1 / tq_f32_to_e2m1_sr on every fp32 input (RN) and a dense sweep (SR). */
template <bool kRz>
__device__ __forceinline__ uint32_t e2m1_grid_code(float m) {
    const uint32_t c_bits = (max(__float_as_uint(m), 0x3F800000u) & 0x7F800000u) + (22u << 23);
    const float c = __uint_as_float(c_bits);
    const float r = kRz ? __fadd_rz(m, c) : __fadd_rn(m, c);
    return __float_as_uint(r) - c_bits + (c_bits >> 22);
}
constexpr uint32_t kGridBias = 298u * 0x11111111u; /* 298 in each of 8 nibbles, mod 2^32 */

/* Code (magnitude + 298) of a scaled value v, round to nearest (tq_f32_to_e2m1 without the sign):
 * fminf gives min(|v|, 6), and 6 for NaN (+6, code 7). The sign is added by the caller; on the
 * device a NaN v is the FMUL's canonical positive NaN, so it gets no sign, as in formats.h. */
__device__ __forceinline__ uint32_t e2m1_rn_biased(float v) { return e2m1_grid_code<false>(fminf(fabsf(v), 6.0f)); }

/* Stochastic rounding (tq_f32_to_e2m1_sr without the sign) with random byte u = byte `k` of
 * `word`: t = |v| + u * step(|v|) / 256 (exact product, one rounding), then floor to the grid of
 * min(t, 6) (round toward zero; NaN gives 6). step(|v|) / 256 = 2^(e-136) with the exponent e
 * clamped to [127, 129] (|v| >= 4, Inf and NaN: step 2). u becomes a float exactly through the
 * bits 2^23 + u minus 2^23 (no integer-to-float convert). */
__device__ __forceinline__ uint32_t e2m1_sr_biased(float v, uint32_t word, int k) {
    const float mag = fabsf(v);
    const uint32_t e = min(max(__float_as_uint(mag), 0x3F800000u), 0x40800000u) & 0x7F800000u;
    const float step_256 = __uint_as_float(e - (9u << 23));
    const float u = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7650u + (uint32_t)k)) - 8388608.0f;
    const float t = __fadd_rn(mag, __fmul_rn(u, step_256));
    return e2m1_grid_code<true>(fminf(t, 6.0f));
}

/* NVFP4 block scale byte (tq_nvfp4_block_scale) with the hardware E4M3 convert: its input is
 * never NaN (block amaxes ignore NaN, s_enc_div6 is finite), and on non-NaN inputs
 * cvt.rn.satfinite.e4m3x2 equals tq_f32_to_e4m3 (tests/test_formats.py checks the codec). */
__device__ __forceinline__ uint8_t block_scale(float block_amax, float s_enc_div6) {
    const float s = fminf(block_amax * s_enc_div6, TQ_FLT_MAX);
    return (uint8_t)__nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
}

/* tq_nvfp4_block_enc: min(RN(1 / RN(s_b * S_dec)), FLT_MAX); E4M3 -> f32 via the exact
 * hardware convert (s_b is never the NaN pattern), RN reciprocal by __frcp_rn (IEEE). */
__device__ __forceinline__ float block_enc(uint8_t s_b, float s_dec) {
    const float s_b_f32 = __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)s_b, __NV_E4M3)));
    return fminf(__frcp_rn(s_b_f32 * s_dec), TQ_FLT_MAX);
}

}  // namespace tq_nvfp4

#endif /* TEQUANT_CUDA_NVFP4_CODES_CUH_ */
