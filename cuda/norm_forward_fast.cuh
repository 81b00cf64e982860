/* norm_forward_fast.cuh: norm_forward.cu's fast_kernel (whole chunks, aligned rows, K <= 16384;
 * with y_q_t written from shared memory: tiles of 32 rows, K <= 4096) and its launch: what it
 * computes, and why its bits are the reference's, is in norm_forward.cu's opening comment.
 * Included by norm_forward.cu alone, inside its anonymous namespace, after FwdParams and the
 * shared pieces it uses (a part of that translation unit kept in its own file for size). Tests: tests/test_norm_kernels.py (GPU cases), tests/test_sanitize_kernels.py.
 */
#pragma once
constexpr int kFastMaxChunks = 2048; /* K <= 16384 */

/* 8 elements of x (one chunk, kVecs<T> uint4) widened exactly to FP32. */
template <typename T>
constexpr int kVecs = (int)sizeof(T) / 2;

/* FP32: the bits as they are, through a volatile asm so that each pass reads the loaded registers
 * again (else the compiler keeps RN(v - mean) of the variance pass for the output pass: more
 * live registers than the cap, spills). */
__device__ __forceinline__ void widen8(const uint4 (&u)[2], float (&v)[kChunk], const float *) {
    const uint32_t w[8] = {u[0].x, u[0].y, u[0].z, u[0].w, u[1].x, u[1].y, u[1].z, u[1].w};
#pragma unroll
    for (int e = 0; e < kChunk; e++) asm volatile("mov.b32 %0, %1;" : "=f"(v[e]) : "r"(w[e]));
}
/* bf16 is the top half of an FP32: the low element of a word shifted up, the high one masked
 * (tq_bf16_to_f32 of each). In volatile asm so that the compiler widens again in each pass
 * rather than keeping the 64 widened values of a thread live across the passes (spills). */
__device__ __forceinline__ void widen8(const uint4 (&u)[1], float (&v)[kChunk], const Bf16 *) {
    const uint32_t w[4] = {u[0].x, u[0].y, u[0].z, u[0].w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        asm volatile("{\n\tshl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xFFFF0000;\n\t}"
                     : "=f"(v[2 * i]), "=f"(v[2 * i + 1])
                     : "r"(w[i]));
}
/* cvt.f32.f16: exact for every non-NaN half, subnormals included (see the header for NaNs);
 * volatile as for bf16. */
__device__ __forceinline__ void widen8(const uint4 (&u)[1], float (&v)[kChunk], const Half *) {
    const uint32_t w[4] = {u[0].x, u[0].y, u[0].z, u[0].w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        asm volatile("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\t"
            "cvt.f32.f16 %1, hi;\n\t}"
            : "=f"(v[2 * i]), "=f"(v[2 * i + 1])
            : "r"(w[i]));
}

/* Element i of gamma / beta (run-time dtype) widened exactly, as tq_norm_vec_load does. */
__device__ __forceinline__ float load_w1(const void *w, int dtype, int64_t i) {
    if (dtype == TQ_DTYPE_FLOAT32) return static_cast<const float *>(w)[i];
    if (dtype == TQ_DTYPE_BFLOAT16) return tq_norm::widen(static_cast<const Bf16 *>(w)[i]);
    return tq_norm::widen(static_cast<const Half *>(w)[i]);
}

/* Waits for the kT threads of one group (named barrier `id`; kT a multiple of 32). Orders their
 * shared-memory accesses like __syncthreads does for a CTA. */
__device__ __forceinline__ void group_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* S's fold of the 256 lanes of kN sums at once over a group of kT threads, returned to every
 * thread of the group in out: norm_rows.cuh's fold (the same additions of the same pairs in the
 * same order: strides >= kT in the thread, strides kT/2 .. 32 through the group's kN * kT floats
 * of shared memory `red`, strides 16 .. 1 as the XOR butterfly) with the group's own barrier
 * instead of the CTA's. acc[i][k] is lane t + k * kT of sum i. Consecutive calls must alternate
 * between two scratch buffers (the barrier inside a call orders the reads of the call before it
 * ahead of the next call's writes). */
template <int kT, int kN>
__device__ __forceinline__ void group_fold(float (&acc)[kN][kLanes / kT], float *red, int t,
                                           int bar, float (&out)[kN]) {
#pragma unroll
    for (int s = kLanes / 2; s >= kT; s /= 2) {
#pragma unroll
        for (int k = 0; k < s / kT; k++)
#pragma unroll
            for (int i = 0; i < kN; i++) acc[i][k] = tq_nadd(acc[i][k], acc[i][k + s / kT]);
    }
    float v[kN];
#pragma unroll
    for (int i = 0; i < kN; i++) v[i] = acc[i][0];
    if constexpr (kT > 32) {
#pragma unroll
        for (int i = 0; i < kN; i++) red[i * kT + t] = v[i];
        group_sync(bar, kT);
        const int l = t & 31;
        float w[kN][kT / 32]; /* lanes l + 32q */
#pragma unroll
        for (int q = 0; q < kT / 32; q++)
#pragma unroll
            for (int i = 0; i < kN; i++) w[i][q] = red[i * kT + l + 32 * q];
#pragma unroll
        for (int s = kT / 2; s >= 32; s /= 2) {
#pragma unroll
            for (int q = 0; q < s / 32; q++)
#pragma unroll
                for (int i = 0; i < kN; i++) w[i][q] = tq_nadd(w[i][q], w[i][q + s / 32]);
        }
#pragma unroll
        for (int i = 0; i < kN; i++) v[i] = w[i][0];
    }
#pragma unroll
    for (int s = 16; s >= 1; s /= 2)
#pragma unroll
        for (int i = 0; i < kN; i++) v[i] = tq_nadd(v[i], __shfl_xor_sync(0xffffffffu, v[i], s));
#pragma unroll
    for (int i = 0; i < kN; i++) out[i] = v[i];
}

/* What the output pass of fast_kernel writes, chosen once per launch: the fused norm's common
 * calls without a run-time test per chunk (E4M3 codes with the history slot's amax: delayed
 * scaling; E4M3 codes alone: current scaling's cast run; amax alone: its first run), else kAny:
 * whatever p asks for. */
enum WriteMode { kAny, kCodesAmax, kCodes, kAmax };

/* y of one whole chunk (raw: its packed x; c: its index) into the outputs, and amax. g, b: the
 * staged gamma / beta; yrow, qrow: the row of y_hp / y_q (only where given). */
template <typename T, bool kRms, int kMode, bool kStage>
__device__ __forceinline__ void fast_write(const FwdParams &p, const uint4 (&raw)[kVecs<T>],
                                           int c, const float4 *g, const float4 *b, int nch,
                                           float mean, float rstd, float scale, T *yrow,
                                           uint2 *qrow, uint32_t *srow, float &amax) {
    constexpr bool kWantAmax = kMode == kAny || kMode == kCodesAmax || kMode == kAmax;
    constexpr bool kWantCodes = kMode == kCodesAmax || kMode == kCodes;
    float v[kChunk], y[kChunk];
    widen8(raw, v, static_cast<const T *>(nullptr));
    const float4 g0 = g[c], g1 = g[nch + c];
    const float gv[kChunk] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    if constexpr (kRms) {
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            y[e] = tq_norm_y(tq_norm_xhat(v[e], 0.0f, rstd, 1), gv[e], 0.0f, 0);
    } else {
        const float4 b0 = b[c], b1 = b[nch + c];
        const float bv[kChunk] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int e = 0; e < kChunk; e++)
            y[e] = tq_norm_y(tq_norm_xhat(v[e], mean, rstd, 0), gv[e], bv[e], 1);
    }
    if constexpr (kWantAmax) {
#pragma unroll
        for (int e = 0; e < kChunk; e++) amax = tq_amax_step(amax, y[e]);
    }
    if (kMode == kAny && yrow != nullptr) {
        float o[kChunk]; /* tq_norm_canon: NaN -> 0x7FFFFFFF */
#pragma unroll
        for (int e = 0; e < kChunk; e++) o[e] = isnan(y[e]) ? __uint_as_float(0x7FFFFFFFu) : y[e];
        uint4 *dst = reinterpret_cast<uint4 *>(yrow) + kVecs<T> * c;
        if constexpr (kVecs<T> == 1) {
            const T *tag = nullptr;
            dst[0] = make_uint4(
                tq_norm::narrow2(o[0], o[1], tag), tq_norm::narrow2(o[2], o[3], tag),
                tq_norm::narrow2(o[4], o[5], tag), tq_norm::narrow2(o[6], o[7], tag));
        } else {
            dst[0] = make_uint4(__float_as_uint(o[0]), __float_as_uint(o[1]), __float_as_uint(o[2]),
                                __float_as_uint(o[3]));
            dst[1] = make_uint4(__float_as_uint(o[4]), __float_as_uint(o[5]), __float_as_uint(o[6]),
                                __float_as_uint(o[7]));
        }
    }
    if (kWantCodes || (kMode == kAny && qrow != nullptr)) {
        float scaled[kChunk];
        uint32_t w[2];
#pragma unroll
        for (int e = 0; e < kChunk; e++) scaled[e] = tq_mul(y[e], scale);
        tq_norm::cvt8x8(scaled, kMode == kAny && p.e5m2, w);
        qrow[c] = make_uint2(w[0], w[1]);
        if constexpr (kStage) srow[2 * c] = w[0], srow[2 * c + 1] = w[1]; /* 4-byte aligned */
    }
}

/* The output pass over a thread's chunks of one row (kStage: its codes into srow too). */
template <typename T, int kT, int kC, bool kRms, bool kFull, int kMode, bool kStage>
__device__ __forceinline__ void fast_write_row(const FwdParams &p,
                                               const uint4 (&raw)[kC][kVecs<T>], int t,
                                               const float4 *g, const float4 *b, int nch,
                                               float mean, float rstd, float scale, T *yrow,
                                               uint2 *qrow, uint32_t *srow, float &amax) {
#pragma unroll
    for (int j = 0; j < kC; j++) {
        const int c = t + j * kT;
        if (kFull || c < nch)
            fast_write<T, kRms, kMode, kStage>(p, raw[j], c, g, b, nch, mean, rstd, scale, yrow,
                                               qrow, srow, amax);
    }
}

/* kColT: the rows of a tile of kTileRows, staged in shared memory as codes (a row K + 4 bytes
 * apart), leave as columns of y_q_t (tile_transpose.cuh's store_columns32: whole 32-byte
 * sectors; a 16-row form, half a sector per CTA, measured 2.5-4x slower than the norm plus
 * the transpose). */
constexpr int kTileRows = 32;

__host__ __device__ constexpr int64_t stage_ld(int64_t cols) { return cols + 4; }

/* kT threads per row, kC chunks per thread, kCta threads per CTA; kFull: every row is exactly
 * kT * kC chunks (no bounds at all). Registers are capped so that 1024 threads fit an SM when
 * the packed row takes at most 32 registers per thread (else 512). kColT (E4M3 codes without
 * y_hp, M % 32 == 0: colt_fits): the CTA takes tiles of 32 consecutive rows (its groups split
 * a tile's rows), stages their codes in shared memory after gamma / beta and writes y_q_t's
 * columns of the tile (store_columns32) before the next; each row is computed as without it. */
template <typename T, int kT, int kC, bool kRms, bool kFull, int kCta, bool kColT>
__global__ void __launch_bounds__(kCta, (kC * kVecs<T> <= 8 ? 1024 : 512) / kCta)
    fast_kernel(const FwdParams p) {
    constexpr int kV = kVecs<T>, kSlots = kLanes / kT, kGroups = kCta / kT;
    /* named barriers 1..15, one per group of more than a warp */
    static_assert(kT % 32 == 0 && kT <= kLanes && kGroups >= 1 && (kT == 32 || kGroups <= 15),
                  "layout");
    /* gamma then beta: chunk c's elements 0..3 at [c], 4..7 at [nchunks + c] of each */
    extern __shared__ float4 w_smem[];
    __shared__ float red[2][2 * kCta]; /* fold scratch, alternate buffers, 2 kT floats a group */
    __shared__ float warp_amax[kCta / 32];
    const int nch = kFull ? kT * kC : (int)p.nchunks;
    const float4 *g_sm = w_smem, *b_sm = w_smem + 2 * nch;
    for (int64_t i = threadIdx.x; i < p.cols; i += kCta) {
        const int c = (int)(i / kChunk), e = (int)(i % kChunk);
        const int at = 4 * ((e < 4 ? 0 : nch) + c) + (e & 3);
        reinterpret_cast<float *>(w_smem)[at] =
            tq_norm_gamma(load_w1(p.gamma, p.w_dtype, i), p.zero_centered);
        if constexpr (!kRms)
            reinterpret_cast<float *>(w_smem)[8 * nch + at] =
                p.has_beta ? load_w1(p.beta, p.w_dtype, i) : -0.0f;
    }
    __syncthreads();

    const int t = threadIdx.x % kT, group = threadIdx.x / kT, bar = 1 + group;
    const float scale = cast_scale(p);
    if (blockIdx.x == 0 && threadIdx.x == 0 && p.quantize) *p.scale_inv = tq_rcp(scale);
    const bool codes_only = p.quantize && !p.e5m2 && p.y_hp == nullptr;
    const int mode = codes_only ? (p.amax != nullptr ? kCodesAmax : kCodes)
                     : (!p.quantize && p.y_hp == nullptr && p.amax != nullptr) ? kAmax : kAny;
    float amax = 0.0f;
    int buf = 0;
    auto do_row = [&](int64_t row, uint32_t *srow) {
        const uint4 *xr =
            reinterpret_cast<const uint4 *>(static_cast<const T *>(p.x) + row * p.ld_x);
        uint4 raw[kC][kV];
#pragma unroll
        for (int j = 0; j < kC; j++) {
            const int c = t + j * kT;
#pragma unroll
            for (int i = 0; i < kV; i++)
                raw[j][i] = kFull || c < nch ? __ldg(xr + kV * c + i) : make_uint4(0u, 0u, 0u, 0u);
        }
        float acc[1][kSlots], sum[1];
#pragma unroll
        for (int k = 0; k < kSlots; k++) acc[0][k] = 0.0f;
#pragma unroll
        for (int j = 0; j < kC; j++) {
            if (kFull || t + j * kT < nch) {
                float v[kChunk];
                widen8(raw[j], v, static_cast<const T *>(nullptr));
#pragma unroll
                for (int e = 0; e < kChunk; e++)
                    acc[0][j % kSlots] =
                        tq_nadd(acc[0][j % kSlots], kRms ? tq_nmul(v[e], v[e]) : v[e]);
            }
        }
        group_fold<kT, 1>(acc, &red[buf][group * 2 * kT], t, bar, sum);
        buf ^= 1;
        float mean = 0.0f, rstd;
        if constexpr (!kRms) {
            /* the second pass: e = RN(v - m0) and RN(e * e), folded together (fused.h) */
            const float m0 = tq_norm_mean(sum[0], p.cols);
            float acc2[2][kSlots], sum2[2];
#pragma unroll
            for (int k = 0; k < kSlots; k++) acc2[0][k] = acc2[1][k] = 0.0f;
#pragma unroll
            for (int j = 0; j < kC; j++) {
                if (kFull || t + j * kT < nch) {
                    float v[kChunk];
                    widen8(raw[j], v, static_cast<const T *>(nullptr));
#pragma unroll
                    for (int e = 0; e < kChunk; e++) {
                        const float d = tq_nsub(v[e], m0);
                        acc2[0][j % kSlots] = tq_nadd(acc2[0][j % kSlots], d);
                        acc2[1][j % kSlots] = tq_nadd(acc2[1][j % kSlots], tq_nmul(d, d));
                    }
                }
            }
            group_fold<kT, 2>(acc2, &red[buf][group * 2 * kT], t, bar, sum2);
            buf ^= 1;
            mean = tq_norm_mean_fixed(m0, sum2[0], p.cols);
            rstd = tq_norm_rstd_of_var(tq_norm_var_fixed(sum2[0], sum2[1], p.cols), p.eps);
        } else {
            rstd = tq_norm_rstd(sum[0], p.cols, p.eps);
        }
        if (t == 0) {
            if (p.mean != nullptr) p.mean[row] = tq_norm_canon(mean);
            if (p.rstd != nullptr) p.rstd[row] = tq_norm_canon(rstd);
        }
        T *yrow = p.y_hp != nullptr ? static_cast<T *>(p.y_hp) + row * p.ld_y : nullptr;
        uint2 *qrow = p.quantize ? reinterpret_cast<uint2 *>(p.y_q + row * p.ld_q) : nullptr;
#define TQ_FAST_WRITE_ROW(mode_)                                                          \
    fast_write_row<T, kT, kC, kRms, kFull, mode_, kColT>(p, raw, t, g_sm, b_sm, nch, mean, \
                                                         rstd, scale, yrow, qrow, srow, amax)
        if (mode == kCodesAmax) TQ_FAST_WRITE_ROW(kCodesAmax);
        else if (kColT || mode == kCodes) TQ_FAST_WRITE_ROW(kCodes);
        else if (mode == kAmax) TQ_FAST_WRITE_ROW(kAmax);
        else TQ_FAST_WRITE_ROW(kAny);
#undef TQ_FAST_WRITE_ROW
    };
    if constexpr (kColT) {
        uint8_t *stage = reinterpret_cast<uint8_t *>(w_smem + (kRms ? 2 : 4) * nch);
        const int64_t tiles = p.rows / kTileRows;
        for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            for (int i = group; i < kTileRows; i += kGroups)
                do_row(tile * kTileRows + i,
                       reinterpret_cast<uint32_t *>(stage + i * stage_ld(p.cols)));
            __syncthreads(); /* the tile's codes are staged */
            tq_tile::store_columns32<kCta>(stage, stage_ld(p.cols), (int)p.cols,
                                           p.y_q_t + tile * kTileRows, p.ld_qt);
            __syncthreads(); /* read before the next tile overwrites them */
        }
    } else {
        for (int64_t row = (int64_t)blockIdx.x * kGroups + group; row < p.rows;
             row += (int64_t)gridDim.x * kGroups)
            do_row(row, nullptr);
    }
    if (p.amax != nullptr) {
        for (int offset = 16; offset > 0; offset >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < kCta / 32; w++) amax = fmaxf(amax, warp_amax[w]);
            atomicMax(reinterpret_cast<int *>(p.amax), __float_as_int(amax)); /* as above */
        }
    }
}

/* Launches fast_kernel; false (nothing launched, no error left pending) where this GPU cannot
 * hold one of its CTAs (shared memory: 136 KiB for LayerNorm at K = 16384; GPUs that JIT the
 * PTX may have less), and the caller runs the general kernel instead. */
template <typename T, int kT, int kC, bool kRms, bool kFull, int kCta, bool kColT>
bool launch_fast_kernel(const FwdParams &p, int sms, cudaStream_t s) {
    constexpr int kGroups = kCta / kT;
    static_assert(!kColT || kTileRows % kGroups == 0, "a tile's rows split evenly");
    const auto kernel = fast_kernel<T, kT, kC, kRms, kFull, kCta, kColT>;
    /* FP32 gamma (and beta): K floats each, at most 128 KiB (kColT: and a tile of codes); with
     * the static fold scratch past 48 KiB the kernel must opt in to more dynamic memory */
    const size_t smem = (kRms ? 1 : 2) * (size_t)p.cols * sizeof(float)
                        + (kColT ? (size_t)(kTileRows * stage_ld(p.cols)) : 0);
    if (smem + sizeof(float) * (4 * kCta + kCta / 32) > 48 * 1024
        && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)
               != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    /* one wave of CTAs striding over the rows (each stages gamma once) */
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCta, smem) != cudaSuccess
        || per_sm < 1) {
        (void)cudaGetLastError();
        return false;
    }
    int64_t grid = kColT ? p.rows / kTileRows : (p.rows + kGroups - 1) / kGroups;
    const int64_t cap = (int64_t)sms * per_sm;
    if (grid > cap) grid = cap;
    kernel<<<(unsigned)grid, kCta, smem, s>>>(p);
    return true;
}

template <typename T, int kT, int kC, bool kRms, int kCta, bool kColT>
bool launch_fast_as(const FwdParams &p, int sms, cudaStream_t s) {
    if (p.nchunks == (int64_t)kT * kC)
        return launch_fast_kernel<T, kT, kC, kRms, true, kCta, kColT>(p, sms, s);
    return launch_fast_kernel<T, kT, kC, kRms, false, kCta, kColT>(p, sms, s);
}

/* kT and kC by row length: the fewest threads per row that hold it in kC <= 8 (16-bit) or
 * kC <= 4 (FP32; 8 for K > 8192) chunks of registers. kColT (16-bit x, K <= 4096: colt_fits):
 * at K > 2048 one CTA of 1024 threads an SM (its 132 KiB tile of codes leaves room for one),
 * 128 threads a row. */
template <typename T, bool kRms, bool kColT = false>
bool launch_fast(const FwdParams &p, int sms, cudaStream_t s) {
    const int64_t n = p.nchunks;
    if (n <= 128) return launch_fast_as<T, 32, 4, kRms, 512, kColT>(p, sms, s);
    if constexpr (sizeof(T) == 2) {
        if (n <= 256) return launch_fast_as<T, 32, 8, kRms, 512, kColT>(p, sms, s);
        if (kColT) return launch_fast_as<T, 128, 4, kRms, 1024, kColT>(p, sms, s);
        if (n <= 512) return launch_fast_as<T, 64, 8, kRms, 512, false>(p, sms, s);
        if (n <= 1024) return launch_fast_as<T, 128, 8, kRms, 512, false>(p, sms, s);
        return launch_fast_as<T, 256, 8, kRms, 1024, false>(p, sms, s);
    } else {
        static_assert(!kColT, "kColT is instantiated for 16-bit x only");
        if (n <= 256) return launch_fast_as<T, 64, 4, kRms, 512, false>(p, sms, s);
        if (n <= 512) return launch_fast_as<T, 128, 4, kRms, 512, false>(p, sms, s);
        if (n <= 1024) return launch_fast_as<T, 256, 4, kRms, 1024, false>(p, sms, s);
        return launch_fast_as<T, 256, 8, kRms, 512, false>(p, sms, s);
    }
}

/* The fast kernel takes the call: rows, whole chunks, aligned rows of every matrix given. */
bool fast_fits(const FwdParams &p) {
    return p.rows > 0 && p.cols % kChunk == 0 && p.nchunks <= kFastMaxChunks && p.x_vec &&
           (p.y_hp == nullptr || p.y_vec) && (!p.quantize || p.q_vec);
}

/* ... and writes y_q_t itself (kColT): E4M3 codes without y_hp (its two write modes), whole
 * tiles of 32 rows, 8-byte aligned columns of y_q_t, K <= 4096 (a tile of codes in shared memory). */
bool colt_fits(const FwdParams &p, size_t elem) {
    return p.y_q_t != nullptr && fast_fits(p) && elem == 2 && p.quantize && !p.e5m2
           && p.y_hp == nullptr && p.rows % kTileRows == 0 && p.nchunks <= 512
           && tq_norm::aligned(p.y_q_t, 8) && p.ld_qt % 8 == 0;
}
