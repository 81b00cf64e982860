/* pad.cu: the CUDA side of tq_pad_rows (csrc/core/pad.c checks the arguments): one launch that
 * copies x's rows into the head of out and zeroes the rest. It replaced a cudaMemcpy2DAsync plus
 * a cudaMemset2DAsync: two runtime calls cost more host time than one launch, and te.Linear
 * pads on every call whose token count misses the format's multiple (docs/results/NOTES.md).
 * Moves 16 bytes per thread when every row start and the row length allow it, else 1.
 * CPU reference: csrc/ref/pad_ref.c. Tests: tests/test_linear.py, tests/test_linear_alloc.py.
 */
#include <stdint.h>

#include "internal_kernels.h"
#include "launch.cuh"

namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGridY = 65535;

/* Unit U (uint4 or uint8_t) c of row r: x's when r < x_rows, else zero. Rows stride over
 * gridDim.y, units over the x dimension. */
template <typename U>
__global__ void __launch_bounds__(kThreads) pad_rows_kernel(const char *__restrict__ x, char *__restrict__ out,
                                                            int64_t x_rows, int64_t out_rows, int64_t units,
                                                            int64_t x_pitch, int64_t out_pitch) {
    const int64_t c = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (c >= units) return;
    for (int64_t r = blockIdx.y; r < out_rows; r += gridDim.y) {
        U v{};
        if (r < x_rows) v = reinterpret_cast<const U *>(x + r * x_pitch)[c];
        reinterpret_cast<U *>(out + r * out_pitch)[c] = v;
    }
}

bool aligned16(const void *p, int64_t pitch) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && pitch % 16 == 0;
}

}  // namespace

extern "C" tq_status tq_pad_rows_cuda(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream) {
    const int64_t elem = tq_dtype_bits(x->dtype) / 8;
    const int64_t row_bytes = x->cols * elem, x_pitch = x->ld * elem, out_pitch = out->ld * elem;
    if (row_bytes == 0 || out->rows == 0) return TQ_SUCCESS;
    tq_cuda::DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return tq_cuda::cuda_failed("pad rows: making out's device current", guard.status);
    const bool wide = row_bytes % 16 == 0 && aligned16(out->data, out_pitch)
                      && (x->rows == 0 || aligned16(x->data, x_pitch));
    const int64_t units = wide ? row_bytes / 16 : row_bytes;
    const int64_t blocks_x = (units + kThreads - 1) / kThreads;
    if (blocks_x > 0x7FFFFFFFLL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "pad rows: a row of %lld bytes is too long", (long long)row_bytes);
    const dim3 grid((unsigned)blocks_x, (unsigned)(out->rows < kMaxGridY ? out->rows : kMaxGridY));
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const char *src = static_cast<const char *>(x->data);
    char *dst = static_cast<char *>(out->data);
    if (wide) pad_rows_kernel<uint4><<<grid, kThreads, 0, s>>>(src, dst, x->rows, out->rows, units, x_pitch, out_pitch);
    else pad_rows_kernel<uint8_t><<<grid, kThreads, 0, s>>>(src, dst, x->rows, out->rows, units, x_pitch, out_pitch);
    const cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) return tq_cuda::launch_failed("pad rows kernel launch");
    return TQ_SUCCESS;
}
