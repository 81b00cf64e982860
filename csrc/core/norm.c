/* norm.c: tq_norm_forward / tq_norm_backward argument checks and dispatch, and the backward's
 * workspace size. The rules (shapes, dtypes, which outputs each norm and scaling takes) are
 * checked here once; the references (csrc/ref/norm_forward_ref.c, norm_backward_ref.c) and the
 * kernels (cuda/norm_forward.cu, norm_backward.cu) trust them.
 * Tests: tests/test_norm_kernels.py (test_errors_*).
 */
#include <math.h>

#include "internal_kernels.h"
#include "internal_norm.h"

#define FLOAT_MASK ((1u << TQ_DTYPE_FLOAT32) | (1u << TQ_DTYPE_BFLOAT16) | (1u << TQ_DTYPE_FLOAT16))
#define F32_MASK (1u << TQ_DTYPE_FLOAT32)

static int given(const tq_tensor *t) { return t->data != NULL; }

static const char *norm_name(tq_norm_type norm) {
    return norm == TQ_NORM_LAYERNORM ? "LayerNorm" : "RMSNorm";
}

static tq_status check_norm_and_flags(const char *fn, tq_norm_type norm, uint32_t flags) {
    if (norm != TQ_NORM_LAYERNORM && norm != TQ_NORM_RMSNORM)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: norm=%d must be TQ_NORM_LAYERNORM (0) or "
                       "TQ_NORM_RMSNORM (1)", fn, (int)norm);
    if (flags & ~(uint32_t)TQ_NORM_ZERO_CENTERED_GAMMA)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: flags=0x%x has bits other than "
                       "TQ_NORM_ZERO_CENTERED_GAMMA", fn, (unsigned)flags);
    return TQ_SUCCESS;
}

/* x (and dy): a float [M, K] matrix with K >= 1. */
static tq_status check_input(const char *fn, const tq_tensor *x, const char *name) {
    tq_status st = tq_tensor_check(x, name);
    if (st != TQ_SUCCESS) return st;
    if (!((FLOAT_MASK >> x->dtype) & 1u))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s has dtype %s; expected float32, "
                       "bfloat16 or float16", fn, name, tq_dtype_name(x->dtype));
    if (x->cols < 1)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is [%lld, %lld]; the norm runs over the "
                       "last dim, which needs at least one element", fn, name,
                       (long long)x->rows, (long long)x->cols);
    return TQ_SUCCESS;
}

/* n contiguous elements of a dtype in mask, on device. */
static tq_status check_vector(const char *fn, const tq_tensor *t, const char *name, int64_t n,
                              uint32_t mask, int device) {
    tq_status st = tq_tensor_check(t, name);
    if (st != TQ_SUCCESS) return st;
    const int contiguous = t->rows <= 1 || (t->cols == 1 && t->ld == 1) || t->rows * t->cols == 0;
    if (!((mask >> t->dtype) & 1u) || t->rows * t->cols != n || !contiguous)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is %s [%lld, %lld] (ld %lld); expected "
                       "%lld contiguous %s elements", fn, name, tq_dtype_name(t->dtype),
                       (long long)t->rows, (long long)t->cols, (long long)t->ld, (long long)n,
                       mask == F32_MASK ? "float32" : "float32/bfloat16/float16");
    if (t->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is on device %d, x on device %d", fn,
                       name, t->device, device);
    return TQ_SUCCESS;
}

/* An [M, K] output of one dtype (or, for codes, also UINT8), any ld >= K, on device. */
static tq_status check_matrix(const char *fn, const tq_tensor *t, const char *name,
                              const tq_tensor *x, tq_dtype dtype) {
    tq_status st = tq_tensor_check(t, name);
    if (st != TQ_SUCCESS) return st;
    const int codes_ok = tq_dtype_bits(dtype) == 8 && t->dtype == TQ_DTYPE_UINT8;
    if ((t->dtype != dtype && !codes_ok) || t->rows != x->rows || t->cols != x->cols)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is %s [%lld, %lld]; expected %s [%lld, "
                       "%lld] like x", fn, name, tq_dtype_name(t->dtype), (long long)t->rows,
                       (long long)t->cols, tq_dtype_name(dtype), (long long)x->rows,
                       (long long)x->cols);
    if (t->device != x->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s is on device %d, x on device %d", fn,
                       name, t->device, x->device);
    return TQ_SUCCESS;
}

static tq_status not_for(const char *fn, const char *name, const char *what) {
    return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: %s was given, but %s", fn, name, what);
}

/* The quantized output: a DELAYED or CURRENT FP8 config, y_q and scale_inv, and the scale
 * (DELAYED) or the amax it comes from (CURRENT). */
static tq_status check_quantized(const char *fn, const tq_tensor *x,
                                 const tq_norm_forward_args *a) {
    const tq_quant_config *c = a->config;
    if (c == NULL) {
        const tq_tensor *ts[] = {&a->y_q, &a->scale_inv, &a->scale, &a->amax_in};
        static const char *const names[] = {"y_q", "scale_inv", "scale", "amax_in"};
        for (int i = 0; i < 4; i++)
            if (given(ts[i])) return not_for(fn, names[i], "config is NULL (no quantized output)");
        return TQ_SUCCESS;
    }
    tq_status st = tq_quant_config_check(c);
    if (st != TQ_SUCCESS) return st;
    if (c->scaling != TQ_SCALING_DELAYED && c->scaling != TQ_SCALING_CURRENT)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "%s: the fused norm writes per-tensor FP8 (delayed "
                       "or current scaling); this config's scaling is %d: quantize y_hp with "
                       "tq_quantize instead", fn, (int)c->scaling);
    /* an empty y_q (M = 0) may have no data pointer (CUDA's empty tensors have none) */
    if ((!given(&a->y_q) && x->rows > 0) || !given(&a->scale_inv))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: a config needs both y_q and scale_inv",
                       fn);
    st = check_matrix(fn, &a->y_q, "y_q", x, c->elem_dtype);
    if (st == TQ_SUCCESS) st = check_vector(fn, &a->scale_inv, "scale_inv", 1, F32_MASK, x->device);
    if (st != TQ_SUCCESS) return st;
    if (c->scaling == TQ_SCALING_DELAYED) {
        if (given(&a->amax_in))
            return not_for(fn, "amax_in", "delayed scaling casts with the given scale");
        if (!given(&a->scale))
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: delayed scaling needs scale (one "
                           "float32, the scale to cast with)", fn);
        return check_vector(fn, &a->scale, "scale", 1, F32_MASK, x->device);
    }
    if (given(&a->scale))
        return not_for(fn, "scale", "current scaling computes its scale from amax_in");
    if (!given(&a->amax_in))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: current scaling needs amax_in, the amax of "
                       "every row's y: run the forward once with amax first", fn);
    st = check_vector(fn, &a->amax_in, "amax_in", 1, F32_MASK, x->device);
    if (st == TQ_SUCCESS && given(&a->amax) && a->amax.data == a->amax_in.data)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: amax and amax_in are the same memory; the "
                       "scale would read an amax the same pass is still accumulating", fn);
    return st;
}

tq_status tq_norm_forward(const tq_tensor *x, const tq_norm_forward_args *a,
                          struct CUstream_st *stream) {
    static const char fn[] = "norm forward";
    tq_status st = check_input(fn, x, "x");
    if (st != TQ_SUCCESS) return st;
    if (a == NULL || a->struct_size < sizeof(tq_norm_forward_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: args are NULL or their struct_size is too "
                       "small (use TQ_NORM_FORWARD_ARGS_INIT)", fn);
    st = check_norm_and_flags(fn, a->norm, a->flags);
    if (st != TQ_SUCCESS) return st;
    if (!(a->eps >= 0.0f) || isinf(a->eps))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: eps=%g must be finite and >= 0", fn,
                       (double)a->eps);
    const int64_t m = x->rows, k = x->cols;
    const int ln = a->norm == TQ_NORM_LAYERNORM;
    st = check_vector(fn, &a->gamma, "gamma", k, FLOAT_MASK, x->device);
    if (st != TQ_SUCCESS) return st;
    if (given(&a->beta)) {
        if (!ln) return not_for(fn, "beta", "RMSNorm has no beta");
        st = check_vector(fn, &a->beta, "beta", k, 1u << a->gamma.dtype, x->device);
        if (st != TQ_SUCCESS) return st;
    }
    if (given(&a->y_hp) && (st = check_matrix(fn, &a->y_hp, "y_hp", x, x->dtype)) != TQ_SUCCESS)
        return st;
    if (given(&a->mean)) {
        if (!ln) return not_for(fn, "mean", "RMSNorm has no mean");
        if ((st = check_vector(fn, &a->mean, "mean", m, F32_MASK, x->device)) != TQ_SUCCESS)
            return st;
    }
    if (given(&a->rstd)
        && (st = check_vector(fn, &a->rstd, "rstd", m, F32_MASK, x->device)) != TQ_SUCCESS)
        return st;
    if (given(&a->amax)
        && (st = check_vector(fn, &a->amax, "amax", 1, F32_MASK, x->device)) != TQ_SUCCESS)
        return st;
    st = check_quantized(fn, x, a);
    if (st != TQ_SUCCESS) return st;
    return TQ_DISPATCH(norm_forward, x->device == TQ_DEVICE_CPU, x, a, stream);
}

tq_status tq_norm_backward_workspace_size(tq_norm_type norm, int64_t rows, int64_t cols,
                                          size_t *bytes) {
    tq_status st = check_norm_and_flags("norm backward workspace size", norm, 0u);
    if (st != TQ_SUCCESS) return st;
    if (bytes == NULL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "norm backward workspace size: bytes is NULL");
    if (rows < 0 || cols < 1)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "norm backward workspace size: x [%lld, %lld] "
                       "needs rows >= 0 and cols >= 1", (long long)rows, (long long)cols);
    const int64_t p = rows == 0 ? 0 : tq_norm_partials(rows, cols);
    *bytes = (size_t)p * (size_t)cols * (size_t)tq_norm_planes(norm) * sizeof(float);
    return TQ_SUCCESS;
}

tq_status tq_norm_backward(const tq_tensor *dy, const tq_tensor *x,
                           const tq_norm_backward_args *a, struct CUstream_st *stream) {
    static const char fn[] = "norm backward";
    tq_status st = check_input(fn, x, "x");
    if (st == TQ_SUCCESS) st = check_input(fn, dy, "dy");
    if (st != TQ_SUCCESS) return st;
    if (dy->dtype != x->dtype || dy->rows != x->rows || dy->cols != x->cols
        || dy->device != x->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: dy is %s [%lld, %lld] on device %d; "
                       "expected x's dtype, shape and device: %s [%lld, %lld] on device %d", fn,
                       tq_dtype_name(dy->dtype), (long long)dy->rows, (long long)dy->cols,
                       dy->device, tq_dtype_name(x->dtype), (long long)x->rows,
                       (long long)x->cols, x->device);
    if (a == NULL || a->struct_size < sizeof(tq_norm_backward_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: args are NULL or their struct_size is too "
                       "small (use TQ_NORM_BACKWARD_ARGS_INIT)", fn);
    st = check_norm_and_flags(fn, a->norm, a->flags);
    if (st != TQ_SUCCESS) return st;
    const int64_t m = x->rows, k = x->cols;
    const int ln = a->norm == TQ_NORM_LAYERNORM;
    st = check_vector(fn, &a->gamma, "gamma", k, FLOAT_MASK, x->device);
    if (st != TQ_SUCCESS) return st;
    /* M = 0: the [0] and [0, K] tensors may have no data pointer */
    const int rows_given = m > 0;
    if (ln && !given(&a->mean) && rows_given)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: LayerNorm needs the forward's mean", fn);
    if (!ln && given(&a->mean)) return not_for(fn, "mean", "RMSNorm has no mean");
    if (!ln && given(&a->dbeta)) return not_for(fn, "dbeta", "RMSNorm has no beta");
    if (ln && (st = check_vector(fn, &a->mean, "mean", m, F32_MASK, x->device)) != TQ_SUCCESS)
        return st;
    if (!given(&a->rstd) && rows_given)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: rstd (the forward's) is required", fn);
    if ((st = check_vector(fn, &a->rstd, "rstd", m, F32_MASK, x->device)) != TQ_SUCCESS) return st;
    if ((!given(&a->dx) && rows_given) || !given(&a->dgamma))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: dx and dgamma are required outputs", fn);
    if ((st = check_matrix(fn, &a->dx, "dx", x, x->dtype)) != TQ_SUCCESS) return st;
    if ((st = check_vector(fn, &a->dgamma, "dgamma", k, F32_MASK, x->device)) != TQ_SUCCESS)
        return st;
    if (given(&a->dbeta)
        && (st = check_vector(fn, &a->dbeta, "dbeta", k, F32_MASK, x->device)) != TQ_SUCCESS)
        return st;
    size_t need = 0;
    st = tq_norm_backward_workspace_size(a->norm, m, k, &need);
    if (st != TQ_SUCCESS) return st;
    if (need > 0) {
        const tq_tensor *w = &a->workspace;
        st = tq_tensor_check(w, "workspace");
        if (st != TQ_SUCCESS) return st;
        const int contiguous = w->rows <= 1 || w->ld == w->cols;
        const size_t elem = (size_t)(tq_dtype_bits(w->dtype) / 8);
        const size_t have = contiguous ? (size_t)(w->rows * w->cols) * elem : 0;
        if (w->data == NULL || have < need || ((uintptr_t)w->data & 3u) != 0)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: workspace has %zu contiguous bytes at "
                           "%p; %s [%lld, %lld] needs %zu, 4-byte aligned "
                           "(tq_norm_backward_workspace_size)", fn, have, w->data,
                           norm_name(a->norm), (long long)m, (long long)k, need);
        if (w->device != x->device)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: workspace is on device %d, x on device "
                           "%d", fn, w->device, x->device);
    }
    return TQ_DISPATCH(norm_backward, x->device == TQ_DEVICE_CPU, dy, x, a, stream);
}
