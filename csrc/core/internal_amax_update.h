/* internal_amax_update.h: the per-device implementations behind tq_amax_update (delayed
 * scaling's amax-history roll and scale update). csrc/core/amax_update.c checks the arguments
 * and dispatches; the CPU reference is csrc/ref/amax_update_ref.c, the kernel
 * cuda/amax_update.cu (the roll itself: cuda/amax_roll.cuh, which the grad_output cast's dbias
 * pass runs too). Not part of the public API. Tests: tests/test_amax_update.py.
 */
#ifndef TEQUANT_CORE_INTERNAL_AMAX_UPDATE_H_
#define TEQUANT_CORE_INTERNAL_AMAX_UPDATE_H_

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Called only with checked arguments: n_slots >= 1, slots non-NULL with non-NULL history and
 * scale pointers and stride >= 1, args->history_len >= 1, algo MAX or MOST_RECENT, every
 * pointer (and reduced_amax, if not NULL) on args->device. */
tq_status tq_amax_update_ref(const tq_amax_slot *slots, int64_t n_slots,
                             const tq_amax_update_args *args, struct CUstream_st *stream);
tq_status tq_amax_update_cuda(const tq_amax_slot *slots, int64_t n_slots,
                              const tq_amax_update_args *args, struct CUstream_st *stream);

/* The checks of tq_quantize_args' / tq_act_backward_args' update (tequant.h): NULL passes; else
 * a DELAYED config, update_args without reduced_amax on `device`, update->history the amax
 * output's data, and tq_amax_update's checks of that one slot. fn names the caller. */
tq_status tq_amax_update_after_check(const char *fn, const tq_amax_slot *update,
                                     const tq_amax_update_args *update_args,
                                     const tq_quant_config *config, const tq_tensor *amax,
                                     int device);

#ifdef __cplusplus
}
#endif

#endif /* TEQUANT_CORE_INTERNAL_AMAX_UPDATE_H_ */
