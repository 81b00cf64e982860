/* amax.cu: tq_amax on CUDA: amax = max |x| over all elements, NaN ignored (NUMERICS.md 2, A.1).
 *
 * Rule: |x| of the exactly widened value, max over the tensor, NaN elements skipped, so the
 * result is independent of reduction order and equals the CPU reference bit for bit
 * (csrc/ref/amax_ref.c). Each thread scans a grid-stride range (16-byte loads when x is
 * contiguous, or its rows are 16-byte aligned: one warp per row; else element by element), a
 * warp then a block reduce with the same NaN-ignoring step, then one atomicMax on the float's
 * bits per block (valid for values >= 0). The output is zeroed on the stream first. No sync, no
 * allocation. The FP8 current-scaling quantizer runs this as its first pass.
 * Tests: tests/test_amax.py (GPU cases).
 */
#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "internal_kernels.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

constexpr int kThreads = 256;

using tq_fp::Bf16;
using tq_fp::Half;
using tq_fp::widen;

/* max |.| of the 16 bytes of x in v (4 floats or 8 bf16 / fp16). */
template <typename T>
__device__ __forceinline__ float amax_vec(float m, const uint4 &v) {
    union {
        uint4 u;
        T t[16 / sizeof(T)];
    } buf;
    buf.u = v;
#pragma unroll
    for (int e = 0; e < (int)(16 / sizeof(T)); e++) m = tq_amax_step(m, widen(buf.t[e]));
    return m;
}

enum Path { kScalar, kFlatVec, kRowVec };

/* Block max of m with the NaN-ignoring step, then one atomicMax on the float's bits. */
__device__ __forceinline__ void block_amax(float m, float *__restrict__ amax) {
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

template <typename T, Path kPath>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T *__restrict__ x, int64_t rows,
                                                        int64_t cols, int64_t ld,
                                                        float *__restrict__ amax) {
    constexpr int kVec = 16 / sizeof(T);
    float m = 0.0f;
    const int64_t n = rows * cols;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if constexpr (kPath == kFlatVec) { /* contiguous, 16-byte aligned: x is n elements */
        const uint4 *xv = reinterpret_cast<const uint4 *>(x);
        const int64_t nv = n / kVec;
        int64_t i = tid;
        for (; i + 3 * stride < nv; i += 4 * stride) { /* 4 loads in flight per thread */
            const uint4 a = __ldg(xv + i), b = __ldg(xv + i + stride);
            const uint4 c = __ldg(xv + i + 2 * stride), d = __ldg(xv + i + 3 * stride);
            m = amax_vec<T>(amax_vec<T>(amax_vec<T>(amax_vec<T>(m, a), b), c), d);
        }
        for (; i < nv; i += stride) m = amax_vec<T>(m, __ldg(xv + i));
        for (int64_t j = nv * kVec + tid; j < n; j += stride) m = tq_amax_step(m, widen(x[j]));
    } else if constexpr (kPath == kRowVec) { /* rows 16-byte aligned: one warp per row */
        const int lane = threadIdx.x & 31;
        const int64_t vpr = cols / kVec;
        for (int64_t r = tid >> 5; r < rows; r += stride >> 5) {
            const T *row = x + r * ld;
            for (int64_t v = lane; v < vpr; v += 32)
                m = amax_vec<T>(m, __ldg(reinterpret_cast<const uint4 *>(row) + v));
            for (int64_t c = vpr * kVec + lane; c < cols; c += 32) m = tq_amax_step(m, widen(row[c]));
        }
    } else {
        for (int64_t i = tid; i < n; i += stride) {
            const int64_t r = i / cols, c = i - r * cols;
            m = tq_amax_step(m, widen(x[r * ld + c]));
        }
    }
    block_amax(m, amax);
}

template <typename T>
void launch_amax(const tq_tensor *x, float *out, int sms, cudaStream_t s) {
    constexpr int kVec = 16 / sizeof(T);
    const T *data = static_cast<const T *>(x->data);
    const int64_t n = x->rows * x->cols;
    const bool aligned = (reinterpret_cast<uintptr_t>(x->data) & 15u) == 0;
    const bool contiguous = x->ld == x->cols || x->rows == 1;
    const bool rows_aligned = aligned && ((uint64_t)x->ld * sizeof(T)) % 16 == 0;
    const Path path = aligned && contiguous ? kFlatVec
                      : rows_aligned && x->cols >= 2 * kVec ? kRowVec : kScalar;
    /* Enough threads to fill the GPU (8 blocks of 256 per SM), each with work to stream. */
    const int64_t per_block = path == kRowVec ? 8 : kThreads * (path == kFlatVec ? 4 * kVec : 8);
    const int64_t units = path == kRowVec ? x->rows : n;
    int64_t blocks = (units + per_block - 1) / per_block;
    if (blocks > 8LL * sms) blocks = 8LL * sms;
    const dim3 grid((unsigned)blocks), block(kThreads);
    if (path == kFlatVec) amax_kernel<T, kFlatVec><<<grid, block, 0, s>>>(data, x->rows, x->cols, x->ld, out);
    else if (path == kRowVec) amax_kernel<T, kRowVec><<<grid, block, 0, s>>>(data, x->rows, x->cols, x->ld, out);
    else amax_kernel<T, kScalar><<<grid, block, 0, s>>>(data, x->rows, x->cols, x->ld, out);
}


tq_status run_amax(const tq_tensor *x, float *out, cudaStream_t s) {
    if (cudaMemsetAsync(out, 0, sizeof(float), s) != cudaSuccess)
        return launch_failed("amax: cudaMemsetAsync");
    const int64_t n = x->rows * x->cols;
    if (n == 0) return TQ_SUCCESS;
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x->device);
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32: launch_amax<float>(x, out, sms, s); break;
        case TQ_DTYPE_BFLOAT16: launch_amax<Bf16>(x, out, sms, s); break;
        default: launch_amax<Half>(x, out, sms, s); break;
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
