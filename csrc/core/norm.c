/* norm.c: tq_norm_forward / tq_norm_backward argument checks and dispatch, and the backward's
 * workspace size. The rules (shapes, dtypes, which outputs each norm and scaling takes) are
 * checked here once; the references (csrc/ref/norm_forward_ref.c, norm_backward_ref.c) and the
 * kernels (cuda/norm_forward.cu, norm_backward.cu) trust them.
 * Tests: tests/test_norm_kernels.py (test_errors_*).
 */
#include <math.h>
#include <stdio.h>

#include "internal_fused.h"
#include "internal_kernels.h"
#include "internal_norm.h"

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
    return tq_fused_check_input(fn, x, name, "the norm runs over the last dim, which needs at "
                                "least one element");
}

/* n contiguous elements (gamma, beta, mean, rstd, dgamma, dbeta, amax) on x's device. */
static tq_status check_vector(const char *fn, const tq_tensor *t, const char *name, int64_t n,
                              uint32_t mask, const tq_tensor *x) {
    return tq_fused_check_vector(fn, t, name, n, mask, x->device);
}

/* An [M, K] output like x. */
static tq_status check_matrix(const char *fn, const tq_tensor *t, const char *name,
                              const tq_tensor *x, tq_dtype dtype) {
    return tq_fused_check_matrix(fn, t, name, x->rows, x->cols, dtype, x->device, "x");
}

/* The quantized output: a DELAYED or CURRENT FP8 config, y_q and scale_inv, and the scale
 * (DELAYED) or the amax it comes from (CURRENT). */
static tq_status check_quantized(const char *fn, const tq_tensor *x,
                                 const tq_norm_forward_args *a) {
    const tq_fused_fp8 o = {a->config, &a->y_q, &a->scale_inv, &a->scale, &a->amax_in, &a->amax,
                            "y_q", &a->y_q_t, "y_q_t"};
    return tq_fused_check_fp8(fn, &o, x->rows, x->cols, x->device, "x");
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
    st = check_vector(fn, &a->gamma, "gamma", k, TQ_FLOAT_MASK, x);
    if (st != TQ_SUCCESS) return st;
    if (tq_given(&a->beta)) {
        if (!ln) return tq_fused_not_for(fn, "beta", "RMSNorm has no beta");
        st = check_vector(fn, &a->beta, "beta", k, 1u << a->gamma.dtype, x);
        if (st != TQ_SUCCESS) return st;
    }
    if (tq_given(&a->y_hp) && (st = check_matrix(fn, &a->y_hp, "y_hp", x, x->dtype)) != TQ_SUCCESS)
        return st;
    if (tq_given(&a->mean)) {
        if (!ln) return tq_fused_not_for(fn, "mean", "RMSNorm has no mean");
        if ((st = check_vector(fn, &a->mean, "mean", m, TQ_F32_MASK, x)) != TQ_SUCCESS)
            return st;
    }
    if (tq_given(&a->rstd)
        && (st = check_vector(fn, &a->rstd, "rstd", m, TQ_F32_MASK, x)) != TQ_SUCCESS)
        return st;
    if (tq_given(&a->amax)
        && (st = check_vector(fn, &a->amax, "amax", 1, TQ_F32_MASK, x)) != TQ_SUCCESS)
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
    st = check_vector(fn, &a->gamma, "gamma", k, TQ_FLOAT_MASK, x);
    if (st != TQ_SUCCESS) return st;
    /* M = 0: the [0] and [0, K] tensors may have no data pointer */
    const int rows_given = m > 0;
    if (ln && !tq_given(&a->mean) && rows_given)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: LayerNorm needs the forward's mean", fn);
    if (!ln && tq_given(&a->mean)) return tq_fused_not_for(fn, "mean", "RMSNorm has no mean");
    if (!ln && tq_given(&a->dbeta)) return tq_fused_not_for(fn, "dbeta", "RMSNorm has no beta");
    if (ln && (st = check_vector(fn, &a->mean, "mean", m, TQ_F32_MASK, x)) != TQ_SUCCESS)
        return st;
    if (!tq_given(&a->rstd) && rows_given)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: rstd (the forward's) is required", fn);
    if ((st = check_vector(fn, &a->rstd, "rstd", m, TQ_F32_MASK, x)) != TQ_SUCCESS)
        return st;
    if ((!tq_given(&a->dx) && rows_given) || !tq_given(&a->dgamma))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: dx and dgamma are required outputs", fn);
    if ((st = check_matrix(fn, &a->dx, "dx", x, x->dtype)) != TQ_SUCCESS) return st;
    if ((st = check_vector(fn, &a->dgamma, "dgamma", k, TQ_FLOAT_MASK, x)) != TQ_SUCCESS)
        return st;
    if (tq_given(&a->dbeta)
        && (st = check_vector(fn, &a->dbeta, "dbeta", k, 1u << a->dgamma.dtype, x)) != TQ_SUCCESS)
        return st;
    size_t need = 0;
    st = tq_norm_backward_workspace_size(a->norm, m, k, &need);
    if (st != TQ_SUCCESS) return st;
    char sized_by[96];
    snprintf(sized_by, sizeof sized_by, "tq_norm_backward_workspace_size of %s [%lld, %lld]",
             norm_name(a->norm), (long long)m, (long long)k);
    st = tq_fused_check_workspace(fn, &a->workspace, need, x->device, sized_by);
    if (st != TQ_SUCCESS) return st;
    return TQ_DISPATCH(norm_backward, x->device == TQ_DEVICE_CPU, dy, x, a, stream);
}
