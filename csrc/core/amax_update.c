/* amax_update.c: tq_amax_update argument checks and dispatch (CPU reference or CUDA kernel) for
 * delayed scaling's amax-history roll and scale update (tequant.h, NUMERICS.md 2).
 * Reference: csrc/ref/amax_update_ref.c; kernel: cuda/amax_update.cu;
 * tests: tests/test_amax_update.py.
 */
#include "internal_amax_update.h"
#include "internal_kernels.h"

static tq_status amax_update_check(const tq_amax_slot *slots, int64_t n_slots,
                                   const tq_amax_update_args *args) {
    if (args == NULL || args->struct_size < sizeof(tq_amax_update_args))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: args are NULL or their "
                       "struct_size is too small (use TQ_AMAX_UPDATE_ARGS_INIT)");
    if (n_slots < 0)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: n_slots=%lld must be >= 0",
                       (long long)n_slots);
    if (n_slots > 0 && slots == NULL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: slots is NULL with n_slots=%lld",
                       (long long)n_slots);
    if (args->history_len < 1)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: history_len=%lld must be >= 1",
                       (long long)args->history_len);
    if (args->amax_algo == TQ_AMAX_ALGO_CUSTOM)
        return tq_fail(TQ_ERROR_NOT_SUPPORTED, "amax update: a callable amax algorithm runs in "
                       "Python");
    if (args->amax_algo != TQ_AMAX_ALGO_MAX && args->amax_algo != TQ_AMAX_ALGO_MOST_RECENT)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: amax_algo=%d; expected "
                       "TQ_AMAX_ALGO_MAX (0) or TQ_AMAX_ALGO_MOST_RECENT (1)",
                       (int)args->amax_algo);
    if (args->device < TQ_DEVICE_CPU)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: device=%d is neither "
                       "TQ_DEVICE_CPU (-1) nor a CUDA ordinal", args->device);
    for (int64_t i = 0; i < n_slots; i++) {
        const tq_amax_slot *s = &slots[i];
        if (s->history == NULL || s->scale == NULL)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: slot %lld has a NULL %s",
                           (long long)i, s->history == NULL ? "history" : "scale");
        if (s->stride < 1)
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: slot %lld has stride=%lld; "
                           "expected >= 1", (long long)i, (long long)s->stride);
        /* NaN would give a NaN scale whose bits differ between the CPU and CUDA; negative is
         * no fmax * 2^-margin. */
        if (!(s->scaled_max >= 0.0f))
            return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "amax update: slot %lld has scaled_max=%g; "
                           "expected fmax * 2^-margin >= 0", (long long)i, (double)s->scaled_max);
    }
    return TQ_SUCCESS;
}

tq_status tq_amax_update(const tq_amax_slot *slots, int64_t n_slots,
                         const tq_amax_update_args *args, struct CUstream_st *stream) {
    const tq_status st = amax_update_check(slots, n_slots, args);
    if (st != TQ_SUCCESS || n_slots == 0) return st;
    return TQ_DISPATCH(amax_update, args->device == TQ_DEVICE_CPU, slots, n_slots, args, stream);
}

tq_status tq_amax_update_after_check(const char *fn, const tq_amax_slot *update,
                                     const tq_amax_update_args *update_args,
                                     const tq_quant_config *config, const tq_tensor *amax,
                                     int device) {
    if (update == NULL) return TQ_SUCCESS;
    if (config == NULL || config->scaling != TQ_SCALING_DELAYED)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: update is DelayedScaling's (a DELAYED "
                       "config); this one has none or another scaling", fn);
    if (update_args == NULL || update_args->reduced_amax != NULL || update_args->device != device)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: update needs update_args with no "
                       "reduced_amax, on x's device (%d)", fn, device);
    if (amax->data == NULL || update->history != (float *)amax->data)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "%s: update->history must be the slot the cast "
                       "accumulates its amax into (the amax output's data)", fn);
    return amax_update_check(update, 1, update_args);
}
