/* act_backward_ref.c: CPU reference of tq_act_backward: dh = dy * act'(h) (gated: both halves),
 * with, each optional, h's-dtype dh, its amax, its per-tensor FP8 codes (rowwise, and columnwise:
 * their transpose) and dbias.
 *
 * Plain loops on purpose: the oracle of cuda/act_backward.cu, bit for bit. The per-element steps
 * are internal_act.h's tq_act_grad (the kernel runs the same code); dbias follows tequant.h's
 * column order: rows in chunks of R(M, K) (tq_norm_partial_rows), each chunk's partial added row
 * by row into the workspace ([chunk][K] FP32, the kernel's layout), then
 * tq_norm_column_sum_ref (groups of 32 chunks, the group sums in order), rounded once to dbias's
 * dtype. TQ_ACT_IDENTITY reads no h (dh = dy). With a BLOCK or MXFP8 config, dh in h's dtype
 * goes through that quantizer's reference.
 * Tests: tests/test_act_kernels.py (against torch autograd of the float32 activations; CUDA
 * against this), tests/test_act_grad_block.py (the block formats).
 */
#include "internal_act.h"
#include "internal_amax_update.h"
#include "internal_fused.h"
#include "internal_kernels.h"
#include "ref_io.h"

/* The FP32 dh of row r, column j (j < n; gated: j of each half into dh[0], dh[1]). */
static void dh_elems(const tq_tensor *dy, const tq_tensor *h, int base, int gated, int64_t n,
                     int64_t r, int64_t j, float dh[2]) {
    const float g = tq_ref_load(dy, r, j);
    float value;
    if (base == TQ_ACT_IDENTITY) { /* h is not read */
        dh[0] = g;
        return;
    }
    if (!gated) {
        dh[0] = tq_act_grad(base, tq_ref_load(h, r, j), g, &value);
        return;
    }
    const float second = tq_ref_load(h, r, n + j);
    dh[0] = tq_act_grad(base, tq_ref_load(h, r, j), tq_nmul(g, second), &value);
    dh[1] = tq_nmul(g, value);
}

tq_status tq_act_backward_ref(const tq_tensor *dy, const tq_tensor *h,
                              const tq_act_backward_args *a, struct CUstream_st *stream) {
    (void)stream;
    const int gated = tq_act_gated(a->act), base = tq_act_base(a->act);
    const int64_t m_rows = h->rows, k = h->cols, n = gated ? k / 2 : k;
    const int quantize = a->config != NULL;
    const int e5m2 = quantize && a->config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const float scale = quantize ? tq_fused_cast_scale(a->config, &a->scale, &a->amax_in) : 1.0f;
    if (quantize) *(float *)a->scale_inv.data = tq_rcp(scale);
    const int want_dbias = a->dbias.data != NULL;
    const int64_t r_chunk = tq_norm_partial_rows(m_rows, k);
    const int64_t p_count = m_rows == 0 ? 0 : (m_rows + r_chunk - 1) / r_chunk;
    float *partials = want_dbias ? (float *)a->workspace.data : NULL;
    uint8_t *dh_q = (uint8_t *)a->dh_q.data, *dh_q_t = (uint8_t *)a->dh_q_t.data;
    float amax = 0.0f;
    for (int64_t p = 0; p < p_count; p++) {
        float *part = want_dbias ? partials + p * k : NULL;
        for (int64_t c = 0; want_dbias && c < k; c++) part[c] = 0.0f;
        const int64_t r_end = (p + 1) * r_chunk < m_rows ? (p + 1) * r_chunk : m_rows;
        for (int64_t r = p * r_chunk; r < r_end; r++) {
            for (int64_t j = 0; j < n; j++) {
                float dh[2] = {0.0f, 0.0f};
                dh_elems(dy, h, base, gated, n, r, j, dh);
                for (int half = 0; half <= gated; half++) {
                    const int64_t c = j + half * n;
                    const float v = dh[half];
                    amax = tq_amax_step(amax, v);
                    if (want_dbias) part[c] = tq_nadd(part[c], v);
                    if (a->dh.data != NULL)
                        tq_ref_store((tq_tensor *)&a->dh, r, c, tq_norm_canon(v));
                    if (!quantize) continue;
                    const uint8_t code = tq_f32_to_fp8(tq_mul(v, scale), e5m2);
                    dh_q[r * a->dh_q.ld + c] = code;
                    if (dh_q_t != NULL) dh_q_t[c * a->dh_q_t.ld + r] = code;
                }
            }
        }
    }
    tq_tensor dbias = {a->dbias.data, 1, k, k, a->dbias.dtype, a->dbias.device}; /* [1, K] */
    for (int64_t j = 0; want_dbias && j < k; j++)
        tq_ref_store(&dbias, 0, j, tq_norm_column_sum_ref(partials, p_count, k, j));
    if (a->amax.data != NULL) tq_fused_max_accumulate((float *)a->amax.data, amax);
    /* the update of the slot amax accumulated into, after the pass as on CUDA */
    return a->update == NULL ? TQ_SUCCESS : tq_amax_update_ref(a->update, 1, a->update_args, NULL);
}

/* A block-format config: dh's values (the FP32 dh rounded to h's dtype after the canonical NaN:
 * the bits of the dh output) in a zero-padded [q->rows, K] copy of h's dtype, then that format's
 * quantizer reference on it (block_format_ref.c): the definition the kernels
 * (cuda/act_quantize_block.cu, cuda/act_quantize_mxfp8.cu) are checked against. */
static tq_status block_format_ref(const tq_tensor *dy, const tq_tensor *h,
                                  const tq_act_backward_args *a) {
    const int gated = tq_act_gated(a->act), base = tq_act_base(a->act);
    tq_qtensor *q = a->q;
    const int64_t k = h->cols, n = gated ? k / 2 : k;
    tq_tensor d;
    const tq_status st = tq_block_format_values("act backward", "dh", q->rows, k, h->dtype, &d);
    if (st != TQ_SUCCESS) return st;
    for (int64_t r = 0; r < h->rows; r++) {
        for (int64_t j = 0; j < n; j++) {
            float dh[2] = {0.0f, 0.0f};
            dh_elems(dy, h, base, gated, n, r, j, dh);
            for (int half = 0; half <= gated; half++)
                tq_ref_store(&d, r, j + half * n, tq_norm_canon(dh[half]));
        }
    }
    return tq_block_format_ref(&d, a->config, q);
}

tq_status tq_act_backward_block_ref(const tq_tensor *dy, const tq_tensor *h,
                                    const tq_act_backward_args *a, struct CUstream_st *stream) {
    (void)stream;
    return block_format_ref(dy, h, a);
}

tq_status tq_act_backward_mxfp8_ref(const tq_tensor *dy, const tq_tensor *h,
                                    const tq_act_backward_args *a, struct CUstream_st *stream) {
    (void)stream;
    return block_format_ref(dy, h, a);
}
