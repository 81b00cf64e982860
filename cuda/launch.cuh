/* launch.cuh: what every kernel file in cuda/ shares, internal to cuda/: making the tensors'
 * device current for a launch (and restoring the caller's), turning a CUDA error into a
 * tq_status with the call and CUDA's message in tq_last_error(), and the CTAs per SM a
 * cooperative launch may have. Tests: each kernel's GPU tests (a device mismatch or a failed
 * launch surfaces as tequant.CudaError).
 */
#ifndef TEQUANT_CUDA_LAUNCH_CUH_
#define TEQUANT_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <atomic>

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

/* CTAs of `kernel` (`threads` per CTA, `dynamic_smem` bytes of dynamic shared memory, allowed
 * for the kernel on `device` here) that fit on one SM of `device`, 0 where cooperative launches
 * are not supported; asked once per kernel and device, the answer kept in the kernel's own
 * cache (0 unknown, else blocks + 1). Instances of one kernel template share a
 * function type, so a cache keyed by that type would hand one instance's occupancy to the
 * others: a heavier one then failed with cudaErrorCooperativeLaunchTooLarge. */
template <typename Kernel>
inline int coop_blocks_per_sm(Kernel kernel, int threads, int device,
                              std::atomic<int> (&cache)[64], int dynamic_smem = 0) {
    if (device < 0 || device >= 64) return 0;
    int v = cache[device].load(std::memory_order_relaxed);
    if (v > 0) return v - 1;
    int coop = 0, blocks = 0;
    if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) != cudaSuccess
        || (dynamic_smem > 0
            && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_smem)
                   != cudaSuccess)
        || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, (size_t)dynamic_smem)
               != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    v = coop ? blocks : 0;
    cache[device].store(v + 1, std::memory_order_relaxed);
    return v;
}

}  // namespace tq_cuda

#endif  // TEQUANT_CUDA_LAUNCH_CUH_
