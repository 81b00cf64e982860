/* internal_act.h: the arithmetic of tq_act_forward / tq_act_backward, written once for the C
 * references (csrc/ref/act_forward_ref.c, act_backward_ref.c) and the kernels (cuda/act_forward.cu,
 * act_backward.cu), so both produce the same bits. tequant.h states the formulas; this file is
 * them, step by step.
 *
 * Neither libm's nor CUDA's exp / tanh / sigmoid appear: they differ from each other in the last
 * bits. The one transcendental, tq_act_exp, is built from single IEEE operations that round the
 * same on both sides: RN add / multiply / divide (internal_norm.h's tq_nadd ... tq_ndiv: the _rn
 * intrinsics on the device, plain C operators on the host with -ffp-contract=off) and the fused
 * multiply-add tq_nfma (__fmaf_rn / C99 fmaf, both correctly rounded). Selects and bit
 * operations are exact. Subnormals are kept on both sides (no -ftz, no --use_fast_math).
 * Accuracy against float64 and against torch's float32 activations: tests/test_act_kernels.py
 * measures it (docs in tequant.h). Tests: tests/test_act_kernels.py.
 */
#ifndef TEQUANT_CORE_INTERNAL_ACT_H_
#define TEQUANT_CORE_INTERNAL_ACT_H_

#include "internal_norm.h" /* RN primitives, tq_norm_canon, the column order of dbias */
#include "tequant/formats.h"
#include "tequant/tequant.h"

/* exp: x = k ln2 + r (Cody-Waite: the first fma is exact), e^r - 1 by Taylor to r^8 (|r| <=
 * ln2 / 2: truncation below 1e-9 relative), scaled by 2^k in two exact halves. */
#define TQ_ACT_L2E 0x1.715476p+0f     /* RN(1 / ln 2) */
#define TQ_ACT_LN2_HI 0x1.62e430p-1f  /* RN(ln 2) */
#define TQ_ACT_LN2_LO -0x1.05c610p-29f /* RN(ln 2 - LN2_HI) */
#define TQ_ACT_RINT 0x1.8p23f         /* 1.5 * 2^23: adding it rounds to an integer (RNE) */

/* TE's constants (transformer_engine/common/util/math.h): gelu's sqrt(2/pi) and sqrt(2/pi) *
 * 0.044715, dgelu's 3 * that, qgelu's alpha. */
#define TQ_ACT_GELU_C1 0x1.988454p-1f  /* 0.79788456f */
#define TQ_ACT_GELU_C2 0x1.2444f4p-5f  /* 0.03567741f */
#define TQ_ACT_GELU_C3 0x1.b6676cp-4f  /* 0.1070322243f */
#define TQ_ACT_QGELU_ALPHA 0x1.b3b646p+0f /* 1.702f */

/* Whether act is a gated one (geglu, reglu, swiglu: h = [first | second]), and the activation
 * it applies to the first half (gelu, relu, silu); the others are their own base. */
TQ_HD int tq_act_gated(int act) {
    return act == TQ_ACT_GEGLU || act == TQ_ACT_REGLU || act == TQ_ACT_SWIGLU;
}
TQ_HD int tq_act_base(int act) {
    return act == TQ_ACT_GEGLU ? TQ_ACT_GELU
           : act == TQ_ACT_REGLU ? TQ_ACT_RELU
           : act == TQ_ACT_SWIGLU ? TQ_ACT_SILU : act;
}

/* 2^k for -126 <= k <= 127, from its bits. */
TQ_HD float tq_act_pow2(int32_t k) { return tq_f32_from_bits(((uint32_t)k + 127u) << 23); }

/* E(x), tequant's e^x: +Inf from x > 88.72 (at x >= 89 without computing), 0 below -103.97,
 * subnormals in between, NaN for NaN (the compares let it through; its k is garbage but every
 * step keeps the NaN). */
TQ_HD float tq_act_exp(float x) {
    const float xc = x > 89.0f ? 89.0f : (x < -104.0f ? -104.0f : x);
    const float big = tq_nadd(tq_nmul(xc, TQ_ACT_L2E), TQ_ACT_RINT); /* 1.5 * 2^23 + k */
    const float kf = tq_nsub(big, TQ_ACT_RINT);
    const int32_t k = (int32_t)(tq_f32_bits(big) - 0x4B400000u);   /* -150 <= k <= 128 */
    float r = tq_nfma(-kf, TQ_ACT_LN2_HI, xc);
    r = tq_nfma(-kf, TQ_ACT_LN2_LO, r);
    float p = 0x1.a01a02p-16f;             /* 1/8! */
    p = tq_nfma(p, r, 0x1.a01a02p-13f);    /* 1/7! */
    p = tq_nfma(p, r, 0x1.6c16c2p-10f);    /* 1/6! */
    p = tq_nfma(p, r, 0x1.111112p-7f);     /* 1/5! */
    p = tq_nfma(p, r, 0x1.555556p-5f);     /* 1/4! */
    p = tq_nfma(p, r, 0x1.555556p-3f);     /* 1/3! */
    p = tq_nfma(p, r, 0.5f);               /* 1/2! */
    const float q = tq_nfma(tq_nmul(r, r), p, r); /* e^r - 1 */
    const int32_t k1 = k / 2, k2 = k - k1; /* both in [-75, 64]: 2^k1, 2^k2 are normal */
    const float s1 = tq_act_pow2(k1);
    return tq_nmul(tq_nfma(q, s1, s1), tq_act_pow2(k2)); /* RN(2^k1 (1 + q)), then exact but
                                                            for overflow and subnormals */
}

/* The sigmoid's argument z of each sigmoid-based activation: act(x) = x * sigmoid(z):
 * gelu's tanh form x * (0.5 + 0.5 tanh(u)), u = x (C1 + C2 x^2), is x * sigmoid(2u), without
 * the cancellation of 1 + tanh(u) for negative x; qgelu's z = 1.702 x; silu's z = x. */
TQ_HD float tq_act_z(int base, float x) {
    if (base == TQ_ACT_GELU)
        return tq_nmul(x, tq_nfma(2.0f * TQ_ACT_GELU_C2, tq_nmul(x, x), 2.0f * TQ_ACT_GELU_C1));
    if (base == TQ_ACT_QGELU) return tq_nmul(TQ_ACT_QGELU_ALPHA, x);
    return x;
}

/* relu as torch's on the CPU: x < 0 gives +0, any other x itself (-0 and NaN kept). The test is
 * on the bits (negative, non-zero, not NaN): the float select `x < 0 ? 0 : x` came out of the
 * GPU compiler as +0 for -0 in act_quantize_block.cu's float32 loader (a max, presumably). */
TQ_HD float tq_act_relu(float x) {
    const uint32_t b = tq_f32_bits(x);
    return b > 0x80000000u && b <= 0xFF800000u ? 0.0f : x;
}

/* act(x) of a base activation: x / RN(1 + E(-z)) for gelu, silu, qgelu (one rounding after the
 * sum, as torch's silu); relu; srelu = RN(relu(x)^2); identity x. */
TQ_HD float tq_act_value(int base, float x) {
    if (base == TQ_ACT_IDENTITY) return x;
    if (base == TQ_ACT_RELU) return tq_act_relu(x);
    if (base == TQ_ACT_SRELU) {
        const float r = tq_act_relu(x);
        return tq_nmul(r, r);
    }
    return tq_ndiv(x, tq_nadd(1.0f, tq_act_exp(-tq_act_z(base, x))));
}

/* act'(x) of a sigmoid-family base (gelu, silu, qgelu) as tq_act_grad multiplies g by it, and
 * act(x) into *value: both depend on x alone, so a kernel may read them from a table of every
 * 16-bit x (cuda/act_table.cuh) and give the same bits. With e = E(-z), d = RN(1 + e),
 * s = RN(1 / d) and 1 - s as RN(e * s) for z >= 0 (no cancellation) or RN(1 - s) below:
 * fma(slope, RN(s * (1 - s)), s), slope = x (silu), z (qgelu),
 * RN(RN(2x) * fma(C3, RN(x^2), C1)) (gelu: s + 2x s (1 - s) (C1 + 3 C2 x^2)). */
TQ_HD float tq_act_deriv(int base, float x, float *value) {
    const float z = tq_act_z(base, x);
    const float e = tq_act_exp(-z);
    const float d = tq_nadd(1.0f, e);
    const float s = tq_ndiv(1.0f, d);
    const float one_minus_s = z >= 0.0f ? tq_nmul(e, s) : tq_nsub(1.0f, s);
    const float slope = base == TQ_ACT_SILU ? x
                        : base == TQ_ACT_QGELU
                            ? z
                            : tq_nmul(tq_nadd(x, x),
                                      tq_nfma(TQ_ACT_GELU_C3, tq_nmul(x, x), TQ_ACT_GELU_C1));
    *value = tq_ndiv(x, d);
    return tq_nfma(slope, tq_nmul(s, one_minus_s), s);
}

/* RN(g * act'(x)), the gradient through act of the incoming g, and act(x) into *value (the
 * same bits as tq_act_value). Sigmoid family: RN(g * tq_act_deriv(x)).
 * relu: g where x > 0, +0 where x <= 0; srelu: RN(g * 2x) where x > 0, +0 where x <= 0 (torch's
 * select, not a multiply by 0: no -0, no NaN from an infinite g); a NaN x gives NaN. identity:
 * g itself. */
TQ_HD float tq_act_grad(int base, float x, float g, float *value) {
    if (base == TQ_ACT_IDENTITY) {
        *value = x;
        return g;
    }
    if (base == TQ_ACT_RELU || base == TQ_ACT_SRELU) {
        const float r = tq_act_relu(x);
        const int srelu = base == TQ_ACT_SRELU;
        *value = srelu ? tq_nmul(r, r) : r;
        if (x > 0.0f) return srelu ? tq_nmul(g, tq_nadd(x, x)) : g;
        return x <= 0.0f ? 0.0f : x;
    }
    return tq_nmul(g, tq_act_deriv(base, x, value));
}

#endif /* TEQUANT_CORE_INTERNAL_ACT_H_ */
