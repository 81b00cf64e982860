/* internal_kernels.h: the per-device implementations behind each public entry point. A CPU
 * reference in csrc/ref/<stem>_ref.c and a CUDA kernel in cuda/<stem>.cu share a signature;
 * csrc/core/<stem>.c checks the arguments once and dispatches on the tensors' device.
 */
#ifndef TEQUANT_CORE_INTERNAL_KERNELS_H_
#define TEQUANT_CORE_INTERNAL_KERNELS_H_

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

tq_status tq_amax_ref(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream);
tq_status tq_amax_cuda(const tq_tensor *x, tq_tensor *amax, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* TEQUANT_CORE_INTERNAL_KERNELS_H_ */
