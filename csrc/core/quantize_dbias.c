/* quantize_dbias.c: tq_quantize with args->dbias (tequant.h): x's column sums, a Linear's bias
 * gradient from its grad_output, taken in the pass over x that the quantization makes anyway
 * where the scaling has one; and tq_quantize_workspace_size.
 *
 * No kernel of its own: the pass is tq_act_backward of TQ_ACT_IDENTITY (dh = x; cuda/
 * act_backward.cu, csrc/ref/act_backward_ref.c), which sums in the fixed column order and can
 * cast to per-tensor FP8 (both directions) and find max |x| on the way; the rest are
 * tq_quantize's kernels. CPU and CUDA tensors run the same steps, each bit-exact with its
 * reference, so both give the same bits, and q those of tq_quantize without dbias:
 *   DELAYED with ROWWISE  the pass casts (rowwise codes, and the columnwise ones when asked;
 *                         scale_inv; max |x| into the history slot); on CUDA with both
 *                         directions it is the whole call: a cooperative launch that finishes
 *                         the column sums itself, where the device runs cooperative launches,
 *                         and runs args->update (the slot's roll) after its grid barrier.
 *   CURRENT, own amax     the pass finds max |x| (into the workspace's last float, zeroed first);
 *                         the cast is tq_quantize's with that amax given (no amax pass); except
 *                         on CUDA where the cast finds the amax in its own launch anyway
 *                         (x of at most 16M elements: tq_fp8_current_one_launch); and no
 *                         pass at all where that launch is the cooperative one, x is bf16 and
 *                         both directions are wanted: it sums the columns too
 *                         (tq_fp8_current_fuses_dbias).
 *   otherwise             (block formats, DELAYED columnwise alone, a given amax) the pass only
 *                         sums; tq_quantize's kernels follow as without dbias. (Summing in
 *                         Float8BlockScaling's tile kernel instead was measured slower than the
 *                         pass: docs/results/NOTES.md, twentieth session.)
 * args->update otherwise follows as tq_amax_update's launch (tq_quantize_then_update).
 * Tests: tests/test_linear_dbias.py.
 */
#include <stdio.h>

#include "internal_fused.h"
#include "internal_kernels.h"

#ifdef TQ_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

tq_status tq_quantize_workspace_size(const tq_quant_config *config, int64_t rows, int64_t cols,
                                     size_t *bytes) {
    if (bytes == NULL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize workspace size: bytes is NULL");
    tq_status st = tq_quant_config_check(config);
    if (st != TQ_SUCCESS) return st;
    if (rows < 0 || cols < 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize workspace size: x [%lld, %lld] has a "
                       "negative dim", (long long)rows, (long long)cols);
    *bytes = 0;
    if (cols == 0) return TQ_SUCCESS; /* no column to sum */
    st = tq_act_backward_workspace_size(rows, cols, bytes);
    /* CURRENT: the pass's amax, then the cooperative launch's CTA maxima (internal_kernels.h) */
    if (st == TQ_SUCCESS && config->scaling == TQ_SCALING_CURRENT)
        *bytes += (1 + TQ_FP8_CURRENT_MAX_CTAS) * sizeof(float);
    return st;
}

/* Whether the CURRENT cast after the pass finds x's amax itself (then the pass only sums). */
static int cast_finds_amax(const tq_tensor *x) {
#ifdef TQ_WITH_CUDA
    return x->device != TQ_DEVICE_CPU && tq_fp8_current_one_launch(x->rows * x->cols);
#else
    (void)x;
    return 0;
#endif
}

/* Whether the quantize kernel sums x's columns itself (CUDA only; see the callees). */
static int kernel_sums(const tq_tensor *x, const tq_quant_config *c, const tq_quantize_args *a) {
#ifdef TQ_WITH_CUDA
    if (x->device == TQ_DEVICE_CPU) return 0;
    return c->scaling == TQ_SCALING_CURRENT && a->amax.data == NULL
           && tq_fp8_current_fuses_dbias(x, c, a->usage);
#else
    (void)x, (void)c, (void)a;
    return 0;
#endif
}

/* *slot = +0, the start of a max-accumulated amax: on the CPU now, on CUDA queued on stream. */
static tq_status zero_slot(float *slot, int device, struct CUstream_st *stream) {
    if (device == TQ_DEVICE_CPU) {
        *slot = 0.0f;
        return TQ_SUCCESS;
    }
#ifdef TQ_WITH_CUDA
    int previous = -1;
    cudaError_t err = cudaGetDevice(&previous);
    if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
    if (err == cudaSuccess) err = cudaMemsetAsync(slot, 0, sizeof(float), stream);
    if (previous >= 0 && previous != device) cudaSetDevice(previous);
    if (err != cudaSuccess)
        return tq_fail(TQ_ERROR_CUDA, "quantize: zeroing the dbias pass's amax failed: %s (%s)",
                       cudaGetErrorName(err), cudaGetErrorString(err));
    return TQ_SUCCESS;
#else
    (void)stream;
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "a CUDA tensor, but tequant was built without CUDA");
#endif
}

tq_status tq_quantize_dbias_run(const tq_tensor *x, const tq_quant_config *c,
                                const tq_quantize_args *a, tq_qtensor *q,
                                struct CUstream_st *stream) {
    static const char fn[] = "quantize";
    const int64_t m = x->rows, k = x->cols;
    tq_status st = tq_fused_check_vector(fn, &a->dbias, "dbias", k, TQ_FLOAT_MASK, x->device);
    if (st != TQ_SUCCESS) return st;
    if (k == 0) return tq_quantize_then_update(x, c, a, q, stream); /* no column to sum */
    size_t partial_bytes = 0, need = 0;
    if ((st = tq_act_backward_workspace_size(m, k, &partial_bytes)) != TQ_SUCCESS
        || (st = tq_quantize_workspace_size(c, m, k, &need)) != TQ_SUCCESS)
        return st;
    char sized_by[96];
    snprintf(sized_by, sizeof sized_by, "tq_quantize_workspace_size of x [%lld, %lld]",
             (long long)m, (long long)k);
    if ((st = tq_fused_check_workspace(fn, &a->workspace, need, x->device, sized_by))
        != TQ_SUCCESS)
        return st;

    if (kernel_sums(x, c, a)) return tq_quantize_dispatch(x, c, a, q, stream); /* no pass */

    tq_act_backward_args pass = TQ_ACT_BACKWARD_ARGS_INIT;
    pass.act = TQ_ACT_IDENTITY;
    pass.dbias = a->dbias;
    pass.workspace = a->workspace; /* the partials first */
    tq_quantize_args rest = *a;    /* what tq_quantize's kernels do after the pass */
    const tq_tensor none = TQ_TENSOR_NONE;
    rest.dbias = rest.workspace = none;
    const int cast = c->scaling == TQ_SCALING_DELAYED && (a->usage & TQ_USAGE_ROWWISE);
    if (cast) {
        pass.config = c;
        pass.dh_q = q->data;
        pass.scale_inv = q->scale_inv;
        pass.scale = a->scale;
        pass.amax = q->amax; /* the history slot, max-accumulated as tq_quantize does */
        if (a->usage & TQ_USAGE_COLUMNWISE) pass.dh_q_t = q->data_t; /* in the same pass */
        pass.update = a->update; /* after the pass: its amax is the slot's */
        pass.update_args = a->update_args;
    } else if (c->scaling == TQ_SCALING_CURRENT && a->amax.data == NULL && !cast_finds_amax(x)) {
        float *slot = (float *)((char *)a->workspace.data + partial_bytes);
        const tq_tensor amax = {slot, 1, 1, 1, TQ_DTYPE_FLOAT32, x->device};
        if ((st = zero_slot(slot, x->device, stream)) != TQ_SUCCESS) return st;
        pass.amax = rest.amax = amax; /* found by the pass, given to the cast */
    }
    const int on_cpu = x->device == TQ_DEVICE_CPU;
    st = TQ_DISPATCH(act_backward, on_cpu, x, x, &pass, stream);
    if (st != TQ_SUCCESS) return st;
    return cast ? TQ_SUCCESS : tq_quantize_then_update(x, c, &rest, q, stream);
}
