/* pad.c: tq_pad_rows, x copied into the head of a taller tensor whose remaining rows are zeroed:
 * te.Linear's tokens padded to a format's row multiple (NUMERICS 3.4) in one pass (csrc/ref/pad_ref.c,
 * cuda/pad.cu) instead of a zero fill, a copy and two views through torch.
 * Tests: tests/test_linear.py (M = 1, 7, 1000 against references that pad with torch) and
 * tests/test_linear_alloc.py (the padding is zero in reused, poisoned memory).
 */
#include "internal_kernels.h"

tq_status tq_pad_rows(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream) {
    tq_status st = tq_tensor_check(x, "x");
    if (st == TQ_SUCCESS) st = tq_tensor_check(out, "out");
    if (st != TQ_SUCCESS) return st;
    char xd[16], od[16];
    if (x->dtype != out->dtype || x->cols != out->cols || x->rows > out->rows
        || x->device != out->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "pad rows: x is %s [%lld, %lld] on %s, out is "
                       "%s [%lld, %lld] on %s; out needs x's dtype, cols and device and at least "
                       "its rows", tq_dtype_name(x->dtype), (long long)x->rows,
                       (long long)x->cols, tq_device_str(x->device, xd), tq_dtype_name(out->dtype),
                       (long long)out->rows, (long long)out->cols, tq_device_str(out->device, od));
    return TQ_DISPATCH(pad_rows, out->device == TQ_DEVICE_CPU, x, out, stream);
}
