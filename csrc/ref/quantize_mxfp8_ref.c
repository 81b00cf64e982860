/* quantize_mxfp8_ref.c: CPU reference of the MXFP8 quantizer and its dequantization
 * (NUMERICS.md 2 "MXFP8", TE_REFERENCE A.4 / 6.4). Plain loops on purpose: this is the oracle
 * that the CUDA kernels (cuda/quantize_mxfp8.cu) must equal bit for bit.
 *   block amax A (NaN ignored) over 32 elements along K (rowwise), 32 rows of a column
 *   (columnwise), or a 32x32 tile shared by both directions (TQ_QUANT_2D);
 *   e = tq_mxfp8_exponent(A) (E8M0 rounded up); q = cvt8(x * 2^(127-e)); scale byte = e.
 * Scales are block-major: a direction with codes [R, C] keeps its exponents as [C/32, R].
 * Dequantization: RN(fp8_value * 2^(e-127)), narrowed RNE to out's dtype.
 * Tests: tests/test_quantize_mxfp8.py (against torch references, and CUDA against this).
 */
#include "internal_kernels.h"
#include "ref_io.h"
#include "tequant/formats.h"

#define MX_BLOCK 32

/* max |x| over rows [r0, r0 + nr) x cols [c0, c0 + nc), NaN ignored. */
static float region_amax(const tq_tensor *x, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    float amax = 0.0f;
    for (int64_t r = r0; r < r0 + nr; r++)
        for (int64_t c = c0; c < c0 + nc; c++) amax = tq_amax_step(amax, tq_ref_load(x, r, c));
    return amax;
}

tq_status tq_quantize_mxfp8_ref(const tq_tensor *x, const tq_quant_config *config,
                                const tq_quantize_args *args, tq_qtensor *q,
                                struct CUstream_st *stream) {
    (void)stream;
    const int e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const int two_d = (config->flags & TQ_QUANT_2D) != 0;
    const int64_t M = x->rows, K = x->cols;
    /* 1D: a rowwise block is 1x32 and a columnwise block 32x1; 2D: both are the 32x32 tile. */
    const int64_t tile_rows = two_d ? MX_BLOCK : 1, tile_cols = two_d ? MX_BLOCK : 1;

    if (args->usage & TQ_USAGE_ROWWISE) {
        uint8_t *data = (uint8_t *)q->data.data, *scale = (uint8_t *)q->scale_inv.data;
        for (int64_t r0 = 0; r0 < M; r0 += tile_rows) {
            for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
                const uint8_t e = tq_mxfp8_exponent(
                    region_amax(x, r0, tile_rows, kb * MX_BLOCK, MX_BLOCK), e5m2);
                const float factor = tq_e8m0_rcp(e);
                for (int64_t r = r0; r < r0 + tile_rows; r++) {
                    scale[kb * M + r] = e;
                    for (int64_t c = kb * MX_BLOCK; c < (kb + 1) * MX_BLOCK; c++)
                        data[r * K + c] = tq_f32_to_fp8(tq_ref_load(x, r, c) * factor, e5m2);
                }
            }
        }
    }
    if (args->usage & TQ_USAGE_COLUMNWISE) {
        /* data_t [K, M] = quant(x^T): row c of data_t is column c of x, blocks along M. */
        uint8_t *data_t = (uint8_t *)q->data_t.data, *scale_t = (uint8_t *)q->scale_inv_t.data;
        for (int64_t c0 = 0; c0 < K; c0 += tile_cols) {
            for (int64_t mb = 0; mb < M / MX_BLOCK; mb++) {
                const uint8_t e = tq_mxfp8_exponent(
                    region_amax(x, mb * MX_BLOCK, MX_BLOCK, c0, tile_cols), e5m2);
                const float factor = tq_e8m0_rcp(e);
                for (int64_t c = c0; c < c0 + tile_cols; c++) {
                    scale_t[mb * K + c] = e;
                    for (int64_t r = mb * MX_BLOCK; r < (mb + 1) * MX_BLOCK; r++)
                        data_t[c * M + r] = tq_f32_to_fp8(tq_ref_load(x, r, c) * factor, e5m2);
                }
            }
        }
    }
    return TQ_SUCCESS;
}

tq_status tq_dequantize_mxfp8_ref(const tq_quant_config *config, const tq_qtensor *q,
                                  uint32_t usage, tq_tensor *out, struct CUstream_st *stream) {
    (void)stream;
    const int e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const int row = usage == TQ_USAGE_ROWWISE;
    const tq_tensor *data = row ? &q->data : &q->data_t;
    const tq_tensor *scale = row ? &q->scale_inv : &q->scale_inv_t;
    const uint8_t *codes = (const uint8_t *)data->data, *exps = (const uint8_t *)scale->data;
    for (int64_t r = 0; r < data->rows; r++) {
        for (int64_t c = 0; c < data->cols; c++) {
            const uint8_t e = exps[(c / MX_BLOCK) * data->rows + r];
            const float v = tq_mul(tq_fp8_to_f32(codes[r * data->cols + c], e5m2), tq_e8m0_to_f32(e));
            tq_ref_store(out, r, c, v);
        }
    }
    return TQ_SUCCESS;
}
