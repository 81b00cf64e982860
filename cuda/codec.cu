/* codec.cu: tq_codec_apply on CUDA: out[r][c] = codec(in[r][c]) for one scalar codec of formats.h.
 *
 * Rule: exactly formats.h's functions (RNE saturating FP8, E2M1 with NaN -> +6, E8M0 rounded up,
 * RNE bf16/fp16, and the decoders), the same code the CPU reference (csrc/ref/codec_ref.c) runs,
 * so the two agree bit for bit. Built with -fmad=false; these are integer bit work plus single
 * IEEE adds, nothing to fuse. One grid-stride loop over rows * cols with int64 indexing; in and
 * out each have their own row stride (ld). A test and inspection tool, not a hot path: no
 * vectorization. No sync, no allocation. Tests: tests/test_formats.py (GPU cases).
 */
#include <cuda_runtime.h>

#include "internal_kernels.h"
#include "launch.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

constexpr int kThreads = 256;

/* One functor per codec: In / Out are the storage types, apply() the formats.h rule. */
template <tq_codec C>
struct Codec;

#define TQ_CODEC_FUNCTOR(codec, in_t, out_t, expr)                          \
    template <>                                                             \
    struct Codec<codec> {                                                   \
        using In = in_t;                                                    \
        using Out = out_t;                                                  \
        __device__ __forceinline__ static Out apply(In v) { return expr; } \
    };

TQ_CODEC_FUNCTOR(TQ_CODEC_F32_TO_E4M3, float, uint8_t, tq_f32_to_e4m3(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_F32_TO_E5M2, float, uint8_t, tq_f32_to_e5m2(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_F32_TO_E2M1, float, uint8_t, tq_f32_to_e2m1(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_F32_TO_E8M0, float, uint8_t, tq_f32_to_e8m0_up(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_F32_TO_BF16, float, uint16_t, tq_f32_to_bf16(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_F32_TO_F16, float, uint16_t, tq_f32_to_f16(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_E4M3_TO_F32, uint8_t, float, tq_e4m3_to_f32(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_E5M2_TO_F32, uint8_t, float, tq_e5m2_to_f32(v))
TQ_CODEC_FUNCTOR(TQ_CODEC_E2M1_TO_F32, uint8_t, float, tq_e2m1_to_f32((uint8_t)(v & 0xFu)))
TQ_CODEC_FUNCTOR(TQ_CODEC_E8M0_TO_F32, uint8_t, float, tq_e8m0_to_f32(v))

#undef TQ_CODEC_FUNCTOR

template <tq_codec C>
__global__ void __launch_bounds__(kThreads)
codec_kernel(const typename Codec<C>::In *__restrict__ in, int64_t in_ld,
             typename Codec<C>::Out *__restrict__ out, int64_t out_ld, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t r = i / cols, c = i - r * cols;
        out[r * out_ld + c] = Codec<C>::apply(in[r * in_ld + c]);
    }
}


template <tq_codec C>
void launch(const tq_tensor *in, tq_tensor *out, dim3 grid, cudaStream_t s) {
    codec_kernel<C><<<grid, kThreads, 0, s>>>(
        static_cast<const typename Codec<C>::In *>(in->data), in->ld,
        static_cast<typename Codec<C>::Out *>(out->data), out->ld, in->rows, in->cols);
}

tq_status run_codec(tq_codec codec, const tq_tensor *in, tq_tensor *out, cudaStream_t s) {
    const int64_t n = in->rows * in->cols;
    if (n == 0) return TQ_SUCCESS;
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, in->device);
    int64_t blocks = (n + kThreads * 4 - 1) / (kThreads * 4);
    if (blocks > 16LL * sms) blocks = 16LL * sms;
    const dim3 grid((unsigned)blocks);
    switch (codec) {
        case TQ_CODEC_F32_TO_E4M3: launch<TQ_CODEC_F32_TO_E4M3>(in, out, grid, s); break;
        case TQ_CODEC_F32_TO_E5M2: launch<TQ_CODEC_F32_TO_E5M2>(in, out, grid, s); break;
        case TQ_CODEC_F32_TO_E2M1: launch<TQ_CODEC_F32_TO_E2M1>(in, out, grid, s); break;
        case TQ_CODEC_F32_TO_E8M0: launch<TQ_CODEC_F32_TO_E8M0>(in, out, grid, s); break;
        case TQ_CODEC_F32_TO_BF16: launch<TQ_CODEC_F32_TO_BF16>(in, out, grid, s); break;
        case TQ_CODEC_F32_TO_F16: launch<TQ_CODEC_F32_TO_F16>(in, out, grid, s); break;
        case TQ_CODEC_E4M3_TO_F32: launch<TQ_CODEC_E4M3_TO_F32>(in, out, grid, s); break;
        case TQ_CODEC_E5M2_TO_F32: launch<TQ_CODEC_E5M2_TO_F32>(in, out, grid, s); break;
        case TQ_CODEC_E2M1_TO_F32: launch<TQ_CODEC_E2M1_TO_F32>(in, out, grid, s); break;
        case TQ_CODEC_E8M0_TO_F32: launch<TQ_CODEC_E8M0_TO_F32>(in, out, grid, s); break;
        default: return tq_fail(TQ_ERROR_INTERNAL, "codec: unhandled codec %d", (int)codec);
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("codec kernel launch");
    return TQ_SUCCESS;
}

}  // namespace

extern "C" tq_status tq_codec_cuda(tq_codec codec, const tq_tensor *in, tq_tensor *out,
                                   struct CUstream_st *stream) {
    if (in->rows * in->cols == 0) return TQ_SUCCESS; /* nothing to launch, no device needed */
    DeviceGuard guard(in->device);
    if (guard.status != cudaSuccess) return launch_failed("codec: making the tensors' device current");
    return run_codec(codec, in, out, reinterpret_cast<cudaStream_t>(stream));
}
