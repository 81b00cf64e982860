/* quantize_fp8_ref.c: CPU reference of the FP8 per-tensor quantizers (DELAYED and CURRENT
 * scaling, NUMERICS.md 2, TE_REFERENCE A.1 / A.2) and of their dequantization.
 * Plain loops on purpose: this is the oracle that cuda/quantize_fp8.cu is checked against bit for
 * bit, and it is itself checked against a torch reference in tests/test_quantize_fp8.py.
 * Both multiplies are tq_mul (formats.h): a NaN product is the canonical +NaN, so a NaN element
 * encodes as 0x7F and dequantizes to 0x7FFFFFFF, the same bits as on the GPU.
 */
#include "internal_kernels.h"
#include "ref_io.h"
#include "tequant/formats.h"

/* The history slot keeps the larger of old and new compared as SIGNED int bits: that is what the
 * CUDA kernel's atomicMax on the float's bits does; for the non-negative values a history holds
 * it is the float max (a negative or -0.0 old value is replaced, a +NaN old value stays). */
static void max_accumulate(float *slot, float amax) {
    if ((int32_t)tq_f32_bits(amax) > (int32_t)tq_f32_bits(*slot)) *slot = amax;
}

tq_status tq_quantize_fp8_ref(const tq_tensor *x, const tq_quant_config *c,
                              const tq_quantize_args *a, tq_qtensor *q, struct CUstream_st *stream) {
    (void)stream;
    const int e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    float amax = 0.0f;
    if (a->amax.data != NULL) /* CURRENT with a given amax (a shard's all-reduced one) */
        amax = *(const float *)a->amax.data;
    else
        for (int64_t r = 0; r < x->rows; r++)
            for (int64_t col = 0; col < x->cols; col++)
                amax = tq_amax_step(amax, tq_ref_load(x, r, col));

    float scale;
    if (c->scaling == TQ_SCALING_CURRENT) {
        *(float *)q->amax.data = amax;
        scale = tq_scale_from_amax(amax, c->fmax, c->amax_epsilon,
                                   (c->flags & TQ_QUANT_POW2_SCALE) != 0, TQ_FLT_MAX);
    } else { /* DELAYED: the stored scale; amax goes into the caller's history slot */
        scale = *(const float *)a->scale.data;
        max_accumulate((float *)q->amax.data, amax);
    }
    *(float *)q->scale_inv.data = tq_rcp(scale);

    uint8_t *data = (uint8_t *)q->data.data, *data_t = (uint8_t *)q->data_t.data;
    const int64_t rows = x->rows, cols = x->cols;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t col = 0; col < cols; col++) {
            const uint8_t code = tq_f32_to_fp8(tq_mul(tq_ref_load(x, r, col), scale), e5m2);
            if (a->usage & TQ_USAGE_ROWWISE) data[r * cols + col] = code;
            if (a->usage & TQ_USAGE_COLUMNWISE) data_t[col * rows + r] = code;
        }
    }
    return TQ_SUCCESS;
}

tq_status tq_dequantize_fp8_ref(const tq_quant_config *c, const tq_qtensor *q, uint32_t usage,
                                tq_tensor *out, struct CUstream_st *stream) {
    (void)stream;
    const int e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const float scale_inv = *(const float *)q->scale_inv.data;
    const uint8_t *codes = (const uint8_t *)(usage == TQ_USAGE_ROWWISE ? q->data.data : q->data_t.data);
    for (int64_t r = 0; r < out->rows; r++) {
        for (int64_t col = 0; col < out->cols; col++) {
            tq_ref_store(out, r, col, tq_mul(tq_fp8_to_f32(codes[r * out->cols + col], e5m2), scale_inv));
        }
    }
    return TQ_SUCCESS;
}
