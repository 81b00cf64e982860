/* test_gemm_block_ref.c: csrc/ref/gemm_fp8_block_ref.c (the CPU reference of the Hopper
 * block-scaled FP8 GEMM) against a float64 product of the decoded operands: 1x128 x 128x128,
 * 1x128 x 1x128 and 128x128 x 1x128 scales, E4M3 and E5M2 codes, K with a partial last block,
 * M and N off every multiple, FP32 / BF16 / FP16 outputs, bias and accumulate. Codes and
 * scales come from a fixed-seed generator; the decode here is its own (bit fields), not
 * formats.h's. Linked with every csrc/core and csrc/ref source (no CUDA) by
 * tests/test_gemm_fp8_block.py; prints "N passed, M failed" last.
 */
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "internal_gemm.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

/* A finite code of either format with |value| <= 2 (exponent field below the bias + 1). */
static uint8_t random_code(int e5m2) {
    const uint32_t h = next_u32();
    (void)e5m2; /* 0x3F: exponent field at most the bias in both formats */
    return (uint8_t)((h & 0x3Fu) | (h & 0x80u));
}

static double decode(uint8_t c, int e5m2) {
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const int e = (c & 0x7F) >> mbits, m = c & ((1 << mbits) - 1);
    const double v = e == 0 ? ldexp((double)m, 1 - bias - mbits) : ldexp(1.0 + ldexp(m, -mbits), e - bias);
    return (c & 0x80) ? -v : v;
}

static double half_value(uint16_t h, int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? ldexp(m, -24) : ldexp(1.0 + m / 1024.0, e - 15);
    return (h & 0x8000) ? -v : v;
}

typedef struct side_buf {
    tq_block_gemm_side side;
    uint8_t *codes;
    float *scales;
} side_buf;

static side_buf make_side(int64_t rows, int64_t k, int per_row, int e5m2) {
    side_buf s;
    const int64_t kb = (k + 127) / 128, pad = per_row ? (rows + 3) / 4 * 4 : (kb + 3) / 4 * 4;
    const int64_t entries = per_row ? kb * pad : ((rows + 127) / 128) * pad;
    s.codes = malloc((size_t)(rows * k));
    s.scales = calloc((size_t)entries, sizeof(float));
    for (int64_t i = 0; i < rows * k; i++) s.codes[i] = random_code(e5m2);
    for (int64_t i = 0; i < entries; i++) s.scales[i] = ldexpf(1.0f, (int)(next_u32() % 9) - 4);
    s.side.data = s.codes, s.side.rows = rows, s.side.ld = k, s.side.scale_inv = s.scales;
    s.side.scale_ld = pad, s.side.per_row = per_row, s.side.e5m2 = e5m2;
    return s;
}

static double scale_at(const tq_block_gemm_side *s, int64_t row, int64_t kb) {
    return s->per_row ? s->scale_inv[kb * s->scale_ld + row] : s->scale_inv[(row / 128) * s->scale_ld + kb];
}

static double out_value(const void *out, int dtype, int64_t i) {
    if (dtype == TQ_DTYPE_FLOAT32) return ((const float *)out)[i];
    return half_value(((const uint16_t *)out)[i], dtype == TQ_DTYPE_BFLOAT16);
}

/* One case: relative Frobenius error of the reference against float64 below `tol`. */
static void run_case(int64_t m, int64_t n, int64_t k, int a_per_row, int b_per_row, int a_e5m2,
                     int out_dtype, int with_bias, int accumulate) {
    side_buf a = make_side(m, k, a_per_row, a_e5m2), b = make_side(n, k, b_per_row, 0);
    const int elem = out_dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    void *out = calloc((size_t)(m * n), (size_t)elem);
    double *old = calloc((size_t)(m * n), sizeof(double));
    float bias[512];
    for (int64_t c = 0; c < n; c++) bias[c] = with_bias ? (float)(next_u32() % 17) - 8.0f : 0.0f;
    if (accumulate)
        for (int64_t i = 0; i < m * n; i++) {
            const float v = (float)(next_u32() % 33) - 16.0f; /* exact in every output dtype */
            if (out_dtype == TQ_DTYPE_FLOAT32) ((float *)out)[i] = v;
            else {
                /* small integers: bf16 is the top half of the fp32 bits; fp16 by its fields */
                uint32_t bits;
                memcpy(&bits, &v, 4);
                uint16_t h;
                if (out_dtype == TQ_DTYPE_BFLOAT16) h = (uint16_t)(bits >> 16);
                else if (v == 0.0f) h = 0;
                else {
                    const int e = (int)((bits >> 23) & 255) - 127;
                    h = (uint16_t)(((bits >> 16) & 0x8000) | ((e + 15) << 10) | ((bits >> 13) & 1023));
                }
                ((uint16_t *)out)[i] = h;
            }
            old[i] = v;
        }
    tq_block_gemm g;
    memset(&g, 0, sizeof g);
    g.device = TQ_DEVICE_CPU, g.a = a.side, g.b = b.side, g.k = k, g.out = out, g.ldo = n;
    g.out_dtype = out_dtype, g.bias = with_bias ? bias : NULL, g.bias_dtype = TQ_DTYPE_FLOAT32;
    g.accumulate = accumulate;
    CHECK(tq_gemm_fp8_block_ref(&g, NULL) == TQ_SUCCESS);
    double dd = 0.0, rr = 0.0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) {
            double want = 0.0;
            for (int64_t i = 0; i < k; i++)
                want += decode(a.codes[r * k + i], a_e5m2) * decode(b.codes[c * k + i], 0)
                        * scale_at(&a.side, r, i / 128) * scale_at(&b.side, c, i / 128);
            want += bias[c] + old[r * n + c];
            const double got = out_value(out, out_dtype, r * n + c);
            dd += (got - want) * (got - want), rr += want * want;
        }
    const double err = sqrt(dd / (rr > 0 ? rr : 1.0));
    const double tol = out_dtype == TQ_DTYPE_FLOAT32 ? 1e-5 : 8e-3;
    char what[160];
    snprintf(what, sizeof what, "[%lld, %lld, %lld] a %s b %s%s out %d bias %d acc %d: error %.3g",
             (long long)m, (long long)n, (long long)k, a_per_row ? "1x128" : "128x128",
             b_per_row ? "1x128" : "128x128", a_e5m2 ? " (a E5M2)" : "", out_dtype, with_bias,
             accumulate, err);
    check_at(err < tol && err > 0.0 ? 1 : (err == 0.0 && out_dtype == TQ_DTYPE_FLOAT32), what,
             __FILE__, __LINE__);
    free(a.codes), free(a.scales), free(b.codes), free(b.scales), free(out), free(old);
}

int main(void) {
    const int dtypes[3] = {TQ_DTYPE_FLOAT32, TQ_DTYPE_BFLOAT16, TQ_DTYPE_FLOAT16};
    for (int d = 0; d < 3; d++) {
        run_case(37, 24, 400, 1, 0, 0, dtypes[d], 0, 0);   /* fprop / dgrad: 1x128 x 128x128 */
        run_case(130, 136, 272, 1, 1, 0, dtypes[d], 1, 0); /* wgrad: 1x128 x 1x128 */
        run_case(200, 8, 144, 0, 1, 0, dtypes[d], 0, 1);   /* 128x128 x 1x128 */
        run_case(9, 264, 528, 1, 1, 1, dtypes[d], 1, 1);   /* E5M2 gradients (HYBRID) */
    }
    run_case(1, 8, 16, 1, 1, 0, TQ_DTYPE_FLOAT32, 0, 0);
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
