/* quantize_fp8_block_ref.c: CPU reference of FP8 block scaling (Float8BlockScaling; NUMERICS 2,
 * TE_REFERENCE A.3 / 6.3): one FP32 scale per 1x128 block (rowwise: 128 consecutive elements of a
 * row; columnwise: 128 consecutive rows of a column) or per 128x128 tile (TQ_QUANT_2D, one scale
 * shared by both directions). Partial edge blocks use their valid elements only. Scale layouts
 * are tequant.h's GEMM-ready ones, padding entries written as 0. A NaN element's code is the
 * positive NaN (0x7F) whatever its sign: tq_mul canonicalizes the scaled NaN as CUDA does.
 * Plain loops on purpose: this is the oracle that cuda/quantize_fp8_block.cu is checked against
 * bit for bit. Tests: tests/test_quantize_fp8_block.py (against an independent torch reference).
 */
#include "internal_kernels.h"
#include "ref_io.h"
#include "tequant/formats.h"

#define BLOCK 128

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Max finite value of x's dtype: the scale used when fmax / amax overflows (TE's value_for_inf). */
static float input_max(tq_dtype dtype) {
    if (dtype == TQ_DTYPE_BFLOAT16) return tq_f32_from_bits(0x7F7F0000u);
    if (dtype == TQ_DTYPE_FLOAT16) return 65504.0f;
    return TQ_FLT_MAX;
}

/* The scale of the block x[r0 .. r1) x [c0 .. c1) (ends already clipped to x's shape). */
static float block_scale(const tq_tensor *x, const tq_quant_config *c, int64_t r0, int64_t r1,
                         int64_t c0, int64_t c1) {
    float amax = 0.0f;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = c0; k < c1; k++) amax = tq_amax_step(amax, tq_ref_load(x, r, k));
    return tq_scale_from_amax(amax, c->fmax, c->amax_epsilon, (c->flags & TQ_QUANT_POW2_SCALE) != 0,
                              input_max(x->dtype));
}

/* Quantizes the block with `scale` into data ([M, K], row-major) and/or data_t ([K, M]). */
static void block_quantize(const tq_tensor *x, int e5m2, float scale, int64_t r0, int64_t r1,
                           int64_t c0, int64_t c1, uint8_t *data, uint8_t *data_t) {
    const int64_t rows = x->rows, cols = x->cols;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t k = c0; k < c1; k++) {
            const uint8_t code = tq_f32_to_fp8(tq_mul(tq_ref_load(x, r, k), scale), e5m2);
            if (data) data[r * cols + k] = code;
            if (data_t) data_t[k * rows + r] = code;
        }
    }
}

/* 1x128 blocks: rowwise and columnwise are two independent quantizations. */
static void quantize_1d(const tq_tensor *x, const tq_quant_config *c, int e5m2, tq_qtensor *q) {
    const int64_t M = x->rows, K = x->cols;
    if (q->data.data) {
        /* scale_inv [ceil(K/128), pad4(M)], entry [kb][m] */
        float *scale_inv = (float *)q->scale_inv.data;
        const int64_t ld = q->scale_inv.ld;
        for (int64_t kb = 0; kb < ceil_div(K, BLOCK); kb++) {
            const int64_t c0 = kb * BLOCK, c1 = c0 + BLOCK < K ? c0 + BLOCK : K;
            for (int64_t m = 0; m < M; m++) {
                const float scale = block_scale(x, c, m, m + 1, c0, c1);
                block_quantize(x, e5m2, scale, m, m + 1, c0, c1, (uint8_t *)q->data.data, NULL);
                scale_inv[kb * ld + m] = tq_rcp(scale);
            }
            for (int64_t m = M; m < ld; m++) scale_inv[kb * ld + m] = 0.0f;
        }
    }
    if (q->data_t.data) {
        /* scale_inv_t [ceil(M/128), pad4(K)], entry [mb][k] */
        float *scale_inv_t = (float *)q->scale_inv_t.data;
        const int64_t ld = q->scale_inv_t.ld;
        for (int64_t mb = 0; mb < ceil_div(M, BLOCK); mb++) {
            const int64_t r0 = mb * BLOCK, r1 = r0 + BLOCK < M ? r0 + BLOCK : M;
            for (int64_t k = 0; k < K; k++) {
                const float scale = block_scale(x, c, r0, r1, k, k + 1);
                block_quantize(x, e5m2, scale, r0, r1, k, k + 1, NULL, (uint8_t *)q->data_t.data);
                scale_inv_t[mb * ld + k] = tq_rcp(scale);
            }
            for (int64_t k = K; k < ld; k++) scale_inv_t[mb * ld + k] = 0.0f;
        }
    }
}

/* 128x128 tiles: one scale per tile for both directions; data_t is the transpose of data. */
static void quantize_2d(const tq_tensor *x, const tq_quant_config *c, int e5m2, tq_qtensor *q) {
    const int64_t M = x->rows, K = x->cols, n_mb = ceil_div(M, BLOCK), n_kb = ceil_div(K, BLOCK);
    float *scale_inv = (float *)q->scale_inv.data;     /* [n_mb, pad4(n_kb)], [mb][kb] */
    float *scale_inv_t = (float *)q->scale_inv_t.data; /* [n_kb, pad4(n_mb)], [kb][mb] */
    for (int64_t mb = 0; mb < n_mb; mb++) {
        for (int64_t kb = 0; kb < n_kb; kb++) {
            const int64_t r0 = mb * BLOCK, r1 = r0 + BLOCK < M ? r0 + BLOCK : M;
            const int64_t c0 = kb * BLOCK, c1 = c0 + BLOCK < K ? c0 + BLOCK : K;
            const float scale = block_scale(x, c, r0, r1, c0, c1);
            block_quantize(x, e5m2, scale, r0, r1, c0, c1, (uint8_t *)q->data.data,
                           (uint8_t *)q->data_t.data);
            if (scale_inv) scale_inv[mb * q->scale_inv.ld + kb] = tq_rcp(scale);
            if (scale_inv_t) scale_inv_t[kb * q->scale_inv_t.ld + mb] = tq_rcp(scale);
        }
    }
    if (scale_inv)
        for (int64_t mb = 0; mb < n_mb; mb++)
            for (int64_t kb = n_kb; kb < q->scale_inv.ld; kb++) scale_inv[mb * q->scale_inv.ld + kb] = 0.0f;
    if (scale_inv_t)
        for (int64_t kb = 0; kb < n_kb; kb++)
            for (int64_t mb = n_mb; mb < q->scale_inv_t.ld; mb++)
                scale_inv_t[kb * q->scale_inv_t.ld + mb] = 0.0f;
}

tq_status tq_quantize_fp8_block_ref(const tq_tensor *x, const tq_quant_config *c,
                                    const tq_quantize_args *a, tq_qtensor *q,
                                    struct CUstream_st *stream) {
    (void)a, (void)stream; /* usage is already reflected in which members q has */
    const int e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    if (c->flags & TQ_QUANT_2D) quantize_2d(x, c, e5m2, q);
    else quantize_1d(x, c, e5m2, q);
    return TQ_SUCCESS;
}

/* Dequantizes one direction. Seen from that direction's data [R, C] (data, or data_t), both
 * layouts index alike: 1D blocks run along C with scale entry [c / 128][r]; 2D tiles have scale
 * entry [r / 128][c / 128] (rowwise [mb][kb], columnwise [kb][mb]). */
tq_status tq_dequantize_fp8_block_ref(const tq_quant_config *c, const tq_qtensor *q, uint32_t usage,
                                      tq_tensor *out, struct CUstream_st *stream) {
    (void)stream;
    const int row = usage == TQ_USAGE_ROWWISE, e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const int two_d = (c->flags & TQ_QUANT_2D) != 0;
    const tq_tensor *data = row ? &q->data : &q->data_t, *scale = row ? &q->scale_inv : &q->scale_inv_t;
    const uint8_t *codes = (const uint8_t *)data->data;
    const float *scale_inv = (const float *)scale->data;
    for (int64_t r = 0; r < data->rows; r++) {
        for (int64_t k = 0; k < data->cols; k++) {
            const float s = two_d ? scale_inv[(r / BLOCK) * scale->ld + k / BLOCK]
                                  : scale_inv[(k / BLOCK) * scale->ld + r];
            const float v = tq_mul(tq_fp8_to_f32(codes[r * data->cols + k], e5m2), s);
            tq_ref_store(out, r, k, v);
        }
    }
    return TQ_SUCCESS;
}
