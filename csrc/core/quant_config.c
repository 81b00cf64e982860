/* quant_config.c: consistency rules of tq_quant_config (which dtypes, blocks and flags go with
 * which scaling family). The extension builds configs from recipes and checks each one here, so
 * a wrong combination is caught once, at recipe registration, not in a kernel.
 * Tests: tests/test_registry.py (every recipe and role passes; hand-made bad configs fail).
 */
#include <math.h>

#include "internal.h"

static int is_fp8(tq_dtype d) { return d == TQ_DTYPE_FLOAT8_E4M3 || d == TQ_DTYPE_FLOAT8_E5M2; }

static float fp8_max(tq_dtype d) { return d == TQ_DTYPE_FLOAT8_E4M3 ? 448.0f : 57344.0f; }

static tq_status check_block(const tq_quant_config *c, int32_t len, const char *family) {
    int two_d = (c->flags & TQ_QUANT_2D) != 0;
    if (c->block_cols != len || c->block_rows != (two_d ? len : 1))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT,
                       "%s blocks must be 1x%d (or %dx%d with TQ_QUANT_2D), got %dx%d%s", family,
                       (int)len, (int)len, (int)len, (int)c->block_rows, (int)c->block_cols,
                       two_d ? " with TQ_QUANT_2D" : "");
    return TQ_SUCCESS;
}

tq_status tq_quant_config_check(const tq_quant_config *c) {
    if (c == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "quant config is NULL");
    if (c->struct_size < sizeof(tq_quant_config))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT,
                       "quant config struct_size=%zu, expected %zu (use TQ_QUANT_CONFIG_INIT)",
                       c->struct_size, sizeof(tq_quant_config));
    if (!(c->amax_epsilon >= 0.0f) || isinf(c->amax_epsilon))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax_epsilon=%g must be finite and >= 0",
                       (double)c->amax_epsilon);
    const uint32_t fp4_only = TQ_QUANT_RHT | TQ_QUANT_STOCHASTIC_ROUNDING;
    switch (c->scaling) {
        case TQ_SCALING_NONE:
        case TQ_SCALING_CUSTOM:
            return TQ_SUCCESS;
        case TQ_SCALING_DELAYED:
        case TQ_SCALING_CURRENT:
        case TQ_SCALING_BLOCK:
        case TQ_SCALING_MXFP8:
            if (!is_fp8(c->elem_dtype))
                return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "FP8 scaling needs an E4M3 or E5M2 "
                               "element dtype, got %s", tq_dtype_name(c->elem_dtype));
            if (c->fmax != fp8_max(c->elem_dtype))
                return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "fmax=%g does not match %s (%g)",
                               (double)c->fmax, tq_dtype_name(c->elem_dtype),
                               (double)fp8_max(c->elem_dtype));
            if (c->flags & fp4_only)
                return tq_fail(TQ_ERROR_INVALID_ARGUMENT,
                               "RHT and stochastic rounding exist only for NVFP4");
            break;
        case TQ_SCALING_NVFP4:
            if (c->elem_dtype != TQ_DTYPE_FLOAT4_E2M1X2 || c->scale_dtype != TQ_DTYPE_FLOAT8_E4M3
                || c->fmax != 6.0f)
                return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "NVFP4 needs E2M1 elements (fmax 6) "
                               "with E4M3 block scales, got %s elements, %s scales, fmax %g",
                               tq_dtype_name(c->elem_dtype), tq_dtype_name(c->scale_dtype),
                               (double)c->fmax);
            if ((c->flags & TQ_QUANT_2D) && (c->flags & TQ_QUANT_RHT))
                return tq_fail(TQ_ERROR_INVALID_ARGUMENT,
                               "NVFP4 2D (16x16) blocks cannot be combined with RHT");
            return check_block(c, 16, "NVFP4");
        default:
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "unknown scaling %d", (int)c->scaling);
    }
    if (c->scaling == TQ_SCALING_MXFP8) {
        if (c->scale_dtype != TQ_DTYPE_FLOAT8_E8M0)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "MXFP8 scales are E8M0, got %s",
                           tq_dtype_name(c->scale_dtype));
        return check_block(c, 32, "MXFP8");
    }
    if (c->scale_dtype != TQ_DTYPE_FLOAT32)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "FP8 per-tensor and block scales are float32, "
                       "got %s", tq_dtype_name(c->scale_dtype));
    if (c->scaling == TQ_SCALING_BLOCK) {
        int two_d = (c->flags & TQ_QUANT_2D) != 0;
        if (c->block_cols != 128 || c->block_rows != (two_d ? 128 : 1))
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "FP8 block scaling uses 1x128 or 128x128 "
                           "(TQ_QUANT_2D) blocks, got %dx%d", (int)c->block_rows,
                           (int)c->block_cols);
        return TQ_SUCCESS;
    }
    if (c->block_rows != 0 || c->block_cols != 0 || (c->flags & TQ_QUANT_2D))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "per-tensor scaling has no blocks, got %dx%d",
                       (int)c->block_rows, (int)c->block_cols);
    if (c->scaling == TQ_SCALING_DELAYED && (c->amax_history_len < 1 || c->margin < 0))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "delayed scaling needs amax_history_len >= 1 "
                       "and margin >= 0, got %d and %d", (int)c->amax_history_len,
                       (int)c->margin);
    return TQ_SUCCESS;
}
