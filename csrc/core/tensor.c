/* tensor.c: element-type facts and the tq_tensor descriptor check.
 *
 * Tests: tests/c/test_status.c (descriptor errors), tests/test_tensor_view.py (through the
 * extension's intake, which fills these descriptors from torch tensors).
 */
#include "internal.h"

const char *tq_dtype_name(tq_dtype dtype) {
    switch (dtype) {
        case TQ_DTYPE_FLOAT32: return "float32";
        case TQ_DTYPE_BFLOAT16: return "bfloat16";
        case TQ_DTYPE_FLOAT16: return "float16";
        case TQ_DTYPE_FLOAT8_E4M3: return "float8_e4m3";
        case TQ_DTYPE_FLOAT8_E5M2: return "float8_e5m2";
        case TQ_DTYPE_FLOAT4_E2M1X2: return "float4_e2m1x2";
        case TQ_DTYPE_FLOAT8_E8M0: return "float8_e8m0";
        case TQ_DTYPE_UINT8: return "uint8";
        case TQ_DTYPE_INT32: return "int32";
        case TQ_DTYPE_INT64: return "int64";
        case TQ_DTYPE_COUNT_: break;
    }
    return "invalid";
}

int tq_dtype_bits(tq_dtype dtype) {
    switch (dtype) {
        case TQ_DTYPE_FLOAT32: return 32;
        case TQ_DTYPE_BFLOAT16: return 16;
        case TQ_DTYPE_FLOAT16: return 16;
        case TQ_DTYPE_FLOAT8_E4M3: return 8;
        case TQ_DTYPE_FLOAT8_E5M2: return 8;
        case TQ_DTYPE_FLOAT4_E2M1X2: return 4;
        case TQ_DTYPE_FLOAT8_E8M0: return 8;
        case TQ_DTYPE_UINT8: return 8;
        case TQ_DTYPE_INT32: return 32;
        case TQ_DTYPE_INT64: return 64;
        case TQ_DTYPE_COUNT_: break;
    }
    return 0;
}

tq_status tq_tensor_check(const tq_tensor *t, const char *name) {
    if (name == NULL) name = "tensor";
    if (t == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: descriptor is NULL", name);
    if ((int)t->dtype < 0 || t->dtype >= TQ_DTYPE_COUNT_)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: unknown dtype %d", name, (int)t->dtype);
    if (t->rows < 0 || t->cols < 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: shape [%lld, %lld] has a negative dim",
                       name, (long long)t->rows, (long long)t->cols);
    if (t->ld < t->cols)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: ld=%lld must be >= cols=%lld", name,
                       (long long)t->ld, (long long)t->cols);
    if (t->dtype == TQ_DTYPE_FLOAT4_E2M1X2 && (t->cols % 2 != 0 || t->ld % 2 != 0))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT,
                       "%s: cols=%lld and ld=%lld must be even for packed E2M1 (two per byte)",
                       name, (long long)t->cols, (long long)t->ld);
    if (t->device < TQ_DEVICE_CPU)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: device=%d is neither a CUDA ordinal nor "
                       "TQ_DEVICE_CPU (-1)", name, t->device);
    if (t->data == NULL && t->rows > 0 && t->cols > 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: data is NULL for a [%lld, %lld] tensor",
                       name, (long long)t->rows, (long long)t->cols);
    return TQ_SUCCESS;
}
