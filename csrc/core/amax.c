/* amax.c: tq_amax argument checks and dispatch (CPU reference or CUDA kernel).
 * Reference: csrc/ref/amax_ref.c; kernel: cuda/amax.cu; tests: tests/test_amax.py.
 */
#include "internal_kernels.h"

tq_status tq_amax(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream) {
    tq_status st = tq_tensor_check(x, "x");
    if (st == TQ_SUCCESS) st = tq_tensor_check(amax, "amax");
    if (st != TQ_SUCCESS) return st;
    if (x->dtype != TQ_DTYPE_FLOAT32 && x->dtype != TQ_DTYPE_BFLOAT16 && x->dtype != TQ_DTYPE_FLOAT16)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax: x has dtype %s; expected float32, "
                       "bfloat16 or float16", tq_dtype_name(x->dtype));
    if (amax->dtype != TQ_DTYPE_FLOAT32 || amax->rows * amax->cols != 1)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax: output must be one float32 element, got "
                       "%s [%lld, %lld]", tq_dtype_name(amax->dtype), (long long)amax->rows,
                       (long long)amax->cols);
    if (amax->device != x->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax: output is on device %d, x on device %d",
                       amax->device, x->device);
    if (x->device == TQ_DEVICE_CPU) return tq_amax_ref(x, amax, stream);
#ifdef TQ_WITH_CUDA
    return tq_amax_cuda(x, amax, stream);
#else
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "amax: x is on cuda:%d but tequant was built without "
                   "CUDA", x->device);
#endif
}
