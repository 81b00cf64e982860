/* quantize_mxfp8.cu: the MXFP8 quantizer on CUDA (NUMERICS.md 2 "MXFP8", TE_REFERENCE A.4 / 6.4).
 *
 * Rule: per block (1x32 along K rowwise, 32x1 along M columnwise, or one 32x32 tile for both
 * directions with TQ_QUANT_2D) amax A = max |x| with NaN ignored, e = tq_mxfp8_exponent(A) (E8M0
 * rounded up), q = cvt8(x * 2^(127-e)), scale byte = e. data_t [K, M] is quant(x^T).
 * The tile kernel (mxfp8_tile.cuh, shared with act_quantize_mxfp8.cu): one CTA per 128x128 tile
 * of x, read once with 16-byte streaming loads into registers: the
 * rowwise codes leave straight from registers (a 1x32 block is 4 or 8 adjacent lanes: its amax
 * is a shuffle reduction), the columnwise ones through a swizzled shared-memory copy of the tile
 * in which each lane holds 16 rows of one or two columns (a 32x1 block is a lane pair) and
 * writes them as one 16-byte store into a data_t row. 2D tiles reduce their amax through shared
 * memory first. The exponents are block-major ([K/32, M] rowwise, [M/32, K] columnwise): a
 * tile's are staged in shared memory and leave as 16-byte pieces of four 128-byte runs (stored
 * [M, K/32] they were 4 bytes in each of 128 rows per direction: 15% of the kernel's time).
 * Elements go through the hardware cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (what TE
 * uses), which equals formats.h's tq_f32_to_fp8 on all 2^32 non-NaN fp32 inputs (checked on an
 * H200); NaN elements are re-encoded with tq_f32_to_fp8 itself, as the GPU's multiply and cvt
 * drop a NaN's sign. Also here: dequantize, and tq_gemm_values_mxfp8_cuda, both GEMM operands'
 * dequantization in one launch (gemm.c's emulated MXFP8 GEMM).
 * Reference: csrc/ref/quantize_mxfp8_ref.c. Tests: tests/test_quantize_mxfp8.py (GPU cases),
 * tests/test_gemm.py (the emulated GEMM).
 */
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "fp_cast.cuh"
#include "internal_gemm.h"
#include "internal_kernels.h"
#include "dequant_out.cuh"
#include "launch.cuh"
#include "mxfp8_tile.cuh"
#include "tequant/formats.h"

namespace {

using tq_cuda::DeviceGuard;
using tq_cuda::cuda_failed;
using tq_cuda::launch_failed;

using namespace tq_mxfp8;

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <typename In, bool kVec, bool k2D, bool kE5M2>
void launch_directions(const Args &a, unsigned grid, cudaStream_t st) {
    const bool row = a.data != nullptr, col = a.data_t != nullptr;
    using L = RawLoad<kVec>;
    if (row && col) quantize_kernel<In, L, kVec, true, true, k2D, kE5M2><<<grid, kThreads, 0, st>>>(a, L{});
    else if (row) quantize_kernel<In, L, kVec, true, false, k2D, kE5M2><<<grid, kThreads, 0, st>>>(a, L{});
    else quantize_kernel<In, L, kVec, false, true, k2D, kE5M2><<<grid, kThreads, 0, st>>>(a, L{});
}

template <typename In>
void dispatch_quantize(const Args &a, bool vec, bool two_d, bool e5m2, unsigned grid, cudaStream_t st) {
#define TQ_MXFP8_LAUNCH(V, D, E) \
    if (vec == V && two_d == D && e5m2 == E) return launch_directions<In, V, D, E>(a, grid, st)
    TQ_MXFP8_LAUNCH(true, false, false);
    TQ_MXFP8_LAUNCH(true, false, true);
    TQ_MXFP8_LAUNCH(true, true, false);
    TQ_MXFP8_LAUNCH(true, true, true);
    TQ_MXFP8_LAUNCH(false, false, false);
    TQ_MXFP8_LAUNCH(false, false, true);
    TQ_MXFP8_LAUNCH(false, true, false);
    TQ_MXFP8_LAUNCH(false, true, true);
#undef TQ_MXFP8_LAUNCH
}

tq_status quantize_mxfp8(const tq_tensor *x, const tq_quant_config *config, const tq_quantize_args *args,
                         tq_qtensor *q, cudaStream_t st) {
    const int64_t M = x->rows, K = x->cols;
    if (M == 0 || K == 0) return TQ_SUCCESS;
    DeviceGuard guard(x->device);
    if (guard.status != cudaSuccess) return launch_failed("mxfp8 quantize: making x's device current");
    const bool rowwise = (args->usage & TQ_USAGE_ROWWISE) != 0;
    const bool columnwise = (args->usage & TQ_USAGE_COLUMNWISE) != 0;
    Args a;
    a.x = x->data;
    a.ld = x->ld, a.rows = M, a.cols = K;
    const int64_t tiles_k = (K + kTile - 1) / kTile, tiles = (M + kTile - 1) / kTile * tiles_k;
    a.tiles_k = (uint32_t)tiles_k, a.n_tiles = (uint32_t)tiles;
    if (tiles > INT32_MAX)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "mxfp8 quantize: x [%lld, %lld] needs more tiles "
                       "than one launch takes", (long long)M, (long long)K);
    a.data = rowwise ? static_cast<uint8_t *>(q->data.data) : nullptr;
    a.scale_inv = rowwise ? static_cast<uint8_t *>(q->scale_inv.data) : nullptr;
    a.data_t = columnwise ? static_cast<uint8_t *>(q->data_t.data) : nullptr;
    a.scale_inv_t = columnwise ? static_cast<uint8_t *>(q->scale_inv_t.data) : nullptr;
    /* 16-byte loads and stores need 16-byte aligned rows; output rows are multiples of 32
     * bytes, so aligned when their base is. Anything else takes the element-wise path. */
    const int esize = x->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    const bool vec = aligned16(x->data) && (x->ld * esize) % 16 == 0
                     && (!rowwise || (aligned16(a.data) && aligned16(a.scale_inv)))
                     && (!columnwise || (aligned16(a.data_t) && aligned16(a.scale_inv_t)));
    const bool e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const bool two_d = (config->flags & TQ_QUANT_2D) != 0;
    switch (x->dtype) {
        case TQ_DTYPE_FLOAT32: dispatch_quantize<F32>(a, vec, two_d, e5m2, (unsigned)tiles, st); break;
        case TQ_DTYPE_BFLOAT16: dispatch_quantize<Bf16>(a, vec, two_d, e5m2, (unsigned)tiles, st); break;
        default: dispatch_quantize<F16>(a, vec, two_d, e5m2, (unsigned)tiles, st); break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("mxfp8 quantize kernel launch");
    return TQ_SUCCESS;
}

}  // namespace

extern "C" tq_status tq_quantize_mxfp8_cuda(const tq_tensor *x, const tq_quant_config *config,
                                            const tq_quantize_args *args, tq_qtensor *q,
                                            struct CUstream_st *stream) {
    return quantize_mxfp8(x, config, args, q, reinterpret_cast<cudaStream_t>(stream));
}

namespace {

/* Two FP8 codes (low byte first) as fp32, through Hopper's exact FP8 -> fp16 pair convert:
 * every E4M3 / E5M2 value is an fp16 value (a NaN stays a NaN, whose product is canonical). */
__device__ __forceinline__ float2 fp8x2_to_f32x2(uint16_t codes, int e5m2) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, e5m2 ? __NV_E5M2 : __NV_E4M3);
    return __half22float2(__half2(h));
}

/* Dequantization: a thread takes unit u (8 codes, a quarter of a block: cols % 32 == 0) of 32
 * consecutive rows, so a warp reads 256 consecutive code bytes of a row and, bf16 / fp16 out,
 * writes 512 consecutive bytes, and the thread's exponents (block-major [cols / 32, rows]:
 * exps[(u / 4) * rows + r]) are 32 consecutive bytes, one sector.
 * value = RN(fp8 * 2^(e-127)), narrowed RNE to out's dtype. */
constexpr int kDequantThreads = 256;
constexpr int kDequantRows = 32;
using tq_cuda::kDequantUnit;

/* Unit u of the row groups y, y + ny, ...: the body of dequantize_kernel. exps_ld: the stride of
 * the block-major exponents (rows, or more for rows [r0, r0 + rows) of a taller direction, whose
 * exps start at its column r0: an emulated GEMM's chunks of A). */
template <typename Out, bool kVec>
__device__ __forceinline__ void dequantize_unit(const uint8_t *__restrict__ codes,
                                                const uint8_t *__restrict__ exps, int64_t exps_ld,
                                                int64_t rows, int64_t cols, int e5m2,
                                                typename Out::storage *__restrict__ out, int64_t ld,
                                                int64_t u, int64_t y, int64_t ny) {
    using T = typename Out::storage;
    if (u >= cols / kDequantUnit) return;
    const uint8_t *unit_exps = exps + (u >> 2) * exps_ld;
    for (int64_t r0 = y * kDequantRows; r0 < rows; r0 += ny * kDequantRows) {
        const int n = (int)min(rows - r0, (int64_t)kDequantRows);
#pragma unroll 4
        for (int i = 0; i < n; i++) {
            const int64_t r = r0 + i;
            const uint8_t *src = codes + r * cols + u * kDequantUnit;
            uint32_t words[2];
            if (kVec) {
                const uint2 w = *reinterpret_cast<const uint2 *>(src);
                words[0] = w.x, words[1] = w.y;
            } else {
#pragma unroll
                for (int k = 0; k < 2; k++)
                    words[k] = src[4 * k] | (uint32_t)src[4 * k + 1] << 8 | (uint32_t)src[4 * k + 2] << 16
                               | (uint32_t)src[4 * k + 3] << 24;
            }
            const float scale = tq_e8m0_to_f32(unit_exps[r]);
            __align__(16) T vals[kDequantUnit];
#pragma unroll
            for (int k = 0; k < kDequantUnit; k += 2) {
                const float2 v = fp8x2_to_f32x2((uint16_t)(words[k >> 2] >> (8 * (k & 3))), e5m2);
                Out::narrow2(v.x * scale, v.y * scale, &vals[k]);
            }
            tq_cuda::store_vals<T, kVec>(out + r * ld + u * kDequantUnit, vals);
        }
    }
}

template <typename Out, bool kVec>
__global__ void __launch_bounds__(kDequantThreads)
dequantize_kernel(const uint8_t *__restrict__ codes, const uint8_t *__restrict__ exps,
                  int64_t rows, int64_t cols, int e5m2, typename Out::storage *__restrict__ out,
                  int64_t ld) {
    dequantize_unit<Out, kVec>(codes, exps, rows, rows, cols, e5m2, out, ld,
                               (int64_t)blockIdx.x * kDequantThreads + threadIdx.x, blockIdx.y,
                               gridDim.y);
}

/* An emulated MXFP8 GEMM's two operands in one launch: x blocks [0, blocks_a) dequantize A's
 * direction, the rest B's, both to bf16 (the GEMM values; two launches were ~3.5 us more of
 * host time per GEMM). */
struct ValuesPair {
    const uint8_t *codes[2], *exps[2];
    int64_t exps_ld[2], rows[2], cols[2], ld[2];
    int e5m2[2];
    uint16_t *out[2];
    unsigned blocks_a;
};

template <bool kVec>
__global__ void __launch_bounds__(kDequantThreads) values_pair_kernel(const ValuesPair p) {
    const int i = blockIdx.x < p.blocks_a ? 0 : 1;
    const int64_t block = i ? blockIdx.x - p.blocks_a : blockIdx.x;
    dequantize_unit<tq_cuda::DequantBf16, kVec>(p.codes[i], p.exps[i], p.exps_ld[i], p.rows[i],
                                                p.cols[i],
                                                p.e5m2[i], p.out[i], p.ld[i],
                                                block * kDequantThreads + threadIdx.x, blockIdx.y,
                                                gridDim.y);
}

/* The dequantize grid of a [rows, cols] direction: unit groups in x, row groups in y. */
dim3 dequantize_grid(int64_t rows, int64_t cols) {
    const int64_t units = cols / kDequantUnit, row_groups = (rows + kDequantRows - 1) / kDequantRows;
    return dim3((unsigned)((units + kDequantThreads - 1) / kDequantThreads),
                (unsigned)(row_groups < 65535 ? row_groups : 65535));
}

/* 8-byte code loads and 16-byte stores: code rows are multiples of 32 bytes, so loads are
 * aligned when their base is; stores need a 16-aligned base and row pitch. */
bool dequantize_vec(const void *codes, const tq_tensor *out) {
    const int esize = out->dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    return aligned16(codes) && aligned16(out->data) && (out->ld * esize) % 16 == 0;
}

template <typename Out>
void launch_dequantize(bool vec, const uint8_t *codes, const uint8_t *exps, int64_t rows,
                       int64_t cols, int e5m2, tq_tensor *out, cudaStream_t st) {
    const dim3 grid = dequantize_grid(rows, cols);
    auto *o = static_cast<typename Out::storage *>(out->data);
    if (vec)
        dequantize_kernel<Out, true><<<grid, kDequantThreads, 0, st>>>(codes, exps, rows, cols, e5m2, o, out->ld);
    else
        dequantize_kernel<Out, false><<<grid, kDequantThreads, 0, st>>>(codes, exps, rows, cols, e5m2, o, out->ld);
}

}  // namespace

extern "C" tq_status tq_dequantize_mxfp8_cuda(const tq_quant_config *config, const tq_qtensor *q,
                                              uint32_t usage, tq_tensor *out,
                                              struct CUstream_st *stream) {
    const bool rowwise = usage == TQ_USAGE_ROWWISE;
    const tq_tensor *data = rowwise ? &q->data : &q->data_t;
    const tq_tensor *scale = rowwise ? &q->scale_inv : &q->scale_inv_t;
    if (data->rows == 0 || data->cols == 0) return TQ_SUCCESS;
    DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return launch_failed("mxfp8 dequantize: making out's device current");
    const bool vec = dequantize_vec(data->data, out);
    const int e5m2 = config->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
    const auto *codes = static_cast<const uint8_t *>(data->data);
    const auto *exps = static_cast<const uint8_t *>(scale->data);
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    switch (out->dtype) {
        case TQ_DTYPE_FLOAT32:
            launch_dequantize<tq_cuda::DequantF32>(vec, codes, exps, data->rows, data->cols, e5m2, out, st);
            break;
        case TQ_DTYPE_BFLOAT16:
            launch_dequantize<tq_cuda::DequantBf16>(vec, codes, exps, data->rows, data->cols, e5m2, out, st);
            break;
        default:
            launch_dequantize<tq_cuda::DequantF16>(vec, codes, exps, data->rows, data->cols, e5m2, out, st);
            break;
    }
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("mxfp8 dequantize kernel launch");
    return TQ_SUCCESS;
}

extern "C" tq_status tq_gemm_values_mxfp8_cuda(const tq_quant_config *config_a, const tq_tensor *data_a,
                                               const tq_tensor *scale_a, tq_tensor *values_a,
                                               const tq_quant_config *config_b, const tq_tensor *data_b,
                                               const tq_tensor *scale_b, tq_tensor *values_b,
                                               struct CUstream_st *stream) {
    DeviceGuard guard(values_a->device);
    if (guard.status != cudaSuccess) return launch_failed("MXFP8 GEMM values: making the device current");
    const tq_quant_config *configs[2] = {config_a, config_b};
    const tq_tensor *data[2] = {data_a, data_b}, *scales[2] = {scale_a, scale_b};
    tq_tensor *values[2] = {values_a, values_b};
    ValuesPair p;
    dim3 grids[2];
    bool vec = true;
    for (int i = 0; i < 2; i++) {
        p.codes[i] = static_cast<const uint8_t *>(data[i]->data);
        p.exps[i] = static_cast<const uint8_t *>(scales[i]->data);
        p.rows[i] = values[i]->rows, p.cols[i] = values[i]->cols, p.ld[i] = values[i]->ld;
        p.exps_ld[i] = scales[i]->ld > values[i]->rows ? scales[i]->ld : values[i]->rows;
        p.e5m2[i] = configs[i]->elem_dtype == TQ_DTYPE_FLOAT8_E5M2;
        p.out[i] = static_cast<uint16_t *>(values[i]->data);
        grids[i] = dequantize_grid(values[i]->rows, values[i]->cols);
        vec = vec && dequantize_vec(data[i]->data, values[i]);
    }
    p.blocks_a = grids[0].x;
    const dim3 grid(grids[0].x + grids[1].x, grids[0].y > grids[1].y ? grids[0].y : grids[1].y);
    if (grid.x == 0 || grid.y == 0) return TQ_SUCCESS; /* nothing to write */
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
    if (vec) values_pair_kernel<true><<<grid, kDequantThreads, 0, st>>>(p);
    else values_pair_kernel<false><<<grid, kDequantThreads, 0, st>>>(p);
    if (cudaPeekAtLastError() != cudaSuccess) return launch_failed("MXFP8 GEMM values kernel launch");
    return TQ_SUCCESS;
}
