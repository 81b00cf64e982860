/* device.c: build facts and CUDA device queries (count, compute capability, cuBLASLt version).
 *
 * Built with TQ_WITH_CUDA when setup.py found nvcc; then these call the CUDA runtime (linked
 * statically) and cuBLASLt. With no driver or no GPU the count is 0 and the caller falls back
 * to the CPU reference path; that is a normal state (CI), not an error.
 * Tests: tests/test_device.py (and on the GPU machine, the same file's GPU cases).
 */
#include "internal.h"

#ifdef TQ_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#endif

tq_status tq_get_build_info(tq_build_info *info) {
    if (info == NULL || info->struct_size < sizeof(tq_build_info))
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT,
                       "tq_get_build_info needs a tq_build_info set up with TQ_BUILD_INFO_INIT");
#ifdef TQ_WITH_CUDA
    info->with_cuda = 1;
    info->cuda_runtime_version = CUDART_VERSION;
    info->cublaslt_header_version = CUBLAS_VERSION;
#else
    info->with_cuda = 0;
    info->cuda_runtime_version = 0;
    info->cublaslt_header_version = 0;
#endif
    return TQ_SUCCESS;
}

#ifdef TQ_WITH_CUDA

static tq_status cuda_fail(cudaError_t err, const char *what) {
    (void)cudaGetLastError(); /* clear a non-sticky error so later calls start clean */
    return tq_fail(TQ_ERROR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

tq_status tq_device_count(int *count) {
    if (count == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "count is NULL");
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
        /* No GPU or no driver on this machine: the CPU reference path serves everything. */
        (void)cudaGetLastError();
        *count = 0;
        return TQ_SUCCESS;
    }
    if (err != cudaSuccess) return cuda_fail(err, "cudaGetDeviceCount");
    *count = n;
    return TQ_SUCCESS;
}

tq_status tq_device_capability(int device, int *major, int *minor) {
    if (major == NULL || minor == NULL)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "major/minor output is NULL");
    int n = 0;
    tq_status st = tq_device_count(&n);
    if (st != TQ_SUCCESS) return st;
    if (device < 0 || device >= n)
        return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "device=%d is not a CUDA device (this process "
                       "sees %d)", device, n);
    cudaError_t err = cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceGetAttribute(major)");
    err = cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceGetAttribute(minor)");
    return TQ_SUCCESS;
}

tq_status tq_current_device(int *device) {
    if (device == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "device output is NULL");
    cudaError_t err = cudaGetDevice(device);
    if (err != cudaSuccess) return cuda_fail(err, "cudaGetDevice");
    return TQ_SUCCESS;
}

tq_status tq_cublaslt_version(size_t *version) {
    if (version == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "version output is NULL");
    *version = cublasLtGetVersion();
    return TQ_SUCCESS;
}

#else /* !TQ_WITH_CUDA */

tq_status tq_device_count(int *count) {
    if (count == NULL) return tq_fail(TQ_ERROR_INVALID_ARGUMENT, "count is NULL");
    *count = 0;
    return TQ_SUCCESS;
}

static tq_status no_cuda(const char *what) {
    return tq_fail(TQ_ERROR_NOT_SUPPORTED, "%s: tequant was built without CUDA (nvcc was not "
                   "found at build time, or TEQUANT_CUDA=0)", what);
}

tq_status tq_device_capability(int device, int *major, int *minor) {
    (void)device, (void)major, (void)minor;
    return no_cuda("tq_device_capability");
}

tq_status tq_current_device(int *device) {
    (void)device;
    return no_cuda("tq_current_device");
}

tq_status tq_cublaslt_version(size_t *version) {
    (void)version;
    return no_cuda("tq_cublaslt_version");
}

#endif
