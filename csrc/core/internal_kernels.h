/* internal_kernels.h: the per-device implementations behind each public entry point. A CPU
 * reference in csrc/ref/<stem>_ref.c and a CUDA kernel in cuda/<stem>.cu share a signature;
 * csrc/core/<stem>.c checks the arguments once and dispatches on the tensors' device.
 */
#ifndef TEQUANT_CORE_INTERNAL_KERNELS_H_
#define TEQUANT_CORE_INTERNAL_KERNELS_H_

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

tq_status tq_amax_ref(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream);
tq_status tq_amax_cuda(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream);

tq_status tq_pad_rows_ref(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream);
tq_status tq_pad_rows_cuda(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream);

tq_status tq_transpose_ref(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream);
tq_status tq_transpose_cuda(const tq_tensor *x, tq_tensor *out, struct CUstream_st *stream);

tq_status tq_codec_ref(tq_codec codec, const tq_tensor *in, tq_tensor *out, struct CUstream_st *stream);
tq_status tq_codec_cuda(tq_codec codec, const tq_tensor *in, tq_tensor *out, struct CUstream_st *stream);

/* Quantizers: one stem per scaling family (fp8 = per-tensor DELAYED and CURRENT). Arguments are
 * checked by csrc/core/quantize.c before these run: q is laid out by tq_quantize_layout with
 * contiguous members on x's device, usage is valid, and dequantize's out has the right shape. */
#define TQ_DECLARE_QUANTIZER(stem)                                                              \
    tq_status tq_quantize_##stem##_ref(const tq_tensor *x, const tq_quant_config *config,       \
                                       const tq_quantize_args *args, tq_qtensor *q,            \
                                       struct CUstream_st *stream);                            \
    tq_status tq_quantize_##stem##_cuda(const tq_tensor *x, const tq_quant_config *config,      \
                                        const tq_quantize_args *args, tq_qtensor *q,           \
                                        struct CUstream_st *stream);                           \
    tq_status tq_dequantize_##stem##_ref(const tq_quant_config *config, const tq_qtensor *q,    \
                                         uint32_t usage, tq_tensor *out,                       \
                                         struct CUstream_st *stream);                          \
    tq_status tq_dequantize_##stem##_cuda(const tq_quant_config *config, const tq_qtensor *q,   \
                                          uint32_t usage, tq_tensor *out,                      \
                                          struct CUstream_st *stream);

/* Whether tq_quantize_fp8_cuda under CURRENT scaling finds the amax of an x of `elems` elements
 * in the cast's own launch (quantize_fp8.cu: the small and the cooperative paths), so that a
 * pass before it (quantize_dbias.c) need not find it (a memset and a larger pass fewer). */
int tq_fp8_current_one_launch(int64_t elems);
/* Whether tq_quantize_fp8_cuda sums dbias in its own launch for this x, config and usage
 * (CURRENT, a bfloat16 x for the cooperative launch, both directions, R(M, K) <= 128, a device
 * that runs it): quantize_dbias.c then passes args->dbias and the workspace through, and no
 * pass runs. That launch uses the workspace laid out by tq_quantize_workspace_size under
 * CURRENT scaling: the column partials, one float (the pass's amax, unused there), then
 * TQ_FP8_CURRENT_MAX_CTAS floats for its CTAs' maxima (its grid is at most that). */
#define TQ_FP8_CURRENT_MAX_CTAS 2048
/* tq_quantize_pair's one launch (quantize_fp8_pair.cu: DELAYED or CURRENT, both directions,
 * no dbias, two bfloat16 x on one device, one element format; CURRENT with own amaxes, each x
 * of the cooperative launch's size): *launched 0 and nothing queued where the pair does not qualify or the
 * device cannot run it (the caller then quantizes one after the other). Checked by the caller
 * as two tq_quantize calls are. */
tq_status tq_quantize_fp8_pair_cuda(const tq_tensor *x0, const tq_quant_config *c0,
                                    const tq_quantize_args *a0, tq_qtensor *q0,
                                    const tq_tensor *x1, const tq_quant_config *c1,
                                    const tq_quantize_args *a1, tq_qtensor *q1,
                                    struct CUstream_st *stream, int *launched);
/* tq_quantize_pair's one launch of two FP8 block-scaling quantizations (quantize_fp8_block.cu:
 * BLOCK, both directions, no dbias, two non-empty bfloat16 x on one device, one element format,
 * each its own block shape); *launched as tq_quantize_fp8_pair_cuda's. */
tq_status tq_quantize_fp8_block_pair_cuda(const tq_tensor *x0, const tq_quant_config *c0,
                                          const tq_quantize_args *a0, tq_qtensor *q0,
                                          const tq_tensor *x1, const tq_quant_config *c1,
                                          const tq_quantize_args *a1, tq_qtensor *q1,
                                          struct CUstream_st *stream, int *launched);
int tq_fp8_current_fuses_dbias(const tq_tensor *x, const tq_quant_config *config, uint32_t usage);

/* tq_<stem>_ref(...) for CPU tensors, tq_<stem>_cuda(...) for CUDA tensors (NOT_SUPPORTED in a
 * build without CUDA). */
#ifdef TQ_WITH_CUDA
#define TQ_DISPATCH(stem, on_cpu, ...) \
    ((on_cpu) ? tq_##stem##_ref(__VA_ARGS__) : tq_##stem##_cuda(__VA_ARGS__))
#else
#define TQ_DISPATCH(stem, on_cpu, ...) \
    ((on_cpu) ? tq_##stem##_ref(__VA_ARGS__) \
              : tq_fail(TQ_ERROR_NOT_SUPPORTED, "a CUDA tensor, but tequant was built without CUDA"))
#endif

/* quantize.c: q's members for the directions in usage, checked against tq_quantize_layout
 * (shape, dtype, contiguous, on `device`); and tq_dequantize's dispatch without its checks. An
 * NVFP4 direction whose amax data is NULL dequantizes to q * s_b (the GEMM values, gemm.c). */
tq_status tq_qtensor_check_members(const tq_quant_config *config, const tq_qtensor *q,
                                   uint32_t usage, int device);
tq_status tq_dequantize_dispatch(const tq_quant_config *config, const tq_qtensor *q,
                                 uint32_t usage, tq_tensor *out, struct CUstream_st *stream);
/* tq_quantize's dispatch on the scaling without its checks (args->dbias is read only by the
 * kernels that sum it themselves: quantize_dbias.c passes it only to those), and its path
 * with args->dbias (quantize_dbias.c), called once tq_quantize has checked all but dbias and
 * the workspace. */
tq_status tq_quantize_dispatch(const tq_tensor *x, const tq_quant_config *config,
                               const tq_quantize_args *args, tq_qtensor *q,
                               struct CUstream_st *stream);
tq_status tq_quantize_dbias_run(const tq_tensor *x, const tq_quant_config *config,
                                const tq_quantize_args *args, tq_qtensor *q,
                                struct CUstream_st *stream);
/* tq_quantize_dispatch, then args->update where given (tq_amax_update of that slot). */
tq_status tq_quantize_then_update(const tq_tensor *x, const tq_quant_config *config,
                                  const tq_quantize_args *args, tq_qtensor *q,
                                  struct CUstream_st *stream);

TQ_DECLARE_QUANTIZER(fp8)
TQ_DECLARE_QUANTIZER(fp8_block)
TQ_DECLARE_QUANTIZER(mxfp8)
TQ_DECLARE_QUANTIZER(nvfp4)

/* Normalization (csrc/core/norm.c checks, csrc/ref/norm_{forward,backward}_ref.c,
 * cuda/norm_{forward,backward}.cu): every tensor is on x's device with the shapes and dtypes
 * tequant.h names; K >= 1; the backward workspace is large enough. */
tq_status tq_norm_forward_ref(const tq_tensor *x, const tq_norm_forward_args *args,
                              struct CUstream_st *stream);
tq_status tq_norm_forward_cuda(const tq_tensor *x, const tq_norm_forward_args *args,
                               struct CUstream_st *stream);
tq_status tq_norm_backward_ref(const tq_tensor *dy, const tq_tensor *x,
                               const tq_norm_backward_args *args, struct CUstream_st *stream);
tq_status tq_norm_backward_cuda(const tq_tensor *dy, const tq_tensor *x,
                                const tq_norm_backward_args *args, struct CUstream_st *stream);

/* Activations (csrc/core/act.c checks, csrc/ref/act_{forward,backward}_ref.c,
 * cuda/act_{forward,backward}.cu, the block formats' cuda/act_quantize_{block,mxfp8}.cu): shapes, dtypes and devices as tequant.h names them; a gated
 * h has an even number of columns; with dbias the workspace is large enough. */
tq_status tq_act_forward_ref(const tq_tensor *h, const tq_act_forward_args *args,
                             struct CUstream_st *stream);
tq_status tq_act_forward_cuda(const tq_tensor *h, const tq_act_forward_args *args,
                              struct CUstream_st *stream);
tq_status tq_act_forward_block_ref(const tq_tensor *h, const tq_act_forward_args *args,
                                   struct CUstream_st *stream);
tq_status tq_act_forward_block_cuda(const tq_tensor *h, const tq_act_forward_args *args,
                                    struct CUstream_st *stream);
/* block_format_ref.c: tq_block_format_values allocates y, a zeroed [rows, cols] CPU matrix of
 * dtype for a fused reference's values (fn and what name it in the out-of-memory error);
 * tq_block_format_ref quantizes y (zero-padded to q->rows) into q's BLOCK or MXFP8 members,
 * columnwise where q has them, and frees y's buffer. */
tq_status tq_block_format_values(const char *fn, const char *what, int64_t rows, int64_t cols,
                                 tq_dtype dtype, tq_tensor *y);
tq_status tq_block_format_ref(tq_tensor *y, const tq_quant_config *config, tq_qtensor *q);
tq_status tq_act_forward_mxfp8_ref(const tq_tensor *h, const tq_act_forward_args *args,
                                   struct CUstream_st *stream);
tq_status tq_act_forward_mxfp8_cuda(const tq_tensor *h, const tq_act_forward_args *args,
                                    struct CUstream_st *stream);
tq_status tq_act_backward_ref(const tq_tensor *dy, const tq_tensor *h,
                              const tq_act_backward_args *args, struct CUstream_st *stream);
tq_status tq_act_backward_cuda(const tq_tensor *dy, const tq_tensor *h,
                               const tq_act_backward_args *args, struct CUstream_st *stream);
tq_status tq_act_backward_block_ref(const tq_tensor *dy, const tq_tensor *h,
                                    const tq_act_backward_args *args, struct CUstream_st *stream);
tq_status tq_act_backward_block_cuda(const tq_tensor *dy, const tq_tensor *h,
                                     const tq_act_backward_args *args, struct CUstream_st *stream);
tq_status tq_act_backward_mxfp8_ref(const tq_tensor *dy, const tq_tensor *h,
                                    const tq_act_backward_args *args, struct CUstream_st *stream);
tq_status tq_act_backward_mxfp8_cuda(const tq_tensor *dy, const tq_tensor *h,
                                     const tq_act_backward_args *args, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* TEQUANT_CORE_INTERNAL_KERNELS_H_ */
