/* norm_forward_ref.c: CPU reference of tq_norm_forward (LayerNorm / RMSNorm, optionally with
 * the per-tensor FP8 codes of the output written in the same pass).
 *
 * Plain loops on purpose: this is the oracle that cuda/norm_forward.cu is checked against bit
 * for bit. The row sums follow tequant.h's order S (tq_norm_sum_ref, internal_norm.h: chunks of
 * 8 into 256 lanes, each lane in index order, then a halving fold), which the kernel schedules
 * over its threads without changing; every other step is one of internal_norm.h's RN helpers.
 * The cast is tq_quantize's (quantize_fp8_ref.c): cvt8(tq_mul(y, scale)); y_q_t, when given, holds
 * the same codes transposed.
 * Tests: tests/test_norm_kernels.py (against torch's layer_norm / rms_norm and te.ops.quantize;
 * CUDA against this).
 */
#include <stdlib.h>

#include "internal_fused.h"
#include "internal_kernels.h"
#include "internal_norm.h"
#include "ref_io.h"

tq_status tq_norm_forward_ref(const tq_tensor *x, const tq_norm_forward_args *a,
                              struct CUstream_st *stream) {
    (void)stream;
    const int64_t m_rows = x->rows, k = x->cols;
    const int rms = a->norm == TQ_NORM_RMSNORM;
    const int zc = (a->flags & TQ_NORM_ZERO_CENTERED_GAMMA) != 0;
    const int has_beta = a->beta.data != NULL;
    const int quantize = a->config != NULL;
    const int e5m2 = quantize && a->config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const float scale = quantize ? tq_fused_cast_scale(a->config, &a->scale, &a->amax_in) : 1.0f;
    if (quantize) *(float *)a->scale_inv.data = tq_rcp(scale);

    float *v = malloc((size_t)k * sizeof(float)), *t = malloc((size_t)k * sizeof(float));
    float *g = malloc((size_t)k * sizeof(float)), *b = malloc((size_t)k * sizeof(float));
    float *e = malloc((size_t)k * sizeof(float));
    float lanes[TQ_NORM_LANES];
    if (v == NULL || t == NULL || g == NULL || b == NULL || e == NULL) {
        free(v), free(t), free(g), free(b), free(e);
        return tq_fail(TQ_ERROR_OUT_OF_MEMORY, "norm forward (CPU): no memory for rows of %lld "
                       "floats", (long long)k);
    }
    for (int64_t i = 0; i < k; i++) {
        g[i] = tq_norm_gamma(tq_norm_vec_load(&a->gamma, i), zc);
        b[i] = has_beta ? tq_norm_vec_load(&a->beta, i) : 0.0f;
    }
    float amax = 0.0f;
    uint8_t *y_q = (uint8_t *)a->y_q.data;
    for (int64_t r = 0; r < m_rows; r++) {
        for (int64_t i = 0; i < k; i++) v[i] = tq_ref_load(x, r, i);
        float mean = 0.0f, rstd;
        if (!rms) {
            const float m0 = tq_norm_mean(tq_norm_sum_ref(v, k, lanes), k);
            for (int64_t i = 0; i < k; i++) {
                e[i] = tq_nsub(v[i], m0);
                t[i] = tq_nmul(e[i], e[i]);
            }
            const float sum_e = tq_norm_sum_ref(e, k, lanes);
            const float sum_ee = tq_norm_sum_ref(t, k, lanes);
            mean = tq_norm_mean_fixed(m0, sum_e, k);
            rstd = tq_norm_rstd_of_var(tq_norm_var_fixed(sum_e, sum_ee, k), a->eps);
        } else {
            for (int64_t i = 0; i < k; i++) t[i] = tq_nmul(v[i], v[i]);
            rstd = tq_norm_rstd(tq_norm_sum_ref(t, k, lanes), k, a->eps);
        }
        if (a->mean.data != NULL) ((float *)a->mean.data)[r] = tq_norm_canon(mean);
        if (a->rstd.data != NULL) ((float *)a->rstd.data)[r] = tq_norm_canon(rstd);
        for (int64_t i = 0; i < k; i++) {
            const float y = tq_norm_y(tq_norm_xhat(v[i], mean, rstd, rms), g[i], b[i], has_beta);
            amax = tq_amax_step(amax, y);
            if (a->y_hp.data != NULL) tq_ref_store((tq_tensor *)&a->y_hp, r, i, tq_norm_canon(y));
            if (quantize) y_q[r * a->y_q.ld + i] = tq_f32_to_fp8(tq_mul(y, scale), e5m2);
        }
    }
    if (a->y_q_t.data != NULL) { /* the columnwise copy: the same codes, transposed */
        tq_tensor y_q_t = a->y_q_t;
        tq_transpose_ref(&a->y_q, &y_q_t, NULL);
    }
    if (a->amax.data != NULL) tq_fused_max_accumulate((float *)a->amax.data, amax);
    free(v), free(t), free(g), free(b), free(e);
    return TQ_SUCCESS;
}
