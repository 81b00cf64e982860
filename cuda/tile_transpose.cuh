/* tile_transpose.cuh: byte transposes, internal to cuda/. transpose4x4: a 4 x 4-byte block held
 * as 4 words, transposed in registers (per-tensor FP8's columnwise codes in quantize_fp8.cu, the
 * byte transpose of transpose.cu); store_columns32: a 32-row tile of codes staged in shared
 * memory out as columns (the fused norm's and activation's columnwise codes). The rest: the columnwise half of the 128x128-tile quantizers
 * (FP8 block scaling, MXFP8): a tile held in registers as 16-byte chunks goes through a swizzled
 * shared-memory copy, 256 bytes of each tile row per round, and comes back as columns.
 * In a pass, lane (g = lane / 8, c = lane % 8) of a warp reads word g of the warp's logical chunk
 * lc in rows 16c .. 16c + 15 (kPerWord columns x 16 rows), so 8 lanes cover a column's 128 rows.
 * The slot of chunk lc in row r is lc ^ ((r >> 4) & 7): the 8 lane groups of a pass read rows
 * 16 apart, whose chunks land in 8 different 4-bank groups, and the row writes (8 lanes per
 * 16-byte phase) stay conflict-free too.
 * Tests: tests/test_quantize_fp8.py, tests/test_transpose.py, tests/test_quantize_fp8_block.py,
 * tests/test_quantize_mxfp8.py, tests/test_norm_columnwise.py, tests/test_act_columnwise.py (GPU
 * cases, bit for bit).
 */
#ifndef TEQUANT_CUDA_TILE_TRANSPOSE_CUH_
#define TEQUANT_CUDA_TILE_TRANSPOSE_CUH_

#include <cuda_runtime.h>

namespace tq_tile {

/* w[i] holds row i of a 4 x 4-byte block (byte j = column j); t[j] gets column j (byte i of w[i]):
 * 8 byte permutes. */
__device__ __forceinline__ void transpose4x4(const uint32_t (&w)[4], uint32_t (&t)[4]) {
    const uint32_t a = __byte_perm(w[0], w[1], 0x5140), b = __byte_perm(w[0], w[1], 0x7362);
    const uint32_t c = __byte_perm(w[2], w[3], 0x5140), d = __byte_perm(w[2], w[3], 0x7362);
    t[0] = __byte_perm(a, c, 0x5410);
    t[1] = __byte_perm(a, c, 0x7632);
    t[2] = __byte_perm(b, d, 0x5410);
    t[3] = __byte_perm(b, d, 0x7632);
}

/* The columns of a 32-row tile of one-byte codes staged in shared memory (row i at stage + i *
 * ld; ld a multiple of 4 and ld / 4 odd) into out: out[j * ld_out + i] = stage[i * ld + j] for
 * j < cols (cols % 4 == 0; out and ld_out 8-byte aligned). Item (q, quarter) of a thread reads
 * one word (columns 4q .. 4q+3) of each of the quarter's 8 rows, transposes the two 4 x 4 blocks
 * and stores each column's 8 rows with one 8-byte store. The quarter varies fastest over the
 * lanes, so the four lanes of a column quad write its columns' whole 32-byte sectors in one
 * warp store (a sector written in parts at different times costs the L2 a read of it from HBM),
 * and, with ld / 4 odd, the 32 lanes' words (rows 8 apart) sit in 32 different banks. The
 * norm's and the activation's columnwise codes (norm_forward_fast.cuh, act_forward.cu). */
template <int kCta>
__device__ __forceinline__ void store_columns32(const uint8_t *stage, int64_t ld, int cols,
                                                uint8_t *out, int64_t ld_out) {
    for (int item = threadIdx.x; item < cols; item += kCta) {
        const int q = item >> 2, quarter = item & 3;
        uint32_t w[2][4], t[2][4];
#pragma unroll
        for (int r = 0; r < 8; r++)
            w[r / 4][r % 4] =
                *reinterpret_cast<const uint32_t *>(stage + (8 * quarter + r) * ld + 4 * q);
        transpose4x4(w[0], t[0]);
        transpose4x4(w[1], t[1]);
#pragma unroll
        for (int i = 0; i < 4; i++)
            *reinterpret_cast<uint2 *>(out + (int64_t)(4 * q + i) * ld_out + 8 * quarter) =
                make_uint2(t[0][i], t[1][i]);
    }
}

constexpr int kEdge = 128;      /* tile rows */
constexpr int kSmemChunks = 16; /* 16-byte chunks per shared-memory row: 256 bytes */

/* Round `round` of the tile into smem: the thread's kLoads chunks (chunk `chunk` of rows
 * i * kRowsPerPass + row_in_pass) that fall in this round's 256 bytes of each row. */
template <int kLoads, int kRowsPerPass>
__device__ __forceinline__ void stage_round(uint4 (*smem)[kSmemChunks], const uint4 (&in)[kLoads],
                                            int round, int chunk, int row_in_pass) {
#pragma unroll
    for (int i = 0; i < kLoads; i++) {
        const int r = i * kRowsPerPass + row_in_pass;
        if (chunk / kSmemChunks == round) smem[r][(chunk % kSmemChunks) ^ ((r >> 4) & 7)] = in[i];
    }
}

/* The 16 words of lane (g, c) for logical chunk lc: word g of lc in rows 16c + j. */
__device__ __forceinline__ void column_words(const uint4 (*smem)[kSmemChunks], int lc, int g, int c,
                                             uint32_t (&words)[16]) {
    const uint32_t *smem_words = reinterpret_cast<const uint32_t *>(&smem[0][0]);
#pragma unroll
    for (int j = 0; j < 16; j++) /* row 16c + j: its slot of lc is lc ^ c */
        words[j] = smem_words[(16 * c + j) * (kSmemChunks * 4) + (lc ^ c) * 4 + g];
}

}  // namespace tq_tile

#endif  // TEQUANT_CUDA_TILE_TRANSPOSE_CUH_
