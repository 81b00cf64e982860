/* codec.c: tq_codec_apply argument checks and dispatch (CPU reference or CUDA kernel).
 *
 * The elementwise codecs expose formats.h's scalar rules on whole tensors, so the rules can be
 * tested exhaustively against torch's own casts. Reference: csrc/ref/codec_ref.c; kernel:
 * cuda/codec.cu; tests: tests/test_formats.py (through _C._codec, csrc/ext/codec.c).
 */
#include "internal_kernels.h"

typedef struct codec_info {
    const char *name;
    tq_dtype in, out; /* the element types; a code side is UINT8 */
    tq_dtype typed;   /* the 8-bit float dtype a code side may also carry, or UINT8 if none */
} codec_info;

/* Indexed by tq_codec. A code side accepts UINT8 and the format's own 8-bit dtype (torch's
 * float8 views of the same bytes); E2M1 codes travel one per byte, so only as UINT8. */
static const codec_info codecs[TQ_CODEC_COUNT_] = {
    [TQ_CODEC_F32_TO_E4M3] = {"f32_to_e4m3", TQ_DTYPE_FLOAT32, TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT8_E4M3},
    [TQ_CODEC_F32_TO_E5M2] = {"f32_to_e5m2", TQ_DTYPE_FLOAT32, TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT8_E5M2},
    [TQ_CODEC_F32_TO_E2M1] = {"f32_to_e2m1", TQ_DTYPE_FLOAT32, TQ_DTYPE_UINT8, TQ_DTYPE_UINT8},
    [TQ_CODEC_F32_TO_E8M0] = {"f32_to_e8m0", TQ_DTYPE_FLOAT32, TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT8_E8M0},
    [TQ_CODEC_F32_TO_BF16] = {"f32_to_bf16", TQ_DTYPE_FLOAT32, TQ_DTYPE_BFLOAT16, TQ_DTYPE_BFLOAT16},
    [TQ_CODEC_F32_TO_F16] = {"f32_to_f16", TQ_DTYPE_FLOAT32, TQ_DTYPE_FLOAT16, TQ_DTYPE_FLOAT16},
    [TQ_CODEC_E4M3_TO_F32] = {"e4m3_to_f32", TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT32, TQ_DTYPE_FLOAT8_E4M3},
    [TQ_CODEC_E5M2_TO_F32] = {"e5m2_to_f32", TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT32, TQ_DTYPE_FLOAT8_E5M2},
    [TQ_CODEC_E2M1_TO_F32] = {"e2m1_to_f32", TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT32, TQ_DTYPE_UINT8},
    [TQ_CODEC_E8M0_TO_F32] = {"e8m0_to_f32", TQ_DTYPE_UINT8, TQ_DTYPE_FLOAT32, TQ_DTYPE_FLOAT8_E8M0},
};

static int dtype_ok(tq_dtype got, tq_dtype want, tq_dtype typed) {
    return got == want || (want == TQ_DTYPE_UINT8 && got == typed);
}

static const char *typed_alternative(tq_dtype want, tq_dtype typed) {
    if (want != TQ_DTYPE_UINT8 || typed == TQ_DTYPE_UINT8) return "";
    return typed == TQ_DTYPE_FLOAT8_E4M3 ? " or float8_e4m3"
           : typed == TQ_DTYPE_FLOAT8_E5M2 ? " or float8_e5m2" : " or float8_e8m0";
}

tq_status tq_codec_apply(tq_codec codec, const tq_tensor *in, tq_tensor *out,
                         struct CUstream_st *stream) {
    if ((int)codec < 0 || codec >= TQ_CODEC_COUNT_)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "codec=%d is not a tq_codec (0..%d)", (int)codec,
                       TQ_CODEC_COUNT_ - 1);
    const codec_info *info = &codecs[codec];
    tq_status st = tq_tensor_check(in, "in");
    if (st == TQ_SUCCESS) st = tq_tensor_check(out, "out");
    if (st != TQ_SUCCESS) return st;
    if (!dtype_ok(in->dtype, info->in, info->typed))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "codec %s: in has dtype %s; expected %s%s",
                       info->name, tq_dtype_name(in->dtype), tq_dtype_name(info->in),
                       typed_alternative(info->in, info->typed));
    if (!dtype_ok(out->dtype, info->out, info->typed))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "codec %s: out has dtype %s; expected %s%s",
                       info->name, tq_dtype_name(out->dtype), tq_dtype_name(info->out),
                       typed_alternative(info->out, info->typed));
    if (in->rows != out->rows || in->cols != out->cols)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "codec %s: in is [%lld, %lld] but out is "
                       "[%lld, %lld]; they must have the same shape", info->name,
                       (long long)in->rows, (long long)in->cols, (long long)out->rows,
                       (long long)out->cols);
    if (in->device != out->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "codec %s: in is on device %d, out on device %d",
                       info->name, in->device, out->device);
    if (in->device == TQ_DEVICE_CPU) return tq_codec_ref(codec, in, out, stream);
#ifdef TQ_WITH_CUDA
    return tq_codec_cuda(codec, in, out, stream);
#else
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "codec %s: in is on cuda:%d but tequant was built "
                   "without CUDA", info->name, in->device);
#endif
}
