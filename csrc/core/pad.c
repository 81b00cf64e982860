/* pad.c: tq_pad_rows, x copied into the head of a taller tensor whose remaining rows are zeroed:
 * te.Linear's tokens padded to a format's row multiple (NUMERICS 3.4) in one copy and one memset
 * instead of a zero fill, a copy and two views through torch.
 * Tests: tests/test_linear.py (M = 1, 7, 1000 against references that pad with torch) and
 * tests/test_linear_alloc.py (the padding is zero in reused, poisoned memory).
 */
#include <string.h>

#include "internal.h"

#ifdef TQ_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

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
    const size_t elem = (size_t)tq_dtype_bits(x->dtype) / 8;
    const size_t row_bytes = (size_t)x->cols * elem, x_pitch = (size_t)x->ld * elem;
    const size_t out_pitch = (size_t)out->ld * elem;
    const int64_t tail = out->rows - x->rows;
    char *tail_at = (char *)out->data + (size_t)x->rows * out_pitch;
    if (row_bytes == 0) return TQ_SUCCESS;
    if (out->device == TQ_DEVICE_CPU) {
        for (int64_t r = 0; r < x->rows; r++)
            memcpy((char *)out->data + (size_t)r * out_pitch, (const char *)x->data + (size_t)r * x_pitch,
                   row_bytes);
        for (int64_t r = 0; r < tail; r++) memset(tail_at + (size_t)r * out_pitch, 0, row_bytes);
        return TQ_SUCCESS;
    }
#ifdef TQ_WITH_CUDA
    int previous = -1, current;
    cudaError_t err = cudaGetDevice(&current);
    if (err == cudaSuccess && current != out->device) {
        err = cudaSetDevice(out->device);
        if (err == cudaSuccess) previous = current;
    }
    cudaStream_t s = (cudaStream_t)stream;
    if (err == cudaSuccess && x->rows > 0)
        err = cudaMemcpy2DAsync(out->data, out_pitch, x->data, x_pitch, row_bytes,
                                (size_t)x->rows, cudaMemcpyDeviceToDevice, s);
    if (err == cudaSuccess && tail > 0)
        err = cudaMemset2DAsync(tail_at, out_pitch, 0, row_bytes, (size_t)tail, s);
    if (previous >= 0) cudaSetDevice(previous);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return tq_fail(TQ_ERROR_CUDA, "pad rows: %s (%s)", cudaGetErrorName(err),
                       cudaGetErrorString(err));
    }
    return TQ_SUCCESS;
#else
    (void)stream;
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "pad rows: %s tensors need a CUDA build of tequant",
                   tq_device_str(out->device, od));
#endif
}
