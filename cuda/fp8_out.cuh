/* fp8_out.cuh: the per-tensor FP8 output of the fused elementwise kernels (act_forward.cu,
 * act_backward.cu), internal to cuda/: the scale to cast with (DELAYED: the given one; CURRENT:
 * tq_scale_from_amax of the given amax), scale_inv = RN(1 / scale), chunks of 8 codes
 * cvt8(tq_mul(v, scale)) by fp_cast.cuh's cvt8x8, and the CTA's max |v| max-accumulated into the
 * amax slot by one atomicMax on the float's signed bits (quantize_fp8.cu's history-slot rule;
 * every CTA issues it, so a zero amax still replaces a negative slot, as the C reference does).
 * The same conventions as norm_forward.cu's outputs; the C side is csrc/core/internal_fused.h.
 * Tests: tests/test_act_kernels.py (GPU cases, bit for bit against the C references).
 */
#ifndef TEQUANT_CUDA_FP8_OUT_CUH_
#define TEQUANT_CUDA_FP8_OUT_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "chunks.cuh"
#include "fp_cast.cuh"
#include "tequant/formats.h"
#include "tequant/tequant.h"

namespace tq_fp8out {

using tq_chunk::kChunk;

struct Out {
    uint8_t *q;            /* codes [rows, cols], or NULL: none (no config, or no rows) */
    int64_t ld_q;
    float *scale_inv;      /* with a config */
    const float *scale;    /* DELAYED */
    const float *amax_in;  /* CURRENT */
    float *amax;           /* the slot to max-accumulate into, or NULL */
    float fmax, eps;
    int quantize, pow2, e5m2;
    int q_vec;             /* the codes' rows (and each half's start) are 8-byte aligned */
};

/* The host side: the members of a checked config and its tensors. */
inline Out make_out(const tq_quant_config *c, const tq_tensor &q, const tq_tensor &scale_inv,
                    const tq_tensor &scale, const tq_tensor &amax_in, const tq_tensor &amax) {
    Out o = {};
    o.amax = static_cast<float *>(amax.data);
    if (c == nullptr) return o;
    o.quantize = 1;
    o.q = static_cast<uint8_t *>(q.data);
    o.ld_q = q.ld;
    o.scale_inv = static_cast<float *>(scale_inv.data);
    o.scale = c->scaling == TQ_SCALING_DELAYED ? static_cast<const float *>(scale.data) : nullptr;
    o.amax_in =
        c->scaling == TQ_SCALING_CURRENT ? static_cast<const float *>(amax_in.data) : nullptr;
    o.fmax = c->fmax;
    o.eps = c->amax_epsilon;
    o.pow2 = (c->flags & TQ_QUANT_POW2_SCALE) != 0;
    o.e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    return o;
}

__device__ __forceinline__ float cast_scale(const Out &o) {
    if (!o.quantize) return 1.0f;
    if (o.scale != nullptr) return *o.scale;
    return tq_scale_from_amax(*o.amax_in, o.fmax, o.eps, o.pow2, TQ_FLT_MAX);
}

/* scale_inv, written once per launch (CTA 0, thread 0). */
__device__ __forceinline__ void write_scale_inv(const Out &o, float scale) {
    if (o.quantize && blockIdx.x == 0 && threadIdx.x == 0) *o.scale_inv = tq_rcp(scale);
}

/* A chunk's 8 codes cvt8(tq_mul(v, scale)) as two words (element 0 in the low byte). */
__device__ __forceinline__ void chunk_codes(const float (&v)[kChunk], float scale, int e5m2,
                                            uint32_t (&w)[2]) {
    float scaled[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; e++) scaled[e] = tq_mul(v[e], scale);
    tq_fp::cvt8x8(scaled, e5m2, w);
}

/* The n <= 8 valid codes of w at dst (one 8-byte store where whole and vec). */
__device__ __forceinline__ void store_words(uint8_t *dst, const uint32_t (&w)[2], int n, bool vec) {
    if (vec && n == kChunk) {
        *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            if (e < n) dst[e] = (uint8_t)(w[e / 4] >> (8 * (e % 4)));
    }
}

/* The n <= 8 valid codes of v at dst. */
__device__ __forceinline__ void store_codes(uint8_t *dst, const float (&v)[kChunk], float scale,
                                            int e5m2, int n, bool vec) {
    uint32_t w[2];
    chunk_codes(v, scale, e5m2, w);
    store_words(dst, w, n, vec);
}

/* The CTA's amax into the slot; every thread of the CTA calls it (kThreads of them). */
template <int kThreads>
__device__ __forceinline__ void block_amax(float *slot, float amax) {
    __shared__ float warp_amax[kThreads / 32];
    if (slot == nullptr) return; /* uniform */
    for (int offset = 16; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kThreads / 32; w++) amax = fmaxf(amax, warp_amax[w]);
        atomicMax(reinterpret_cast<int *>(slot), __float_as_int(amax));
    }
}

}  // namespace tq_fp8out

#endif  // TEQUANT_CUDA_FP8_OUT_CUH_
