/* ref_io.h: element access shared by the CPU references in csrc/ref: read x(r, c) of a
 * FLOAT32 / BFLOAT16 / FLOAT16 matrix widened exactly to fp32, and write a value into a
 * FLOAT32 / BFLOAT16 / FLOAT16 output (RNE, formats.h). Both honour the row stride ld.
 * Tests: every tests/test_quantize_*.py exercises them through the references.
 */
#ifndef TEQUANT_REF_IO_H_
#define TEQUANT_REF_IO_H_

#include "tequant/formats.h"
#include "tequant/tequant.h"

static inline float tq_ref_load(const tq_tensor *x, int64_t r, int64_t c) {
    const int64_t i = r * x->ld + c;
    if (x->dtype == TQ_DTYPE_FLOAT32) return ((const float *)x->data)[i];
    if (x->dtype == TQ_DTYPE_BFLOAT16) return tq_bf16_to_f32(((const uint16_t *)x->data)[i]);
    return tq_f16_to_f32(((const uint16_t *)x->data)[i]);
}

static inline void tq_ref_store(tq_tensor *out, int64_t r, int64_t c, float v) {
    const int64_t i = r * out->ld + c;
    if (out->dtype == TQ_DTYPE_FLOAT32) ((float *)out->data)[i] = v;
    else if (out->dtype == TQ_DTYPE_BFLOAT16) ((uint16_t *)out->data)[i] = tq_f32_to_bf16(v);
    else ((uint16_t *)out->data)[i] = tq_f32_to_f16(v);
}

#endif /* TEQUANT_REF_IO_H_ */
