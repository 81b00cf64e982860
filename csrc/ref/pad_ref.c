/* pad_ref.c: the CPU side of tq_pad_rows (csrc/core/pad.c checks the arguments): x's rows copied
 * into the head of out, out's remaining rows zeroed, row by row with memcpy / memset.
 * Tests: tests/test_linear.py (M = 1, 7, 1000 against references padded with torch) and
 * tests/test_linear_alloc.py (the padding is zero in reused, poisoned memory).
 */
#include <string.h>

#include "internal_kernels.h"

tq_status tq_pad_rows_ref(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream) {
    (void)stream;
    const size_t elem = (size_t)tq_dtype_bits(x->dtype) / 8;
    const size_t row_bytes = (size_t)x->cols * elem;
    const size_t x_pitch = (size_t)x->ld * elem, out_pitch = (size_t)out->ld * elem;
    char *dst = (char *)out->data;
    for (int64_t r = 0; r < out->rows; r++) {
        char *row = dst + (size_t)r * out_pitch;
        if (r < x->rows) memcpy(row, (const char *)x->data + (size_t)r * x_pitch, row_bytes);
        else memset(row, 0, row_bytes);
    }
    return TQ_SUCCESS;
}
