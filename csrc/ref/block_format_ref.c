/* block_format_ref.c: the C references' last step for a fused kernel's block-format output:
 * high-precision values y (a zero-padded [q->rows, cols] copy in the input's dtype) through the
 * BLOCK (quantize_fp8_block_ref.c) or MXFP8 (quantize_mxfp8_ref.c) quantizer's reference into q,
 * the columnwise members where q has them: the definition cuda/act_quantize_{block,mxfp8}.cu are
 * checked against (act_forward_ref.c, act_backward_ref.c).
 * Tests: tests/test_act_block.py, tests/test_act_mxfp8.py, tests/test_act_grad_block.py.
 */
#include <stdlib.h>

#include "internal_kernels.h"

tq_status tq_block_format_values(const char *fn, const char *what, int64_t rows, int64_t cols,
                                 tq_dtype dtype, tq_tensor *y) {
    const size_t elem = dtype == TQ_DTYPE_FLOAT32 ? 4 : 2;
    *y = (tq_tensor){NULL, rows, cols, cols, dtype, TQ_DEVICE_CPU};
    if (rows * cols > 0 && (y->data = calloc((size_t)(rows * cols), elem)) == NULL)
        return tq_fail(TQ_ERROR_OUT_OF_MEMORY, "%s (CPU): no memory for %s [%lld, %lld]", fn,
                       what, (long long)rows, (long long)cols);
    return TQ_SUCCESS;
}

tq_status tq_block_format_ref(tq_tensor *y, const tq_quant_config *config, tq_qtensor *q) {
    tq_quantize_args qa = TQ_QUANTIZE_ARGS_INIT;
    qa.usage = TQ_USAGE_ROWWISE | (q->data_t.data != NULL ? TQ_USAGE_COLUMNWISE : 0u);
    const tq_status st = config->scaling == TQ_SCALING_MXFP8
                             ? tq_quantize_mxfp8_ref(y, config, &qa, q, NULL)
                             : tq_quantize_fp8_block_ref(y, config, &qa, q, NULL);
    free(y->data);
    y->data = NULL;
    return st;
}
