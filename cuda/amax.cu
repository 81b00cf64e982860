/* amax.cu: tq_amax on CUDA: amax = max |x| over all elements, NaN ignored (NUMERICS.md 2, A.1).
 *
 * Rule: |x| of the exactly widened value, max over the tensor, NaN elements skipped, so the
 * result is independent of reduction order and equals the CPU reference bit for bit
 * (csrc/ref/amax_ref.c). Each thread scans a grid-stride range, a warp then a block reduce
 * with the same NaN-ignoring step, then one atomicMax on the float's bits per block (valid
 * for values >= 0). The output is zeroed on the stream first. No sync, no allocation.
 * Tests: tests/test_amax.py (GPU cases).
 */
#include <cuda_runtime.h>

#include "internal_kernels.h"
#include "tequant/formats.h"

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float widen(T v);
template <>
__device__ __forceinline__ float widen<float>(float v) { return v; }
template <>
__device__ __forceinline__ float widen<uint16_t>(uint16_t v) { return tq_bf16_to_f32(v); }

struct Half {
    uint16_t bits;
};
template <>
__device__ __forceinline__ float widen<Half>(Half v) { return tq_f16_to_f32(v.bits); }

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T *__restrict__ x, int64_t rows,
                                                        int64_t cols, int64_t ld,
                                                        float *__restrict__ amax) {
    float m = 0.0f;
    const int64_t n = rows * cols;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t r = i / cols, c = i - r * cols;
        m = tq_amax_step(m, widen<T>(x[r * ld + c]));
    }
    for (int offset = 16; offset > 0; offset >>= 1)
        m = tq_amax_step(m, __shfl_xor_sync(0xffffffffu, m, offset));
    __shared__ float warp_max[kThreads / 32];
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1)
            m = tq_amax_step(m, __shfl_xor_sync(0xffffffffu, m, offset));
        if (threadIdx.x == 0 && m > 0.0f)
            atomicMax(reinterpret_cast<unsigned int *>(amax), __float_as_uint(m));
    }
}

tq_status launch_failed(const char *what) {
    cudaError_t err = cudaGetLastError();
    return tq_fail(TQ_ERROR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

/* Makes x's device current for the launch and restores the caller's afterwards. */
struct DeviceGuard {
    int previous = -1;
    cudaError_t status = cudaSuccess; /* why the device could not be made current */
    explicit DeviceGuard(int device) {
        status = cudaGetDevice(&previous);
        if (status == cudaSuccess && previous != device) status = cudaSetDevice(device);
        else previous = -1;
        if (status != cudaSuccess) previous = -1;
    }
    ~DeviceGuard() {
        if (previous >= 0) cudaSetDevice(previous);
    }
};

tq_status run_amax(const tq_tensor *x, float *out, cudaStream_t s) {
    if (cudaMemsetAsync(out, 0, sizeof(float), s) != cudaSuccess)
        return launch_failed("amax: cudaMemsetAsync");
    const int64_t n = x->rows * x->cols;
    if (n == 0) return TQ_SUCCESS;
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x->device);
    int64_t blocks = (n + kThreads * 8 - 1) / (kThreads * 8);
    if (blocks > 8LL * sms) blocks = 8LL * sms;
    const dim3 grid((unsigned)blocks), block(kThreads);
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32:
            amax_kernel<float><<<grid, block, 0, s>>>(static_cast<const float *>(x->data), x->rows,
                                                      x->cols, x->ld, out);
            break;
        case TQ_DTYPE_BFLOAT16:
            amax_kernel<uint16_t><<<grid, block, 0, s>>>(static_cast<const uint16_t *>(x->data),
                                                         x->rows, x->cols, x->ld, out);
            break;
        default:
            amax_kernel<Half><<<grid, block, 0, s>>>(static_cast<const Half *>(x->data), x->rows,
                                                     x->cols, x->ld, out);
            break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("amax kernel launch");
    return TQ_SUCCESS;
}

}  // namespace

extern "C" tq_status tq_amax_cuda(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return launch_failed("amax: making x's device current");
    return run_amax(x, static_cast<float *>(amax->data), reinterpret_cast<cudaStream_t>(stream));
}
