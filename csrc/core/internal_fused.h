/* internal_fused.h: the argument checks the fused kernels' entry points share (csrc/core/norm.c,
 * act.c; defined in fused_args.c): vectors, output matrices, the per-tensor FP8 output (config,
 * codes, scale_inv, scale or amax_in) and the column-sum workspace. Each fails with
 * TQ_ERROR_INVALID_ARGUMENT (NOT_SUPPORTED for a scaling the fused kernels do not write) and a
 * message naming the function and the argument.
 * Tests: tests/test_norm_kernels.py and tests/test_act_kernels.py (test_errors_*).
 */
#ifndef TEQUANT_CORE_INTERNAL_FUSED_H_
#define TEQUANT_CORE_INTERNAL_FUSED_H_

#include "internal.h"
#include "tequant/formats.h"

#define TQ_FLOAT_MASK \
    ((1u << TQ_DTYPE_FLOAT32) | (1u << TQ_DTYPE_BFLOAT16) | (1u << TQ_DTYPE_FLOAT16))
#define TQ_F32_MASK (1u << TQ_DTYPE_FLOAT32)

static inline int tq_given(const tq_tensor *t) { return t->data != NULL; }

/* "fn: name was given, but what" */
tq_status tq_fused_not_for(const char *fn, const char *name, const char *what);

/* A float [M, K] input with K >= 1; `what` ends the message of K = 0 ("the norm runs over ..."). */
tq_status tq_fused_check_input(const char *fn, const tq_tensor *x, const char *name,
                               const char *what);

/* n contiguous elements of a dtype in mask, on device. */
tq_status tq_fused_check_vector(const char *fn, const tq_tensor *t, const char *name, int64_t n,
                                uint32_t mask, int device);

/* A [rows, cols] output of one dtype (for FP8 codes also UINT8), any ld >= cols, on device;
 * `like` names what the shape follows ("x", "dy"). */
tq_status tq_fused_check_matrix(const char *fn, const tq_tensor *t, const char *name,
                                int64_t rows, int64_t cols, tq_dtype dtype, int device,
                                const char *like);

/* The per-tensor FP8 output of a fused kernel: its members as the args struct holds them. */
typedef struct tq_fused_fp8 {
    const tq_quant_config *config;
    const tq_tensor *q, *scale_inv, *scale, *amax_in, *amax;
    const char *q_name; /* "y_q", "dh_q" */
    const tq_tensor *q_t; /* the optional columnwise codes (q transposed) */
    const char *q_t_name; /* "y_q_t", "dh_q_t" */
} tq_fused_fp8;

/* A DELAYED or CURRENT config with codes [rows, cols] (like `like`) and scale_inv, plus the
 * scale (DELAYED) or the amax it comes from (CURRENT, not the same memory as amax); with no
 * config, none of them. q_t, where given: [cols, rows] codes of the config's dtype, with q. */
tq_status tq_fused_check_fp8(const char *fn, const tq_fused_fp8 *o, int64_t rows, int64_t cols,
                             int device, const char *like);

/* Whether config is a block format a fused kernel writes into a tq_qtensor (BLOCK, MXFP8). */
static inline int tq_fused_block_format(const tq_quant_config *config) {
    return config != NULL
           && (config->scaling == TQ_SCALING_BLOCK || config->scaling == TQ_SCALING_MXFP8);
}

/* A block-format output: BLOCK as 1x128 E4M3 blocks, MXFP8 as 1x32 E4M3 (a forward operand's
 * formats), into q laid out by tq_quantize_layout for [R >= rows, cols] on device, its rowwise
 * members given (the columnwise ones optional); MXFP8's members 16-byte aligned (the kernel's
 * vector stores; tq_quantize_layout's allocations are). what: the values ("act(h)"). */
tq_status tq_fused_check_block_q(const char *fn, const tq_quant_config *config,
                                 const tq_qtensor *q, int64_t rows, int64_t cols, int device,
                                 const char *what);

/* need bytes of contiguous, 4-byte aligned workspace on device (nothing when need is 0). */
tq_status tq_fused_check_workspace(const char *fn, const tq_tensor *w, size_t need, int device,
                                   const char *sized_by);

/* For the C references: a DELAYED history slot's max-accumulation, the larger as signed int32
 * bits (quantize_fp8_ref.c's rule, and the kernels' atomicMax). */
static inline void tq_fused_max_accumulate(float *slot, float amax) {
    if ((int32_t)tq_f32_bits(amax) > (int32_t)tq_f32_bits(*slot)) *slot = amax;
}

/* For the C references: the scale a checked config casts with, DELAYED the given one, CURRENT
 * the rule of the given amax (tq_quantize's). */
static inline float tq_fused_cast_scale(const tq_quant_config *c, const tq_tensor *scale,
                                        const tq_tensor *amax_in) {
    if (c->scaling == TQ_SCALING_DELAYED) return *(const float *)scale->data;
    return tq_scale_from_amax(*(const float *)amax_in->data, c->fmax, c->amax_epsilon,
                              (c->flags & TQ_QUANT_POW2_SCALE) != 0, TQ_FLT_MAX);
}

#endif /* TEQUANT_CORE_INTERNAL_FUSED_H_ */
