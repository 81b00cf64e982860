/* amax_update_ref.c: CPU reference of tq_amax_update, delayed scaling's history roll and scale
 * update with TE's FUSED semantics (tequant.h "Delayed scaling", NUMERICS.md 2, TE_REFERENCE
 * 6.1). Plain loops on purpose: this is the oracle cuda/amax_update.cu is checked against bit
 * for bit. Tests: tests/test_amax_update.py (against a Python model of the rule, and CUDA
 * against this).
 */
#include <math.h>

#include "internal_amax_update.h"
#include "tequant/formats.h"

static void update_slot(const tq_amax_slot *s, float reduced, int64_t len, tq_amax_algo algo) {
    float *h = s->history;
    const int64_t stride = s->stride;
    const float last = reduced != 0.0f ? reduced : h[0];
    if (last == 0.0f) return; /* no amax this step: no roll, the scale stays */
    /* The window: this step (last) and the L-1 steps before it, h[1..L-1]; fmaxf skips NaN. */
    float amax = last;
    if (algo == TQ_AMAX_ALGO_MAX)
        for (int64_t i = 1; i < len; i++) amax = fmaxf(amax, h[i * stride]);
    /* Roll: [0, h[2], ..., h[L-1], last]; ascending order reads h[i+1] before it is written. */
    for (int64_t i = 1; i + 1 < len; i++) h[i * stride] = h[(i + 1) * stride];
    h[(len - 1) * stride] = last;
    h[0] = 0.0f; /* after the last one when L == 1: the row then accumulates the next step */
    if (isfinite(amax) && amax > 0.0f) {
        float scale = s->scaled_max / amax;
        if (scale == INFINITY) scale = TQ_FLT_MAX;
        *s->scale = scale;
    }
}

tq_status tq_amax_update_ref(const tq_amax_slot *slots, int64_t n_slots,
                             const tq_amax_update_args *args, struct CUstream_st *stream) {
    (void)stream;
    for (int64_t i = 0; i < n_slots; i++)
        update_slot(&slots[i], args->reduced_amax ? args->reduced_amax[i] : 0.0f,
                    args->history_len, args->amax_algo);
    return TQ_SUCCESS;
}
