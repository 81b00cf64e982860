/* norm_backward_ref.c: CPU reference of tq_norm_backward (dx, dgamma, dbeta of LayerNorm /
 * RMSNorm from the forward's saved mean and rstd).
 *
 * Plain loops on purpose: the oracle of cuda/norm_backward.cu, bit for bit. Row sums follow
 * tequant.h's order S (tq_norm_sum_ref); the column sums follow its fixed chunk order: rows in
 * chunks of R(M, K) (tq_norm_partial_rows), each chunk's partial added row by row into the
 * workspace, partials summed in groups of 32 chunks, the group sums in order. The kernel keeps
 * the same partials in the same workspace layout ([plane][chunk][K] FP32).
 * Tests: tests/test_norm_kernels.py (against torch autograd of layer_norm / rms_norm; CUDA
 * against this).
 */
#include <stdlib.h>

#include "internal_kernels.h"
#include "internal_norm.h"
#include "ref_io.h"

tq_status tq_norm_backward_ref(const tq_tensor *dy, const tq_tensor *x,
                               const tq_norm_backward_args *a, struct CUstream_st *stream) {
    (void)stream;
    const int64_t m_rows = x->rows, k = x->cols;
    const int rms = a->norm == TQ_NORM_RMSNORM;
    const int zc = (a->flags & TQ_NORM_ZERO_CENTERED_GAMMA) != 0;
    const int want_dbeta = a->dbeta.data != NULL;
    const int64_t r_chunk = tq_norm_partial_rows(m_rows, k);
    const int64_t p_count = m_rows == 0 ? 0 : (m_rows + r_chunk - 1) / r_chunk;
    float *partial_g = (float *)a->workspace.data;
    float *partial_b = rms ? NULL : partial_g + p_count * k; /* LayerNorm's second plane */

    float *g = malloc((size_t)k * sizeof(float)), *xhat = malloc((size_t)k * sizeof(float));
    float *dyv = malloc((size_t)k * sizeof(float)), *dyg = malloc((size_t)k * sizeof(float));
    float *prod = malloc((size_t)k * sizeof(float));
    float lanes[TQ_NORM_LANES];
    if (g == NULL || xhat == NULL || dyv == NULL || dyg == NULL || prod == NULL) {
        free(g), free(xhat), free(dyv), free(dyg), free(prod);
        return tq_fail(TQ_ERROR_OUT_OF_MEMORY, "norm backward (CPU): no memory for rows of %lld "
                       "floats", (long long)k);
    }
    for (int64_t i = 0; i < k; i++) g[i] = tq_norm_gamma(tq_norm_vec_load(&a->gamma, i), zc);

    for (int64_t p = 0; p < p_count; p++) {
        float *pg = partial_g + p * k, *pb = rms ? NULL : partial_b + p * k;
        for (int64_t i = 0; i < k; i++) {
            pg[i] = 0.0f;
            if (!rms) pb[i] = 0.0f;
        }
        const int64_t r_end = (p + 1) * r_chunk < m_rows ? (p + 1) * r_chunk : m_rows;
        for (int64_t r = p * r_chunk; r < r_end; r++) {
            const float mean = rms ? 0.0f : ((const float *)a->mean.data)[r];
            const float rstd = ((const float *)a->rstd.data)[r];
            for (int64_t i = 0; i < k; i++) {
                dyv[i] = tq_ref_load(dy, r, i);
                xhat[i] = tq_norm_xhat(tq_ref_load(x, r, i), mean, rstd, rms);
                dyg[i] = tq_nmul(dyv[i], g[i]);
                prod[i] = tq_nmul(dyg[i], xhat[i]);
                pg[i] = tq_nadd(pg[i], tq_nmul(dyv[i], xhat[i]));
                if (!rms) pb[i] = tq_nadd(pb[i], dyv[i]);
            }
            const float c1 = tq_norm_mean(tq_norm_sum_ref(prod, k, lanes), k);
            const float c2 = rms ? 0.0f : tq_norm_mean(tq_norm_sum_ref(dyg, k, lanes), k);
            for (int64_t i = 0; i < k; i++)
                tq_ref_store((tq_tensor *)&a->dx, r, i,
                             tq_norm_canon(tq_norm_dx(dyg[i], xhat[i], c1, c2, rstd, rms)));
        }
    }
    tq_tensor dgamma = {a->dgamma.data, 1, k, k, a->dgamma.dtype, a->dgamma.device}; /* [1, K] */
    tq_tensor dbeta = {a->dbeta.data, 1, k, k, a->dbeta.dtype, a->dbeta.device};
    for (int64_t j = 0; j < k; j++) {
        tq_ref_store(&dgamma, 0, j, tq_norm_column_sum_ref(partial_g, p_count, k, j));
        if (want_dbeta)
            tq_ref_store(&dbeta, 0, j, tq_norm_column_sum_ref(partial_b, p_count, k, j));
    }
    free(g), free(xhat), free(dyv), free(dyg), free(prod);
    return TQ_SUCCESS;
}
