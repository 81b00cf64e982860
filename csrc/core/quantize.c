/* quantize.c: tq_quantize_layout, and the argument checks and device dispatch of tq_quantize and
 * tq_dequantize. The layout rules (documented in tequant.h) live here once; the kernels
 * (csrc/ref/quantize_<stem>_ref.c, cuda/quantize_<stem>.cu) trust what these checks establish:
 * members laid out as tq_quantize_layout says, contiguous, on x's device. With args->dbias,
 * quantize_dbias.c takes over after these checks. tq_quantize_pair: two such calls, or one launch
 * of both where the kernels have one (quantize_fp8_pair.cu: te.Linear's x and W under per-tensor
 * FP8 scaling; quantize_fp8_block.cu: under FP8 block scaling).
 * Tests: tests/test_quantize_*.py (through te.ops), tests/test_ops.py (errors),
 * tests/test_linear_dbias.py (dbias), tests/test_quantize_pair.py (the pair).
 */
#include "internal_amax_update.h"
#include "internal_kernels.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t pad4(int64_t a) { return ceil_div(a, 4) * 4; }

static void set(tq_tensor *t, int64_t rows, int64_t cols, tq_dtype dtype) {
    t->data = NULL;
    t->rows = rows;
    t->cols = cols;
    /* ld is never 0 (ld == 0 marks a member the layout does not use); packed E2M1 needs it even */
    t->ld = cols > 0 ? cols : (dtype == TQ_DTYPE_FLOAT4_E2M1X2 ? 2 : 1);
    t->dtype = dtype;
    t->device = TQ_DEVICE_CPU;
}

static const char *family(tq_scaling s) {
    switch (s) {
        case TQ_SCALING_DELAYED: return "FP8 delayed scaling";
        case TQ_SCALING_CURRENT: return "FP8 current scaling";
        case TQ_SCALING_BLOCK: return "FP8 block scaling";
        case TQ_SCALING_MXFP8: return "MXFP8";
        case TQ_SCALING_NVFP4: return "NVFP4";
        default: return "this scaling";
    }
}

tq_status tq_quantize_layout(const tq_quant_config *c, int64_t rows, int64_t cols, uint32_t usage,
                             tq_qtensor *q) {
    tq_status st = tq_quant_config_check(c);
    if (st != TQ_SUCCESS) return st;
    if (q == NULL || q->struct_size < sizeof(tq_qtensor))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "qtensor is NULL or its struct_size is too "
                       "small (use TQ_QTENSOR_INIT)");
    if (c->scaling == TQ_SCALING_NONE || c->scaling == TQ_SCALING_CUSTOM)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "the config does not quantize (scaling is %s)",
                       c->scaling == TQ_SCALING_NONE ? "none" : "custom");
    if (usage == 0 || (usage & ~(uint32_t)(TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE)))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "usage=%u must be TQ_USAGE_ROWWISE, "
                       "TQ_USAGE_COLUMNWISE or both", (unsigned)usage);
    if (rows < 0 || cols < 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "shape [%lld, %lld] has a negative dim",
                       (long long)rows, (long long)cols);
    const int64_t align = c->scaling == TQ_SCALING_MXFP8 ? 32 : c->scaling == TQ_SCALING_NVFP4 ? 16 : 1;
    if (rows % align != 0 || cols % align != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s needs both dims to be multiples of %lld; x "
                       "is [%lld, %lld] (%s=%lld is not)", family(c->scaling), (long long)align,
                       (long long)rows, (long long)cols, rows % align ? "rows" : "cols",
                       (long long)(rows % align ? rows : cols));
    const size_t size = q->struct_size;
    const tq_qtensor empty = TQ_QTENSOR_INIT;
    *q = empty;
    q->struct_size = size;
    q->rows = rows;
    q->cols = cols;
    const int row = (usage & TQ_USAGE_ROWWISE) != 0, col = (usage & TQ_USAGE_COLUMNWISE) != 0;
    if (row) set(&q->data, rows, cols, c->elem_dtype);
    if (col) set(&q->data_t, cols, rows, c->elem_dtype);
    switch (c->scaling) {
        case TQ_SCALING_DELAYED:
        case TQ_SCALING_CURRENT:
            set(&q->scale_inv, 1, 1, TQ_DTYPE_FLOAT32);
            set(&q->amax, 1, 1, TQ_DTYPE_FLOAT32);
            break;
        case TQ_SCALING_BLOCK:
            if (c->flags & TQ_QUANT_2D) {
                if (row) set(&q->scale_inv, ceil_div(rows, 128), pad4(ceil_div(cols, 128)), TQ_DTYPE_FLOAT32);
                if (col) set(&q->scale_inv_t, ceil_div(cols, 128), pad4(ceil_div(rows, 128)), TQ_DTYPE_FLOAT32);
            } else {
                if (row) set(&q->scale_inv, ceil_div(cols, 128), pad4(rows), TQ_DTYPE_FLOAT32);
                if (col) set(&q->scale_inv_t, ceil_div(rows, 128), pad4(cols), TQ_DTYPE_FLOAT32);
            }
            break;
        case TQ_SCALING_MXFP8: /* block-major: a 128x128 tile's exponents are 4 runs of 128 bytes */
            if (row) set(&q->scale_inv, cols / 32, rows, TQ_DTYPE_FLOAT8_E8M0);
            if (col) set(&q->scale_inv_t, rows / 32, cols, TQ_DTYPE_FLOAT8_E8M0);
            break;
        case TQ_SCALING_NVFP4:
            if (row) set(&q->scale_inv, rows, cols / 16, TQ_DTYPE_FLOAT8_E4M3);
            if (col) set(&q->scale_inv_t, cols, rows / 16, TQ_DTYPE_FLOAT8_E4M3);
            if (row) set(&q->amax, 1, 1, TQ_DTYPE_FLOAT32);
            if (col) set(&q->amax_t, 1, 1, TQ_DTYPE_FLOAT32);
            break;
        default:
            break;
    }
    return TQ_SUCCESS;
}

/* One member of q against the layout: same shape and dtype, contiguous, on the device. */
static tq_status check_member(const tq_tensor *got, const tq_tensor *want, int device,
                              const char *name) {
    if (want->rows == 0 && want->cols == 0 && want->ld == 0) return TQ_SUCCESS; /* not used */
    tq_status st = tq_tensor_check(got, name);
    if (st != TQ_SUCCESS) return st;
    int same_kind = got->dtype == want->dtype
                    || (tq_dtype_bits(want->dtype) == 8 && got->dtype == TQ_DTYPE_UINT8);
    /* ld of a member without elements addresses nothing (torch gives [K, 0] a row stride of 1) */
    const int ld_ok = got->ld == want->cols || got->rows * got->cols == 0;
    if (!same_kind || got->rows != want->rows || got->cols != want->cols || !ld_ok)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s is %s [%lld, %lld] (ld %lld); the layout "
                       "needs a contiguous %s [%lld, %lld]", name, tq_dtype_name(got->dtype),
                       (long long)got->rows, (long long)got->cols, (long long)got->ld,
                       tq_dtype_name(want->dtype), (long long)want->rows, (long long)want->cols);
    if (got->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s is on device %d, x on device %d", name,
                       got->device, device);
    return TQ_SUCCESS;
}

tq_status tq_qtensor_check_members(const tq_quant_config *c, const tq_qtensor *q, uint32_t usage,
                                   int device) {
    if (q == NULL || q->struct_size < sizeof(tq_qtensor))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "qtensor is NULL or its struct_size is too "
                       "small (use TQ_QTENSOR_INIT)");
    tq_qtensor want = TQ_QTENSOR_INIT;
    tq_status st = tq_quantize_layout(c, q->rows, q->cols, usage, &want);
    if (st != TQ_SUCCESS) return st;
    const tq_tensor *got[] = {&q->data, &q->scale_inv, &q->data_t, &q->scale_inv_t, &q->amax, &q->amax_t};
    const tq_tensor *exp[] = {&want.data, &want.scale_inv, &want.data_t, &want.scale_inv_t, &want.amax, &want.amax_t};
    static const char *const names[] = {"data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t"};
    for (int i = 0; i < 6 && st == TQ_SUCCESS; i++) st = check_member(got[i], exp[i], device, names[i]);
    return st;
}

static int float_dtype(tq_dtype d) {
    return d == TQ_DTYPE_FLOAT32 || d == TQ_DTYPE_BFLOAT16 || d == TQ_DTYPE_FLOAT16;
}

/* One FP32 element on x's device, or nothing given. */
static tq_status check_amax_tensor(const tq_tensor *t, const char *name, int device) {
    if (t->data == NULL) return TQ_SUCCESS;
    tq_status st = tq_tensor_check(t, name);
    if (st != TQ_SUCCESS) return st;
    if (t->dtype != TQ_DTYPE_FLOAT32 || t->rows * t->cols != 1 || t->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize: a given %s must be one float32 on "
                       "x's device (%d); got %s [%lld, %lld] on device %d", name, device,
                       tq_dtype_name(t->dtype), (long long)t->rows, (long long)t->cols, t->device);
    return TQ_SUCCESS;
}

/* args->amax / amax_t: only where a per-tensor scale comes from an amax (CURRENT, NVFP4), and
 * with an RHT columnwise copy the transformed amax too (it differs from max|x|). */
static tq_status check_given_amax(const tq_tensor *x, const tq_quant_config *c,
                                  const tq_quantize_args *a) {
    const int given = a->amax.data != NULL, given_t = a->amax_t.data != NULL;
    if (!given && !given_t) return TQ_SUCCESS;
    const int nvfp4 = c->scaling == TQ_SCALING_NVFP4;
    if (c->scaling != TQ_SCALING_CURRENT && !nvfp4)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize: a given amax applies to current "
                       "scaling and NVFP4 (a per-tensor scale from an amax); this config's "
                       "scaling has none");
    if (!given || (given_t && !nvfp4))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize: amax_t is NVFP4's columnwise amax "
                       "and comes with amax");
    if (nvfp4 && (c->flags & TQ_QUANT_RHT) && (a->usage & TQ_USAGE_COLUMNWISE) && !given_t)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize: NVFP4 with RHT scales its "
                       "columnwise copy from the transformed values' amax: give amax_t too");
    tq_status st = check_amax_tensor(&a->amax, "amax", x->device);
    return st != TQ_SUCCESS ? st : check_amax_tensor(&a->amax_t, "amax_t", x->device);
}

/* tq_quantize's checks of everything but dbias and the workspace (quantize_dbias.c's). */
static tq_status quantize_check(const tq_tensor *x, const tq_quant_config *c,
                                const tq_quantize_args *a, const tq_qtensor *q) {
    tq_status st = tq_tensor_check(x, "x");
    if (st != TQ_SUCCESS) return st;
    if (!float_dtype(x->dtype))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize: x has dtype %s; expected float32, "
                       "bfloat16 or float16", tq_dtype_name(x->dtype));
    if (a == NULL || a->struct_size < sizeof(tq_quantize_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize args are NULL or their struct_size "
                       "is too small (use TQ_QUANTIZE_ARGS_INIT)");
    if (q != NULL && (q->rows != x->rows || q->cols != x->cols))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "qtensor is laid out for [%lld, %lld], x is "
                       "[%lld, %lld]", (long long)q->rows, (long long)q->cols,
                       (long long)x->rows, (long long)x->cols);
    st = tq_qtensor_check_members(c, q, a->usage, x->device);
    if (st != TQ_SUCCESS) return st;
    if (c->scaling == TQ_SCALING_DELAYED) {
        st = tq_tensor_check(&a->scale, "scale");
        if (st != TQ_SUCCESS) return st;
        if (a->scale.dtype != TQ_DTYPE_FLOAT32 || a->scale.rows * a->scale.cols != 1
            || a->scale.device != x->device)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "delayed scaling needs scale = one float32 "
                           "on x's device (%d); got %s [%lld, %lld] on device %d", x->device,
                           tq_dtype_name(a->scale.dtype), (long long)a->scale.rows,
                           (long long)a->scale.cols, a->scale.device);
    }
    if (a->rng_state.data != NULL) {
        st = tq_tensor_check(&a->rng_state, "rng_state");
        if (st != TQ_SUCCESS) return st;
        if (!(c->flags & TQ_QUANT_STOCHASTIC_ROUNDING))
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quantize: rng_state is set but the "
                           "config does not round stochastically");
        if (a->rng_state.dtype != TQ_DTYPE_INT64 || a->rng_state.rows * a->rng_state.cols != 2
            || a->rng_state.ld != a->rng_state.cols || a->rng_state.device != x->device)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "rng_state must be two contiguous int64 "
                           "(seed, offset) on x's device (%d); got %s [%lld, %lld] (ld %lld) on "
                           "device %d", x->device, tq_dtype_name(a->rng_state.dtype),
                           (long long)a->rng_state.rows, (long long)a->rng_state.cols,
                           (long long)a->rng_state.ld, a->rng_state.device);
    }
    const tq_tensor none = TQ_TENSOR_NONE;
    st = tq_amax_update_after_check("quantize", a->update, a->update_args, c,
                                    q != NULL ? &q->amax : &none, x->device);
    return st != TQ_SUCCESS ? st : check_given_amax(x, c, a);
}

/* tq_quantize after its checks: the dbias path or the plain dispatch. */
static tq_status quantize_checked(const tq_tensor *x, const tq_quant_config *c,
                                  const tq_quantize_args *a, tq_qtensor *q,
                                  struct CUstream_st *stream) {
    if (a->dbias.data != NULL) return tq_quantize_dbias_run(x, c, a, q, stream);
    return tq_quantize_then_update(x, c, a, q, stream);
}

/* a->update's launch where given (after a cast that did not run it itself). */
static tq_status update_after(const tq_quantize_args *a, struct CUstream_st *stream) {
    return a->update == NULL ? TQ_SUCCESS : tq_amax_update(a->update, 1, a->update_args, stream);
}

tq_status tq_quantize_then_update(const tq_tensor *x, const tq_quant_config *c,
                                  const tq_quantize_args *a, tq_qtensor *q,
                                  struct CUstream_st *stream) {
    const tq_status st = tq_quantize_dispatch(x, c, a, q, stream);
    return st != TQ_SUCCESS ? st : update_after(a, stream);
}

tq_status tq_quantize(const tq_tensor *x, const tq_quant_config *c, const tq_quantize_args *a,
                      tq_qtensor *q, struct CUstream_st *stream) {
    tq_status st = quantize_check(x, c, a, q);
    return st != TQ_SUCCESS ? st : quantize_checked(x, c, a, q, stream);
}

tq_status tq_quantize_pair(const tq_tensor *x0, const tq_quant_config *c0,
                           const tq_quantize_args *a0, tq_qtensor *q0, const tq_tensor *x1,
                           const tq_quant_config *c1, const tq_quantize_args *a1, tq_qtensor *q1,
                           struct CUstream_st *stream) {
    /* both checked before either runs; each checked once */
    tq_status st = quantize_check(x0, c0, a0, q0);
    if (st == TQ_SUCCESS) st = quantize_check(x1, c1, a1, q1);
    if (st != TQ_SUCCESS) return st;
#ifdef TQ_WITH_CUDA
    int launched = 0;
    if (x0->device != TQ_DEVICE_CPU && a0->dbias.data == NULL && a1->dbias.data == NULL) {
        st = c0->scaling == TQ_SCALING_BLOCK && c1->scaling == TQ_SCALING_BLOCK
                 ? tq_quantize_fp8_block_pair_cuda(x0, c0, a0, q0, x1, c1, a1, q1, stream, &launched)
                 : tq_quantize_fp8_pair_cuda(x0, c0, a0, q0, x1, c1, a1, q1, stream, &launched);
        if (st != TQ_SUCCESS) return st;
    }
    if (launched) { /* the pair's launch ran no update */
        st = update_after(a0, stream);
        return st != TQ_SUCCESS ? st : update_after(a1, stream);
    }
#endif
    st = quantize_checked(x0, c0, a0, q0, stream);
    return st != TQ_SUCCESS ? st : quantize_checked(x1, c1, a1, q1, stream);
}

tq_status tq_quantize_dispatch(const tq_tensor *x, const tq_quant_config *c,
                               const tq_quantize_args *a, tq_qtensor *q,
                               struct CUstream_st *stream) {
    const int on_cpu = x->device == TQ_DEVICE_CPU;
    switch (c->scaling) {
        case TQ_SCALING_DELAYED:
        case TQ_SCALING_CURRENT: return TQ_DISPATCH(quantize_fp8, on_cpu, x, c, a, q, stream);
        case TQ_SCALING_BLOCK: return TQ_DISPATCH(quantize_fp8_block, on_cpu, x, c, a, q, stream);
        case TQ_SCALING_MXFP8: return TQ_DISPATCH(quantize_mxfp8, on_cpu, x, c, a, q, stream);
        case TQ_SCALING_NVFP4: return TQ_DISPATCH(quantize_nvfp4, on_cpu, x, c, a, q, stream);
        default: return tq_fail(TQ_ERROR_INTERNAL, "quantize: unhandled scaling %d", (int)c->scaling);
    }
}

tq_status tq_dequantize(const tq_quant_config *c, const tq_qtensor *q, uint32_t usage,
                        tq_tensor *out, struct CUstream_st *stream) {
    if (usage != TQ_USAGE_ROWWISE && usage != TQ_USAGE_COLUMNWISE)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "dequantize reads one direction: usage must be "
                       "TQ_USAGE_ROWWISE or TQ_USAGE_COLUMNWISE, got %u", (unsigned)usage);
    tq_status st = tq_tensor_check(out, "out");
    if (st != TQ_SUCCESS) return st;
    if (!float_dtype(out->dtype))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "dequantize: out has dtype %s; expected "
                       "float32, bfloat16 or float16", tq_dtype_name(out->dtype));
    st = tq_qtensor_check_members(c, q, usage, out->device);
    if (st != TQ_SUCCESS) return st;
    const int row = usage == TQ_USAGE_ROWWISE;
    const int64_t want_rows = row ? q->rows : q->cols, want_cols = row ? q->cols : q->rows;
    if (out->rows != want_rows || out->cols != want_cols)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "dequantize: out is [%lld, %lld]; the %s "
                       "direction is [%lld, %lld]", (long long)out->rows, (long long)out->cols,
                       row ? "rowwise" : "columnwise", (long long)want_rows, (long long)want_cols);
    return tq_dequantize_dispatch(c, q, usage, out, stream);
}

tq_status tq_dequantize_dispatch(const tq_quant_config *c, const tq_qtensor *q, uint32_t usage,
                                 tq_tensor *out, struct CUstream_st *stream) {
    const int on_cpu = out->device == TQ_DEVICE_CPU;
    switch (c->scaling) {
        case TQ_SCALING_DELAYED:
        case TQ_SCALING_CURRENT: return TQ_DISPATCH(dequantize_fp8, on_cpu, c, q, usage, out, stream);
        case TQ_SCALING_BLOCK: return TQ_DISPATCH(dequantize_fp8_block, on_cpu, c, q, usage, out, stream);
        case TQ_SCALING_MXFP8: return TQ_DISPATCH(dequantize_mxfp8, on_cpu, c, q, usage, out, stream);
        case TQ_SCALING_NVFP4: return TQ_DISPATCH(dequantize_nvfp4, on_cpu, c, q, usage, out, stream);
        default: return tq_fail(TQ_ERROR_INTERNAL, "dequantize: unhandled scaling %d", (int)c->scaling);
    }
}
