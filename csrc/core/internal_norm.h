/* internal_norm.h: the arithmetic of tq_norm_forward / tq_norm_backward that the C references
 * (csrc/ref/norm_forward_ref.c, norm_backward_ref.c) and the kernels (cuda/norm_forward.cu,
 * norm_backward.cu) share, so both round the same values the same way (tequant.h states the
 * formulas and the summation orders; this file holds their constants and each per-element step).
 *
 * Every step is one IEEE single operation with round-to-nearest-even: on the device through the
 * _rn intrinsics (never contracted into an FMA, correctly rounded division and square root
 * whatever -fmad / -prec-div / -prec-sqrt say), on the host plain C operators (the build has
 * -ffp-contract=off; x86-64 evaluates float in SSE, and sqrtf is IEEE's correctly rounded sqrt).
 * What differs between the two sides is only HOW the sums are scheduled, never their order.
 * The activation kernels (internal_act.h) use the same primitives, plus tq_nfma (one fused
 * multiply-add, a single RN: __fmaf_rn / C99 fmaf; the norm never uses it), tq_norm_canon, and
 * the backward's column order for their bias gradient.
 * Tests: tests/test_norm_kernels.py, tests/test_act_kernels.py.
 */
#ifndef TEQUANT_CORE_INTERNAL_NORM_H_
#define TEQUANT_CORE_INTERNAL_NORM_H_

#include <math.h>

#include "tequant/formats.h"
#include "tequant/tequant.h"

#define TQ_NORM_CHUNK 8        /* consecutive elements per chunk of a row sum */
#define TQ_NORM_LANES 256      /* chunk c adds into lane c mod 256; the lanes then fold in halves */
#define TQ_NORM_GROUP 32       /* backward: column partials summed in groups of 32 chunks */
#define TQ_NORM_MAX_PARTIALS 1024 /* backward: at most 1024 row chunks (32 groups) */
#define TQ_NORM_PARTIAL_ELEMS ((int64_t)1 << 22) /* backward: P * K bound of the workspace */

#if defined(__CUDA_ARCH__)
#define TQ_NORM_HD __device__ __forceinline__
TQ_NORM_HD float tq_nadd(float a, float b) { return __fadd_rn(a, b); }
TQ_NORM_HD float tq_nsub(float a, float b) { return __fsub_rn(a, b); }
TQ_NORM_HD float tq_nmul(float a, float b) { return __fmul_rn(a, b); }
TQ_NORM_HD float tq_ndiv(float a, float b) { return __fdiv_rn(a, b); }
TQ_NORM_HD float tq_nsqrt(float a) { return __fsqrt_rn(a); }
TQ_NORM_HD float tq_nfloat(int64_t k) { return __ll2float_rn((long long)k); }
TQ_NORM_HD float tq_nfma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
#define TQ_NORM_HD static inline
TQ_NORM_HD float tq_nadd(float a, float b) { return a + b; }
TQ_NORM_HD float tq_nsub(float a, float b) { return a - b; }
TQ_NORM_HD float tq_nmul(float a, float b) { return a * b; }
TQ_NORM_HD float tq_ndiv(float a, float b) { return a / b; }
TQ_NORM_HD float tq_nsqrt(float a) { return sqrtf(a); }
TQ_NORM_HD float tq_nfloat(int64_t k) { return (float)k; }
TQ_NORM_HD float tq_nfma(float a, float b, float c) { return fmaf(a, b, c); } /* C99: one RN */
#endif

/* A stored FP32 value: any NaN becomes the canonical +NaN (the GPU's arithmetic NaN; x86 keeps
 * an operand's sign and payload), so NaN outputs have the same bits on both sides. */
TQ_NORM_HD float tq_norm_canon(float v) {
    return tq_isnan(v) ? tq_f32_from_bits(0x7FFFFFFFu) : v;
}

/* gamma as the norm multiplies by it */
TQ_NORM_HD float tq_norm_gamma(float w, int zero_centered) {
    return zero_centered ? tq_nadd(1.0f, w) : w;
}

/* mean = RN(sum / K) */
TQ_NORM_HD float tq_norm_mean(float sum, int64_t k) { return tq_ndiv(sum, tq_nfloat(k)); }

/* rstd = RN(1 / RN(sqrt(RN(var + eps)))) */
TQ_NORM_HD float tq_norm_rstd_of_var(float var, float eps) {
    return tq_ndiv(1.0f, tq_nsqrt(tq_nadd(var, eps)));
}

/* RMSNorm: rstd = RN(1 / RN(sqrt(RN(RN(sum_sq / K) + eps)))) */
TQ_NORM_HD float tq_norm_rstd(float sum_sq, int64_t k, float eps) {
    return tq_norm_rstd_of_var(tq_ndiv(sum_sq, tq_nfloat(k)), eps);
}

/* LayerNorm's second pass sums e = RN(v - m0) and RN(e * e) about the first mean m0 = RN(S(v) /
 * K); with c = RN(S(e) / K) the mean becomes RN(m0 + c) and the variance RN(RN(S(e * e) / K) -
 * RN(c * c)), +0 where that rounds below zero (a NaN stays). Why: m0 alone is S's rounding of the
 * mean, a few ulps off, and a row of equal values (a padding row, a constant tensor) would then
 * normalize to those ulps times rstd ~ 1 / sqrt(eps) instead of exactly 0: y = beta, as torch and
 * TE give; under current scaling such noise sets amax and becomes full-scale codes. For equal
 * values e is the same small multiple of an ulp everywhere, so S(e) = K * e, c = e, m0 + c = v
 * and the variance is 0, all exactly. */
TQ_NORM_HD float tq_norm_mean_fixed(float m0, float sum_e, int64_t k) {
    return tq_nadd(m0, tq_norm_mean(sum_e, k));
}

TQ_NORM_HD float tq_norm_var_fixed(float sum_e, float sum_ee, int64_t k) {
    const float c = tq_norm_mean(sum_e, k);
    const float var = tq_nsub(tq_norm_mean(sum_ee, k), tq_nmul(c, c));
    return var < 0.0f ? 0.0f : var;
}

/* xhat = RN(RN(v - mean) * rstd) (LayerNorm) or RN(v * rstd) (RMSNorm) */
TQ_NORM_HD float tq_norm_xhat(float v, float mean, float rstd, int rms) {
    return rms ? tq_nmul(v, rstd) : tq_nmul(tq_nsub(v, mean), rstd);
}

/* y = RN(RN(xhat * g) + b), or RN(xhat * g) without beta (no add: -0 stays -0) */
TQ_NORM_HD float tq_norm_y(float xhat, float g, float b, int has_beta) {
    const float y = tq_nmul(xhat, g);
    return has_beta ? tq_nadd(y, b) : y;
}

/* dx = RN(RN(dyg - RN(RN(xhat * c1) + c2)) * rstd) (LayerNorm), RN(RN(dyg - RN(xhat * c1)) *
 * rstd) (RMSNorm) */
TQ_NORM_HD float tq_norm_dx(float dyg, float xhat, float c1, float c2, float rstd, int rms) {
    const float t = tq_nmul(xhat, c1);
    return tq_nmul(tq_nsub(dyg, rms ? t : tq_nadd(t, c2)), rstd);
}

/* Backward: the rows per column-partial chunk, R(M, K) (fused.h): the smallest power of two
 * >= R0 with ceil(M / R) <= 1024 and ceil(M / R) * K <= 2^22, or R >= M; R0 = 4 for K <= 1024,
 * else 16. Each chunk is walked row by row by one CTA, so short rows need more, shorter chunks
 * to keep the GPU busy (K = 512, M = 8192: 1024 chunks of 8 rows, not 512 of 16). */
static inline int64_t tq_norm_partial_rows(int64_t rows, int64_t cols) {
    int64_t r = cols <= 1024 ? 4 : 16;
    while (r < rows) {
        const int64_t p = (rows + r - 1) / r;
        if (p <= TQ_NORM_MAX_PARTIALS && p * cols <= TQ_NORM_PARTIAL_ELEMS) break;
        r *= 2;
    }
    return r;
}

static inline int64_t tq_norm_partials(int64_t rows, int64_t cols) {
    const int64_t r = tq_norm_partial_rows(rows, cols);
    return (rows + r - 1) / r;
}

/* FP32 planes of partials: dgamma's, and dbeta's for LayerNorm */
static inline int tq_norm_planes(tq_norm_type norm) { return norm == TQ_NORM_LAYERNORM ? 2 : 1; }

#if !defined(__CUDACC__)
/* S (tequant.h) written plainly, for the C references: v[0..n) into 256 lanes by chunk of 8,
 * each lane in index order onto +0, then the halving fold. lanes: scratch of TQ_NORM_LANES. */
static inline float tq_norm_sum_ref(const float *v, int64_t n, float *lanes) {
    for (int l = 0; l < TQ_NORM_LANES; l++) lanes[l] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const int l = (int)((i / TQ_NORM_CHUNK) % TQ_NORM_LANES);
        lanes[l] = tq_nadd(lanes[l], v[i]);
    }
    for (int s = TQ_NORM_LANES / 2; s >= 1; s /= 2)
        for (int l = 0; l < s; l++) lanes[l] = tq_nadd(lanes[l], lanes[l + s]);
    return lanes[0];
}

/* The sum of column j of partials [p_count][k] in tequant.h's column order: groups of 32
 * consecutive partials, each in order onto +0, then the group sums in order onto +0; canonical
 * NaN. */
static inline float tq_norm_column_sum_ref(const float *partials, int64_t p_count, int64_t k,
                                           int64_t j) {
    float total = 0.0f;
    for (int64_t g0 = 0; g0 < p_count; g0 += TQ_NORM_GROUP) {
        float group = 0.0f;
        for (int64_t p = g0; p < g0 + TQ_NORM_GROUP && p < p_count; p++)
            group = tq_nadd(group, partials[p * k + j]);
        total = tq_nadd(total, group);
    }
    return tq_norm_canon(total);
}

/* Element i of a checked vector argument (n contiguous elements), widened exactly. */
static inline float tq_norm_vec_load(const tq_tensor *t, int64_t i) {
    if (t->dtype == TQ_DTYPE_FLOAT32) return ((const float *)t->data)[i];
    if (t->dtype == TQ_DTYPE_BFLOAT16) return tq_bf16_to_f32(((const uint16_t *)t->data)[i]);
    return tq_f16_to_f32(((const uint16_t *)t->data)[i]);
}
#endif

#endif /* TEQUANT_CORE_INTERNAL_NORM_H_ */
