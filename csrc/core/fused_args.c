/* fused_args.c: argument checks shared by the fused kernels' entry points (norm.c, act.c); the
 * rules are in internal_fused.h (the block formats' q: tq_fused_check_block_q), the messages
 * name the function, the argument, what it is and what was expected. Tests: tests/test_norm_kernels.py, tests/test_act_kernels.py (errors).
 */
#include <stdio.h>

#include "internal_fused.h"
#include "internal_kernels.h"

tq_status tq_fused_not_for(const char *fn, const char *name, const char *what) {
    return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s was given, but %s", fn, name, what);
}

tq_status tq_fused_check_input(const char *fn, const tq_tensor *x, const char *name,
                               const char *what) {
    tq_status st = tq_tensor_check(x, name);
    if (st != TQ_SUCCESS) return st;
    if (!((TQ_FLOAT_MASK >> x->dtype) & 1u))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s has dtype %s; expected float32, "
                       "bfloat16 or float16", fn, name, tq_dtype_name(x->dtype));
    if (x->cols < 1)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is [%lld, %lld]; %s", fn, name,
                       (long long)x->rows, (long long)x->cols, what);
    return TQ_SUCCESS;
}

tq_status tq_fused_check_vector(const char *fn, const tq_tensor *t, const char *name, int64_t n,
                                uint32_t mask, int device) {
    tq_status st = tq_tensor_check(t, name);
    if (st != TQ_SUCCESS) return st;
    const int contiguous = t->rows <= 1 || (t->cols == 1 && t->ld == 1) || t->rows * t->cols == 0;
    if (!((mask >> t->dtype) & 1u) || t->rows * t->cols != n || !contiguous) {
        char dtypes[96] = ""; /* the dtypes of mask, "a/b/c" */
        size_t used = 0;
        for (int d = 0; d < TQ_DTYPE_COUNT_ && used < sizeof dtypes; d++)
            if ((mask >> d) & 1u)
                used += (size_t)snprintf(dtypes + used, sizeof dtypes - used, "%s%s",
                                         used ? "/" : "", tq_dtype_name((tq_dtype)d));
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is %s [%lld, %lld] (ld %lld); expected "
                       "%lld contiguous %s elements", fn, name, tq_dtype_name(t->dtype),
                       (long long)t->rows, (long long)t->cols, (long long)t->ld, (long long)n,
                       dtypes);
    }
    if (t->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is on device %d, the input on device "
                       "%d", fn, name, t->device, device);
    return TQ_SUCCESS;
}

tq_status tq_fused_check_matrix(const char *fn, const tq_tensor *t, const char *name,
                                int64_t rows, int64_t cols, tq_dtype dtype, int device,
                                const char *like) {
    tq_status st = tq_tensor_check(t, name);
    if (st != TQ_SUCCESS) return st;
    const int codes_ok = tq_dtype_bits(dtype) == 8 && t->dtype == TQ_DTYPE_UINT8;
    if ((t->dtype != dtype && !codes_ok) || t->rows != rows || t->cols != cols)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is %s [%lld, %lld]; expected %s [%lld, "
                       "%lld] like %s", fn, name, tq_dtype_name(t->dtype), (long long)t->rows,
                       (long long)t->cols, tq_dtype_name(dtype), (long long)rows, (long long)cols,
                       like);
    if (t->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is on device %d, the input on device "
                       "%d", fn, name, t->device, device);
    return TQ_SUCCESS;
}

static tq_status check_rowwise(const char *fn, const tq_fused_fp8 *o, int64_t rows,
                               int64_t cols, int device, const char *like) {
    const tq_quant_config *c = o->config;
    if (c == NULL) {
        const tq_tensor *ts[] = {o->q, o->scale_inv, o->scale, o->amax_in};
        const char *const names[] = {o->q_name, "scale_inv", "scale", "amax_in"};
        for (int i = 0; i < 4; i++)
            if (tq_given(ts[i]))
                return tq_fused_not_for(fn, names[i], "config is NULL (no quantized output)");
        return TQ_SUCCESS;
    }
    tq_status st = tq_quant_config_check(c);
    if (st != TQ_SUCCESS) return st;
    if (c->scaling != TQ_SCALING_DELAYED && c->scaling != TQ_SCALING_CURRENT)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "%s: the fused kernels write per-tensor FP8 "
                       "(delayed or current scaling); this config's scaling is %d: quantize the "
                       "high-precision output with tq_quantize instead", fn, (int)c->scaling);
    /* empty codes (no rows) may have no data pointer (CUDA's empty tensors have none) */
    if ((!tq_given(o->q) && rows > 0) || !tq_given(o->scale_inv))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: a config needs both %s and scale_inv",
                       fn, o->q_name);
    st = tq_fused_check_matrix(fn, o->q, o->q_name, rows, cols, c->elem_dtype, device, like);
    if (st == TQ_SUCCESS)
        st = tq_fused_check_vector(fn, o->scale_inv, "scale_inv", 1, TQ_F32_MASK, device);
    if (st != TQ_SUCCESS) return st;
    if (c->scaling == TQ_SCALING_DELAYED) {
        if (tq_given(o->amax_in))
            return tq_fused_not_for(fn, "amax_in", "delayed scaling casts with the given scale");
        if (!tq_given(o->scale))
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: delayed scaling needs scale (one "
                           "float32, the scale to cast with)", fn);
        return tq_fused_check_vector(fn, o->scale, "scale", 1, TQ_F32_MASK, device);
    }
    if (tq_given(o->scale))
        return tq_fused_not_for(fn, "scale", "current scaling computes its scale from amax_in");
    if (!tq_given(o->amax_in))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: current scaling needs amax_in, the amax "
                       "of the whole output: run once with amax first", fn);
    st = tq_fused_check_vector(fn, o->amax_in, "amax_in", 1, TQ_F32_MASK, device);
    if (st == TQ_SUCCESS && tq_given(o->amax) && o->amax->data == o->amax_in->data)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: amax and amax_in are the same memory; the "
                       "scale would read an amax the same pass is still accumulating", fn);
    return st;
}

tq_status tq_fused_check_fp8(const char *fn, const tq_fused_fp8 *o, int64_t rows, int64_t cols,
                             int device, const char *like) {
    tq_status st = check_rowwise(fn, o, rows, cols, device, like);
    if (st != TQ_SUCCESS || o->q_t == NULL || !tq_given(o->q_t)) return st;
    if (o->config == NULL || (!tq_given(o->q) && rows > 0))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s was given, but it is %s transposed: "
                       "give config and %s too", fn, o->q_t_name, o->q_name, o->q_name);
    char like_t[64];
    snprintf(like_t, sizeof like_t, "%s transposed", like);
    return tq_fused_check_matrix(fn, o->q_t, o->q_t_name, cols, rows, o->config->elem_dtype,
                                 device, like_t);
}

tq_status tq_fused_check_workspace(const char *fn, const tq_tensor *w, size_t need, int device,
                                   const char *sized_by) {
    if (need == 0) return TQ_SUCCESS;
    tq_status st = tq_tensor_check(w, "workspace");
    if (st != TQ_SUCCESS) return st;
    const int contiguous = w->rows <= 1 || w->ld == w->cols;
    const size_t elem = (size_t)(tq_dtype_bits(w->dtype) / 8);
    const size_t have = contiguous ? (size_t)(w->rows * w->cols) * elem : 0;
    if (w->data == NULL || have < need || ((uintptr_t)w->data & 3u) != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: workspace has %zu contiguous bytes at %p; "
                       "%s needs %zu, 4-byte aligned", fn, have, w->data, sized_by, need);
    if (w->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: workspace is on device %d, the input on "
                       "device %d", fn, w->device, device);
    return TQ_SUCCESS;
}

tq_status tq_fused_check_block_q(const char *fn, const tq_quant_config *c, const tq_qtensor *q,
                                 int64_t rows, int64_t cols, int device, const char *what) {
    const int mx = c->scaling == TQ_SCALING_MXFP8;
    const char *kind = mx ? "an MXFP8" : "a BLOCK";
    tq_status st = tq_quant_config_check(c);
    if (st != TQ_SUCCESS) return st;
    if (c->block_rows != 1 || c->block_cols != (mx ? 32 : 128) || (c->flags & TQ_QUANT_2D)
        || c->elem_dtype != TQ_DTYPE_FLOAT8_E4M3)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "%s: %s config is fused as 1x%d blocks of E4M3 (the "
                       "recipes' defaults); this one has %dx%d blocks of %s: quantize %s with "
                       "tq_quantize", fn, kind, mx ? 32 : 128, (int)c->block_rows,
                       (int)c->block_cols, tq_dtype_name(c->elem_dtype), what);
    if (q == NULL || q->struct_size < sizeof(tq_qtensor))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s config needs q (a tq_qtensor, "
                       "TQ_QTENSOR_INIT)", fn, kind);
    if (q->rows < rows || q->cols != cols)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: q is [%lld, %lld]; %s is [%lld, %lld]: q "
                       "needs its columns and at least its rows", fn, (long long)q->rows,
                       (long long)q->cols, what, (long long)rows, (long long)cols);
    if (q->data.data == NULL && q->rows * q->cols > 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: q needs its rowwise members (data, "
                       "scale_inv); the columnwise ones are optional", fn);
    const uint32_t usage = TQ_USAGE_ROWWISE | (q->data_t.data != NULL ? TQ_USAGE_COLUMNWISE : 0u);
    if ((st = tq_qtensor_check_members(c, q, usage, device)) != TQ_SUCCESS) return st;
    const tq_tensor *members[] = {&q->data, &q->scale_inv, &q->data_t, &q->scale_inv_t};
    static const char *const names[] = {"data", "scale_inv", "data_t", "scale_inv_t"};
    for (int i = 0; mx && i < 4; i++)
        if ((uintptr_t)members[i]->data % 16 != 0)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: q.%s starts at %p; the MXFP8 pass "
                           "stores 16 bytes at a time and needs 16-byte aligned members", fn,
                           names[i], members[i]->data);
    return TQ_SUCCESS;
}
