/* act_table.cuh: the sigmoid-family activations (gelu, silu, qgelu) of bfloat16 inputs from a
 * table in shared memory, internal to cuda/ (act_forward.cu, act_backward.cu).
 *
 * Why: their exact arithmetic (internal_act.h: tequant's own e^x from RN operations, two IEEE
 * divisions) costs ~60 instructions per element, which made the fused kernels compute-bound at
 * about a third of HBM bandwidth (docs/results/bench_act.md). A bfloat16 x has 65536 values, and
 * act(x) (tq_act_value) and act'(x) (tq_act_deriv) depend on x alone, so each CTA first computes
 * them for the x of a window of exponents, with the same functions, into shared memory; the
 * element loop then reads the table and multiplies by g as tq_act_grad does. The bits are those
 * of the direct computation by construction; x outside the window (|x| < 2^-14 or >= 2^8, zero,
 * subnormals, Inf, NaN) is computed directly.
 * Window: sign x 22 exponents x 128 mantissas = 5632 entries, 22 KiB per table (value and
 * derivative: 44 KiB, under the 48 KiB of static shared memory). A CTA spends ~5632 evaluations
 * filling it, so the launches use it only where each CTA has many elements to amortize that
 * (tq_act_table::worth_it).
 * Tests: tests/test_act_kernels.py (GPU cases: bit-exact against the C reference, inputs inside
 * and outside the window).
 */
#ifndef TEQUANT_CUDA_ACT_TABLE_CUH_
#define TEQUANT_CUDA_ACT_TABLE_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "fp_cast.cuh"
#include "internal_act.h"

namespace tq_act_table {

constexpr int kExpLo = 127 - 14; /* biased exponent of 2^-14 */
constexpr int kExps = 22;        /* up to 2^7 .. 2^8 */
constexpr int kEntries = 2 * kExps * 128;
/* CTAs of the table launches (fewer and larger than the plain ones: each fills its table once) */
constexpr int kThreads = 512;
constexpr int kCtasPerSm = 2;

/* Whether kernels of this element type and base activation read a table. */
template <typename T, int kBase>
constexpr bool kUses = std::is_same<T, tq_fp::Bf16>::value &&
                       (kBase == TQ_ACT_GELU || kBase == TQ_ACT_SILU || kBase == TQ_ACT_QGELU);

/* The window is one run of |x|'s bits, (bits & 0x7FFF) in [kLoBits, kLoBits + kSpan) for either
 * sign, and an entry is sign * kSpan + that offset: the layout of (sign * kExps + exponent - kExpLo)
 * << 7 | mantissa in fewer integer instructions (the element loop is bound by the ALU pipe:
 * ncu, H200, 8192 x 16384 gelu forward at 81% ALU, docs/results/NOTES.md). */
constexpr unsigned kLoBits = (unsigned)kExpLo << 7;
constexpr unsigned kSpan = (unsigned)kExps << 7;

/* The offset of bf16 bits in the window's run (>= kSpan outside it). */
__device__ __forceinline__ unsigned offset(uint16_t bits) {
    return ((unsigned)bits & 0x7FFFu) - kLoBits;
}

/* The entry of bf16 bits, or -1 outside the window. */
__device__ __forceinline__ int index(uint16_t bits) {
    const unsigned off = offset(bits);
    return off < kSpan ? (int)(off + ((unsigned)bits >> 15) * kSpan) : -1;
}

__device__ __forceinline__ float x_of(int entry) {
    const unsigned sign = (unsigned)entry / (kExps * 128u);
    const unsigned rest = (unsigned)entry - sign * (kExps * 128u);
    const unsigned bits = sign << 15 | ((rest >> 7) + kExpLo) << 7 | (rest & 0x7Fu);
    return tq_bf16_to_f32((uint16_t)bits);
}

/* Every thread of the CTA fills the tables it is given (value and / or derivative), then waits
 * for the others. */
template <int kBase>
__device__ __forceinline__ void fill(float *value, float *deriv) {
    for (int i = threadIdx.x; i < kEntries; i += blockDim.x) {
        const float x = x_of(i);
        if (deriv != nullptr) {
            float v;
            deriv[i] = tq_act_deriv(kBase, x, &v);
            if (value != nullptr) value[i] = v;
        } else {
            value[i] = tq_act_value(kBase, x);
        }
    }
    __syncthreads();
}

/* The entries of a chunk's x where all are in the window (then returns true; otherwise at[]
 * holds nothing usable and the callers take index() element by element). Two elements a word:
 * one AND and one subtraction give both offsets (a borrow out of the low half only happens
 * when the low element is outside the window, and then nothing of at[] is used). */
template <int kN>
__device__ __forceinline__ bool entries(const tq_fp::Bf16 (&x)[kN], int (&at)[kN]) {
    static_assert(kN % 2 == 0, "entries takes whole words");
    bool all = true;
#pragma unroll
    for (int e = 0; e < kN; e += 2) {
        const uint32_t w = (uint32_t)x[e].bits | (uint32_t)x[e + 1].bits << 16;
        const uint32_t off = (w & 0x7FFF7FFFu) - (kLoBits << 16 | kLoBits);
        all &= off << 16 < kSpan << 16; /* the low offset */
        all &= off < kSpan << 16;       /* the high one */
        /* both signs' kSpan at once: inside the window no half carries into the other */
        const uint32_t both = off + (w >> 15 & 0x10001u) * kSpan;
        at[e] = (int)(both & 0xFFFFu);
        at[e + 1] = (int)(both >> 16);
    }
    return all;
}

/* act(x) of a chunk of n elements, tq_act_value's bits: when every x is in the window (the
 * common case) one branch and n independent table reads; element by element otherwise. */
template <int kBase, int kN>
__device__ __forceinline__ void values(const float *table, const tq_fp::Bf16 (&x)[kN],
                                       float (&y)[kN]) {
    int at[kN];
    if (entries(x, at)) {
#pragma unroll
        for (int e = 0; e < kN; e++) y[e] = table[at[e]];
        return;
    }
#pragma unroll
    for (int e = 0; e < kN; e++) {
        const int i = index(x[e].bits);
        y[e] = i >= 0 ? table[i] : tq_act_value(kBase, tq_fp::widen(x[e]));
    }
}

/* tq_act_grad(kBase, x, g, &v)'s bits for a chunk: d = RN(g * act'(x)), and v = act(x) where
 * value_table (and v) are given; the same fast path as values. */
template <int kBase, int kN>
__device__ __forceinline__ void grads(const float *value_table, const float *deriv_table,
                                      const tq_fp::Bf16 (&x)[kN], const float (&g)[kN],
                                      float (&d)[kN], float *v) {
    int at[kN];
    if (entries(x, at)) {
#pragma unroll
        for (int e = 0; e < kN; e++) {
            d[e] = tq_nmul(g[e], deriv_table[at[e]]);
            if (value_table != nullptr) v[e] = value_table[at[e]];
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < kN; e++) {
        float value;
        const int i = index(x[e].bits);
        if (i >= 0) {
            d[e] = tq_nmul(g[e], deriv_table[i]);
            value = value_table != nullptr ? value_table[i] : 0.0f;
        } else {
            d[e] = tq_act_grad(kBase, tq_fp::widen(x[e]), g[e], &value);
        }
        if (value_table != nullptr) v[e] = value;
    }
}

/* Whether a launch over `elements` is worth the tables: each CTA of the table launch must have
 * at least 4 elements per entry it computes (a direct element costs about what an entry does). */
inline bool worth_it(int64_t elements, int sms) {
    return elements >= (int64_t)4 * kEntries * kCtasPerSm * sms;
}

}  // namespace tq_act_table

#endif  // TEQUANT_CUDA_ACT_TABLE_CUH_
