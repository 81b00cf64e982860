/* formats.h: the scalar codecs and scale rules, shared by the CPU references (C) and the CUDA
 * kernels (TQ_HD = __host__ __device__). One definition of each rule of NUMERICS.md:
 *   - exact widening of bf16 / fp16 to fp32, and RNE narrowing of fp32 to bf16 / fp16;
 *   - fp32 -> E4M3 / E5M2 (RNE, saturating to +-448 / +-57344, NaN kept) and back;
 *   - fp32 -> E2M1 (RNE, saturating to +-6; NaN -> +6, negative zero -> code 8) and back, plus
 *     the stochastic-rounding variant; E8M0 rounded up (MXFP8) and its reciprocal;
 *   - the per-tensor / block / MXFP8 / NVFP4 scale rules, Philox4x32-10 and the RHT butterfly.
 * Everything is integer bit work or single IEEE operations (multiply, divide, add) so host and
 * device agree bit for bit; the CUDA build uses -fmad=false and the C build -ffp-contract=off so
 * no multiply-add is fused. Tests: tests/test_formats.py (every bf16 pattern and a dense fp32
 * sweep against torch's casts, on CPU and CUDA).
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

#define TQ_FLT_MAX 0x1.fffffep127f
#define TQ_RCP_6 0x1.555556p-3f          /* RN(1/6) */
#define TQ_RCP_2688 0x1.861862p-12f      /* RN(1/(6*448)): NVFP4 dequantization */
#define TQ_RCP_7225344 0x1.293726p-23f   /* RN(1/(6*6*448*448)): NVFP4 GEMM alpha */
#define TQ_NVFP4_ENC_NUMERATOR 2688.0f   /* 6 * 448, exact */
#define TQ_RHT_SIGN_MASK 0xD7E8u         /* bit i set: the RHT's input i is negated */

/* ---- bit casts and the 16-bit float types ---- */

TQ_HD float tq_f32_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

TQ_HD uint32_t tq_f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

TQ_HD int tq_isnan(float f) { return (tq_f32_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }

/* bf16 is the top half of an fp32: widening is a shift. */
TQ_HD float tq_bf16_to_f32(uint16_t bits) { return tq_f32_from_bits((uint32_t)bits << 16); }

/* fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN of the same sign. */
TQ_HD uint16_t tq_f32_to_bf16(float f) {
    uint32_t b = tq_f32_bits(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40u);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

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

/* fp32 -> IEEE half, round to nearest even, overflow to Inf, NaN kept (quiet). */
TQ_HD uint16_t tq_f32_to_f16(float f) {
    uint32_t b = tq_f32_bits(f);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    uint32_t a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to Inf */
    if (a < 0x38800000u) {                                    /* below 2^-14: subnormal half */
        /* Adding 0.5 (ulp 2^-24, the half subnormal step) lets the FPU round to nearest even. */
        float r = tq_f32_from_bits(a) + 0.5f;
        return (uint16_t)(sign | (tq_f32_bits(r) - 0x3F000000u));
    }
    a += 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
    return (uint16_t)(sign | (a >> 13));
}

/* max(running, |v|) where a NaN v leaves running unchanged (amax never sees NaN). */
TQ_HD float tq_amax_step(float running, float v) {
#if defined(__CUDA_ARCH__)
    /* One FMNMX: fmaxf returns the non-NaN operand, and running is never NaN. */
    return fmaxf(running, fabsf(v));
#else
    float a = v < 0.0f ? -v : v;
    return a > running ? a : running; /* false for NaN */
#endif
}

/* ---- FP8: E4M3 (bias 7, max 448, no Inf) and E5M2 (bias 15, max 57344) ----
 * Saturating RNE: |v| at or above the max (Inf included) gives +-max; NaN gives sign|0x7F (the
 * pattern torch writes). Subnormal results: adding 2^14 (E4M3) or 2^7 (E5M2) puts the format's
 * subnormal step at the fp32 ulp, so the FPU's own RNE rounds, and the code is the difference
 * of the bit patterns. */

TQ_HD uint8_t tq_f32_to_e4m3(float f) {
    uint32_t b = tq_f32_bits(f), a = b & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    if (a > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);
    if (a >= 0x43E00000u) return (uint8_t)(sign | 0x7Eu); /* >= 448 (and Inf) saturate */
    if (a < 0x3C800000u) {                                 /* below 2^-6: subnormal E4M3 */
        float r = tq_f32_from_bits(a) + 16384.0f;
        return (uint8_t)(sign | (tq_f32_bits(r) - 0x46800000u));
    }
    a += 0x7FFFFu + ((a >> 20) & 1u) - (120u << 23);
    return (uint8_t)(sign | (a >> 20));
}

TQ_HD float tq_e4m3_to_f32(uint8_t q) {
    uint32_t sign = (uint32_t)(q & 0x80u) << 24, e = (q >> 3) & 0xFu, m = q & 7u;
    if (e == 0xFu && m == 7u) return tq_f32_from_bits(sign | 0x7FC00000u);
    if (e == 0) return tq_f32_from_bits(sign | tq_f32_bits((float)m * 0x1p-9f));
    return tq_f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

TQ_HD uint8_t tq_f32_to_e5m2(float f) {
    uint32_t b = tq_f32_bits(f), a = b & 0x7FFFFFFFu;
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    if (a > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);
    if (a >= 0x47600000u) return (uint8_t)(sign | 0x7Bu); /* >= 57344 (and Inf) saturate */
    if (a < 0x38800000u) {                                 /* below 2^-14: subnormal E5M2 */
        float r = tq_f32_from_bits(a) + 128.0f;
        return (uint8_t)(sign | (tq_f32_bits(r) - 0x43000000u));
    }
    a += 0xFFFFFu + ((a >> 21) & 1u) - (112u << 23);
    return (uint8_t)(sign | (a >> 21));
}

TQ_HD float tq_e5m2_to_f32(uint8_t q) {
    uint32_t sign = (uint32_t)(q & 0x80u) << 24, e = (q >> 2) & 0x1Fu, m = q & 3u;
    if (e == 0x1Fu) return tq_f32_from_bits(sign | 0x7F800000u | (m << 21));
    if (e == 0) return tq_f32_from_bits(sign | tq_f32_bits((float)m * 0x1p-16f));
    return tq_f32_from_bits(sign | ((e + 112u) << 23) | (m << 21));
}

/* Either FP8 format, chosen by the config's element dtype (1 = E5M2). */
TQ_HD uint8_t tq_f32_to_fp8(float f, int e5m2) { return e5m2 ? tq_f32_to_e5m2(f) : tq_f32_to_e4m3(f); }
TQ_HD float tq_fp8_to_f32(uint8_t q, int e5m2) { return e5m2 ? tq_e5m2_to_f32(q) : tq_e4m3_to_f32(q); }

/* ---- E2M1 (NVFP4 elements): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign ---- */

TQ_HD uint8_t tq_f32_to_e2m1(float f) {
    /* Branch-free (selects only) so a warp never diverges: every case is computed, the right
     * one selected. Below 1: adding 2^22 puts the 0.5 step at the fp32 ulp (FPU RNE). From 1:
     * integer RNE of the bits to one mantissa bit. >= 6 (and Inf) saturate; NaN -> +6. */
    uint32_t b = tq_f32_bits(f), a = b & 0x7FFFFFFFu;
    uint32_t sign = (b >> 28) & 0x8u;
    uint32_t small = tq_f32_bits(tq_f32_from_bits(a) + 4194304.0f) - 0x4A800000u;
    uint32_t big = (a + 0x1FFFFFu + ((a >> 22) & 1u) - (126u << 23)) >> 22;
    uint32_t mag = a < 0x3F800000u ? small : big;
    mag = a >= 0x40C00000u ? 7u : mag;
    return (uint8_t)(a > 0x7F800000u ? 7u : (sign | mag)); /* -0 and tiny negatives: 0x8 */
}

TQ_HD float tq_e2m1_to_f32(uint8_t code) {
    /* magnitude = {0, .5, 1, 1.5, 2, 3, 4, 6}[code & 7] without a table (device friendly) */
    uint32_t e = (code >> 1) & 3u, m = code & 1u;
    float mag = e == 0 ? 0.5f * (float)m : tq_f32_from_bits(((e + 126u) << 23) | (m << 22));
    return (code & 8u) ? -mag : mag;
}

/* Stochastic rounding of an already scaled value v to E2M1 with 8 random bits u (NUMERICS 3.2):
 * t = |v| + (u/256) * step(|v|), q = min(floor(t / step(t)) * step(t), 6), sign restored. The
 * product is exact (u < 256, step a power of two); the one rounding is the fp32 add. */
TQ_HD float tq_e2m1_step(float mag) { return mag < 2.0f ? 0.5f : (mag < 4.0f ? 1.0f : 2.0f); }

TQ_HD uint8_t tq_f32_to_e2m1_sr(float v, uint32_t u) {
    uint32_t b = tq_f32_bits(v), a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7u;
    float mag = tq_f32_from_bits(a);
    float t = mag + ((float)u * 0x1p-8f) * tq_e2m1_step(mag);
    float q = 6.0f;
    if (t < 6.0f) {
        float s = tq_e2m1_step(t);
        float s_rcp = t < 2.0f ? 2.0f : (t < 4.0f ? 1.0f : 0.5f); /* 1/s: t * s_rcp == t / s */
        q = (float)(uint32_t)(t * s_rcp) * s; /* 0 <= t / s < 12: truncation is floor */
    }
    return (uint8_t)(((b >> 28) & 0x8u) | tq_f32_to_e2m1(q));
}

/* ---- E8M0 (MXFP8 scales): a biased power-of-two exponent ---- */

/* The biased exponent of the smallest power of two >= v (v >= 0), saturating at 254; NaN -> 255,
 * +Inf -> 254, 0 -> 0; subnormals up to 2^-127 give 0 (TE_REFERENCE 1.2). */
TQ_HD uint8_t tq_f32_to_e8m0_up(float v) {
    /* Branch-free (the MXFP8 kernels run it once per block): adding 2^23 - 1 to a normal's
     * bits carries into the exponent exactly when the mantissa is non-zero; a subnormal
     * (exponent field 0) rounds up to 2^-127 (field 0) up to 0x400000 and to 2^-126 (field
     * 1) above it, which adding 2^22 - 1 gives. +Inf and overflow land on 255 and saturate. */
    const uint32_t a = tq_f32_bits(v) & 0x7FFFFFFFu;
    uint32_t e = (a + (a < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;
    e = e > 0xFEu ? 0xFEu : e;
    return (uint8_t)(a > 0x7F800000u ? 0xFFu : e);
}

/* 2^(e-127): the scale an E8M0 code stands for (e = 0 is 2^-127, a subnormal; 255 NaN). */
TQ_HD float tq_e8m0_to_f32(uint8_t e) {
    if (e == 0xFFu) return tq_f32_from_bits(0x7FC00000u);
    if (e == 0) return tq_f32_from_bits(0x00400000u);
    return tq_f32_from_bits((uint32_t)e << 23);
}

/* 2^(127-e): what the MXFP8 quantizer multiplies by (e = 254 gives 2^-127; 255 NaN). */
TQ_HD float tq_e8m0_rcp(uint8_t e) {
    uint32_t bits = (uint32_t)(254u - e) << 23; /* selects, not branches: once per block */
    bits = e == 0xFEu ? 0x00400000u : bits;
    bits = e == 0xFFu ? 0x7FC00000u : bits;
    return tq_f32_from_bits(bits);
}

/* ---- scale rules ---- */

/* RN(1/fmax) of an FP8 format, as TE's kernels hold it (MXFP8 multiplies by it). */
TQ_HD float tq_fp8_fmax_rcp(int e5m2) { return e5m2 ? 0x1.24924ap-16f : 0x1.24924ap-9f; }

/* Per-tensor current scaling and FP8 blocks (NUMERICS 2, A.1 / A.3): the scale for amax.
 * amax < eps -> eps; amax 0 / Inf / NaN -> 1; RN(fmax / amax), Inf -> value_for_inf; pow2
 * clears the mantissa (floor to a power of two). */
TQ_HD float tq_scale_from_amax(float amax, float fmax, float eps, int pow2, float value_for_inf) {
    if (amax < eps) amax = eps;
    uint32_t a = tq_f32_bits(amax) & 0x7FFFFFFFu;
    if (a == 0 || a >= 0x7F800000u) return 1.0f;
    float s = fmax / amax;
    if (tq_f32_bits(s) == 0x7F800000u) s = value_for_inf;
    if (pow2) s = tq_f32_from_bits(tq_f32_bits(s) & 0xFF800000u);
    return s;
}

/* RN(x * s), the scaling multiply of the quantizers and dequantizers, with a NaN result made
 * the canonical +NaN (bits 0x7FFFFFFF): CUDA's FMUL returns exactly that for any NaN operand,
 * while x86 keeps the NaN operand's sign and payload. So a NaN element gets the same code from
 * the CPU reference and the kernels (E4M3 / E5M2 0x7F, as TE's GPU quantizers give). */
TQ_HD float tq_mul(float x, float s) {
#if defined(__CUDA_ARCH__)
    return x * s;
#else
    const float v = x * s;
    return tq_isnan(v) ? tq_f32_from_bits(0x7FFFFFFFu) : v;
#endif
}

/* RN(1/s), the stored scale_inv of a scale s. */
TQ_HD float tq_rcp(float s) { return 1.0f / s; }

/* MXFP8 (A.4): the block's E8M0 exponent from its amax. */
TQ_HD uint8_t tq_mxfp8_exponent(float block_amax, int e5m2) {
    return tq_f32_to_e8m0_up(block_amax * tq_fp8_fmax_rcp(e5m2));
}

/* NVFP4 (A.5): the per-tensor encode scale S_enc from the direction's global amax. */
TQ_HD float tq_nvfp4_s_enc(float global_amax) {
    float s = TQ_NVFP4_ENC_NUMERATOR / global_amax;
    if (s > TQ_FLT_MAX) s = TQ_FLT_MAX;
    if (global_amax == 0.0f || s == 0.0f) s = 1.0f;
    return s;
}

/* NVFP4 block scale code: cvt_e4m3_satfinite(min(RN(block_amax * RN(S_enc * RN(1/6))), FLT_MAX)).
 * s_enc_div6 = RN(S_enc * RN(1/6)) is computed once per tensor by the caller. */
TQ_HD uint8_t tq_nvfp4_block_scale(float block_amax, float s_enc_div6) {
    float s = block_amax * s_enc_div6;
    if (s > TQ_FLT_MAX) s = TQ_FLT_MAX;
    return tq_f32_to_e4m3(s);
}

/* NVFP4 per-block encode factor: min(RN(1 / RN(s_b * S_dec)), FLT_MAX), S_dec = RN(1/S_enc). */
TQ_HD float tq_nvfp4_block_enc(uint8_t block_scale, float s_dec) {
    float e = 1.0f / (tq_e4m3_to_f32(block_scale) * s_dec);
    return e > TQ_FLT_MAX ? TQ_FLT_MAX : e;
}

/* NVFP4 dequantization factor of a block: RN(RN(s_b * A) * RN(1/2688)). */
TQ_HD float tq_nvfp4_block_dec(uint8_t block_scale, float global_amax) {
    return (tq_e4m3_to_f32(block_scale) * global_amax) * TQ_RCP_2688;
}

/* NVFP4 GEMM global factor (alpha) of two operands with direction amaxes A and B:
 * RN(RN(A * B) * RN(1/7225344)). The GEMM multiplies q * s_b values; this restores the rest. */
TQ_HD float tq_nvfp4_gemm_alpha(float amax_a, float amax_b) {
    return (amax_a * amax_b) * TQ_RCP_7225344;
}

/* ---- Philox4x32-10 (stochastic rounding, NUMERICS 3.2) ---- */

TQ_HD void tq_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        if (round > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* The 16 random bytes of group g = i div 16 of a direction's output: counter (offset_lo,
 * offset_hi, g_lo, g_hi), key (seed_lo, seed_hi). Element i takes byte (i mod 4) of word
 * ((i div 4) mod 4), byte 0 being the least significant. */
TQ_HD void tq_sr_group_bits(uint64_t seed, uint64_t offset, uint64_t group, uint32_t words[4]) {
    const uint32_t counter[4] = {(uint32_t)offset, (uint32_t)(offset >> 32), (uint32_t)group,
                                 (uint32_t)(group >> 32)};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    tq_philox4x32_10(counter, key, words);
}

TQ_HD uint32_t tq_sr_byte(const uint32_t words[4], uint64_t i) {
    return (words[(i >> 2) & 3u] >> (8u * (uint32_t)(i & 3u))) & 0xFFu;
}

/* ---- random Hadamard transform (NUMERICS 2): R = diag(s) * H16 * 0.25 ---- */

/* The RHT of one 16-group v (in place), y = v R with R[i][j] = s_i * (-1)^popcount(i & j) * 0.25,
 * s_i = -1 where bit i of the sign mask is set, evaluated in this exact fp32 order (tequant's
 * definition; every step but the adds is exact):
 *   1. v_i = v_i * (s_i * 0.25)   (exact for bf16 inputs: a sign flip and a power of two);
 *   2. four butterfly stages, h = 1, 2, 4, 8 in that order: for every i with (i & h) == 0,
 *      (v_i, v_{i+h}) = (RN(v_i + v_{i+h}), RN(v_i - v_{i+h}));
 *   3. output j is v_j (the caller rounds it to BF16).
 * The stages compute the Sylvester H16 (the order changes only the fp32 rounding of the sums). */
TQ_HD void tq_rht16(float v[16]) {
    for (int i = 0; i < 16; i++) v[i] = v[i] * (((TQ_RHT_SIGN_MASK >> i) & 1u) ? -0.25f : 0.25f);
    for (int h = 1; h < 16; h <<= 1) {
        for (int i = 0; i < 16; i++) {
            if (i & h) continue;
            const float a = v[i], b = v[i + h];
            v[i] = a + b;
            v[i + h] = a - b;
        }
    }
}

#endif /* TEQUANT_FORMATS_H_ */
