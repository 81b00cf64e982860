/* transpose.cu: tq_transpose on CUDA, out[c][r] = x[r][c] for one-byte codes (csrc/core/transpose.c
 * checks the arguments; CPU reference csrc/ref/transpose_ref.c).
 *
 * torch's x.t().contiguous() on one-byte elements reads x with a stride of x's row length per
 * element: a warp touches 32 rows for 32 bytes. Here a block moves a 128 x 128-byte tile: each
 * thread reads 4 x 4-byte blocks as 4 words of consecutive rows (a warp reads 128 contiguous bytes
 * of a row), transposes each block in registers with byte permutes, and puts the 4 words in
 * shared memory as rows of the transposed tile; the block then writes the tile a row (128
 * contiguous bytes per warp) at a time. Shared word w of tile row i sits at w ^ ((i >> 2) & 31), so
 * both the column-ordered stores and the row reads hit 32 different banks.
 * Words are used where x's and out's row starts are 4-byte aligned; edges and unaligned rows go
 * byte by byte in the same tiles.
 * Tests: tests/test_transpose.py (GPU cases, bit for bit), tests/test_sanitize_kernels.py.
 */
#include <stdint.h>

#include "internal_kernels.h"
#include "launch.cuh"
#include "tile_transpose.cuh"

namespace {

constexpr int kTile = 128;         /* tile edge in bytes */
constexpr int kWords = kTile / 4;  /* 4-byte words per tile row */
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kMaxGridY = 65535;

/* The word of bytes x[r][c .. c + 3] (0 beyond x's edge); `wide`: 4-byte aligned rows. */
__device__ __forceinline__ uint32_t load_word(const uint8_t *__restrict__ x, int64_t r, int64_t c,
                                              int64_t rows, int64_t cols, int64_t ld, bool wide) {
    if (r >= rows) return 0;
    const uint8_t *row = x + r * ld;
    if (wide && c + 3 < cols) return *reinterpret_cast<const uint32_t *>(row + c);
    uint32_t v = 0;
    for (int j = 0; j < 4; j++)
        if (c + j < cols) v |= (uint32_t)row[c + j] << (8 * j);
    return v;
}

/* out[r][c .. c + 3] = the bytes of v, those inside out's edge. */
__device__ __forceinline__ void store_word(uint8_t *__restrict__ out, int64_t r, int64_t c, uint32_t v,
                                           int64_t rows, int64_t cols, int64_t ld, bool wide) {
    if (r >= rows) return;
    uint8_t *row = out + r * ld;
    if (wide && c + 3 < cols) {
        *reinterpret_cast<uint32_t *>(row + c) = v;
        return;
    }
    for (int j = 0; j < 4; j++)
        if (c + j < cols) row[c + j] = (uint8_t)(v >> (8 * j));
}

__global__ void __launch_bounds__(kThreads) transpose_kernel(const uint8_t *__restrict__ x, uint8_t *__restrict__ out,
                                                             int64_t rows, int64_t cols, int64_t x_ld, int64_t out_ld,
                                                             bool x_wide, bool out_wide) {
    __shared__ uint32_t tile[kTile][kWords]; /* transposed tile: row i = x's column c0 + i */
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t c0 = (int64_t)blockIdx.x * kTile;
    const int64_t row_tiles = (rows + kTile - 1) / kTile;
    for (int64_t ty = blockIdx.y; ty < row_tiles; ty += gridDim.y) {
        const int64_t r0 = ty * kTile;
        uint32_t a[kWords / kWarps][4];
#pragma unroll
        for (int it = 0; it < kWords / kWarps; it++) { /* block row bi = warp + 8 it, block column lane */
            const int64_t r = r0 + 4 * (warp + kWarps * it), c = c0 + 4 * lane;
#pragma unroll
            for (int k = 0; k < 4; k++) a[it][k] = load_word(x, r + k, c, rows, cols, x_ld, x_wide);
        }
#pragma unroll
        for (int it = 0; it < kWords / kWarps; it++) {
            const int bi = warp + kWarps * it;
            uint32_t o[4];
            tq_tile::transpose4x4(a[it], o);
#pragma unroll
            for (int k = 0; k < 4; k++) tile[4 * lane + k][bi ^ lane] = o[k]; /* (row >> 2) & 31 == lane */
        }
        __syncthreads();
#pragma unroll 4
        for (int i = warp; i < kTile; i += kWarps)
            store_word(out, c0 + i, r0 + 4 * lane, tile[i][lane ^ ((i >> 2) & 31)], cols, rows, out_ld, out_wide);
        __syncthreads(); /* the tile is refilled by the next row of tiles */
    }
}

bool aligned4(const void *p, int64_t ld) { return reinterpret_cast<uintptr_t>(p) % 4 == 0 && ld % 4 == 0; }

}  // namespace

extern "C" tq_status tq_transpose_cuda(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream) {
    if (x->rows == 0 || x->cols == 0) return TQ_SUCCESS;
    tq_cuda::DeviceGuard guard(out->device);
    if (guard.status != cudaSuccess) return tq_cuda::cuda_failed("transpose: making out's device current", guard.status);
    const int64_t col_tiles = (x->cols + kTile - 1) / kTile, row_tiles = (x->rows + kTile - 1) / kTile;
    if (col_tiles > 0x7FFFFFFFLL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "transpose: x has %lld columns, more than this kernel's grid "
                       "covers", (long long)x->cols);
    const dim3 grid((unsigned)col_tiles, (unsigned)(row_tiles < kMaxGridY ? row_tiles : kMaxGridY));
    transpose_kernel<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint8_t *>(x->data), static_cast<uint8_t *>(out->data), x->rows, x->cols, x->ld, out->ld,
        aligned4(x->data, x->ld), aligned4(out->data, out->ld));
    if (cudaPeekAtLastError() != cudaSuccess) return tq_cuda::launch_failed("transpose kernel launch");
    return TQ_SUCCESS;
}
