/* launch.cuh: what every kernel file in cuda/ shares, internal to cuda/: making the tensors'
 * device current for a launch (and restoring the caller's), and turning a CUDA error into a
 * tq_status with the call and CUDA's message in tq_last_error(). Tests: each kernel's GPU tests
 * (a device mismatch or a failed launch surfaces as tequant.CudaError).
 */
#ifndef TEQUANT_CUDA_LAUNCH_CUH_
#define TEQUANT_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include "internal.h"

namespace tq_cuda {

inline tq_status cuda_failed(const char *what, cudaError_t err) {
    return tq_fail(TQ_ERROR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

/* After a launch or a runtime call: the pending error (cleared). */
inline tq_status launch_failed(const char *what) { return cuda_failed(what, cudaGetLastError()); }

/* Makes a device current for the launch and restores the caller's device afterwards. */
struct DeviceGuard {
    int previous = -1;
    cudaError_t status = cudaSuccess; /* why the device could not be made current */
    explicit DeviceGuard(int device) {
        status = cudaGetDevice(&previous);
        if (status == cudaSuccess && previous != device) status = cudaSetDevice(device);
        else previous = -1;
        if (status != cudaSuccess) previous = -1;
    }
    ~DeviceGuard() {
        if (previous >= 0) cudaSetDevice(previous);
    }
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;
};

}  // namespace tq_cuda

#endif  // TEQUANT_CUDA_LAUNCH_CUH_
