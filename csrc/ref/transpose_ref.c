/* transpose_ref.c: the CPU side of tq_transpose (csrc/core/transpose.c checks the arguments):
 * out[c][r] = x[r][c], byte by byte, in 64 x 64 tiles so both sides stay in cache.
 * Tests: tests/test_transpose.py (against torch's x.t().contiguous()).
 */
#include "internal_kernels.h"

enum { TILE = 64 };

tq_status tq_transpose_ref(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream) {
    (void)stream;
    const uint8_t *src = (const uint8_t *)x->data;
    uint8_t *dst = (uint8_t *)out->data;
    for (int64_t r0 = 0; r0 < x->rows; r0 += TILE)
        for (int64_t c0 = 0; c0 < x->cols; c0 += TILE) {
            const int64_t r1 = r0 + TILE < x->rows ? r0 + TILE : x->rows;
            const int64_t c1 = c0 + TILE < x->cols ? c0 + TILE : x->cols;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++) dst[c * out->ld + r] = src[r * x->ld + c];
        }
    return TQ_SUCCESS;
}
