/* codec_ref.c: CPU reference of tq_codec_apply: out[r][c] = codec(in[r][c]) with formats.h's
 * scalar functions, row by row (in and out may each have ld > cols).
 * Plain loops on purpose: this is the oracle the CUDA kernel (cuda/codec.cu) is checked against
 * bit for bit; tests/test_formats.py checks it against torch's casts. Arguments were checked by
 * csrc/core/codec.c.
 */
#include "internal_kernels.h"
#include "tequant/formats.h"

/* One element; in_row / out_row point at the start of a row of the codec's element types. */
static void apply_one(tq_codec codec, const void *in_row, void *out_row, int64_t c) {
    const float *in_f32 = (const float *)in_row;
    const uint8_t *in_code = (const uint8_t *)in_row;
    uint8_t *out_code = (uint8_t *)out_row;
    uint16_t *out_16 = (uint16_t *)out_row;
    float *out_f32 = (float *)out_row;
    switch (codec) {
        case TQ_CODEC_F32_TO_E4M3: out_code[c] = tq_f32_to_e4m3(in_f32[c]); break;
        case TQ_CODEC_F32_TO_E5M2: out_code[c] = tq_f32_to_e5m2(in_f32[c]); break;
        case TQ_CODEC_F32_TO_E2M1: out_code[c] = tq_f32_to_e2m1(in_f32[c]); break;
        case TQ_CODEC_F32_TO_E8M0: out_code[c] = tq_f32_to_e8m0_up(in_f32[c]); break;
        case TQ_CODEC_F32_TO_BF16: out_16[c] = tq_f32_to_bf16(in_f32[c]); break;
        case TQ_CODEC_F32_TO_F16: out_16[c] = tq_f32_to_f16(in_f32[c]); break;
        case TQ_CODEC_E4M3_TO_F32: out_f32[c] = tq_e4m3_to_f32(in_code[c]); break;
        case TQ_CODEC_E5M2_TO_F32: out_f32[c] = tq_e5m2_to_f32(in_code[c]); break;
        case TQ_CODEC_E2M1_TO_F32: out_f32[c] = tq_e2m1_to_f32((uint8_t)(in_code[c] & 0xFu)); break;
        case TQ_CODEC_E8M0_TO_F32: out_f32[c] = tq_e8m0_to_f32(in_code[c]); break;
        case TQ_CODEC_COUNT_: break;
    }
}

tq_status tq_codec_ref(tq_codec codec, const tq_tensor *in, tq_tensor *out,
                       struct CUstream_st *stream) {
    (void)stream;
    const int64_t in_bytes = tq_dtype_bits(in->dtype) / 8, out_bytes = tq_dtype_bits(out->dtype) / 8;
    for (int64_t r = 0; r < in->rows; r++) {
        const char *in_row = (const char *)in->data + r * in->ld * in_bytes;
        char *out_row = (char *)out->data + r * out->ld * out_bytes;
        for (int64_t c = 0; c < in->cols; c++) apply_one(codec, in_row, out_row, c);
    }
    return TQ_SUCCESS;
}
