/* norm_forward.cu: tq_norm_forward on CUDA: LayerNorm / RMSNorm of x [M, K] with, in the same
 * pass, the per-tensor FP8 codes of y (DELAYED / CURRENT scaling), max |y| and mean / rstd.
 *
 * Rule (tequant.h, NUMERICS.md 2 for the cast): every step is an internal_norm.h helper (one RN
 * operation, no FMA); the row sums (LayerNorm: S(v), then S(e) and S(e * e) about the first
 * mean, folded together, fused.h) follow tequant's order S, scheduled by norm_rows.cuh;
 * codes are cvt8(tq_mul(y, scale)) by the hardware's cvt.rn.satfinite, as quantize_fp8.cu casts
 * (the rule of formats.h's codec, which the CPU reference uses); y_hp is rounded by cvt.rn too
 * (formats.h's rule); amax is fmaxf(|y|) (NaN ignored) per CTA, then one atomicMax on the slot's signed bits
 * (quantize_fp8.cu's history-slot rule). So every output equals csrc/ref/norm_forward_ref.c bit
 * for bit, whatever the launch shape.
 *
 * y_q_t (the codes transposed, wgrad's operand): fast_kernel's kColT form writes it from shared
 * memory where colt_fits (16-bit x, K <= 4096, M % 32 == 0, no y_hp); else tq_transpose_cuda runs
 * on y_q after the norm (same bits either way).
 * Two kernels (fast_kernel's code is in norm_forward_fast.cuh, included below):
 * - fast_kernel (the common case: M > 0, K % 8 == 0, K <= 16384, x's rows 16-byte aligned, y_hp's
 *   too and y_q's 8-byte aligned when given, and the GPU holds one of its CTAs; else the other
 *   kernel runs). A CTA of kCta threads is kCta / kT independent groups of kT threads
 *   (kT = 32 .. 256), each on its own rows (grid-striding): a group's
 *   barriers are named ones (bar.sync 1 + group, kT), so a group waiting on its fold never holds
 *   up the others, and a warp-wide group (kT = 32) has no barrier at all. A thread loads its
 *   kC (4 or 8) whole chunks of the row once (16-byte loads, a warp reading 512 contiguous
 *   bytes), keeps them packed in registers for both sums and the output, and stores 16 bytes of
 *   y_hp and 8 of codes per chunk. gamma (RN(1 + gamma) when zero-centered) and beta are widened
 *   to FP32 once per CTA into shared memory (two planes of float4, conflict-free), so the output
 *   pass reads 4 floats per load and never converts them. No per-element bounds: K % 8 == 0, so
 *   every chunk of the row is whole.
 *   Why the bits are the reference's: (1) the sums: chunk c is thread c mod kT's slot j = c / kT,
 *   whose lane c mod 256 = t + (j mod 256/kT) * kT is accumulator acc[j mod 256/kT]; a thread
 *   visits its slots in increasing j, hence each lane's chunks in increasing c and each chunk's
 *   elements in index order, from +0; lanes without a chunk stay +0, as in the reference; the
 *   fold is group_fold (norm_rows.cuh's scheme: strides >= kT in the thread, down to 32 through
 *   shared memory, then the XOR butterfly). (2) gamma and beta in shared memory are the very
 *   values the reference computes (tq_norm_gamma of the exactly widened element, the widened
 *   beta). (3) LayerNorm without beta adds -0 instead of skipping the add: RN(y + -0) = y for
 *   every y (x + -0 is exact for x != 0, and -0 + -0 = -0, +0 + -0 = +0 under RN), so y keeps
 *   the reference's bits, signed zeros included. (4) fp16 x is widened by cvt.f32.f16, exact for
 *   every finite and infinite half (subnormals too: no .ftz); a NaN may keep another payload than
 *   formats.h's software widening gives, but no output takes it: every output of a NaN element
 *   goes through at least one FP32 add or multiply first (which returns the canonical NaN on
 *   the GPU), mean / rstd / y_hp are canonicalized, amax skips NaN and cvt8 of any NaN is 0x7F.
 * - norm_forward_kernel (everything else: odd K, misaligned or strided-by-odd rows, K > 16384,
 *   M = 0): a CTA of 256 threads works on 256 / kT rows at a time, kT threads per row (the least
 *   of 32, 64, 128, 256 with K <= 64 * kT), grid-striding over rows. A thread keeps its (at most
 *   8) chunks of the row in registers between the passes (16-byte loads when the rows are
 *   aligned, element loads otherwise and for a row's last, partial chunk); rows longer than
 *   16384 elements are read again from memory for each pass (kT = 256).
 * No sync, no allocation.
 * Tests: tests/test_norm_kernels.py (GPU cases: bit-exact against the CPU reference, both kernels).
 */
#include <cuda_runtime.h>

#include "internal_kernels.h"
#include "launch.cuh"
#include "norm_rows.cuh"
#include "tile_transpose.cuh"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_norm::Bf16;
using tq_norm::Chunk;
using tq_norm::Half;
using tq_norm::chunk_len;
using tq_norm::kChunk;
using tq_norm::kLanes;

constexpr int kThreads = 256;
constexpr int kCached = 8; /* chunks per thread held in registers across the passes */

struct FwdParams {
    const void *x;
    int64_t rows, cols, ld_x, nchunks;
    const void *gamma, *beta;
    int w_dtype, zero_centered, has_beta, rms;
    float eps;
    void *y_hp;
    int64_t ld_y;
    float *mean, *rstd, *amax;
    uint8_t *y_q;
    int64_t ld_q;
    uint8_t *y_q_t; /* [K, M] codes, y_q transposed (fast_kernel's kColT form writes it) */
    int64_t ld_qt;
    float *scale_inv;
    const float *scale;   /* DELAYED */
    const float *amax_in; /* CURRENT */
    float fmax, amax_eps;
    int quantize, pow2, e5m2; /* quantize: a config was given (y_q may be empty: M = 0) */
    int x_vec, y_vec, q_vec, w_vec; /* 16-byte rows of x, y_hp, gamma / beta; 8-byte rows of y_q */
};

__device__ __forceinline__ float cast_scale(const FwdParams &p) {
    if (!p.quantize) return 1.0f;
    if (p.scale != nullptr) return *p.scale;
    return tq_scale_from_amax(*p.amax_in, p.fmax, p.amax_eps, p.pow2, TQ_FLT_MAX);
}

/* y of chunk c (n valid elements of raw) into the outputs; amax over the valid ones. */
template <typename T>
__device__ __forceinline__ void write_chunk(const FwdParams &p, const Chunk<T> &raw, int64_t row,
                                            int64_t c, int n, float mean, float rstd, float scale,
                                            float &amax) {
    float g[kChunk], b[kChunk] = {}, y[kChunk];
    tq_norm::load_w(g, p.gamma, p.w_dtype, c, n, p.w_vec);
    if (p.has_beta) tq_norm::load_w(b, p.beta, p.w_dtype, c, n, p.w_vec);
#pragma unroll
    for (int e = 0; e < kChunk; e++) {
        const float xhat = tq_norm_xhat(tq_norm::widen(raw.t[e]), mean, rstd, p.rms);
        y[e] = tq_norm_y(xhat, tq_norm_gamma(g[e], p.zero_centered), b[e], p.has_beta);
        if (e < n) amax = tq_amax_step(amax, y[e]);
    }
    if (p.y_hp != nullptr) {
        float out[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; e++) out[e] = tq_norm_canon(y[e]);
        tq_norm::store_chunk(static_cast<T *>(p.y_hp) + row * p.ld_y, c, out, n, p.y_vec);
    }
    if (p.quantize) {
        float scaled[kChunk];
        uint32_t w[2];
#pragma unroll
        for (int e = 0; e < kChunk; e++) scaled[e] = tq_mul(y[e], scale);
        tq_norm::cvt8x8(scaled, p.e5m2, w);
        uint8_t *dst = p.y_q + row * p.ld_q + (int64_t)kChunk * c;
        if (p.q_vec && n == kChunk) {
            *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int e = 0; e < kChunk; e++)
                if (e < n) dst[e] = (uint8_t)(w[e / 4] >> (8 * (e % 4)));
        }
    }
}

/* What a pass adds for v: v itself (LayerNorm's first pass, into sum 0), v * v (RMSNorm, into
 * sum 0), or e = RN(v - m0) into sum 0 and RN(e * e) into sum 1 (LayerNorm's second pass). */
enum Term { kValue, kSquare, kDeviation };

__device__ __forceinline__ void add_term(float (&acc)[2], float v, Term what, float m0) {
    if (what == kValue) {
        acc[0] = tq_nadd(acc[0], v);
    } else if (what == kSquare) {
        acc[0] = tq_nadd(acc[0], tq_nmul(v, v));
    } else {
        const float e = tq_nsub(v, m0);
        acc[0] = tq_nadd(acc[0], e);
        acc[1] = tq_nadd(acc[1], tq_nmul(e, e));
    }
}

template <typename T, int kT, bool kCache>
__global__ void __launch_bounds__(kThreads) norm_forward_kernel(const FwdParams p) {
    constexpr int kSlots = kLanes / kT, kRows = kThreads / kT, kJ = kCache ? kCached : 1;
    __shared__ float red[2][2 * kThreads]; /* fold scratch (two sums), alternate buffers */
    __shared__ float warp_amax[kThreads / 32];
    const int t = threadIdx.x % kT, group = threadIdx.x / kT;
    const T *x = static_cast<const T *>(p.x);
    const float scale = cast_scale(p);
    if (blockIdx.x == 0 && threadIdx.x == 0 && p.quantize) *p.scale_inv = tq_rcp(scale);
    float amax = 0.0f;
    int buf = 0;
    for (int64_t row0 = (int64_t)blockIdx.x * kRows; row0 < p.rows;
         row0 += (int64_t)gridDim.x * kRows) {
        const int64_t row = row0 + group;
        const bool active = row < p.rows; /* idle groups still join every fold */
        const T *xr = x + (active ? row : 0) * p.ld_x;
        Chunk<T> raw[kJ];
        if constexpr (kCache) {
#pragma unroll
            for (int j = 0; j < kJ; j++) {
                const int64_t c = t + (int64_t)j * kT;
                const int n = active ? chunk_len(c, p.cols) : 0;
                if (n > 0) tq_norm::load_chunk(raw[j], xr, c, n, p.x_vec);
            }
        }
        float m0 = 0.0f, sum[2];
        const int n_passes = p.rms ? 1 : 2;
        for (int pass = 0; pass < n_passes; pass++) {
            const Term what = p.rms ? kSquare : (pass == 0 ? kValue : kDeviation);
            float acc[2][kSlots]; /* the lanes' sums, [sum][slot] as tq_norm::fold takes them */
#pragma unroll
            for (int k = 0; k < kSlots; k++) acc[0][k] = acc[1][k] = 0.0f;
            if constexpr (kCache) {
#pragma unroll
                for (int j = 0; j < kJ; j++) {
                    const int n = active ? chunk_len(t + (int64_t)j * kT, p.cols) : 0;
#pragma unroll
                    for (int e = 0; e < kChunk; e++)
                        if (e < n) {
                            float a[2] = {acc[0][j % kSlots], acc[1][j % kSlots]};
                            add_term(a, tq_norm::widen(raw[j].t[e]), what, m0);
                            acc[0][j % kSlots] = a[0], acc[1][j % kSlots] = a[1];
                        }
                }
            } else { /* kT == 256: one lane per thread */
                for (int64_t c = t; active && c < p.nchunks; c += kT) {
                    const int n = chunk_len(c, p.cols);
                    tq_norm::load_chunk(raw[0], xr, c, n, p.x_vec);
#pragma unroll
                    for (int e = 0; e < kChunk; e++)
                        if (e < n) {
                            float a[2] = {acc[0][0], acc[1][0]};
                            add_term(a, tq_norm::widen(raw[0].t[e]), what, m0);
                            acc[0][0] = a[0], acc[1][0] = a[1];
                        }
                }
            }
            /* both sums folded in every pass (the second is +0 but in LayerNorm's second):
             * this kernel is the general fallback, one fold form keeps it short */
            tq_norm::fold<kT, 2>(acc, red[buf] + group * 2 * kT, t, sum);
            buf ^= 1;
            if (pass == 0 && !p.rms) m0 = tq_norm_mean(sum[0], p.cols);
        }
        const float mean = p.rms ? 0.0f : tq_norm_mean_fixed(m0, sum[0], p.cols);
        const float rstd = p.rms ? tq_norm_rstd(sum[0], p.cols, p.eps)
                                 : tq_norm_rstd_of_var(tq_norm_var_fixed(sum[0], sum[1], p.cols),
                                                       p.eps);
        if (!active) continue;
        if (t == 0) {
            if (p.mean != nullptr) p.mean[row] = tq_norm_canon(mean);
            if (p.rstd != nullptr) p.rstd[row] = tq_norm_canon(rstd);
        }
        if constexpr (kCache) {
#pragma unroll
            for (int j = 0; j < kJ; j++) {
                const int64_t c = t + (int64_t)j * kT;
                const int n = chunk_len(c, p.cols);
                if (n > 0) write_chunk<T>(p, raw[j], row, c, n, mean, rstd, scale, amax);
            }
        } else {
            for (int64_t c = t; c < p.nchunks; c += kT) {
                const int n = chunk_len(c, p.cols);
                tq_norm::load_chunk(raw[0], xr, c, n, p.x_vec);
                write_chunk<T>(p, raw[0], row, c, n, mean, rstd, scale, amax);
            }
        }
    }
    if (p.amax != nullptr) {
        for (int offset = 16; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < kThreads / 32; w++) amax = fmaxf(amax, warp_amax[w]);
            /* Signed compare of the bits, as the reference's slot rule; issued by every CTA
             * (also one that saw no row) so a zero amax still replaces a negative slot. */
            atomicMax(reinterpret_cast<int *>(p.amax), __float_as_int(amax));
        }
    }
}

#include "norm_forward_fast.cuh" /* fast_kernel, launch_fast, fast_fits */

template <typename T, int kT, bool kCache>
void launch_as(const FwdParams &p, int sms, cudaStream_t s) {
    constexpr int kRows = kThreads / kT;
    int64_t grid = (p.rows + kRows - 1) / kRows;
    const int64_t cap = 8LL * sms; /* a full GPU of 256-thread CTAs, each striding over rows */
    if (grid > cap) grid = cap;
    if (grid < 1) grid = 1; /* M = 0: scale_inv and the amax slot still follow the rule */
    norm_forward_kernel<T, kT, kCache><<<(unsigned)grid, kThreads, 0, s>>>(p);
}

template <typename T>
void launch(const FwdParams &p, int sms, cudaStream_t s) {
    const int64_t per_thread = kCached;
    if (p.nchunks <= per_thread * 32) launch_as<T, 32, true>(p, sms, s);
    else if (p.nchunks <= per_thread * 64) launch_as<T, 64, true>(p, sms, s);
    else if (p.nchunks <= per_thread * 128) launch_as<T, 128, true>(p, sms, s);
    else if (p.nchunks <= per_thread * 256) launch_as<T, 256, true>(p, sms, s);
    else launch_as<T, 256, false>(p, sms, s);
}

}  // namespace

extern "C" tq_status tq_norm_forward_cuda(const tq_tensor *x, const tq_norm_forward_args *a,
                                          struct CUstream_st *stream) {
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess)
        return cuda_failed("norm forward: making x's device current", guard.status);
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    const size_t elem = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    FwdParams p = {};
    p.x = x->data;
    p.rows = x->rows;
    p.cols = x->cols;
    p.ld_x = x->ld;
    p.nchunks = (x->cols + kChunk - 1) / kChunk;
    p.gamma = a->gamma.data;
    p.beta = a->beta.data;
    p.w_dtype = (int)a->gamma.dtype;
    p.zero_centered = (a->flags & TQ_NORM_ZERO_CENTERED_GAMMA) != 0;
    p.has_beta = a->beta.data != nullptr;
    p.rms = a->norm == TQ_NORM_RMSNORM;
    p.eps = a->eps;
    p.y_hp = a->y_hp.data;
    p.ld_y = a->y_hp.ld;
    p.mean = static_cast<float *>(a->mean.data);
    p.rstd = static_cast<float *>(a->rstd.data);
    p.amax = static_cast<float *>(a->amax.data);
    p.x_vec = tq_norm::rows_aligned16(x->data, x->ld, elem);
    p.y_vec = p.y_hp != nullptr && tq_norm::rows_aligned16(p.y_hp, p.ld_y, elem);
    p.w_vec = tq_norm::aligned(p.gamma, 16) && (!p.has_beta || tq_norm::aligned(p.beta, 16));
    if (a->config != nullptr) {
        const tq_quant_config *c = a->config;
        p.quantize = 1;
        p.y_q = static_cast<uint8_t *>(a->y_q.data);
        p.ld_q = a->y_q.ld;
        p.q_vec = tq_norm::aligned(p.y_q, 8) && p.ld_q % 8 == 0;
        p.scale_inv = static_cast<float *>(a->scale_inv.data);
        p.scale = c->scaling == TQ_SCALING_DELAYED ? static_cast<const float *>(a->scale.data) : nullptr;
        p.amax_in = c->scaling == TQ_SCALING_CURRENT ? static_cast<const float *>(a->amax_in.data) : nullptr;
        p.fmax = c->fmax;
        p.amax_eps = c->amax_epsilon;
        p.pow2 = (c->flags & TQ_QUANT_POW2_SCALE) != 0;
        p.e5m2 = c->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
        p.y_q_t = static_cast<uint8_t *>(a->y_q_t.data);
        p.ld_qt = a->y_q_t.ld;
    }
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x->device);
    bool launched = false, wrote_t = false;
    if (colt_fits(p, elem)) {
        if (x->dtype == TQ_DTYPE_BFLOAT16)
            launched = p.rms ? launch_fast<Bf16, true, true>(p, sms, s)
                             : launch_fast<Bf16, false, true>(p, sms, s);
        else
            launched = p.rms ? launch_fast<Half, true, true>(p, sms, s)
                             : launch_fast<Half, false, true>(p, sms, s);
        wrote_t = launched;
    }
    if (!launched && fast_fits(p)) {
        switch (x->dtype) {
            case TQ_DTYPE_FLOAT32:
                launched = p.rms ? launch_fast<float, true>(p, sms, s)
                                 : launch_fast<float, false>(p, sms, s);
                break;
            case TQ_DTYPE_BFLOAT16:
                launched = p.rms ? launch_fast<Bf16, true>(p, sms, s)
                                 : launch_fast<Bf16, false>(p, sms, s);
                break;
            default:
                launched = p.rms ? launch_fast<Half, true>(p, sms, s)
                                 : launch_fast<Half, false>(p, sms, s);
                break;
        }
    }
    if (!launched) {
        switch (x->dtype) {
            case TQ_DTYPE_FLOAT32: launch<float>(p, sms, s); break;
            case TQ_DTYPE_BFLOAT16: launch<Bf16>(p, sms, s); break;
            default: launch<Half>(p, sms, s); break;
        }
    }
    const cudaError_t err = cudaGetLastError(); /* cleared: must not poison later calls */
    if (err != cudaSuccess) return cuda_failed("norm forward kernel launch", err);
    /* y_q_t where the kernel that ran does not write it: the codes transposed after it */
    if (p.y_q_t != nullptr && !wrote_t && x->rows > 0) {
        tq_tensor y_q_t = a->y_q_t;
        return tq_transpose_cuda(&a->y_q, &y_q_t, stream);
    }
    return TQ_SUCCESS;
}
