/* amax_ref.c: CPU reference of tq_amax: max |x| over all elements, NaN ignored.
 * Plain loops on purpose: this is the oracle the CUDA kernel (cuda/amax.cu) is checked against
 * bit for bit. Tests: tests/test_amax.py (against torch, and CUDA against this).
 */
#include "internal_kernels.h"
#include "tequant/formats.h"

tq_status tq_amax_ref(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream) {
    (void)stream;
    float m = 0.0f;
    for (int64_t r = 0; r < x->rows; r++) {
        for (int64_t c = 0; c < x->cols; c++) {
            int64_t i = r * x->ld + c;
            float v;
            if (x->dtype == TQ_DTYPE_FLOAT32) v = ((const float *)x->data)[i];
            else if (x->dtype == TQ_DTYPE_BFLOAT16) v = tq_bf16_to_f32(((const uint16_t *)x->data)[i]);
            else v = tq_f16_to_f32(((const uint16_t *)x->data)[i]);
            m = tq_amax_step(m, v);
        }
    }
    *(float *)amax->data = m;
    return TQ_SUCCESS;
}
