/* act_forward_ref.c: CPU reference of tq_act_forward (gelu, relu, silu, qgelu, srelu and the gated
 * geglu, reglu, swiglu of h, optionally with the per-tensor FP8 codes of the output written in
 * the same pass).
 *
 * Plain loops on purpose: the oracle that cuda/act_forward.cu is checked against bit for bit.
 * Each element's value is internal_act.h's (tq_act_value, the same code the kernel runs); the
 * outputs follow norm_forward_ref.c: y_hp = RNE of the canonical FP32 value, amax its max |.|
 * max-accumulated into the slot, codes cvt8(tq_mul(y, scale)); y_q_t, when given, the same codes
 * transposed.
 * With a BLOCK or MXFP8 config, act(h) in h's dtype goes through that quantizer's reference.
 * Tests: tests/test_act_kernels.py (against torch's float32 activations and te.ops.quantize;
 * CUDA against this), tests/test_act_block.py, tests/test_act_mxfp8.py (the block formats).
 */
#include "internal_act.h"
#include "internal_fused.h"
#include "internal_kernels.h"
#include "ref_io.h"

tq_status tq_act_forward_ref(const tq_tensor *h, const tq_act_forward_args *a,
                             struct CUstream_st *stream) {
    (void)stream;
    const int gated = tq_act_gated(a->act), base = tq_act_base(a->act);
    const int64_t m_rows = h->rows, n = gated ? h->cols / 2 : h->cols;
    const int quantize = a->config != NULL;
    const int e5m2 = quantize && a->config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const float scale = quantize ? tq_fused_cast_scale(a->config, &a->scale, &a->amax_in) : 1.0f;
    if (quantize) *(float *)a->scale_inv.data = tq_rcp(scale);
    float amax = 0.0f;
    uint8_t *y_q = (uint8_t *)a->y_q.data;
    for (int64_t r = 0; r < m_rows; r++) {
        for (int64_t j = 0; j < n; j++) {
            float y = tq_act_value(base, tq_ref_load(h, r, j));
            if (gated) y = tq_nmul(y, tq_ref_load(h, r, n + j));
            amax = tq_amax_step(amax, y);
            if (a->y_hp.data != NULL) tq_ref_store((tq_tensor *)&a->y_hp, r, j, tq_norm_canon(y));
            if (quantize) y_q[r * a->y_q.ld + j] = tq_f32_to_fp8(tq_mul(y, scale), e5m2);
        }
    }
    if (a->y_q_t.data != NULL) { /* the columnwise copy: the same codes, transposed */
        tq_tensor y_q_t = a->y_q_t;
        tq_transpose_ref(&a->y_q, &y_q_t, NULL);
    }
    if (a->amax.data != NULL) tq_fused_max_accumulate((float *)a->amax.data, amax);
    return TQ_SUCCESS;
}

/* A block-format config: y_hp's values (act(h) rounded to h's dtype after the canonical NaN) in
 * a zero-padded [q->rows, N] copy of h's dtype, then that format's quantizer reference on it
 * (block_format_ref.c):
 * the definition the kernels (cuda/act_quantize_block.cu, cuda/act_quantize_mxfp8.cu) are
 * checked against. */
static tq_status block_format_ref(const tq_tensor *h, const tq_act_forward_args *a,
                                  struct CUstream_st *stream) {
    const int gated = tq_act_gated(a->act), base = tq_act_base(a->act);
    tq_qtensor *q = a->q;
    const int64_t n = q->cols;
    tq_tensor y;
    const tq_status st = tq_block_format_values("act forward", "act(h)", q->rows, n, h->dtype, &y);
    if (st != TQ_SUCCESS) return st;
    for (int64_t r = 0; r < h->rows; r++) {
        for (int64_t j = 0; j < n; j++) {
            float v = tq_act_value(base, tq_ref_load(h, r, j));
            if (gated) v = tq_nmul(v, tq_ref_load(h, r, n + j));
            tq_ref_store(&y, r, j, tq_norm_canon(v));
        }
    }
    (void)stream;
    return tq_block_format_ref(&y, a->config, q);
}

tq_status tq_act_forward_block_ref(const tq_tensor *h, const tq_act_forward_args *a,
                                   struct CUstream_st *stream) {
    return block_format_ref(h, a, stream);
}

tq_status tq_act_forward_mxfp8_ref(const tq_tensor *h, const tq_act_forward_args *a,
                                   struct CUstream_st *stream) {
    return block_format_ref(h, a, stream);
}
