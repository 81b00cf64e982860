/* act.c: tq_act_forward / tq_act_backward argument checks and dispatch, and the backward's
 * workspace size. The rules (shapes, dtypes, which outputs each scaling takes) are checked here
 * once; the references (csrc/ref/act_forward_ref.c, act_backward_ref.c) and the kernels
 * (cuda/act_forward.cu, act_backward.cu) trust them.
 * Tests: tests/test_act_kernels.py (test_errors_*).
 */
#include <stdio.h>

#include "internal_act.h"
#include "internal_amax_update.h"
#include "internal_fused.h"
#include "internal_kernels.h"

static tq_status check_act(const char *fn, tq_act act) {
    if ((int)act < TQ_ACT_GELU || (int)act > TQ_ACT_IDENTITY)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: act=%d is not a tq_act (TQ_ACT_GELU (0) "
                       ".. TQ_ACT_IDENTITY (8))", fn, (int)act);
    return TQ_SUCCESS;
}

/* h: a float [M, K] with K >= 1, and K even for a gated activation (the two halves). */
static tq_status check_h(const char *fn, const tq_tensor *h, tq_act act) {
    tq_status st = tq_fused_check_input(fn, h, "h", "the activation needs at least one feature");
    if (st != TQ_SUCCESS) return st;
    if (tq_act_gated(act) && h->cols % 2 != 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: h is [%lld, %lld]; a gated activation "
                       "splits the features into two halves, which needs an even number",
                       fn, (long long)h->rows, (long long)h->cols);
    return TQ_SUCCESS;
}

static tq_status check_amax(const char *fn, const tq_tensor *amax, int device) {
    if (!tq_given(amax)) return TQ_SUCCESS;
    return tq_fused_check_vector(fn, amax, "amax", 1, TQ_F32_MASK, device);
}

/* A block-format config: q alone (tq_fused_check_block_q), none of the per-tensor outputs, y_hp
 * or amax. */
static tq_status check_block(const char *fn, const tq_tensor *h, const tq_act_forward_args *a,
                             int64_t m, int64_t n) {
    if (a->act == TQ_ACT_IDENTITY)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: TQ_ACT_IDENTITY with %s config is "
                       "tq_quantize of h", fn,
                       a->config->scaling == TQ_SCALING_MXFP8 ? "an MXFP8" : "a BLOCK");
    const tq_tensor *ts[] = {&a->y_hp, &a->amax, &a->y_q, &a->scale_inv, &a->scale, &a->amax_in,
                             &a->y_q_t};
    static const char *const names[] = {"y_hp", "amax", "y_q", "scale_inv", "scale", "amax_in",
                                        "y_q_t"};
    for (int i = 0; i < 7; i++)
        if (tq_given(ts[i]))
            return tq_fused_not_for(fn, names[i], "a block-format config writes q alone");
    return tq_fused_check_block_q(fn, a->config, a->q, m, n, h->device, "act(h)");
}

/* The backward's block-format config: q alone (tq_fused_check_block_q for [m, k]), none of the
 * other outputs. */
static tq_status check_block_backward(const char *fn, const tq_tensor *h,
                                      const tq_act_backward_args *a, int64_t m, int64_t k) {
    if (a->act == TQ_ACT_IDENTITY)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: TQ_ACT_IDENTITY with %s config is "
                       "tq_quantize of dy", fn,
                       a->config->scaling == TQ_SCALING_MXFP8 ? "an MXFP8" : "a BLOCK");
    const tq_tensor *ts[] = {&a->dh, &a->amax, &a->dh_q, &a->scale_inv, &a->scale, &a->amax_in,
                             &a->dbias, &a->workspace, &a->dh_q_t};
    static const char *const names[] = {"dh", "amax", "dh_q", "scale_inv", "scale", "amax_in",
                                        "dbias", "workspace", "dh_q_t"};
    for (int i = 0; i < 9; i++)
        if (tq_given(ts[i]))
            return tq_fused_not_for(fn, names[i], "a block-format config writes q alone");
    return tq_fused_check_block_q(fn, a->config, a->q, m, k, h->device, "dh");
}

tq_status tq_act_forward(const tq_tensor *h, const tq_act_forward_args *a,
                         struct CUstream_st *stream) {
    static const char fn[] = "act forward";
    if (a == NULL || a->struct_size < sizeof(tq_act_forward_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: args are NULL or their struct_size is too "
                       "small (use TQ_ACT_FORWARD_ARGS_INIT)", fn);
    tq_status st = check_act(fn, a->act);
    if (st == TQ_SUCCESS) st = check_h(fn, h, a->act);
    if (st != TQ_SUCCESS) return st;
    const int64_t m = h->rows, n = tq_act_gated(a->act) ? h->cols / 2 : h->cols;
    if (tq_given(&a->y_hp)
        && (st = tq_fused_check_matrix(fn, &a->y_hp, "y_hp", m, n, h->dtype, h->device,
                                       "act(h)")) != TQ_SUCCESS)
        return st;
    if ((st = check_amax(fn, &a->amax, h->device)) != TQ_SUCCESS) return st;
    if (tq_fused_block_format(a->config)) {
        if ((st = check_block(fn, h, a, m, n)) != TQ_SUCCESS) return st;
        if (a->config->scaling == TQ_SCALING_MXFP8)
            return TQ_DISPATCH(act_forward_mxfp8, h->device == TQ_DEVICE_CPU, h, a, stream);
        return TQ_DISPATCH(act_forward_block, h->device == TQ_DEVICE_CPU, h, a, stream);
    }
    if (a->q != NULL)
        return tq_fused_not_for(fn, "q", "it is a BLOCK or MXFP8 config's output");
    const tq_fused_fp8 o = {a->config, &a->y_q, &a->scale_inv, &a->scale, &a->amax_in, &a->amax,
                            "y_q", &a->y_q_t, "y_q_t"};
    st = tq_fused_check_fp8(fn, &o, m, n, h->device, "act(h)");
    if (st != TQ_SUCCESS) return st;
    return TQ_DISPATCH(act_forward, h->device == TQ_DEVICE_CPU, h, a, stream);
}

tq_status tq_act_backward_workspace_size(int64_t rows, int64_t cols, size_t *bytes) {
    if (bytes == NULL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "act backward workspace size: bytes is NULL");
    if (rows < 0 || cols < 1)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "act backward workspace size: h [%lld, %lld] "
                       "needs rows >= 0 and cols >= 1", (long long)rows, (long long)cols);
    const int64_t p = rows == 0 ? 0 : tq_norm_partials(rows, cols);
    *bytes = (size_t)p * (size_t)cols * sizeof(float);
    return TQ_SUCCESS;
}

tq_status tq_act_backward(const tq_tensor *dy, const tq_tensor *h,
                          const tq_act_backward_args *a, struct CUstream_st *stream) {
    static const char fn[] = "act backward";
    if (a == NULL || a->struct_size < sizeof(tq_act_backward_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: args are NULL or their struct_size is too "
                       "small (use TQ_ACT_BACKWARD_ARGS_INIT)", fn);
    tq_status st = check_act(fn, a->act);
    if (st == TQ_SUCCESS) st = check_h(fn, h, a->act);
    if (st != TQ_SUCCESS) return st;
    const int64_t m = h->rows, k = h->cols, n = tq_act_gated(a->act) ? k / 2 : k;
    st = tq_tensor_check(dy, "dy");
    if (st != TQ_SUCCESS) return st;
    if (dy->dtype != h->dtype || dy->rows != m || dy->cols != n || dy->device != h->device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: dy is %s [%lld, %lld] on device %d; "
                       "expected act(h)'s: %s [%lld, %lld] on device %d", fn,
                       tq_dtype_name(dy->dtype), (long long)dy->rows, (long long)dy->cols,
                       dy->device, tq_dtype_name(h->dtype), (long long)m, (long long)n,
                       h->device);
    if (tq_given(&a->dh)
        && (st = tq_fused_check_matrix(fn, &a->dh, "dh", m, k, h->dtype, h->device, "h"))
               != TQ_SUCCESS)
        return st;
    if ((st = check_amax(fn, &a->amax, h->device)) != TQ_SUCCESS
        || (st = tq_amax_update_after_check(fn, a->update, a->update_args, a->config, &a->amax,
                                            h->device)) != TQ_SUCCESS)
        return st;
    if (tq_fused_block_format(a->config)) {
        if ((st = check_block_backward(fn, h, a, m, k)) != TQ_SUCCESS) return st;
        if (a->config->scaling == TQ_SCALING_MXFP8)
            return TQ_DISPATCH(act_backward_mxfp8, h->device == TQ_DEVICE_CPU, dy, h, a, stream);
        return TQ_DISPATCH(act_backward_block, h->device == TQ_DEVICE_CPU, dy, h, a, stream);
    }
    if (a->q != NULL)
        return tq_fused_not_for(fn, "q", "it is a BLOCK or MXFP8 config's output");
    const tq_fused_fp8 o = {a->config, &a->dh_q, &a->scale_inv, &a->scale, &a->amax_in, &a->amax,
                            "dh_q", &a->dh_q_t, "dh_q_t"};
    if ((st = tq_fused_check_fp8(fn, &o, m, k, h->device, "h")) != TQ_SUCCESS) return st;
    if (tq_given(&a->dbias)) {
        st = tq_fused_check_vector(fn, &a->dbias, "dbias", k, TQ_FLOAT_MASK, h->device);
        if (st != TQ_SUCCESS) return st;
        size_t need = 0;
        if ((st = tq_act_backward_workspace_size(m, k, &need)) != TQ_SUCCESS) return st;
        char sized_by[96];
        snprintf(sized_by, sizeof sized_by, "tq_act_backward_workspace_size of h [%lld, %lld]",
                 (long long)m, (long long)k);
        st = tq_fused_check_workspace(fn, &a->workspace, need, h->device, sized_by);
        if (st != TQ_SUCCESS) return st;
    }
    return TQ_DISPATCH(act_backward, h->device == TQ_DEVICE_CPU, dy, h, a, stream);
}
