/* gemm_fp8_block_ref.c: the CPU reference of cuda/gemm_fp8_block.cu (Float8BlockScaling's GEMM,
 * internal_gemm.h's tq_block_gemm on host memory), in the kernel's order: for each 128-wide k
 * block an FP32 sum of code products, then acc = fma(sum, sa * sb, acc) in FP32; then + bias, + out's
 * old value (accumulate), one rounding to out's dtype. The GPU's tensor cores add inside a k
 * block in an order (and with accumulator bits) of their own, so kernel and reference agree to
 * NUMERICS 5's Hopper tolerance, not bit for bit. Slow (scalar C): for tests and debugging.
 * Tests: tests/c/test_gemm_block_ref.c (via tests/test_gemm_fp8_block.py) against a float64
 * product of the decoded operands.
 */
#include <math.h>

#include "internal_gemm.h"
#include "ref_io.h"

static float side_scale(const tq_block_gemm_side *s, int64_t row, int64_t kb) {
    return s->per_row ? s->scale_inv[kb * s->scale_ld + row] : s->scale_inv[(row / 128) * s->scale_ld + kb];
}

tq_status tq_gemm_fp8_block_ref(const tq_block_gemm *g, struct CUstream_st *stream) {
    (void)stream;
    const int64_t m = g->a.rows, n = g->b.rows, k = g->k;
    tq_tensor out = {0};
    out.data = g->out, out.rows = m, out.cols = n, out.ld = g->ldo, out.dtype = (tq_dtype)g->out_dtype;
    tq_tensor bias = {0};
    bias.data = (void *)g->bias, bias.rows = 1, bias.cols = n, bias.ld = n;
    bias.dtype = (tq_dtype)(g->bias != NULL ? g->bias_dtype : TQ_DTYPE_FLOAT32);
    for (int64_t r = 0; r < m; r++) {
        const uint8_t *a = (const uint8_t *)g->a.data + r * g->a.ld;
        for (int64_t c = 0; c < n; c++) {
            const uint8_t *b = (const uint8_t *)g->b.data + c * g->b.ld;
            float acc = 0.0f;
            for (int64_t k0 = 0; k0 < k; k0 += 128) {
                float part = 0.0f;
                for (int64_t i = k0; i < k && i < k0 + 128; i++)
                    part += tq_fp8_to_f32(a[i], g->a.e5m2) * tq_fp8_to_f32(b[i], g->b.e5m2);
                const float s = side_scale(&g->a, r, k0 / 128) * side_scale(&g->b, c, k0 / 128);
                acc = fmaf(part, s, acc); /* one rounding, as the kernel's FMA */
            }
            if (g->bias != NULL) acc += tq_ref_load(&bias, 0, c);
            if (g->accumulate) acc += tq_ref_load(&out, r, c);
            tq_ref_store(&out, r, c, acc);
        }
    }
    return TQ_SUCCESS;
}
