/* transpose.c: tq_transpose, the byte transpose of one-byte codes (out[c][r] = x[r][c]): the
 * columnwise copy of per-tensor FP8 and 2-D-block codes made from the rowwise one after a
 * quantized all-gather (python/tequant/distributed/gather_layout.py), in one tiled pass
 * (cuda/transpose.cu; CPU reference csrc/ref/transpose_ref.c) instead of torch's strided copy.
 * Tests: tests/test_transpose.py.
 */
#include "internal_kernels.h"

static int one_byte(tq_dtype dtype) {
    return dtype == TQ_DTYPE_FLOAT8_E4M3 || dtype == TQ_DTYPE_FLOAT8_E5M2
           || dtype == TQ_DTYPE_FLOAT8_E8M0 || dtype == TQ_DTYPE_UINT8;
}

tq_status tq_transpose(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream) {
    tq_status st = tq_tensor_check(x, "x");
    if (st == TQ_SUCCESS) st = tq_tensor_check(out, "out");
    if (st != TQ_SUCCESS) return st;
    if (!one_byte(x->dtype))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "transpose: x is %s; expected a one-byte dtype "
                       "(float8_e4m3, float8_e5m2, float8_e8m0 or uint8)", tq_dtype_name(x->dtype));
    char xd[16], od[16];
    if (out->dtype != x->dtype || out->rows != x->cols || out->cols != x->rows
        || out->device != x->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "transpose: x is %s [%lld, %lld] on %s, out is "
                       "%s [%lld, %lld] on %s; out must be [%lld, %lld] of x's dtype and device",
                       tq_dtype_name(x->dtype), (long long)x->rows, (long long)x->cols,
                       tq_device_str(x->device, xd), tq_dtype_name(out->dtype),
                       (long long)out->rows, (long long)out->cols, tq_device_str(out->device, od),
                       (long long)x->cols, (long long)x->rows);
    return TQ_DISPATCH(transpose, x->device == TQ_DEVICE_CPU, x, out, stream);
}
